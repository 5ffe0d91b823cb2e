"""The daemon as lease authority: leases over its Unix socket, and how they meet flock leases."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from authority_helpers import ServerThread, kill_group, wait_for
from conftest import gpusd_cli
from fakenvml import make_gpus

GPUSD = [sys.executable, "-m", "gpusd"]


@pytest.fixture
def authority(fake_nvml_inprocess):
    server = ServerThread()
    yield server
    server.stop()


def _leases(env):
    return json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)["leases"]




def test_daemon_leases_and_flock_leases_never_overlap(fake_nvml_inprocess, authority, cli_env):
    fake_nvml_inprocess.write(make_gpus(2))
    flock_only = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    via_daemon = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    try:
        assert wait_for(lambda: len(_leases(cli_env)) == 1)
        held = _leases(cli_env)[0]
        # the record is the daemon's (root's) and names the client the kernel reported
        assert held["pid"] == via_daemon.pid and held["command"] == "sleep 60"
        r = gpusd_cli(["run", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], env=flock_only)
        assert r.returncode == 0 and r.stdout.strip() == "1"  # the daemon holds GPU 0's flock
        own = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=flock_only, start_new_session=True)
        try:
            assert wait_for(lambda: len(_leases(cli_env)) == 2)
            r = gpusd_cli(["select"], env=cli_env)  # through the daemon: both GPUs are taken
            assert r.returncode == 4 and "leased by" in r.stderr, r.stderr
        finally:
            kill_group(own)
        # SIGKILL of the client (and its command): the connection closes, the daemon releases
        os.killpg(via_daemon.pid, signal.SIGKILL)
        assert wait_for(lambda: _leases(cli_env) == [])
        assert gpusd_cli(["select", "-n", "2"], env=flock_only).returncode == 0
    finally:
        kill_group(via_daemon)


def test_lease_outlives_a_killed_runner_through_the_daemon_too(fake_nvml_inprocess, authority, cli_env):
    fake_nvml_inprocess.write(make_gpus(1))
    runner = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    try:
        assert wait_for(lambda: len(_leases(cli_env)) == 1)
        os.kill(runner.pid, signal.SIGKILL)  # only gpusd run: its command holds the connection
        runner.wait()
        time.sleep(0.3)
        assert len(_leases(cli_env)) == 1
        os.killpg(runner.pid, signal.SIGKILL)
        assert wait_for(lambda: _leases(cli_env) == [])
    finally:
        kill_group(runner)


def test_waiting_through_the_daemon_is_served_when_a_flock_lease_ends(fake_nvml_inprocess, authority, cli_env,
                                                                       tmp_path):
    fake_nvml_inprocess.write(make_gpus(1))
    flock_only = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=flock_only, start_new_session=True)
    out = tmp_path / "out"
    try:
        assert wait_for(lambda: len(_leases(cli_env)) == 1)
        waiter = subprocess.Popen([*GPUSD, "run", "--wait", "--timeout", "60", "--", "sh", "-c",
                                   f'echo "$CUDA_VISIBLE_DEVICES" > {out}'], env=cli_env)
        assert wait_for(lambda: json.loads(gpusd_cli(["leases", "--json"], env=cli_env).stdout)["queued"])
        r = gpusd_cli(["run", "--", "true"], env=flock_only)  # the daemon's waiter is in the same queue
        assert r.returncode == 4 and "waiting for GPUs ahead" in r.stderr
        os.killpg(holder.pid, signal.SIGKILL)
        assert waiter.wait(timeout=30) == 0 and out.read_text().strip() == "0"
    finally:
        kill_group(holder)


def test_a_client_that_leaves_while_waiting_leaves_the_queue(fake_nvml_inprocess, authority, cli_env):
    fake_nvml_inprocess.write(make_gpus(1))
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    try:
        assert wait_for(lambda: len(_leases(cli_env)) == 1)
        waiter = subprocess.Popen([*GPUSD, "run", "--wait", "--", "true"], env=cli_env, start_new_session=True)

        def queued():
            return json.loads(gpusd_cli(["leases", "--json"], env=cli_env).stdout)["queued"]

        assert wait_for(lambda: len(queued()) == 1)
        kill_group(waiter)
        assert wait_for(lambda: queued() == [])
    finally:
        kill_group(holder)


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
    assert wait_for(lambda: _leases(cli_env) == [])


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
    assert ask(b'{"op": "lease", "priority": 7}\n')["error"] == "usage"
    assert ask(b'{"op": "lease", "priority": "urgent"}\n')["error"] == "usage"
    assert ask(b"x" * 100_000 + b"\n")["error"] == "usage"  # oversized: refused, not read whole
    assert ask(b'{"op": "lease", "count": 2}\n')["error"] == "no_gpu"
    r = gpusd_cli(["run", "--", "true"], env=cli_env)
    assert r.returncode == 0, r.stderr


def test_refusals_carry_their_code_and_the_0_2_kind(fake_nvml_inprocess, authority, cli_env):
    """docs/errors.md: each refusal names its error's code beside the 0.2 kind, and the client rebuilds
    the very class; a job id of 8 to 32 hex digits (what job records take) is accepted, not only 12."""
    from gpusd.alloc.authority import _check, socket_path
    from gpusd.errors import IdError, NoGpuAvailable

    fake_nvml_inprocess.write(make_gpus(1))

    def ask(raw: bytes) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(20)
            s.connect(str(socket_path()))
            s.sendall(raw)
            line = s.makefile("rb").readline()
            return json.loads(line) if line else {}

    bad = ask(b'{"op": "choose", "count": 1, "job": "../../etc"}\n')
    assert (bad["ok"], bad["code"], bad["error"]) == (False, "bad_id", "usage") and "job" in bad["message"]
    with pytest.raises(IdError, match="bad 'job'"):  # an IdError is a ConfigError: exit 2, as before
        _check(bad)
    assert ask(b"not json\n")["code"] == "usage"
    none = ask(b'{"op": "choose", "count": 2}\n')
    assert (none["code"], none["error"]) == ("no_gpu", "no_gpu")
    with pytest.raises(NoGpuAvailable):
        _check(none)
    for job in ("deadbeef", "3f9c0a1b22de", "0123456789abcdef0123456789abcdef"):
        assert ask(b'{"op": "choose", "count": 1, "job": "%s"}\n' % job.encode())["ok"] is True, job


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
        assert wait_for(lambda: len(_leases(cli_env)) == 1)
        [held] = _leases(cli_env)
        assert held["pid"] == job.pid
        store = LeaseStore.authority()  # the daemon's own directory: lock files only it can open
        lock = os.stat(store.dir / f"gpu-{held['device']}.lock")
        assert [pid for pid, _ in flock_table()[lock_key(lock)]] == [daemon.pid]  # the daemon holds it
        assert stat.S_IMODE(lock.st_mode) == 0o600 and stat.S_IMODE(os.stat(store.dir).st_mode) == 0o755
        assert not (LeaseStore().dir / f"gpu-{held['device']}.lock").exists()  # nothing in the shared one
        kill_group(job)
        assert wait_for(lambda: _leases(cli_env) == [])
    finally:
        if job is not None:
            kill_group(job)
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
        assert wait_for(lambda: len(_leases(cli_env)) == 1)
        r = gpusd_cli(["run", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"'], env=cli_env)
        assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr  # refused as busy, leased itself
    finally:
        kill_group(first)


def test_leases_survive_a_daemon_restart(fake_nvml_inprocess, cli_env):
    fake_nvml_inprocess.write(make_gpus(1))
    flock_only = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    server = ServerThread()
    job = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    try:
        assert wait_for(lambda: len(_leases(cli_env)) == 1)
        server.stop()  # the daemon goes away: it hands the lease's descriptors to its client
        [held] = _leases(cli_env)
        assert held["pid"] == job.pid
        r = gpusd_cli(["select"], env=flock_only)
        assert r.returncode == 4 and "leased by" in r.stderr, r.stderr
        server = ServerThread()  # a new daemon sees the same lease
        assert gpusd_cli(["select"], env=cli_env).returncode == 4
        kill_group(job)  # the job ends: so does its lease
        assert wait_for(lambda: _leases(cli_env) == [])
        assert gpusd_cli(["select"], env=cli_env).returncode == 0
    finally:
        kill_group(job)
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


# -- protocol 2: the connection that holds a lease grows it and gives GPUs back ----------------

def _held_connection(count: int = 1, **extra: object) -> tuple[socket.socket, dict, object]:
    """A protocol-2 lease asked on a raw connection: (the connection, the answer, a line reader)."""
    from gpusd.alloc.authority import socket_path

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(socket_path()))
    s.sendall(json.dumps({"op": "lease", "v": 2, "count": count, "command": "held", **extra}).encode() + b"\n")
    f = s.makefile("rb")
    return s, json.loads(f.readline()), f


def _record(env, lease_id):
    return sorted(le["device"] for le in _leases(env) if le["lease_id"] == lease_id)


def test_a_held_connection_grows_and_releases_under_one_record(fake_nvml_inprocess, authority, cli_env):
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.lockdir import flock_table, lock_key

    fake_nvml_inprocess.write(make_gpus(3))
    s, answer, f = _held_connection(job="3f9c0a1b22de")
    try:
        assert answer["ok"] is True and answer["v"] == 2 and answer["job"] == "3f9c0a1b22de"
        lease_id, first = answer["lease_id"], answer["devices"][0]["gpu"]["uuid"]
        assert [le["job"] for le in _leases(cli_env)] == ["3f9c0a1b22de"]  # the record names the job
        s.sendall(b'{"op": "grow", "id": 1, "count": 2}\n')
        grown = json.loads(f.readline())
        assert grown["ok"] is True and grown["id"] == 1 and grown["lease_id"] == lease_id, grown
        added = [d["gpu"]["uuid"] for d in grown["devices"]]
        assert len(added) == 2 and first not in added and sorted(grown["held"]) == sorted([first, *added])
        # one record, the daemon's, names all three and the job; the daemon (this process) holds the locks
        assert _record(cli_env, lease_id) == sorted([first, *added])
        assert {le["job"] for le in _leases(cli_env)} == {"3f9c0a1b22de"}
        store = LeaseStore.authority()
        for uuid in (first, *added):
            lock = os.stat(store.dir / f"gpu-{uuid}.lock")
            assert [pid for pid, _ in flock_table()[lock_key(lock)]] == [os.getpid()]
        assert gpusd_cli(["select"], env=dict(cli_env, GPUSD_LEASE_SOCKET="off")).returncode == 4
        # the first GPU (not a grown one) goes back at once: the daemon holds every descriptor
        s.sendall(json.dumps({"op": "release", "id": 2, "device": first}).encode() + b"\n")
        released = json.loads(f.readline())
        assert released["ok"] is True and released["id"] == 2 and sorted(released["held"]) == sorted(added)
        assert _record(cli_env, lease_id) == sorted(added)
        r = gpusd_cli(["select", "--json"], env=dict(cli_env, GPUSD_LEASE_SOCKET="off"))
        assert r.returncode == 0 and json.loads(r.stdout)["devices"][0]["uuid"] == first, r.stderr
    finally:
        f.close()
        s.close()
    assert wait_for(lambda: _leases(cli_env) == [])  # the end of the connection ends all of it


def test_bad_requests_on_a_held_connection_get_an_error_and_keep_the_lease(fake_nvml_inprocess, authority,
                                                                             cli_env):
    fake_nvml_inprocess.write(make_gpus(2))
    s, answer, f = _held_connection()
    try:
        lease_id, mine = answer["lease_id"], answer["devices"][0]["gpu"]["uuid"]
        for raw in (b"not json", b"[1, 2]", b'{"op": "grow", "count": "2"}', b'{"op": "grow", "count": 1000000000}',
                    b'{"op": "grow", "count": 64}', b'{"op": "grow", "count": 1, "id": "x"}',
                    b'{"op": "grow", "count": 1, "timeout": -1}', b'{"op": "grow", "count": 1, "include": 5}',
                    b'{"op": "release", "device": 5}', b'{"op": "release", "device": "GPU-not-mine"}',
                    b'{"op": "release", "id": 3, "device": "' + mine.encode() + b'"}',  # its last GPU
                    b'{"op": "lease", "count": 1}', b'{"op": "nope"}', b"x" * 100_000):
            s.sendall(raw + b"\n")
            reply = json.loads(f.readline())
            assert reply["ok"] is False and reply["error"] == "usage", (raw[:60], reply)
            assert "Traceback" not in reply["message"]
            assert _record(cli_env, lease_id) == [mine], raw[:60]
        assert reply["id"] is None
        s.sendall(b'{"op": "grow", "id": 9, "count": 1}\n')  # and it still works
        grown = json.loads(f.readline())
        assert grown["ok"] is True and grown["id"] == 9 and len(_record(cli_env, lease_id)) == 2
        s.sendall(b'{"op": "grow", "id": 10, "count": 1}\n')
        none_left = json.loads(f.readline())
        assert none_left["ok"] is False and none_left["error"] == "no_gpu" and none_left["id"] == 10
    finally:
        f.close()
        s.close()
    assert wait_for(lambda: _leases(cli_env) == [])


def test_protocol_1_still_means_anything_after_the_answer_releases(fake_nvml_inprocess, authority, cli_env):
    from gpusd.alloc.authority import socket_path

    fake_nvml_inprocess.write(make_gpus(1))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(socket_path()))
        s.sendall(b'{"op": "lease", "count": 1}\n')  # no "v": an old client
        f = s.makefile("rb")
        answer = json.loads(f.readline())
        assert answer["ok"] is True and answer["v"] == 1
        assert len(_leases(cli_env)) == 1
        s.sendall(b'{"op": "grow", "count": 1}\n')  # to an old client's daemon: "release"
        assert f.readline() == b""  # no answer: the daemon ended the connection
        assert wait_for(lambda: _leases(cli_env) == [])


def test_a_client_never_sends_a_change_to_an_older_daemon():
    """An old daemon (protocol 1, no "v" in its answer) would take any further line for "release"."""
    from gpusd.alloc.authority import RemoteLease
    from gpusd.alloc.select import Constraints
    from gpusd.errors import GpusdError

    ours, daemon = socket.socketpair()
    lease = RemoteLease("l1", ["GPU-a"], False, None, ours, version=1)
    try:
        with pytest.raises(GpusdError, match="older than this gpusd"):
            lease.grow(Constraints(count=1))
        with pytest.raises(GpusdError, match="older than this gpusd"):
            lease.give_back("GPU-a")
        daemon.setblocking(False)
        with pytest.raises(BlockingIOError):
            daemon.recv(1)  # nothing was sent
    finally:
        lease.release()
        daemon.close()


def test_a_grown_lease_survives_a_daemon_restart(fake_nvml_inprocess, cli_env):
    from gpusd.alloc.authority import connect, lease_through
    from gpusd.alloc.handle import Holder
    from gpusd.alloc.select import Constraints
    from gpusd.errors import GpusdError

    fake_nvml_inprocess.write(make_gpus(3))
    flock_only = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    server = ServerThread()
    sock = connect()
    assert sock is not None
    chosen, lease = lease_through(sock, Constraints(count=1), wait=False, timeout=None,
                                  holder=Holder(command="x", job="0123456789ab"))
    try:
        lease.grow(Constraints(count=1))
        assert len(lease.devices) == 2 and len(_leases(cli_env)) == 2
        server.stop()  # hands every descriptor over, the grown GPU's too
        assert sorted(le["device"] for le in _leases(cli_env)) == sorted(lease.devices)
        r = gpusd_cli(["select", "-n", "2"], env=flock_only)
        assert r.returncode == 4, r.stderr  # only one GPU is free
        with pytest.raises(GpusdError, match="handed the lease over"):
            lease.grow(Constraints(count=1))
        assert len(_leases(cli_env)) == 2  # a refused change loses nothing
        server = ServerThread()
    finally:
        lease.release()
        server.stop()
    assert wait_for(lambda: _leases(cli_env) == [])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play a second user")
def test_another_user_cannot_change_a_lease_through_its_connection(fake_nvml_inprocess, public_authority, cli_env):
    """A command that runs as another user inherits the job's connection (``su bob -c ...``): its
    lines are not obeyed, and the holder's own requests are still answered."""
    from gpusd.alloc.authority import connect, lease_through, socket_path
    from gpusd.alloc.handle import Holder
    from gpusd.alloc.select import Constraints
    from other_user import MALLORY, AsUser

    fake_nvml_inprocess.write(make_gpus(3))
    cli_env = dict(cli_env, GPUSD_LEASE_SOCKET=str(socket_path()))
    sock = connect()
    assert sock is not None
    _, lease = lease_through(sock, Constraints(count=1), wait=False, timeout=None,
                             holder=Holder(command="x", job="0123456789ab"))
    mine = lease.devices[0]
    try:
        def meddle() -> str:
            for message in ({"op": "grow", "id": 1, "count": 2}, {"op": "release", "id": 2, "device": mine},
                            {"op": "grow", "id": 3, "count": 1, "wait": True}):
                sock.sendall(json.dumps(message).encode() + b"\n")
            sock.sendall(b'{"op": "gr')  # half a line: the holder's next line must not complete it
            return "sent"

        assert AsUser(MALLORY, meddle).result == "ok sent"
        time.sleep(0.3)
        assert _record(cli_env, lease.lease_id) == [mine]  # neither grown nor shrunk
        # Mallory's own connection cannot reach it either: "job" is a label, the lease is hers.
        kept = []  # her connection stays open while she stays

        def own() -> str:
            s, answer, f = _held_connection(job="0123456789ab")
            kept.append((s, f))
            s.sendall(json.dumps({"op": "release", "id": 1, "device": mine}).encode() + b"\n")
            return json.dumps([answer["lease_id"], json.loads(f.readline())])

        hers = AsUser(MALLORY, own, stay=True)
        try:
            her_lease, refused = json.loads(hers.result[3:])
            assert refused["ok"] is False and "does not hold" in refused["message"]
            assert [le["user"] for le in _leases(cli_env) if le["lease_id"] == her_lease] == [str(MALLORY)]
            assert _record(cli_env, lease.lease_id) == [mine]
        finally:
            hers.stop()
        # the holder's own grow still gets its own answer (its line is not glued to Mallory's half line)
        lease.grow(Constraints(count=1))
        assert len(lease.devices) == 2 and _record(cli_env, lease.lease_id) == sorted(lease.devices)
    finally:
        lease.release()
    assert wait_for(lambda: _leases(cli_env) == [])


