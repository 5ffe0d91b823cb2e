"""The daemon's lease authority in the test process (tests/alloc/test_lease_authority.py, tests/jobs/),
or as a daemon process of its own (:class:`AuthorityDaemon`: tests/alloc/test_authority_crash.py;
:class:`DaemonProcess`, started again on the same state: tests/usage/test_history_crashes.py)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any


def wait_for(predicate: Any, timeout: float = 20.0) -> bool:
    """Whether ``predicate()`` came true within ``timeout`` seconds (polled every 50 ms)."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s process group (a ``gpusd run`` started in a session of its own), reaped."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()

class ServerThread:
    """A LeaseServer on its own event loop in a thread of this process (the daemon's part)."""

    def __init__(self, simulate: str | None = None) -> None:
        from gpusd.alloc.authority import socket_path
        from gpusd.daemon.leasesock import LeaseServer

        self.loop = asyncio.new_event_loop()
        self.server = LeaseServer(socket_path(), simulate)  # simulate: a daemon serving simulated GPUs
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class AuthorityDaemon:
    """A real ``gpusd start --foreground`` daemon (a process of its own: it can be killed with SIGKILL)
    serving the lease socket of ``env`` (the test's lock directory and socket), with its own state
    directory ``state``; HTTP on 127.0.0.1, mDNS on 127.0.0.1 only, a session of its own."""

    def __init__(self, env: dict[str, str], state: Path, log: Path) -> None:
        self.env = dict(env, GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    def start(self, timeout: float = 60) -> AuthorityDaemon:
        """Start it and wait for its ready line; AssertionError (with the log's end) when it does not come."""
        from daemon_helpers import unique_session
        from netns import read_lines

        r, w = os.pipe()
        try:
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen([sys.executable, "-m", "gpusd", "start", "--foreground", "--port", "0",
                                              "--session", unique_session("authority"), "--ready-fd", str(w)],
                                             env=self.env, pass_fds=(w,), stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=log)
        finally:
            os.close(w)
        try:
            lines = read_lines(r, 1, timeout)
        finally:
            os.close(r)
        if not lines or not lines[0].strip():
            self.stop()
            raise AssertionError(f"the daemon did not start:\n{self.log.read_text()[-3000:]}")
        self.info = json.loads(lines[0])
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def api(self, path: str) -> Any:
        """GET ``/api/v1/<path>`` from its HTTP port, as JSON."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.info['port']}/api/v1/{path}", timeout=10) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        """``kill -9``: nothing of the daemon's runs any more (its socket file stays, with nobody behind it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 15 s; reaped."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()


class DaemonProcess:
    """``gpusd start --foreground`` as a process of its own: the root lease authority of the test's lock
    directory (the environment's), on 127.0.0.1 with a state directory of its own, that a test can
    kill with SIGKILL and start again on the same state (tests/usage/test_history_crashes.py)."""

    def __init__(self, env: dict[str, str], state_dir: Path, *args: str) -> None:
        self.env = dict(env, GPUSD_STATE_DIR=str(state_dir), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")
        self.state_dir = state_dir
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.session = f"crash-{os.getpid()}-{secrets.token_hex(3)}"

    def start(self, timeout: float = 60.0) -> None:
        """Start it and return once it serves (its ready line)."""
        from netns import read_lines

        self.state_dir.mkdir(parents=True, exist_ok=True)
        r, w = os.pipe()
        with open(self.state_dir / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "gpusd", "start", "--foreground", "--port", "0",
                                          "--session", self.session, *self.args, "--ready-fd", str(w)],
                                         env=self.env, pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=log)
        os.close(w)
        try:
            if not read_lines(r, 1, timeout):
                raise RuntimeError(f"the daemon did not come up:\n{self.log()}")
        finally:
            os.close(r)

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        """SIGTERM (a clean stop), SIGKILL after 15 s."""
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def log(self) -> str:
        try:
            return (self.state_dir / "daemon.log").read_text(errors="replace")[-4000:]
        except OSError:
            return "(no log)"
