"""Leases granted by the daemon outlive the daemon: ``kill -9``, a restart, a second daemon.

The daemon here is a real ``gpusd start`` process (the lease authority of the test's own lock directory
and socket, on the fake NVML), so that it can be killed with SIGKILL while jobs hold GPUs through it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from authority_helpers import AuthorityDaemon, ServerThread, kill_group, wait_for
from conftest import gpusd_cli
from fakenvml import make_gpus

GPUSD = [sys.executable, "-m", "gpusd"]
# The command says which GPU it got and where its lease was recorded: through the daemon (its own
# directory) or, with no daemon answering, in the shared lock directory.
WHERE = ('echo "$CUDA_VISIBLE_DEVICES"; '
         'if test -e "$GPUSD_LOCK_DIR/authority/lease-$GPUSD_LEASE.json"; then echo daemon; '
         'elif test -e "$GPUSD_LOCK_DIR/lease-$GPUSD_LEASE.json"; then echo directory; fi')

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lease authority is a root daemon (its directory "
                                "is root's)")


def _leases(env: dict[str, str]) -> dict[str, int]:
    """device -> the pid holding its lease, as ``gpusd leases`` shows them (a fresh process's view)."""
    return {le["device"]: le["pid"] for le in json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)["leases"]
            if not le.get("unleased")}


def _queued(env: dict[str, str]) -> list[dict]:
    return json.loads(gpusd_cli(["leases", "--json"], env=env).stdout)["queued"]




def _index(env: dict[str, str]) -> dict[str, str]:
    """GPU UUID -> its index (as CUDA_VISIBLE_DEVICES names it)."""
    snap = json.loads(gpusd_cli(["devices", "--json"], env=env).stdout)
    hosts = snap if isinstance(snap, list) else [snap]
    return {g["uuid"]: str(g["index"]) for h in hosts for g in h["gpus"]}


def _run(env: dict[str, str], count: int = 1) -> tuple[int, list[str], str]:
    """``gpusd run -n COUNT`` of :data:`WHERE`: (exit status, the GPU indices it got, where it was recorded)."""
    r = gpusd_cli(["run", "-n", str(count), "--", "sh", "-c", WHERE], env=env)
    lines = r.stdout.split()
    return r.returncode, (lines[0].split(",") if lines else []), (lines[1] if len(lines) > 1 else r.stderr)


def _daemon_leases(daemon: AuthorityDaemon) -> dict[str, int]:
    """device -> holder pid, as the daemon's HTTP API shows its GPUs' leases."""
    return {le["device"]: le["pid"] for g in daemon.api("gpus") for le in g.get("leases") or []
            if not le.get("unleased")}


def test_a_killed_daemon_loses_no_lease_and_a_restarted_one_adopts_them(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(3))
    first = AuthorityDaemon(cli_env, tmp_path / "state", tmp_path / "log").start()
    second = None
    jobs: list[subprocess.Popen] = []
    try:
        for n in (1, 2):
            jobs.append(subprocess.Popen([*GPUSD, "run", "--", "sleep", "120"], env=cli_env, start_new_session=True))
            assert wait_for(lambda: len(_leases(cli_env)) == n)  # noqa: B023
        held = _leases(cli_env)
        assert sorted(held.values()) == sorted(j.pid for j in jobs)
        index = _index(cli_env)
        [free] = [index[u] for u in index if u not in held]

        first.kill()  # kill -9: the jobs go on, and so must their leases
        assert _leases(cli_env) == held
        os.kill(jobs[1].pid, signal.SIGKILL)  # and a job's supervisor: its command holds the lease alone now
        jobs[1].wait()
        assert _leases(cli_env) == held
        # Clients fall back to the lock directory and count the daemon's leases there.
        assert _run(cli_env) == (0, [free], "directory")
        status, _, why = _run(cli_env, 2)
        assert status == 4 and "need 2" in why, why

        second = AuthorityDaemon(cli_env, tmp_path / "state", tmp_path / "log").start()
        assert _daemon_leases(second) == held  # from its first answer
        assert _leases(cli_env) == held
        assert _run(cli_env) == (0, [free], "daemon")
        status, _, why = _run(cli_env, 2)
        assert status == 4 and "need 2" in why, why

        kill_group(jobs[0])  # a job ends: its lease ends with it, though no daemon took its connection
        mine = {d: p for d, p in held.items() if p != jobs[0].pid}
        assert wait_for(lambda: _leases(cli_env) == mine)
        assert wait_for(lambda: _daemon_leases(second) == mine)  # type: ignore[union-attr]
        status, got, where = _run(cli_env, 2)
        assert (status, sorted(got), where) == (0, sorted(i for u, i in index.items() if u not in mine), "daemon")
    finally:
        for job in jobs:
            kill_group(job)
        first.stop()
        if second is not None:
            second.stop()


