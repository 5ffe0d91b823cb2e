"""The suite's one wait helper (tests/waiting.py) waits, returns the value, and says what it waited for."""

from __future__ import annotations

import pytest

from waiting import wait_until, wait_until_sync


def test_sync_returns_the_first_truthy_value() -> None:
    calls = iter([0, None, [], "ready"])
    assert wait_until_sync(lambda: next(calls), timeout=5, step=0) == "ready"


def test_sync_names_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match="the queue to drain.*last value 0"):
        wait_until_sync(lambda: 0, timeout=0.05, what="the queue to drain")  # never truthy


async def test_async_accepts_awaitable_conditions() -> None:
    n = 0

    async def cond() -> int:
        nonlocal n
        n += 1
        return n if n >= 3 else 0

    assert await wait_until(cond, timeout=5, step=0) == 3
    with pytest.raises(AssertionError, match="nothing"):
        await wait_until(lambda: None, timeout=0.05, what="nothing")