def test_a_grow_waiting_on_a_held_connection_is_abandoned_with_it(fake_nvml_inprocess, authority, cli_env):
    fake_nvml_inprocess.write(make_gpus(2))
    flock_only = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    s, answer, f = _held_connection()
    other = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=flock_only, start_new_session=True)
    try:
        assert wait_for(lambda: len(_leases(cli_env)) == 2)
        s.sendall(b'{"op": "grow", "id": 1, "count": 1, "wait": true}\n')

        def queued():
            return json.loads(gpusd_cli(["leases", "--json"], env=cli_env).stdout)["queued"]

        assert wait_for(lambda: len(queued()) == 1)  # the grow waits in the queue, like any request
        f.close()
        s.close()
        assert wait_for(lambda: queued() == [] and len(_leases(cli_env)) == 1)  # wait and lease: gone
    finally:
        f.close()
        s.close()
        kill_group(other)


def test_a_daemon_that_stops_during_a_grow_hands_the_lease_to_the_waiting_client(fake_nvml_inprocess, cli_env):
    """The client reads the hand-over while it waits for its answer: it must keep the descriptors."""
    from concurrent.futures import ThreadPoolExecutor

    from gpusd.alloc.authority import connect, lease_through
    from gpusd.alloc.handle import Holder
    from gpusd.alloc.select import Constraints
    from gpusd.errors import GpusdError

    fake_nvml_inprocess.write(make_gpus(3))
    flock_only = dict(cli_env, GPUSD_LEASE_SOCKET="off")
    server = ServerThread()
    other = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=flock_only, start_new_session=True)
    sock = connect()
    assert sock is not None
    _, lease = lease_through(sock, Constraints(count=1), wait=False, timeout=None,
                             holder=Holder(command="x", job="0123456789ab"))
    try:
        lease.grow(Constraints(count=1))
        assert wait_for(lambda: len(_leases(cli_env)) == 3)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(lease.grow, Constraints(count=1), wait=True)
            assert wait_for(lambda: json.loads(gpusd_cli(["leases", "--json"], env=cli_env).stdout)["queued"])
            server.stop()
            with pytest.raises(GpusdError, match="handed this lease over"):
                waiting.result(timeout=30)
        assert len(lease.fds) == 1 + 3  # the connection, and the lease's descriptors (2 GPUs and the record)
        assert sorted(le["device"] for le in _leases(cli_env) if le["lease_id"] == lease.lease_id) == sorted(
            lease.devices)
        r = gpusd_cli(["select", "-n", "1"], env=flock_only)
        assert r.returncode == 4, r.stderr  # the job's two GPUs are still leased
        lease.release()
        assert wait_for(lambda: len(_leases(cli_env)) == 1)  # only the other job's is left
    finally:
        lease.release()
        kill_group(other)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play a second user")
