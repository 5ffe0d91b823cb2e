"""The one wait-until helper of the test suite: poll a condition until it holds or a deadline passes.

``wait_until`` (async) and ``wait_until_sync`` return the condition's first truthy value and raise
AssertionError, naming what was awaited, when ``timeout`` seconds pass without one.  A condition may
be a plain function or (async) return an awaitable.  Deadlines only bound a wait: no test asserts on
how long something took.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def _fail(what: str, timeout: float, last: Any) -> AssertionError:
    return AssertionError(f"{what} not met within {timeout} s (last value {last!r})"[:2000])


async def wait_until(cond: Callable[[], Any], timeout: float = 5.0, step: float = 0.02,
                     what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        last = cond()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise _fail(what, timeout, last)
        await asyncio.sleep(step)


def wait_until_sync(cond: Callable[[], Any], timeout: float = 5.0, step: float = 0.05,
                    what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        last = cond()
        if last:
            return last
        if time.monotonic() > deadline:
            raise _fail(what, timeout, last)
        time.sleep(step)
