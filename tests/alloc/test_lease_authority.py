"""The daemon as lease authority: leases over its Unix socket, and how they meet flock leases."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import gpusd_cli
from fakenvml import make_gpus

GPUSD = [sys.executable, "-m", "gpusd"]


class ServerThread:
    """A LeaseServer on its own event loop in a thread of this process (the daemon's part)."""

    def __init__(self) -> None:
        from gpusd.alloc.authority import socket_path
        from gpusd.daemon.leasesock import LeaseServer

        self.loop = asyncio.new_event_loop()
        self.server = LeaseServer(socket_path())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def authority(fake_nvml_inprocess):
    server = ServerThread()
    yield server
    server.stop()


def _leases(env):
    return json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)["leases"]


def _wait_for(predicate, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def test_daemon_leases_and_flock_leases_never_overlap(fake_nvml_inprocess, authority, cli_env):
    fake_nvml_inprocess.write(make_gpus(2))
    flock_only = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    via_daemon = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    try:
        assert _wait_for(lambda: len(_leases(cli_env)) == 1)
        held = _leases(cli_env)[0]
        # the record is the daemon's (root's) and names the client the kernel reported
        assert held["pid"] == via_daemon.pid and held["command"] == "sleep 60"
        r = gpusd_cli(["run", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], env=flock_only)
        assert r.returncode == 0 and r.stdout.strip() == "1"  # the daemon holds GPU 0's flock
        own = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=flock_only, start_new_session=True)
        try:
            assert _wait_for(lambda: len(_leases(cli_env)) == 2)
            r = gpusd_cli(["select"], env=cli_env)  # through the daemon: both GPUs are taken
            assert r.returncode == 4 and "leased by" in r.stderr, r.stderr
        finally:
            _kill_group(own)
        # SIGKILL of the client (and its command): the connection closes, the daemon releases
        os.killpg(via_daemon.pid, signal.SIGKILL)
        assert _wait_for(lambda: _leases(cli_env) == [])
        assert gpusd_cli(["select", "-n", "2"], env=flock_only).returncode == 0
    finally:
        _kill_group(via_daemon)


def test_lease_outlives_a_killed_runner_through_the_daemon_too(fake_nvml_inprocess, authority, cli_env):
    fake_nvml_inprocess.write(make_gpus(1))
    runner = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    try:
        assert _wait_for(lambda: len(_leases(cli_env)) == 1)
        os.kill(runner.pid, signal.SIGKILL)  # only gpusd run: its command holds the connection
        runner.wait()
        time.sleep(0.3)
        assert len(_leases(cli_env)) == 1
        os.killpg(runner.pid, signal.SIGKILL)
        assert _wait_for(lambda: _leases(cli_env) == [])
    finally:
        _kill_group(runner)


def test_waiting_through_the_daemon_is_served_when_a_flock_lease_ends(fake_nvml_inprocess, authority, cli_env,
                                                                       tmp_path):
    fake_nvml_inprocess.write(make_gpus(1))
    flock_only = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=flock_only, start_new_session=True)
    out = tmp_path / "out"
    try:
        assert _wait_for(lambda: len(_leases(cli_env)) == 1)
        waiter = subprocess.Popen([*GPUSD, "run", "--wait", "--timeout", "60", "--", "sh", "-c",
                                   f'echo "$CUDA_VISIBLE_DEVICES" > {out}'], env=cli_env)
        assert _wait_for(lambda: json.loads(gpusd_cli(["leases", "--json"], env=cli_env).stdout)["queued"])
        r = gpusd_cli(["run", "--", "true"], env=flock_only)  # the daemon's waiter is in the same queue
        assert r.returncode == 4 and "waiting for GPUs ahead" in r.stderr
        os.killpg(holder.pid, signal.SIGKILL)
        assert waiter.wait(timeout=30) == 0 and out.read_text().strip() == "0"
    finally:
        _kill_group(holder)


def test_a_client_that_leaves_while_waiting_leaves_the_queue(fake_nvml_inprocess, authority, cli_env):
    fake_nvml_inprocess.write(make_gpus(1))
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    try:
        assert _wait_for(lambda: len(_leases(cli_env)) == 1)
        waiter = subprocess.Popen([*GPUSD, "run", "--wait", "--", "true"], env=cli_env, start_new_session=True)

        def queued():
            return json.loads(gpusd_cli(["leases", "--json"], env=cli_env).stdout)["queued"]

        assert _wait_for(lambda: len(queued()) == 1)
        _kill_group(waiter)
        assert _wait_for(lambda: queued() == [])
    finally:
        _kill_group(holder)


