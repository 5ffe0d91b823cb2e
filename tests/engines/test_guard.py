"""The host-side guard of an engine that outlives ``gpusd ray up`` (gpusd.engines.hold, docs/engines.md):
the processes a command leaves running (as ``ray start`` does) are stopped before the lease that
holds their GPUs can end, when that lease is released, or on ``--stop`` — and only the guard's own.

Here the lease is a real record in a private lock directory, written the way the daemon writes a
remote lease (``expires`` on this host's clock), and the "engine" is a shell that leaves a
``sleep`` behind, as ``ray start`` leaves raylet."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpusd.alloc.handle import Holder
from gpusd.alloc.leases import LeaseStore

SRC = str(Path(__file__).resolve().parents[2] / "src")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard reads /proc (Linux)")


def _env(locks: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC, "GPUSD_LOCK_DIR": str(locks)}


def _daemonising(pidfile: Path) -> list[str]:
    """A command that starts a background process and returns, as ``ray start`` does."""
    return ["sh", "-c", f"sleep 300 </dev/null >/dev/null 2>&1 & echo $! > {pidfile}; echo started"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _guard(locks: Path, lease: str, cmd: list[str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpusd.engines.hold", "--lease", lease, *extra, "--", *cmd],
                          env=_env(locks), capture_output=True, text=True, timeout=60)


def _wait(pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.fixture
def store(tmp_path: Path) -> LeaseStore:
    return LeaseStore(tmp_path / "locks")


def test_the_engine_is_stopped_before_its_lease_can_end(store: LeaseStore, tmp_path: Path) -> None:
    """Nobody renews the lease (the renewer was killed, --for is over): the guard stops what the
    command left running ``--margin`` seconds before the daemon would end the lease."""
    expires = time.time() + 6.0
    lease = store.acquire(["GPU-guard-0"], holder=Holder(remote_from="198.18.0.9", expires=expires))
    assert lease is not None
    pidfile = tmp_path / "engine.pid"
    try:
        r = _guard(store.dir, lease.lease_id, _daemonising(pidfile), "--margin", "3", "--grace", "1")
        assert r.returncode == 0 and "started" in r.stdout, r.stderr  # returns once the command has
        engine = int(pidfile.read_text())
        assert _alive(engine)  # ... left its process running, guarded
        while time.time() < expires - 0.3 and _alive(engine):
            time.sleep(0.05)
        assert not _alive(engine), "the engine still ran when its lease was about to end"
        assert not lease.released  # nobody ended the lease: the guard acted on its expiry alone
    finally:
        lease.release()
        if pidfile.exists() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), 9)


def test_a_renewed_lease_keeps_the_engine_and_a_released_one_stops_it(store: LeaseStore, tmp_path: Path) -> None:
    lease = store.acquire(["GPU-guard-1"], holder=Holder(remote_from="198.18.0.9", expires=time.time() + 3))
    assert lease is not None
    pidfile = tmp_path / "engine.pid"
    try:
        r = _guard(store.dir, lease.lease_id, _daemonising(pidfile), "--margin", "1", "--grace", "0.5")
        assert r.returncode == 0, r.stderr
        engine = int(pidfile.read_text())
        for _ in range(6):  # renewed as the daemon renews: the record replaced with a later expiry
            with store.mutex():
                store.rewrite(lease, expires=time.time() + 3)
            time.sleep(0.7)
        assert _alive(engine)  # renewed for 4 s past the first expiry: still running
        lease.release()  # released (gpusd release, or the daemon restarted)
        assert _wait(lambda: not _alive(engine), 10)
    finally:
        lease.release()
        if _alive(engine := int(pidfile.read_text())):
            os.kill(engine, 9)


def test_stop_ends_only_the_guard_of_that_lease(store: LeaseStore, tmp_path: Path) -> None:
    """``--stop --lease ID`` (what gpusd ray down runs on each host) stops that cluster's processes and
    returns when they are gone; another cluster's guard on the same host keeps its own."""
    far = time.time() + 600
    a = store.acquire(["GPU-guard-2"], holder=Holder(remote_from="198.18.0.9", expires=far))
    b = store.acquire(["GPU-guard-3"], holder=Holder(remote_from="198.18.0.9", expires=far))
    assert a is not None and b is not None
    pa, pb = tmp_path / "a.pid", tmp_path / "b.pid"
    try:
        assert _guard(store.dir, a.lease_id, _daemonising(pa)).returncode == 0
        assert _guard(store.dir, b.lease_id, _daemonising(pb)).returncode == 0
        ea, eb = int(pa.read_text()), int(pb.read_text())
        r = subprocess.run([sys.executable, "-m", "gpusd.engines.hold", "--stop", "--lease", a.lease_id],
                           env=_env(store.dir), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert not _alive(ea) and _alive(eb)  # gone when --stop returned; the other cluster untouched
        r = subprocess.run([sys.executable, "-m", "gpusd.engines.hold", "--stop", "--lease", a.lease_id],
                           env=_env(store.dir), capture_output=True, text=True, timeout=60)
        assert r.returncode == 3 and "no guard" in r.stderr  # nothing left to stop
    finally:
        for le in (a, b):
            le.release()
        for p in (pa, pb):
            if p.exists() and _alive(int(p.read_text())):
                os.kill(int(p.read_text()), 9)


def test_without_the_lease_nothing_starts_and_a_failing_command_leaves_nothing(store: LeaseStore,
                                                                              tmp_path: Path) -> None:
    store.ensure()
    marker = tmp_path / "ran"
    r = _guard(store.dir, "0123456789ab", ["touch", str(marker)])
    assert r.returncode == 3 and "no lease 0123456789ab" in r.stderr and not marker.exists()
    lease = store.acquire(["GPU-guard-4"], holder=Holder(remote_from="198.18.0.9", expires=time.time() + 600))
    assert lease is not None
    pidfile = tmp_path / "engine.pid"
    try:
        r = _guard(store.dir, lease.lease_id, ["sh", "-c", f"sleep 300 </dev/null >/dev/null 2>&1 & echo $! > "
                                                           f"{pidfile}; exit 7"], "--grace", "0.5")
        assert r.returncode == 7
        assert not _alive(int(pidfile.read_text()))  # what a failed start left is stopped
    finally:
        lease.release()


def test_a_command_that_cannot_be_executed_is_126_and_one_that_is_missing_127(store: LeaseStore,
                                                                              tmp_path: Path) -> None:
    store.ensure()
    lease = store.acquire(["GPU-guard-5"], holder=Holder(remote_from="198.18.0.9", expires=time.time() + 600))
    assert lease is not None
    script = tmp_path / "engine.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o644)  # there but not executable
    try:
        r = _guard(store.dir, lease.lease_id, [str(script)], "--grace", "0.5")
        assert r.returncode == 126 and "cannot start" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = _guard(store.dir, lease.lease_id, [str(tmp_path / "missing")], "--grace", "0.5")
        assert r.returncode == 127 and "cannot start" in r.stderr, r.stderr
    finally:
        lease.release()


def test_the_jobs_guard_says_126_for_a_command_it_cannot_execute(tmp_path: Path) -> None:
    script = tmp_path / "rank.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o644)
    r = subprocess.run([sys.executable, "-m", "gpusd.engines.jobguard", "--grace", "0.5", "--silence", "0", "--",
                        str(script)], env=_env(tmp_path / "locks"), stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 126 and "cannot start" in r.stderr and "Traceback" not in r.stderr, r.stderr


def _forge(locks: Path, lease_id: str, expires: float) -> object:
    """As another local user: write ``lease-ID.json`` the way a live holder does (holding its lock
    and the lock of the GPU it names), for a lease that just ended."""
    import fcntl
    import json

    dev = os.open(locks / "gpu-GPU-forged.lock", os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(dev, fcntl.LOCK_EX)
    fd = os.open(locks / f"lease-{lease_id}.json", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"format": 1, "lease_id": lease_id, "pid": os.getpid(), "user": "root",
                             "started": time.time(), "memory": None, "shared": False, "command": "ray",
                             "devices": ["GPU-forged"], "remote_from": "198.18.0.9",
                             "expires": expires}).encode())
    return "forged"


def test_another_users_record_does_not_keep_the_engine_alive(shared_tmp: Path, tmp_path: Path) -> None:
    """The lease ends (released); another local user at once writes a record of that lease id, live
    and due in an hour, into the shared lock directory (mode 1777): the guard believes only records
    the daemon (root) or its own user wrote, and stops the engine as the lease ended.  Nor does such
    a record alone start anything."""
    from other_user import MALLORY, AsUser, needs_root

    if os.geteuid() != 0:
        pytest.skip(needs_root.kwargs["reason"])
    store = LeaseStore(shared_tmp / "locks")
    lease = store.acquire(["GPU-guard-5"], holder=Holder(remote_from="198.18.0.9", expires=time.time() + 600))
    assert lease is not None
    assert stat.S_IMODE(os.stat(store.dir).st_mode) == 0o1777  # the default lock directory: anyone may create
    pidfile = tmp_path / "engine.pid"
    mallory = None
    try:
        r = _guard(store.dir, lease.lease_id, _daemonising(pidfile), "--margin", "3", "--grace", "0.5")
        assert r.returncode == 0, r.stderr
        engine = int(pidfile.read_text())
        lease.release()
        mallory = AsUser(MALLORY, lambda: _forge(store.dir, lease.lease_id, time.time() + 3600), stay=True)
        assert mallory.result == "ok forged", mallory.result
        assert _wait(lambda: not _alive(engine), 10), "a record another user wrote kept the engine running"
        marker = tmp_path / "ran"
        r = _guard(store.dir, lease.lease_id, ["touch", str(marker)])
        assert r.returncode == 3 and not marker.exists()  # nor does it start anything
    finally:
        if mallory is not None:
            mallory.stop()
        lease.release()
        if pidfile.exists() and _alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), 9)


