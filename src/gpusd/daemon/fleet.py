"""The fleet view of a daemon: every host of its session, as its own discovery client sees them.

Serves ``/api/v1/fleet`` and ``/api/v1/fleet/events`` (the dashboard's feed).  In ``auto`` mode the
client starts on first use and stops after ``fleet_idle`` seconds without a request or a listener,
so a fleet of daemons does not keep N x N event streams open when nobody is looking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from ..discovery.types import DEVICE_ADDED, HOST_ADDED, DiscoveryEvent
from ..wire.sse import format_event
from .events import EventHub

if TYPE_CHECKING:  # pragma: no cover
    from ..discovery.client import AsyncClient
    from .service import Daemon

log = logging.getLogger(__name__)


class Fleet:
    def __init__(self, daemon: "Daemon") -> None:
        self.daemon = daemon
        self.hub = EventHub(maxsize=1024)
        self.client: AsyncClient | None = None
        self._start_lock = asyncio.Lock()
        self._last_used = time.monotonic()
        self._idle_task: asyncio.Task[None] | None = None
        self._closed = False  # stop() was called: a late request must not start a client again

    def touch(self) -> None:
        self._last_used = time.monotonic()

    async def ensure_started(self, settle: float = 2.0) -> None:
        self.touch()
        if self._closed or (self.client is not None and self.client.listening):
            return
        async with self._start_lock:
            if self._closed or (self.client is not None and self.client.listening):
                return
            from ..discovery.client import AsyncClient

            d = self.daemon
            # Requests to peers are signed with the fleet secret (never sent); peers that prove they
            # hold it too are "verified" and show this daemon (so its signed readers) their process
            # owners; to readers without the secret the fleet view is redacted on the way out.
            # Announced loopback addresses are followed only by a daemon itself pinned to loopback.
            ifaces = d.interfaces or []
            client = AsyncClient(session=d.config.session, zeroconf=d.zc, token=d.token,
                                 allow_loopback=bool(ifaces) and all(a.startswith("127.") for a in ifaces))
            client.register_event_handler("*", self._republish)
            await client.start_listening()
            self.client = client
            log.info("fleet view started (session %s)", d.config.session)
            if d.config.fleet == "auto" and self._idle_task is None:
                self._idle_task = asyncio.ensure_future(self._stop_when_idle())
            await client.wait_settled(settle)

    def _republish(self, event: DiscoveryEvent) -> None:
        self.hub.publish(event.event, event.to_dict())

    def replay(self) -> list[bytes]:
        """What a new fleet stream starts with: host_added and device_added for everything known."""
        out: list[bytes] = []
        if self.client is None:
            return out
        for host in self.client.hosts:
            out.append(format_event(HOST_ADDED, DiscoveryEvent(HOST_ADDED, host).to_dict()))
            for dev in host.devices():
                if self.client.filters.device_ok(dev.gpu):
                    out.append(format_event(DEVICE_ADDED, DiscoveryEvent(DEVICE_ADDED, host, device=dev).to_dict()))
        return out

    def to_dict(self) -> dict[str, Any]:
        hosts = []
        if self.client is not None:
            for h in self.client.hosts:
                hosts.append({
                    "node_id": h.node_id,
                    "hostname": h.hostname,
                    "session": h.session,
                    "source": h.source,
                    "url": h.url,
                    "alive": h.alive,
                    "verified": h.verified,
                    "snapshot": h.snapshot.to_dict() if h.snapshot is not None else None,
                })
        return {"session": self.daemon.config.session, "hosts": hosts}

    async def _stop_when_idle(self) -> None:
        idle = self.daemon.config.fleet_idle
        try:
            while True:
                await asyncio.sleep(min(idle, 30.0))
                if len(self.hub) or time.monotonic() - self._last_used < idle:
                    continue
                client, self.client = self.client, None
                if client is not None:
                    log.info("fleet view idle: stopped")
                    await client.stop_listening()
        except asyncio.CancelledError:
            pass
        finally:
            self._idle_task = None

    async def stop(self) -> None:
        self._closed = True
        if self._idle_task is not None:
            self._idle_task.cancel()
        self.hub.close()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.stop_listening()
            self.client = None