@pytest.fixture
def public_authority(fake_nvml_inprocess, monkeypatch):
    """The authority on a socket other users can reach (pytest's tmp_path is private to root)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="gpusd-authority-", dir="/tmp")
    os.chmod(d, 0o755)
    monkeypatch.setenv("GPUSD_LEASE_SOCKET", os.path.join(d, "lease.sock"))
    server = ServerThread()
    yield server
    server.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play a second user")
def test_the_daemon_attributes_a_lease_to_the_uid_the_kernel_reports(fake_nvml_inprocess, public_authority, cli_env):
    from gpusd.alloc.authority import socket_path

    fake_nvml_inprocess.write(make_gpus(1))
    cli_env = dict(cli_env, GPUSD_LEASE_SOCKET=str(socket_path()))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(40001)
            os.setuid(40001)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(socket_path()))
            s.sendall(json.dumps({"op": "lease", "count": 1, "command": "job", "user": "alice"}).encode() + b"\n")
            os.write(w, s.makefile("rb").readline())
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            reply = json.loads(f.readline())
        assert reply["ok"] is True, reply
        [held] = _leases(cli_env)
        assert (held["user"], held["pid"]) == ("40001", pid)  # not "alice": the kernel says who asked
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert _wait_for(lambda: _leases(cli_env) == [])


def test_bad_requests_get_an_error_and_the_server_lives_on(fake_nvml_inprocess, authority, cli_env):
    from gpusd.alloc.authority import socket_path

    fake_nvml_inprocess.write(make_gpus(1))

    def ask(raw: bytes) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(20)
            s.connect(str(socket_path()))
            s.sendall(raw)
            line = s.makefile("rb").readline()
            return json.loads(line) if line else {}

    assert ask(b"not json\n")["error"] == "usage"
    assert ask(b'{"op": "lease", "count": 0}\n')["error"] == "usage"
    assert ask(b'{"op": "lease", "count": 1, "min_free": NaN}\n')["error"] == "usage"
    assert ask(b'{"op": "lease", "include": [' + b'"0",' * 100 + b'"0"]}\n')["error"] == "usage"
    assert ask(b'{"op": "lease", "min_free": "lots"}\n')["error"] == "usage"
    assert ask(b"x" * 100_000 + b"\n")["error"] == "usage"  # oversized: refused, not read whole
    assert ask(b'{"op": "lease", "count": 2}\n')["error"] == "no_gpu"
    r = gpusd_cli(["run", "--", "true"], env=cli_env)
    assert r.returncode == 0, r.stderr


def test_a_socket_not_owned_by_root_or_us_is_ignored(tmp_path, monkeypatch):
    from gpusd.alloc import authority

    path = tmp_path / "lease.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen()
    try:
        assert authority.connect(path) is not None  # ours: used
        if os.geteuid() == 0:
            os.chown(path, 40001, 40001)
            assert authority.connect(path) is None  # another user's: never trusted with a lease
        monkeypatch.setenv("GPUSD_LEASE_SOCKET", "off")
        assert authority.socket_path() is None
    finally:
        srv.close()


def test_a_running_daemon_serves_leases_that_gpusd_run_uses(fake_nvml, cli_env, tmp_path):
    from daemon_helpers import unique_session
    from gpusd.alloc.authority import socket_path
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.lockdir import flock_table, lock_key
    from netns import read_lines

    fake_nvml.write(make_gpus(2))
    env = dict(cli_env, GPUSD_STATE_DIR=str(tmp_path / "state"), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")
    r, w = os.pipe()
    with open(tmp_path / "log", "wb") as log:
        daemon = subprocess.Popen([*GPUSD, "start", "--foreground", "--port", "0", "--session",
                                   unique_session("lease"), "--ready-fd", str(w)], env=env, pass_fds=(w,),
                                  stdout=subprocess.DEVNULL, stderr=log)
    os.close(w)
    job = None
    try:
        assert read_lines(r, 1, 60), (tmp_path / "log").read_text()
        assert socket_path().is_socket()
        job = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
        assert _wait_for(lambda: len(_leases(cli_env)) == 1)
        [held] = _leases(cli_env)
        assert held["pid"] == job.pid
        store = LeaseStore()
        lock = os.stat(store.dir / f"gpu-{held['device']}.lock")
        assert [pid for pid, _ in flock_table()[lock_key(lock)]] == [daemon.pid]  # the daemon holds it
        _kill_group(job)
        assert _wait_for(lambda: _leases(cli_env) == [])
    finally:
        if job is not None:
            _kill_group(job)
        os.close(r)
        daemon.terminate()
        daemon.wait(15)
    assert not socket_path().exists()
    assert gpusd_cli(["run", "--", "true"], env=cli_env).returncode == 0  # no daemon: the lock directory


def test_a_busy_daemon_sends_clients_to_the_lock_directory(fake_nvml_inprocess, authority, cli_env, monkeypatch):
    from gpusd.daemon import leasesock

    monkeypatch.setattr(leasesock, "MAX_PER_UID", 1)
    fake_nvml_inprocess.write(make_gpus(2))
    first = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    try:
        assert _wait_for(lambda: len(_leases(cli_env)) == 1)
        r = gpusd_cli(["run", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], env=cli_env)
        assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr  # refused as busy, leased itself
    finally:
        _kill_group(first)


def test_leases_survive_a_daemon_restart(fake_nvml_inprocess, cli_env):
    fake_nvml_inprocess.write(make_gpus(1))
    flock_only = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    server = ServerThread()
    job = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    try:
        assert _wait_for(lambda: len(_leases(cli_env)) == 1)
        server.stop()  # the daemon goes away: it hands the lease's descriptors to its client
        [held] = _leases(cli_env)
        assert held["pid"] == job.pid
        r = gpusd_cli(["select"], env=flock_only)
        assert r.returncode == 4 and "leased by" in r.stderr, r.stderr
        server = ServerThread()  # a new daemon sees the same lease
        assert gpusd_cli(["select"], env=cli_env).returncode == 4
        _kill_group(job)  # the job ends: so does its lease
        assert _wait_for(lambda: _leases(cli_env) == [])
        assert gpusd_cli(["select"], env=cli_env).returncode == 0
    finally:
        _kill_group(job)
        server.stop()


def test_a_second_daemon_does_not_take_over_a_live_lease_socket(fake_nvml_inprocess, authority):
    from gpusd.alloc import authority as client
    from gpusd.daemon.leasesock import start_lease_server

    async def second():
        return await start_lease_server()

    assert asyncio.run(second()) is None  # logged: another daemon serves leases there
    sock = client.connect()
    assert sock is not None  # the first one still answers
    sock.close()
