"""A hung daemon (SIGSTOP) costs a client a few seconds, never a failed request or a double grant.

The client waits a bounded time for the lease authority's answer, finds that nothing answers a second
connection either, says so in one line on stderr and takes its lease in the lock directory, counting
the stopped daemon's confirmed leases (docs/allocation.md, "A hung daemon").
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from authority_helpers import kill_group, wait_for
from conftest import gpusd_cli
from fakenvml import make_gpus

GPUSD = [sys.executable, "-m", "gpusd"]



def _leases(env):
    return json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)["leases"]



@pytest.fixture
def daemon(fake_nvml, cli_env, tmp_path):
    """A root daemon serving leases (the lease authority) on 3 fake GPUs; resumed and stopped at the end."""
    from daemon_helpers import unique_session
    from netns import read_lines

    if os.geteuid() != 0:
        pytest.skip("only a root daemon is the lease authority")
    fake_nvml.write(make_gpus(3))
    env = dict(cli_env, GPUSD_STATE_DIR=str(tmp_path / "state"), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")
    r, w = os.pipe()
    with open(tmp_path / "log", "wb") as log:
        proc = subprocess.Popen([*GPUSD, "start", "--foreground", "--port", "0", "--session", unique_session("hung"),
                                 "--ready-fd", str(w)], env=env, pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=log)
    os.close(w)
    try:
        assert read_lines(r, 1, 60), (tmp_path / "log").read_text()
        yield proc
    finally:
        os.close(r)
        try:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def test_a_stopped_daemon_sends_clients_to_the_lock_directory_without_double_grants(daemon, cli_env):
    jobs = []
    try:
        jobs.append(subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True))
        assert wait_for(lambda: len(_leases(cli_env)) == 1)
        [first] = _leases(cli_env)
        daemon.send_signal(signal.SIGSTOP)
        # the stopped daemon's lease counts (its record is confirmed by /proc/locks): GPU 1, not GPU 0
        r = gpusd_cli(["run", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], env=cli_env, timeout=40)
        assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr
        note = [line for line in r.stderr.splitlines() if "has not answered" in line]
        assert len(note) == 1 and f"pid {daemon.pid}" in note[0] and "lock directory" in note[0], r.stderr
        r = gpusd_cli(["select", "-n", "2"], env=cli_env, timeout=40)
        assert r.returncode == 0 and r.stdout.strip() == "1,2", r.stderr
        # a lease taken in the lock directory while the daemon is stopped
        jobs.append(subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True))
        assert wait_for(lambda: len(_leases(cli_env)) == 2, 40)
        held = {le["device"]: le for le in _leases(cli_env)}
        assert first["device"] in held
        r = gpusd_cli(["run", "-n", "2", "--", "true"], env=cli_env, timeout=40)
        assert r.returncode == 4, r.stderr  # one GPU left: never one of the two held
        # a request still open at the daemon when it resumes is granted around the lock directory's lease
        pending = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        pending.connect(os.environ["GPUSD_LEASE_SOCKET"])
        pending.sendall(json.dumps({"op": "lease", "v": 2, "count": 1, "command": "pending"}).encode() + b"\n")
        daemon.send_signal(signal.SIGCONT)
        pending.settimeout(30)
        reply = json.loads(pending.makefile("rb").readline())
        assert reply["ok"] is True and reply["devices"][0]["gpu"]["uuid"] not in held, reply
        r = gpusd_cli(["run", "--", "true"], env=cli_env)  # through the daemon again: nothing is free
        assert r.returncode == 4 and "has not answered" not in r.stderr, r.stderr
        pending.close()
    finally:
        for job in jobs:
            kill_group(job)


def test_a_daemon_that_answers_slowly_is_waited_for(monkeypatch):
    """Silence alone is no hang: a daemon whose event loop still answers is waited for."""
    import threading

    from gpusd.alloc import authority

    monkeypatch.setattr(authority, "HUNG_AFTER", 0.2)
    path = os.environ["GPUSD_LEASE_SOCKET"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    probes = []

    def serve():
        first, _ = srv.accept()
        first.recv(65536)
        for _ in range(3):  # the client asks whether we live, three times, before the answer comes
            probe, _ = srv.accept()
            probes.append(probe.recv(65536))
            probe.sendall(b'{"ok": false, "code": "usage", "error": "usage", "message": "unknown request"}\n')
            probe.close()
        first.sendall(b'{"ok": false, "code": "no_gpu", "error": "no_gpu", "message": "nothing free"}\n')
        first.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        sock = authority.connect()
        assert sock is not None
        from gpusd.alloc.select import Constraints
        from gpusd.errors import NoGpuAvailable

        with pytest.raises(NoGpuAvailable, match="nothing free"):
            authority.choose_through(sock, Constraints.build(count=1), wait=False, timeout=None)
        assert len(probes) == 3
    finally:
        t.join(10)
        srv.close()
