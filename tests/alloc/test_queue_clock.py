"""The --wait queue runs on the boot-time clock (gpusd.alloc.queue, docs/jobs.md "Fairness"): a step of
the wall clock (NTP, a VM resume) neither ages every waiter at once nor puts a newcomer ahead of those
who queued before it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gpusd.alloc import queue
from gpusd.alloc.leases import LeaseStore
from gpusd.alloc.priority import LOW, NORMAL


def _enqueue(store: LeaseStore, priority: int) -> queue.Ticket:
    with store.mutex():
        return queue.enqueue(store, 1, priority=priority)


def test_a_wall_clock_step_forward_ages_no_waiter(monkeypatch: pytest.MonkeyPatch) -> None:
    store = LeaseStore()
    store.ensure()
    low = _enqueue(store, LOW)
    try:
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 86400)  # a day forward: many aging periods
        [w] = queue.waiters(store)
        assert w.level == LOW
    finally:
        low.close()


class _Stepped:
    """A ticket's stat as the kernel gives it after the wall clock stepped back ``by`` seconds (its ctime)."""

    def __init__(self, st: Any, by: float) -> None:
        self._st, self.st_ctime_ns, self.st_ctime = st, st.st_ctime_ns - int(by * 1e9), st.st_ctime - by

    def __getattr__(self, name: str) -> Any:
        return getattr(self._st, name)


def test_a_wall_clock_step_back_puts_no_newcomer_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    store = LeaseStore()
    store.ensure()
    first = _enqueue(store, NORMAL)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3600)  # an hour back, then a newcomer queues
    second = _enqueue(store, NORMAL)
    read_live = queue.read_live

    def stepped(dfd: int, name: str, *a: Any, **kw: Any) -> Any:
        got = read_live(dfd, name, *a, **kw)
        if got is not None and name == second.path.name:  # the kernel stamped its ctime on the stepped clock
            got = (_Stepped(got[0], 3600), got[1])
        return got

    monkeypatch.setattr(queue, "read_live", stepped)
    try:
        assert [w.ticket for w in queue.waiters(store)] == [first.path.name, second.path.name]
    finally:
        first.close()
        second.close()
