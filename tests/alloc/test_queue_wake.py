"""The queue head is woken by the kernel when a lease ends (mechanism, not speed: see bench_alloc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from gpusd.alloc import queue
from gpusd.alloc.leases import LeaseStore

HOLD = """
import sys, time
from gpusd.alloc.leases import LeaseStore
lease = LeaseStore().acquire(["GPU-1"])
print("held", flush=True)
time.sleep(60)
"""


def test_a_lease_ending_wakes_the_watch_however_it_ends():
    store = LeaseStore()
    store.ensure()
    with queue.LeaseWatch(store.dir) as watch:
        assert watch.active
        lease = store.acquire(["GPU-1"])
        watch.drain()  # taking a lease is no reason to wake
        assert watch.wait(0.2) is False
        lease.release()
        assert watch.wait(10) is True
        p = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "held"
            watch.drain()
            os.kill(p.pid, signal.SIGKILL)  # no clean-up at all: the kernel closes the lock files
            assert watch.wait(10) is True
        finally:
            p.kill()
            p.wait()


def test_looking_at_the_leases_does_not_wake_the_looker():
    """The head reads lease records and takes the mutex on every look: none of that may wake it,
    or it would spin instead of sleeping."""
    store = LeaseStore()
    other = store.acquire(["GPU-2"])
    with queue.LeaseWatch(store.dir) as watch:
        watch.drain()
        for _ in range(3):
            with store.mutex():
                store.leases(cleanup=True)
                queue.waiting(store, cleanup=True)
            store.release_times()
        assert watch.wait(0.2) is False
    other.release()


def test_a_ticket_is_never_visible_unlocked(monkeypatch):
    """Another waiter's clean-up removes tickets it can lock (dead waiters'): a new ticket seen before
    its owner locked it would be removed, and the queue order lost (a job overtaken)."""
    import fcntl

    store = LeaseStore()
    store.ensure()
    real_flock = fcntl.flock

    def flock_after_a_cleanup(fd, op):
        if op == fcntl.LOCK_EX:
            queue.waiting(store, cleanup=True)  # what another process may do at this very moment
        return real_flock(fd, op)

    monkeypatch.setattr(queue.fcntl, "flock", flock_after_a_cleanup)
    with store.mutex():
        first = queue.enqueue(store, 1)
        second = queue.enqueue(store, 1)
    monkeypatch.undo()
    assert [seq for seq, _ in queue.waiting(store, cleanup=True)] == [first.seq, second.seq]
    assert queue.ahead_of(store, second) == first.path
    first.close()
    second.close()
