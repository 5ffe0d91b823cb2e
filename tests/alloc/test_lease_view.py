"""The lease view: a process that looks at a lock directory again reads only what changed,
and is never told less than a fresh read would tell: a dead holder's lease is free in the next look,
a record kept locked by someone else is confirmed again, a forked child never steals the parent's
events, a flood that overflows the event queue makes the next look a full one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gpusd.alloc import leaseview
from gpusd.alloc.leases import LeaseStore

HOLD = """
import fcntl, os, sys, time
from gpusd.alloc.leases import LeaseStore
lease = LeaseStore().acquire(sys.argv[1].split(","))
assert lease is not None
how = sys.argv[2]
if how == "read-only":  # hold every lock through a read-only descriptor only (as a user could)
    d = str(LeaseStore().dir)
    names = [f"gpu-{dev}.lock" for dev in lease.devices] + [lease.path.name]
    for fd, name in zip(lease.fds, names):
        ro = os.open(os.path.join(d, name), os.O_RDONLY)
        os.close(fd)
        fcntl.flock(ro, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lease.device_fds, lease.record_fd, lease.dir_fd, lease.released = [], -1, -1, True
print("held", lease.path.name, flush=True)
if how == "unlock":  # drop the locks without closing anything: no event at all
    sys.stdin.readline()
    for fd in lease.fds:
        fcntl.flock(fd, fcntl.LOCK_UN)
    print("unlocked", flush=True)
time.sleep(60)
"""


@pytest.fixture(autouse=True)
def _events_only(monkeypatch):
    """No periodic full look during a test (slow machines): what a look tells must come from the events."""
    monkeypatch.setattr(leaseview, "REVALIDATE", 600.0)


def holder(devices: str, how: str = "plain") -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-c", HOLD, devices, how], stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None
    word, name = p.stdout.readline().split()
    assert word == "held"
    return p, name


def kill(p: subprocess.Popen[str]) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.wait()


def warm(store: LeaseStore) -> None:
    """Look until this process keeps a view of the directory (the second look makes one), and once more."""
    for _ in range(3):
        store.leases()
    st = os.stat(store.dir)
    assert (st.st_dev, st.st_ino) in leaseview._views, "no view was made"


def devices(store: LeaseStore, cleanup: bool = False) -> list[str]:
    return sorted(le.device or "" for le in store.leases(cleanup=cleanup) if not le.unleased)


def test_unchanged_records_are_not_read_again(monkeypatch):
    p, _ = holder(",".join(f"GPU-{i}" for i in range(20)))
    try:
        store = LeaseStore()
        warm(store)
        reads: list[str] = []
        real = leaseview.read_live
        monkeypatch.setattr(leaseview, "read_live",
                            lambda dfd, name, *a, **kw: reads.append(name) or real(dfd, name, *a, **kw))
        for _ in range(5):
            assert len(devices(store)) == 20
        assert reads == []
    finally:
        kill(p)


def test_a_killed_holder_is_free_in_the_very_next_look():
    p, _ = holder("GPU-1")
    q, _ = holder("GPU-2")
    try:
        store = LeaseStore()
        warm(store)
        assert devices(store) == ["GPU-1", "GPU-2"]
        kill(p)
        assert devices(store) == ["GPU-2"]
        assert devices(store, cleanup=True) == ["GPU-2"]
        lease = store.acquire(["GPU-1"])
        assert lease is not None
        lease.release()
    finally:
        kill(q)


def test_a_read_only_holder_that_dies_is_free_in_the_next_look():
    p, _ = holder("GPU-1", "read-only")
    try:
        store = LeaseStore()
        warm(store)
        assert devices(store) == ["GPU-1"]
    finally:
        kill(p)
    assert devices(store) == []  # its closes were read-only (IN_CLOSE_NOWRITE), not this process's own


def test_a_record_locked_by_another_process_after_its_holder_died_is_confirmed_again():
    p, name = holder("GPU-1")
    store = LeaseStore()
    # Another process waits for the record's lock, to keep the dead holder's record "alive"
    keeper = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(store.dir / name)!r}, os.O_RDONLY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        warm(store)
        assert devices(store) == ["GPU-1"]
        kill(p)
        assert keeper.stdout is not None and keeper.stdout.readline().strip() == "locked"
        # the record is locked, the same file, but its holder does not hold GPU-1: not a lease
        assert devices(store) == []
        assert devices(store, cleanup=True) == []
    finally:
        kill(keeper)


def test_a_forked_child_does_not_take_the_parents_events():
    p, _ = holder("GPU-1")
    store = LeaseStore()
    warm(store)
    assert devices(store) == ["GPU-1"]
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.close(w)
            os.read(r, 1)  # the lease has ended: its events are queued
            for _ in range(3):
                store.leases()
        finally:
            os._exit(0)
    os.close(r)
    kill(p)
    os.write(w, b"x")
    os.close(w)
    os.waitpid(child, 0)
    assert devices(store) == []


def test_a_lock_dropped_without_a_close_is_seen_within_the_revalidation_period(monkeypatch):
    monkeypatch.setattr(leaseview, "REVALIDATE", 0.3)
    p, _ = holder("GPU-1", "unlock")
    try:
        store = LeaseStore()
        warm(store)
        assert devices(store) == ["GPU-1"]
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "unlocked"
        time.sleep(0.4)
        assert devices(store) == []
    finally:
        kill(p)


def test_an_event_queue_overflow_makes_the_next_look_a_full_one():
    max_events = int(open("/proc/sys/fs/inotify/max_queued_events").read())
    if max_events > 50000:
        pytest.skip(f"max_queued_events is {max_events}: too many files to make for an overflow")
    p, _ = holder("GPU-1")
    store = LeaseStore()
    try:
        warm(store)
        assert devices(store) == ["GPU-1"]
        for i in range(max_events // 2 + 10):  # each file: IN_CREATE and IN_CLOSE_WRITE
            os.close(os.open(store.dir / f"junk-{i}", os.O_CREAT | os.O_WRONLY, 0o600))
    finally:
        kill(p)  # its events are lost: the queue is full
    try:
        assert devices(store) == []
    finally:
        for f in store.dir.glob("junk-*"):
            f.unlink()


def test_a_replaced_directory_is_looked_at_afresh(tmp_path, monkeypatch):
    locks = tmp_path / "locks"
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locks))
    p, _ = holder("GPU-1")
    try:
        store = LeaseStore()
        warm(store)
        assert devices(store) == ["GPU-1"]
        locks.rename(tmp_path / "old")
        assert devices(store) == []  # a new, empty directory now (or none at all)
        q, _ = holder("GPU-2")
        try:
            assert devices(store) == ["GPU-2"]
        finally:
            kill(q)
    finally:
        kill(p)


def test_an_abandoned_record_seen_by_a_view_is_removed_by_the_next_allocation():
    p, name = holder("GPU-1")
    store = LeaseStore()
    warm(store)
    kill(p)
    assert devices(store) == []  # seen dead by a look that does not clean up
    assert (store.dir / name).exists()
    assert devices(store, cleanup=True) == []
    assert not (store.dir / name).exists()


def test_a_lock_taken_without_a_lease_is_named_by_the_next_allocation_look():
    store = LeaseStore()
    store.acquire(["GPU-5"]).release()  # the lock file exists: opening it again makes no file event
    warm(store)
    store.leases(cleanup=True)
    blocker = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, time\n"
        f"fd = os.open({str(store.dir / 'gpu-GPU-5.lock')!r}, os.O_RDONLY)\n"
        "time.sleep(0.2)\n"  # the lock comes well after the open
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert blocker.stdout is not None and blocker.stdout.readline().strip() == "locked"
        found = [le for le in store.leases(cleanup=True) if le.unleased]
        assert [(le.device, le.pid) for le in found] == [("GPU-5", blocker.pid)]
    finally:
        kill(blocker)
    assert [le for le in store.leases(cleanup=True) if le.unleased] == []


@pytest.mark.parametrize("name", ["lease--x.json", "lease-a!b.json", "lease-.json", f"lease-{'a' * 65}.json"])
def test_a_record_whose_name_is_no_lease_id_is_ignored_by_a_view(name):
    """A local user's locked record under a name that is no lease id (the full look skips it): the view's
    events must skip it too, not fail every look of every user of the directory."""
    import fcntl
    import json

    store = LeaseStore()
    dfd = store.open(create=True)
    assert dfd is not None
    os.close(dfd)
    warm(store)
    before = devices(store)
    path = store.dir / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, json.dumps({"format": 1, "pid": os.getpid(), "devices": ["GPU-forged"]}).encode())
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.close(os.open(path, os.O_RDWR))  # a close of a file opened for writing: an event for the view
        assert devices(store) == before
        assert devices(store, cleanup=True) == before
    finally:
        os.close(fd)
        path.unlink()


def test_the_device_locks_a_view_follows_are_bounded_as_a_full_look_bounds_them(monkeypatch):
    """Device lock files made after the view was (anyone may make them in the shared directory): no more
    are followed than a full look takes (MAX_LEASE_FILES), however many the events name."""
    monkeypatch.setattr(leaseview, "MAX_LEASE_FILES", 8)
    store = LeaseStore()
    dfd = store.open(create=True)
    assert dfd is not None
    os.close(dfd)
    warm(store)
    for i in range(20):
        (store.dir / f"gpu-GPU-flood-{i}.lock").touch()
    store.leases()
    st = os.stat(store.dir)
    assert len(leaseview._views[(st.st_dev, st.st_ino)].locks) <= 8


def test_proc_locks_is_read_whole_past_a_lock_with_many_waiters(tmp_path) -> None:
    """/proc/locks comes a page of whole records at most per read, and much less where the next record
    is a lock with many processes waiting on it (one line each: anyone can make one): a short read is not
    the end.  Ours, taken before and after such a lock on one CPU (the kernel lists each CPU's locks
    newest first), are all read (a reader that stopped at a read short of half a page missed the older
    one: who holds a GPU's lock would go unseen)."""
    import fcntl
    import os
    import threading
    import time

    from gpusd.alloc import lockdir

    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})  # this thread, and the threads it starts: one CPU's list
    files: list[object] = []
    waiters: list[threading.Thread] = []
    crowd = tmp_path / "crowd"
    crowd.touch()
    holder = open(crowd, "w")
    try:
        older = open(tmp_path / "older", "w")
        files.append(older)
        fcntl.flock(older, fcntl.LOCK_EX)
        fcntl.flock(holder, fcntl.LOCK_EX)

        def wait() -> None:
            with open(crowd, "w") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # blocks until the holder lets go
                fcntl.flock(f, fcntl.LOCK_UN)

        for _ in range(90):
            t = threading.Thread(target=wait, daemon=True)
            t.start()
            waiters.append(t)
        deadline = time.monotonic() + 10
        while (lockdir.read_proc_locks() or b"").count(b"->") < 90:
            assert time.monotonic() < deadline, "the waiters did not queue on the lock"
            time.sleep(0.02)
        newer = [open(tmp_path / f"newer{i}", "w") for i in range(5)]
        for f in newer:
            fcntl.flock(f, fcntl.LOCK_SH)
        files += newer
        raw = lockdir.read_proc_locks()
        keys = [lockdir.lock_key(os.fstat(f.fileno())).encode() for f in (older, *newer)]
        assert raw is not None and all(b" " + k + b" " in raw for k in keys)
    finally:
        holder.close()  # the waiters get the lock in turn, and end
        os.sched_setaffinity(0, cpus)
        for t in waiters:
            t.join(10)
        for f in files:
            f.close()  # type: ignore[attr-defined]
