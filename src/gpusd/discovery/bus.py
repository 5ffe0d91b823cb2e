"""The event bus of the asyncio client: handlers by event name, and async-iterator subscribers.

Handlers run on the event loop (a coroutine function's result is scheduled as a task); a handler
that raises is logged and the others still run.  A subscriber (:meth:`EventBus.events`) that stops
reading is dropped once its queue is full, so a stuck consumer never holds discovery up.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from .types import EVENTS, DiscoveryEvent, event_names

# the client's log, as before the split
log = logging.getLogger("gpusd.discovery.client")

Handler = Callable[[DiscoveryEvent], Any]


class EventBus:
    """Who hears the client's :class:`~gpusd.discovery.types.DiscoveryEvent` s."""

    def __init__(self) -> None:
        self._handlers: dict[str, list[Handler]] = {e: [] for e in EVENTS}
        self._subscribers: list[asyncio.Queue[DiscoveryEvent | None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()

    def register(self, event: str, fn: Handler) -> None:
        for name in event_names(event):
            self._handlers[name].append(fn)

    def unregister(self, event: str, fn: Handler) -> None:
        for name in event_names(event):
            with contextlib.suppress(KeyError, ValueError):
                self._handlers[name].remove(fn)

    def emit(self, event: DiscoveryEvent) -> None:
        for fn in list(self._handlers.get(event.event, ())):
            try:
                result = fn(event)
                if inspect.isawaitable(result):
                    task = asyncio.ensure_future(self._await_handler(result))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            except Exception:
                # a handler's bug must not stop discovery
                log.exception("event handler %r failed on %s", fn, event.event)
        for q in list(self._subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:
                # a consumer that stopped reading: drop it
                self._subscribers.remove(q)
                log.warning("dropping a slow event subscriber")

    async def _await_handler(self, result: Awaitable[Any]) -> None:
        try:
            await result
        except Exception:
            log.exception("async event handler failed")

    async def events(self, maxsize: int = 10000) -> AsyncIterator[DiscoveryEvent]:
        """Every event from now on (ends at :meth:`close`)."""
        q: asyncio.Queue[DiscoveryEvent | None] = asyncio.Queue(maxsize)
        self._subscribers.append(q)
        try:
            while True:
                ev = await q.get()
                if ev is None:
                    return
                yield ev
        finally:
            with contextlib.suppress(ValueError):
                self._subscribers.remove(q)

    def pending(self) -> list[asyncio.Task[Any]]:
        """The async handlers still running (cancelled by a client that stops)."""
        return list(self._tasks)

    def close(self) -> None:
        """End every subscriber's iteration."""
        for q in list(self._subscribers):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)


__all__ = ["EventBus", "Handler"]