def test_a_second_daemon_on_the_same_lock_directory_is_refused_and_touches_nothing(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(1))
    first = AuthorityDaemon(cli_env, tmp_path / "state1", tmp_path / "log1").start()
    holder = waiter = None
    try:
        holder = subprocess.Popen([*GPUSD, "run", "--", "sleep", "120"], env=cli_env, start_new_session=True)
        assert wait_for(lambda: len(_leases(cli_env)) == 1)
        out = tmp_path / "waited"
        waiter = subprocess.Popen([*GPUSD, "run", "--wait", "--timeout", "60", "--", "sh", "-c",
                                   f"( {WHERE} ) > {out}"], env=cli_env, start_new_session=True)
        assert wait_for(lambda: len(_queued(cli_env)) == 1)  # its ticket is the daemon's, in its directory
        # Another state directory and another socket, the same lock directory: refused, with one line.
        env = dict(cli_env, GPUSD_STATE_DIR=str(tmp_path / "state2"),
                   GPUSD_LEASE_SOCKET=str(tmp_path / "other.sock"), GPUSD_INTERFACES="127.0.0.1")
        r = subprocess.run([*GPUSD, "start", "--foreground", "--port", "0"], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "already the lease authority" in lines[0] and str(first.pid) in lines[0], r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "other.sock").exists()
        assert len(_queued(cli_env)) == 1 and len(_leases(cli_env)) == 1  # the first daemon's waiter still waits
        kill_group(holder)
        assert waiter.wait(60) == 0
        assert out.read_text().split() == ["0", "daemon"]  # served by the first daemon, in its turn
    finally:
        for proc in (holder, waiter):
            if proc is not None:
                kill_group(proc)
        first.stop()


# -- the descriptors the daemon passes with a grant (in-process daemon) -----------------------------------------

@pytest.fixture
def authority(fake_nvml_inprocess):
    server = ServerThread()
    yield server
    server.stop()


def test_the_client_holds_read_only_copies_of_its_lease_from_the_grant_on(fake_nvml_inprocess, authority, cli_env):
    """The grant carries the lease's descriptors, which cannot write root's record (a client that could
    would rewrite who the lease is for); a grow and a give-back keep the copies in step."""
    from gpusd.alloc.authority import connect, lease_through
    from gpusd.alloc.handle import Holder
    from gpusd.alloc.select import Constraints

    fake_nvml_inprocess.write(make_gpus(3))
    sock = connect()
    assert sock is not None
    _, lease = lease_through(sock, Constraints(count=1), wait=False, timeout=None, holder=Holder(command="x"))
    try:
        assert len(lease.fds) == 1 + 2  # the connection, the GPU's lock and the record's, with the answer
        for fd in lease.fds[1:]:
            with pytest.raises(OSError):
                os.write(fd, b"{}")
        lease.grow(Constraints(count=1))
        assert len(lease.fds) == 1 + 3  # a second GPU; the rewritten record's lock replaces the old one
        lease.give_back(lease.devices[0])
        assert len(lease.fds) == 1 + 2
        assert len(_leases(cli_env)) == 1
    finally:
        lease.release()
    assert wait_for(lambda: _leases(cli_env) == {})