def _flood(locks: Path, n: int) -> object:
    for i in range(n):
        fd = os.open(locks / f"lease-junk{i:06d}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
    return n


def test_another_users_lease_files_do_not_hide_the_guards_lease(shared_tmp: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Another local user fills the shared lock directory with files named like lease records: a
    scan of the directory reads at most MAX_LEASE_FILES of them (4096; cut to 1 here, with 200 such
    files, so that the scan order cannot save it), so a guard that looked for its lease by scanning
    would miss it and stop (or not start) another user's engine.  The guard reads its own record only."""
    from gpusd.alloc import leases as leases_mod
    from gpusd.engines import hold
    from other_user import MALLORY, as_user, needs_root

    if os.geteuid() != 0:
        pytest.skip(needs_root.kwargs["reason"])
    store = LeaseStore(shared_tmp / "locks")
    expires = time.time() + 600
    lease = store.acquire(["GPU-guard-6"], holder=Holder(remote_from="198.18.0.9", expires=expires))
    assert lease is not None
    try:
        assert as_user(MALLORY, lambda: _flood(store.dir, 200)) == "ok 200"
        monkeypatch.setattr(leases_mod, "MAX_LEASE_FILES", 1)
        assert hold.lease_expires(store, lease.lease_id) == pytest.approx(expires)
        assert hold.lease_expires(store, "0123456789ab") is False
    finally:
        lease.release()


def test_a_lock_directory_it_cannot_use_is_a_one_line_error(tmp_path: Path) -> None:
    """A lock directory open to every user without the sticky bit (anyone could replace the lease
    record): one ``gpusd:`` line and exit 3, nothing started, no traceback."""
    locks = tmp_path / "locks"
    locks.mkdir()
    os.chmod(locks, 0o777)
    marker = tmp_path / "ran"
    r = _guard(locks, "0123456789ab", ["touch", str(marker)])
    assert r.returncode == 3 and not marker.exists()
    assert "Traceback" not in r.stderr and r.stderr.startswith("gpusd: ") and "chmod 1777" in r.stderr, r.stderr


def test_another_users_record_in_the_shared_directory_does_not_hide_the_daemons(shared_tmp: Path) -> None:
    """A root daemon keeps its remote leases in its own directory (``<lock dir>/authority``); another
    local user writes a live record of the same lease id, due at once, into the shared directory
    (mode 1777): the guard reads the daemon's record (its own directory first, where no one else can
    write) and neither stops the engine early nor believes the forged end."""
    from gpusd.engines.hold import lease_expires
    from other_user import MALLORY, AsUser, needs_root

    if os.geteuid() != 0:
        pytest.skip(needs_root.kwargs["reason"])
    shared = LeaseStore(shared_tmp / "locks")
    authority = LeaseStore.authority(shared.dir)
    authority.prepare()
    ends = time.time() + 600
    lease = authority.acquire(["GPU-guard-7"], holder=Holder(remote_from="198.18.0.9", expires=ends))
    assert lease is not None
    mallory = AsUser(MALLORY, lambda: _forge(shared.dir, lease.lease_id, time.time() + 1), stay=True)
    try:
        assert mallory.result == "ok forged", mallory.result
        got = lease_expires(shared, lease.lease_id)
        assert isinstance(got, float) and abs(got - ends) < 1, got
    finally:
        mallory.stop()
        lease.release()


def test_each_hosts_guard_and_ranks_carry_that_hosts_lease() -> None:
    """What makes a host's daemon know an engine's processes there (fencing, docs/pool.md): each host's
    command, its guard and everything under it, runs with ``GPUSD_LEASE`` set to that host's lease."""
    from gpusd.engines.generate import HostCommand
    from gpusd.engines.placement import HostSlot
    from gpusd.engines.plan import guarded

    slots = [HostSlot("node-1", "198.18.0.2", "node-1", (0,)), HostSlot("node-2", "198.18.0.3", "node-2", (1,))]
    cmds = [HostCommand(s, i, ["train"], {"A": "1"}) for i, s in enumerate(slots)]
    out = guarded(cmds, ["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"], None, 1.0, 0.5)
    assert [c.env for c in out] == [{"A": "1", "GPUSD_LEASE": "aaaaaaaaaaaaaaaa"},
                                    {"A": "1", "GPUSD_LEASE": "bbbbbbbbbbbbbbbb"}]
    assert [c.argv[-1] for c in out] == ["train", "train"]
