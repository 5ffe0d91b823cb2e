"""Publish/subscribe for server-sent events: each event is encoded once, queued per subscriber.

A subscriber that falls ``maxsize`` events behind is disconnected (its stream ends, ``dropped`` is
set); a gpusd client reconnects at once and starts again from a full snapshot, so nothing is lost
but the backlog.  At most ``max_subscribers`` subscribe at once: one more gets :class:`HubFull`."""

from __future__ import annotations

import asyncio
from typing import Any

from ..wire.sse import format_event


class HubFull(Exception):
    """The hub already has ``max_subscribers`` subscribers."""


class Subscription:
    def __init__(self, maxsize: int) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize)
        self.dropped = False  # cut off for falling too far behind (not a normal end)

    async def get(self) -> bytes | None:
        return await self.queue.get()


class EventHub:
    def __init__(self, maxsize: int = 256, max_subscribers: int | None = None) -> None:
        self.maxsize = maxsize
        self.max_subscribers = max_subscribers
        self.refused = 0  # subscriptions refused because the hub was full
        self.dropped = 0  # subscribers cut off for falling behind
        self._subs: set[Subscription] = set()
        self.closed = False

    def __len__(self) -> int:
        return len(self._subs)

    def subscribe(self) -> Subscription:
        """A new subscription; raises :class:`HubFull` beyond ``max_subscribers``."""
        if self.max_subscribers is not None and not self.closed and len(self._subs) >= self.max_subscribers:
            self.refused += 1
            raise HubFull(f"{len(self._subs)} subscribers already")
        sub = Subscription(self.maxsize)
        if self.closed:
            sub.queue.put_nowait(None)
        else:
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def publish(self, event: str, data: Any) -> None:
        if self.closed:
            return
        self.publish_raw(format_event(event, data))

    def publish_raw(self, message: bytes | None) -> None:
        for sub in list(self._subs):
            try:
                sub.queue.put_nowait(message)
            except asyncio.QueueFull:
                self._drop(sub)

    def _drop(self, sub: Subscription) -> None:
        self._subs.discard(sub)
        sub.dropped = True
        self.dropped += 1
        while not sub.queue.empty():
            sub.queue.get_nowait()
        sub.queue.put_nowait(None)

    def close(self, final: bytes | None = None) -> None:
        """End every stream, after ``final`` (e.g. a ``bye`` event)."""
        if self.closed:
            return
        if final is not None:
            self.publish_raw(final)
        self.closed = True
        for sub in list(self._subs):
            try:
                sub.queue.put_nowait(None)
            except asyncio.QueueFull:
                self._drop(sub)
        self._subs.clear()