def test_a_lease_ends_with_its_connection_whatever_copies_the_client_kept(fake_nvml_inprocess, authority, cli_env):
    """A client that closes its connection but keeps the descriptors it was passed holds nothing: the
    daemon unlocks the open files they share."""
    from gpusd.alloc.authority import _Lines, socket_path

    fake_nvml_inprocess.write(make_gpus(1))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(socket_path()))
    s.sendall(json.dumps({"op": "lease", "v": 2, "count": 1, "command": "keeper"}).encode() + b"\n")
    reader = _Lines(s)
    answer = json.loads(reader.readline())
    kept = list(reader.fds)
    try:
        assert answer["ok"] and answer["fds"] == [answer["devices"][0]["gpu"]["uuid"], "record"] and len(kept) == 2
        assert len(_leases(cli_env)) == 1
        s.close()
        assert wait_for(lambda: _leases(cli_env) == {})
        flock_only = dict(cli_env, GPUSD_LEASE_SOCKET="off")
        assert gpusd_cli(["run", "--", "true"], env=flock_only).returncode == 0
        assert gpusd_cli(["run", "--", "true"], env=cli_env).returncode == 0  # the daemon grants it again too
    finally:
        s.close()
        for fd in kept:
            os.close(fd)


def test_a_lease_ended_by_the_last_close_of_a_passed_copy_is_gone_from_the_next_look(fake_nvml_inprocess,
                                                                                     monkeypatch):
    """What a restarted daemon sees when a job whose lease the dead daemon granted ends: the only
    events are read-only closes, and a release_times between two looks must not swallow them."""
    from gpusd.alloc import leaseview
    from gpusd.alloc.leases import LeaseStore

    monkeypatch.setattr(leaseview, "REVALIDATE", 3600.0)  # no full look comes to the rescue
    store = LeaseStore.authority()
    store.ensure()
    lease = store.acquire(["GPU-passed-0"])
    assert lease is not None
    copies = [os.dup(fd) for fd in lease.fds]  # what the client holds
    lease.forget()  # the daemon that granted it dies
    for _ in range(2):  # the second look makes this process's view of the directory (and reads the record)
        assert [le.device for le in store.leases(peers=False)] == ["GPU-passed-0"]
    for fd in copies:  # the job ends
        os.close(fd)
    store.release_times()
    assert store.leases(peers=False) == []


def test_the_authoritys_queue_still_numbers_its_tickets_in_order(fake_nvml_inprocess):
    """Only the GPU locks and records of the authority are read-only (they are passed to clients):
    its queue counter is still written, so its waiters keep their order."""
    from gpusd.alloc import queue
    from gpusd.alloc.leases import LeaseStore

    store = LeaseStore.authority()
    store.ensure()
    tickets = []
    try:
        for _ in range(3):
            with store.mutex():
                tickets.append(queue.enqueue(store, 1))
        assert [t.seq for t in tickets] == [tickets[0].seq + k for k in range(3)]
    finally:
        for t in tickets:
            t.close()


def test_a_read_only_close_wakes_the_queue_in_the_authoritys_directory_only(fake_nvml_inprocess):
    """A lease the daemon granted ends with its client's last close of read-only GPU locks: that wakes
    the head of the queue.  In the shared directory a read-only close is a reader's (a look tries free
    GPUs' locks read-only): waking the head there would have it look again at every look of its own."""
    from gpusd.alloc.leases import LeaseStore
    from gpusd.alloc.queue import LeaseWatch

    shared, authority = LeaseStore(), LeaseStore.authority()
    shared.ensure()
    authority.ensure()
    for store in (shared, authority):
        (store.dir / "gpu-GPU-watched.lock").touch(mode=0o600)
    watch = LeaseWatch(shared.dir)
    try:
        assert watch.active
        watch.drain()
        # (the kernel queues the event as the file is closed: drain reads what is queued, waiting for nothing)
        os.close(os.open(shared.dir / "gpu-GPU-watched.lock", os.O_RDONLY))
        assert watch.drain() is False
        os.close(os.open(authority.dir / "gpu-GPU-watched.lock", os.O_RDONLY))
        assert watch.drain() is True
    finally:
        watch.close()
