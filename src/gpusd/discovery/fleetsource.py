"""Where a one-shot reading of the fleet comes from: this host's daemon's fleet view where it answers
in time, else a one-shot browse of the LAN, the two raced where the daemon is slow.

The daemon's view costs one signed HTTP GET (no asyncio, no browser imported: ~30 ms); a browse costs
the mDNS settling and its imports.  :func:`choose` waits for the view a short while (``QUICK``), or to
its own bound where the daemon took the request and is building its answer (1,000 hosts: 0.1-0.5 s),
and only then browses; :func:`race` browses while a slow view may still come.
"""

from __future__ import annotations

import time

TYPE_CHECKING = False  # typing is not imported at run time: start-up time
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable, Coroutine
    from typing import Any

    from .fleetview import Reading
    from .source import Listing


def choose(local: Reading | None, browse: Callable[[Reading | None], Listing]) -> Listing:
    """The daemon's view (``local``, asked already) where it answers in time; otherwise
    ``browse(local)``, handed the view still on its way where the daemon took the request."""
    if local is not None and local.arrived():
        found = local.result()
        if found is not None:
            return found
        local = None  # no usable answer: browse alone
    return browse(local)


async def race(local: Reading | None, browse: Coroutine[Any, Any, Listing]) -> Listing:
    """``browse``, or the daemon's view where it comes first, or within its own bound after the
    browse settled (the view is the whole fleet, hosts beyond the link too)."""
    import asyncio

    from .fleetview import FLEET_TIMEOUT

    task = asyncio.ensure_future(browse)
    while local is not None and not task.done():  # the local daemon is slow: browse meanwhile
        if local.done():
            answer = local.result()
            if answer is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return answer
            break
        await asyncio.wait({task}, timeout=0.02)
    if local is not None and not local.done():
        end = time.monotonic() + FLEET_TIMEOUT
        while not local.done() and time.monotonic() < end:
            await asyncio.sleep(0.02)
        answer = local.result() if local.done() else None
        if answer is not None:
            return answer
    return await task