def test_the_daemon_queues_a_client_in_the_class_the_policy_allows_its_uid(fake_nvml_inprocess, public_authority,
                                                                          cli_env):
    """The daemon's tickets are root's, and root's tickets are believed: so the daemon itself must cap
    a client's claimed priority by the client's uid (SO_PEERCRED), or any user could queue as urgent."""
    from gpusd.alloc import queue
    from gpusd.alloc.authority import socket_path
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.priority import HIGH, URGENT

    fake_nvml_inprocess.write(make_gpus(1))
    cli_env = dict(cli_env, GPUSD_LEASE_SOCKET=str(socket_path()))
    holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "60"], env=cli_env, start_new_session=True)
    pids = []
    try:
        assert wait_for(lambda: len(_leases(cli_env)) == 1)
        for uid in (40001, 0):
            pid = os.fork()
            if pid == 0:
                try:
                    if uid:
                        os.setgroups([])
                        os.setgid(uid)
                        os.setuid(uid)
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect(str(socket_path()))
                    s.sendall(json.dumps({"op": "lease", "count": 1, "wait": True, "command": f"uid{uid}",
                                          "priority": URGENT}).encode() + b"\n")
                    time.sleep(60)
                finally:
                    os._exit(0)
            pids.append(pid)
            n = len(pids)
            assert wait_for(lambda: len(queue.waiters(LeaseStore())) == n)  # noqa: B023
        waiting = {w.command: w for w in queue.waiters(LeaseStore())}
        assert waiting["uid40001"].priority == HIGH  # capped: urgent is for root and whom the policy names
        assert waiting["uid0"].priority == URGENT
        assert [w.command for w in queue.waiters(LeaseStore())] == ["uid0", "uid40001"]
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        kill_group(holder)
