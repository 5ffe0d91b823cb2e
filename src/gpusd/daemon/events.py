"""Publish/subscribe for server-sent events: each event is encoded once, queued per subscriber.

Heartbeats are the hub's too (:meth:`EventHub.keep_alive`): one timer for the hub, one encoding per
beat, the same bytes handed to every subscriber in one pass; a subscriber costs no timer of its own.

A subscriber that falls ``maxsize`` events behind is disconnected (its stream ends, ``dropped`` is
set); a gpusd client reconnects at once and starts again from a full snapshot, so nothing is lost
but the backlog.

Who may subscribe (docs/daemon.md, "Limits against hostile peers"):

* at most ``max_subscribers`` at once;
* *unsigned* subscribers (readers without the fleet secret) share ``max_subscribers - reserved``
  places, and one peer address (:func:`gpusd.daemon.access.peer_of`) holds at most ``per_peer`` of
  them: a stranger cannot take the places of secret holders, nor one stranger all of the others';
* a *signed* subscriber (a secret holder: a fleet client, ``gpusd list``) is never refused while an
  unsigned one holds a place: when the hub is full, the oldest unsigned subscriber of the peer that
  holds the most is cut off (its stream ends, ``evicted`` is set) to make room.

One more than these allow gets :class:`HubFull`.

A *paced* subscriber (``pace``: seconds, a reader that asked for ``?pace=S``) is sent a message the
publisher marks *minor* (a snapshot whose readings alone changed, a heartbeat) at most every ``pace``
seconds -- the newest one held until then, written at the hub's next message or beat -- and every other
message at once, with whatever minor one it held first.  For :data:`SETTLE` seconds after a message
that is not minor it gets every message (readings lag what changed hands by a sample).  A hundred
paced readers cost the daemon a write each every ``pace`` seconds, not every sample."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from ..wire.sse import format_event
from .bypeer import ByPeer

# seconds after a message that is not minor during which a paced subscriber gets every message
SETTLE = 3.0


class HubFull(Exception):
    """The hub already has ``max_subscribers`` subscribers."""


class Subscription:
    def __init__(self, maxsize: int, peer: str = "-", signed: bool = False, pace: float | None = None) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize)
        self.pace = pace
        # paced: the newest minor message not sent yet; when it was last sent one (monotonic); until
        # when it gets every message
        self.held: bytes | None = None
        self.sent_at = time.monotonic()
        self.settle_until = 0.0
        # cut off for falling too far behind (not a normal end)
        self.dropped = False
        # cut off to make room for a signed subscriber
        self.evicted = False
        self.peer = peer
        self.signed = signed
        # set once a stream serving it has ended (sse_stream)
        self.served: asyncio.Event | None = None

    async def get(self) -> bytes | None:
        return await self.queue.get()


class EventHub:
    def __init__(self, maxsize: int = 256, max_subscribers: int | None = None, per_peer: int | None = None,
                 reserved: int = 0) -> None:
        self.maxsize = maxsize
        self.max_subscribers = max_subscribers
        # unsigned subscribers of one peer address at most (None: no limit)
        self.per_peer = per_peer
        # places only signed subscribers take (at most half of max_subscribers)
        self.reserved = min(max(0, reserved), max_subscribers // 2) if max_subscribers is not None else 0
        # subscriptions refused (the hub, its unsigned share or the peer's share full)
        self.refused = 0
        # subscribers cut off for falling behind
        self.dropped = 0
        # unsigned subscribers cut off to make room for signed ones
        self.evicted = 0
        self._subs: dict[Subscription, None] = {}  # oldest first
        # peer -> its unsigned subscribers, oldest first
        self._unsigned: ByPeer[Subscription] = ByPeer()
        # subscriptions a stream still serves (see drained)
        self._streaming: set[Subscription] = set()
        self.closed = False
        # heartbeats sent (each one encoding, however many subscribers)
        self.beats = 0
        self._every: float | None = None  # keep_alive's period
        self._touch: Callable[[], Any] | None = None
        self._beat: asyncio.TimerHandle | None = None
        # of the last message published
        self._last = time.monotonic()

    def __len__(self) -> int:
        return len(self._subs)

    @property
    def unsigned(self) -> int:
        """Unsigned subscribers now."""
        return len(self._unsigned)

    def subscribe(self, peer: str = "-", signed: bool = False, pace: float | None = None) -> Subscription:
        """A new subscription for a reader at ``peer`` (:func:`gpusd.daemon.access.peer_of`),
        ``signed`` when it is a secret holder's, ``pace`` when it asked for one (above); raises
        :class:`HubFull` beyond the limits above."""
        if not self.closed:
            self._admit(peer, signed)
        sub = Subscription(self.maxsize, peer, signed, pace)
        if self.closed:
            sub.queue.put_nowait(None)
        else:
            self._subs[sub] = None
            if not signed:
                self._unsigned.add(peer, sub)
        return sub

    def _admit(self, peer: str, signed: bool) -> None:
        cap = self.max_subscribers
        if signed:
            if cap is not None and len(self._subs) >= cap:
                victim = self._heaviest_unsigned()
                if victim is None:
                    self.refused += 1
                    raise HubFull(f"{len(self._subs)} signed subscribers already")
                self._evict(victim)
            return
        if self.per_peer is not None and len(self._unsigned.of(peer)) >= self.per_peer:
            self.refused += 1
            raise HubFull(f"{self.per_peer} unsigned subscribers from {peer} already")
        if cap is not None and (len(self._subs) >= cap or self.unsigned >= cap - self.reserved):
            self.refused += 1
            raise HubFull(f"{len(self._subs)} subscribers already ({self.reserved} places kept for signed readers)")

    def _heaviest_unsigned(self) -> Subscription | None:
        peers = self._unsigned.heaviest_first()
        return next(iter(self._unsigned.of(peers[0])), None) if peers else None

    def _evict(self, sub: Subscription) -> None:
        sub.evicted = True
        self.evicted += 1
        self._end(sub)

    def _end(self, sub: Subscription) -> None:
        """Forget ``sub`` and end its stream now: what it had not read is discarded, then the end."""
        self._forget(sub)
        while not sub.queue.empty():
            sub.queue.get_nowait()
        sub.queue.put_nowait(None)

    def _forget(self, sub: Subscription) -> None:
        self._subs.pop(sub, None)
        self._unsigned.discard(sub.peer, sub)

    def unsubscribe(self, sub: Subscription) -> None:
        self._forget(sub)
        self._streaming.discard(sub)
        if sub.served is not None:
            sub.served.set()

    def streaming(self, sub: Subscription) -> None:
        """``sub`` is served by a stream now (it calls :meth:`unsubscribe` when it ends)."""
        sub.served = asyncio.Event()
        self._streaming.add(sub)

    async def drained(self, timeout: float) -> bool:
        """After :meth:`close`: wait until every stream has written what it was given (the ``bye``)
        and ended, at most ``timeout`` seconds (a reader that does not read is not waited for
        longer).  True when all did."""
        waits = [sub.served.wait() for sub in list(self._streaming) if sub.served is not None]
        if not waits:
            return True
        tasks = [asyncio.ensure_future(w) for w in waits]
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        return not pending

    def publish(self, event: str, data: Any) -> None:
        if self.closed:
            return
        self.publish_raw(format_event(event, data))

    def publish_raw(self, message: bytes | None, minor: bool = False) -> None:
        """Queue ``message`` for every subscriber; ``minor``: a paced one may be sent it later, or a
        newer minor one instead (above)."""
        now = self._last = time.monotonic()
        for sub in list(self._subs):
            try:
                if sub.pace is None or message is None:
                    sub.queue.put_nowait(message)
                else:
                    self._paced(sub, message, minor, now)
            except asyncio.QueueFull:
                self._drop(sub)

    @staticmethod
    def _paced(sub: Subscription, message: bytes, minor: bool, now: float) -> None:
        assert sub.pace is not None
        if minor:
            if now >= sub.settle_until and now - sub.sent_at < sub.pace:
                # the newest readings wait for the pace; an older held one is outdated by them
                sub.held = message
                return
        else:
            sub.settle_until = now + SETTLE
            if sub.held is not None:
                # older than this one, and maybe what this one does not say (a threshold after a sample)
                sub.queue.put_nowait(sub.held)
        sub.held = None
        sub.sent_at = now
        sub.queue.put_nowait(message)

    def _drop(self, sub: Subscription) -> None:
        sub.dropped = True
        self.dropped += 1
        self._end(sub)

    def keep_alive(self, every: float, touch: Callable[[], Any] | None = None) -> None:
        """Send a ``heartbeat`` event to every subscriber after ``every`` seconds without a message
        published, while the hub has subscribers (a stream serving one calls this; called again, it
        changes nothing but the period and ``touch``).  ``touch`` is called at each beat.

        One timer for the whole hub, re-armed after each beat: a subscriber that joins hears something
        within ``every`` seconds of its first messages, as each message published reaches all."""
        self._every, self._touch = every, touch
        if self._beat is None and not self.closed:
            self._arm(max(0.0, self._last + every - time.monotonic()) or every)

    def _arm(self, delay: float) -> None:
        self._beat = asyncio.get_running_loop().call_later(delay, self._on_beat)

    def _on_beat(self) -> None:
        self._beat = None
        every = self._every
        if self.closed or not self._subs or every is None:
            # stopped: the next stream's keep_alive starts it again
            return
        due = self._last + every - time.monotonic()
        # quiet for a whole period (a timer may fire a clock tick early)
        if due <= 0.001:
            self.beats += 1
            self._heartbeat(format_event("heartbeat", {"ts": round(time.time(), 3)}))
            if self._touch is not None:
                self._touch()
            due = every
        self._arm(due)

    def _heartbeat(self, beat: bytes) -> None:
        """A heartbeat: to a paced subscriber, the minor message it holds instead where it has one
        (a sign of life too), and nothing before its pace is up."""
        now = self._last = time.monotonic()
        for sub in list(self._subs):
            try:
                if sub.pace is None:
                    sub.queue.put_nowait(beat)
                elif now - sub.sent_at >= sub.pace:
                    sub.queue.put_nowait(sub.held if sub.held is not None else beat)
                    sub.held, sub.sent_at = None, now
            except asyncio.QueueFull:
                self._drop(sub)

    def close(self, final: bytes | None = None) -> None:
        """End every stream, after ``final`` (e.g. a ``bye`` event)."""
        if self.closed:
            return
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        if final is not None:
            self.publish_raw(final)
        self.closed = True
        for sub in list(self._subs):
            try:
                sub.queue.put_nowait(None)
            except asyncio.QueueFull:
                self._drop(sub)
        self._subs.clear()
        self._unsigned.clear()
