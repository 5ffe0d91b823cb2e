"""Leases: flock semantics, death of the holder, hostile files in the lock directory."""

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from gpusd.alloc.leases import LeaseStore

HOLD = """
import sys, time
from gpusd.alloc.leases import LeaseStore
lease = LeaseStore().acquire(sys.argv[1].split(","), shared=sys.argv[2] == "shared", memory=123)
print("held" if lease else "refused", flush=True)
time.sleep(60)
"""


def holder(devices, mode="exclusive"):
    p = subprocess.Popen([sys.executable, "-c", HOLD, devices, mode], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_exclusive_lease_refuses_a_second_holder():
    store = LeaseStore()
    a = store.acquire(["GPU-1"])
    assert a is not None
    assert store.acquire(["GPU-1"]) is None
    assert store.acquire(["GPU-1"], shared=True) is None
    b = store.acquire(["GPU-2"])
    assert b is not None
    a.release()
    c = store.acquire(["GPU-1"])
    assert c is not None
    for lease in (b, c):
        lease.release()


def test_shared_leases_coexist_but_block_exclusive():
    store = LeaseStore()
    a = store.acquire(["GPU-1"], shared=True, memory=10)
    b = store.acquire(["GPU-1"], shared=True, memory=20)
    assert a and b
    assert store.acquire(["GPU-1"]) is None
    assert sorted(le.memory for le in store.leases()) == [10, 20]
    a.release()
    b.release()
    assert store.leases() == []


def test_all_or_nothing():
    store = LeaseStore()
    held = store.acquire(["GPU-2"])
    assert store.acquire(["GPU-1", "GPU-2"]) is None
    assert store.acquire(["GPU-1"]) is not None  # GPU-1 was not left locked by the failed attempt
    held.release()


def test_lease_record_in_another_process():
    p = holder("GPU-9")
    try:
        leases = LeaseStore().leases()
        assert [(le.device, le.pid, le.memory, le.shared) for le in leases] == [("GPU-9", p.pid, 123, False)]
        assert leases[0].user and leases[0].started and leases[0].started <= time.time()
    finally:
        p.kill()
        p.wait()


def test_kill_9_frees_the_lease():
    p = holder("GPU-7")
    store = LeaseStore()
    assert store.acquire(["GPU-7"]) is None
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert store.leases(cleanup=True) == []  # the dead holder's record is ignored and removed
    lease = store.acquire(["GPU-7"])
    assert lease is not None
    lease.release()


def test_lock_directory_is_shared_by_all_users():
    store = LeaseStore()
    lease = store.acquire(["GPU-1"])
    mode = os.stat(store.dir).st_mode
    assert stat.S_IMODE(mode) == 0o1777
    assert stat.S_IMODE(os.stat(store.dir / "gpu-GPU-1.lock").st_mode) == 0o666
    lease.release()


def test_garbage_in_the_lock_directory_is_skipped(caplog):
    import fcntl

    store = LeaseStore()
    store.ensure()
    (store.dir / "lease-dead.json").write_text("{not json")  # unlocked: a dead holder's leftovers
    fd = os.open(store.dir / "lease-live.json", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"\x00\xffgarbage")
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live but unreadable record
    try:
        lease = store.acquire(["GPU-3"], memory=5)
        assert [le.device for le in store.leases()] == ["GPU-3"]
        assert "unreadable lease file lease-live.json" in caplog.text
        lease.release()
    finally:
        os.close(fd)


def test_unwritable_lock_dir_is_a_clear_error(tmp_path, monkeypatch):
    from gpusd.errors import GpusdError

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(blocker / "locks"))
    with pytest.raises(GpusdError, match="cannot create the lock directory"):
        LeaseStore().acquire(["GPU-1"])


def test_lock_dir_not_writable_for_this_user_is_a_clear_error(tmp_path, monkeypatch):
    from gpusd.errors import GpusdError

    locked = tmp_path / "locks"
    locked.mkdir(mode=0o755)
    monkeypatch.setenv("GPUSD_LOCK_DIR", str(locked))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for another user (we are root here)
    with pytest.raises(GpusdError, match="not writable for you.*chmod 1777"):
        LeaseStore().acquire(["GPU-1"])
