"""The queue head is woken by the kernel when a lease ends (mechanism, not speed: see bench_alloc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpusd.alloc import queue
from gpusd.alloc.leases import LeaseStore

HOLD = """
import sys, time
from gpusd.alloc.leases import LeaseStore
lease = LeaseStore().acquire(["GPU-1"])
print("held", flush=True)
time.sleep(60)
"""

ENQUEUE_AND_HOLD = """
import time
from gpusd.alloc import queue
from gpusd.alloc.leases import LeaseStore
store = LeaseStore()
with store.mutex():
    ticket = queue.enqueue(store, 1)
print(ticket.path, flush=True)
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


def test_a_waiter_behind_the_head_is_woken_by_the_ticket_ahead_only():
    """40 waiters woken by every lease and ticket of the directory would take the CPU the hand-over needs:
    a waiter behind the head follows the ticket just ahead of it, and nothing else wakes it."""
    store = LeaseStore()
    store.ensure()
    with store.mutex():
        first = queue.enqueue(store, 1)
        second = queue.enqueue(store, 1)
    assert queue.ahead_of(store, second) == first.path
    try:
        with queue.LeaseWatch(store.dir) as watch:
            wd = watch.follow(first.path)
            assert wd >= 0
            # the directory's traffic: a lease taken and released, a ticket that comes and goes
            store.acquire(["GPU-1"]).release()
            with store.mutex():
                queue.enqueue(store, 1).close()
            assert watch.wait(0.2, followed=True) is False
            first.close()  # the waiter ahead leaves (got its GPUs, gave up or died)
            assert watch.wait(10, followed=True) is True
            watch.unfollow(wd)
            # at the head now: drain() watches the directory again before the look
            watch.drain()
            lease = store.acquire(["GPU-1"])
            watch.drain()
            lease.release()
            assert watch.wait(10) is True
    finally:
        first.close()
        second.close()


def test_wait_for_returns_when_the_waiter_ahead_is_killed():
    """The ticket ahead's lock goes with its holder however it ends: the follower is woken and goes on."""
    store = LeaseStore()
    store.ensure()
    p = subprocess.Popen([sys.executable, "-c", ENQUEUE_AND_HOLD], stdout=subprocess.PIPE, text=True)
    try:
        path = p.stdout.readline().strip()
        assert path
        with queue.LeaseWatch(store.dir) as watch:
            done: list[bool] = []
            import threading

            t = threading.Thread(target=lambda: done.append(
                queue.wait_for(Path(path), time.monotonic() + 60, watch=watch, cancelled=lambda: False)))
            t.start()
            os.kill(p.pid, signal.SIGKILL)
            t.join(60)
            assert done == [True]
    finally:
        p.kill()
        p.wait()


def test_a_new_ticket_does_not_wake_the_head():
    """A ticket that comes ahead of the head is a head itself and looks on its own (the head's look
    checks under the mutex that it still is the head): tickets arriving are no reason to look."""
    store = LeaseStore()
    store.ensure()
    with queue.LeaseWatch(store.dir) as watch:
        watch.drain()
        with store.mutex():
            ticket = queue.enqueue(store, 1, priority=3)
        ticket.close()
        assert watch.wait(0.2) is False


def test_a_wait_says_once_when_its_ticket_is_in_the_queue():
    """``LeaseRequest.queued`` is called once, when the wait's ticket is in the queue and before any GPU
    is taken (a preempted job gives its GPUs back then; ``gpusd run`` its start slot)."""
    from gpusd.alloc.api import LeaseRequest, allocate
    from gpusd.alloc.select import Constraints

    store = LeaseStore()
    first = allocate(LeaseRequest(Constraints(count=1), simulate="1xA100-80GB"), store=store)  # the one GPU
    seen: list[list[int | None]] = []

    def queued() -> None:
        seen.append([w.pid for w in queue.waiters(store)])
        first.release()  # the GPU goes back only now: the wait below must not have taken it before

    got = allocate(LeaseRequest(Constraints(count=1), wait=True, timeout=30, simulate="1xA100-80GB",
                                queued=queued), store=store)
    try:
        assert seen == [[os.getpid()]]  # once, with our ticket in the queue
        assert [d.uuid for d in got.devices] == [d.uuid for d in first.devices] and got.lease is not None
    finally:
        got.release()
