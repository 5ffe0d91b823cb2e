"""The daemon's DNS-SD announcement: one ``_gpusd._tcp`` service per host (and, opt-in, hwsd's
``_gpu-sd._tcp``), TXT updates only when the summary changes and at most every ``txt_min_interval``
seconds, goodbye packets on stop, and a re-announcement when the machine's addresses change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..model import HostSnapshot
from ..wire.mdns import local_ipv4_addresses
from ..wire.txt import (
    API_PREFIX,
    HWSD_PORT,
    HWSD_TYPE,
    SERVICE_TYPE,
    count_free,
    encode_hwsd,
    encode_txt,
    instance_name,
    inventory_of,
)

if TYPE_CHECKING:  # pragma: no cover
    from zeroconf import ServiceInfo
    from zeroconf.asyncio import AsyncZeroconf

    from .service import Daemon

log = logging.getLogger(__name__)


class Announcer:
    def __init__(self, daemon: "Daemon", zc: "AsyncZeroconf", addresses: list[str], port: int) -> None:
        self.daemon = daemon
        self.zc = zc
        self.addresses = addresses
        self.port = port
        self.pinned = daemon.interfaces is not None
        self.instance = instance_name(daemon.hostname, daemon.node_id)
        self.info: ServiceInfo | None = None
        self.hwsd_info: ServiceInfo | None = None
        self.txt: dict[str, str] = {}
        self.updates = 0  # TXT updates sent (not counting the first announcement)
        self._last_update = 0.0
        self._pending: HostSnapshot | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lock = asyncio.Lock()
        self._closed = False

    # -- building records ---------------------------------------------------------------------
    def _txt_for(self, snap: HostSnapshot) -> dict[str, str]:
        cfg = self.daemon.config
        return encode_txt(
            node_id=self.daemon.node_id,
            hostname=self.daemon.hostname,
            session=cfg.session,
            inventory=inventory_of(snap),
            free=count_free(snap),
            api=API_PREFIX,
            gpusd_version=__version__,
            simulated=snap.simulated,
            auth=bool(cfg.token),
            tls_port=getattr(self.daemon, "tls_port", None),
            cert_fp=getattr(self.daemon, "cert_fp", None),
        )

    def _info(self, type_: str, name: str, port: int, props: dict[str, str]) -> "ServiceInfo":
        from zeroconf import ServiceInfo

        return ServiceInfo(
            type_,
            name,
            port=port,
            properties=props,
            server=f"{self.instance}.local.",
            parsed_addresses=self.addresses,
        )

    # -- life cycle ---------------------------------------------------------------------------
    async def start(self, snap: HostSnapshot) -> None:
        """Probe for our name and announce.  Returns when the first announcement is sent."""
        self.txt = self._txt_for(snap)
        self.info = self._info(SERVICE_TYPE, f"{self.instance}.{SERVICE_TYPE}", self.port, self.txt)
        task = await self.zc.async_register_service(self.info, allow_name_change=True)
        self._keep(task)
        self._last_update = time.monotonic()
        if self.daemon.config.gpusd_compat:
            await self._start_hwsd(snap)
        await asyncio.sleep(0.01)  # let the first announcement go out
        log.info("announced %s on %s port %d", self.info.name, ",".join(self.addresses), self.port)

    async def _start_hwsd(self, snap: HostSnapshot) -> None:
        props = encode_hwsd(node_id=self.daemon.node_id, hostname=self.daemon.hostname,
                            session=self.daemon.config.session, count=len(snap.gpus))
        self.hwsd_info = self._info(HWSD_TYPE, f"{self.instance}.{HWSD_TYPE}", HWSD_PORT, props)
        try:
            self._keep(await self.zc.async_register_service(self.hwsd_info, allow_name_change=True))
        except Exception as exc:  # compatibility is a bonus: never fatal
            log.warning("cannot announce the GPU-SD compatibility service: %s", exc)
            self.hwsd_info = None

    async def stop(self, timeout: float = 3.0) -> None:
        """Send the goodbye packets (and wait for them: an un-awaited unregister sends none)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for t in list(self._tasks):
            t.cancel()
        for info in (self.info, self.hwsd_info):
            if info is None:
                continue
            try:
                task = await asyncio.wait_for(self.zc.async_unregister_service(info), timeout)
                await asyncio.wait_for(task, timeout)
            except Exception as exc:
                log.warning("goodbye for %s failed: %r", info.name, exc)

    def _keep(self, aw: Any) -> None:
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("mDNS broadcast failed: %r", task.exception())

    # -- TXT updates --------------------------------------------------------------------------
    def on_sample(self, snap: HostSnapshot) -> None:
        """Called after every sample: schedule a TXT update if the summary changed (rate-limited)."""
        if self._closed or self.info is None:
            return
        if self._txt_for(snap) == self.txt:
            self._pending = None
            return
        self._pending = snap
        if self._timer is not None:
            return  # an update is already scheduled; it will use the newest sample
        wait = self._last_update + self.daemon.config.txt_min_interval - time.monotonic()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(0.0, wait), self._fire)

    def _fire(self) -> None:
        self._timer = None
        snap, self._pending = self._pending, None
        if snap is None or self._closed:
            return
        # Counted from now, not from when _update gets the lock: a sample arriving in between must
        # schedule the next update a full interval later, not at once.
        self._last_update = time.monotonic()
        self._keep(self._update(snap))

    async def _update(self, snap: HostSnapshot) -> None:
        async with self._lock:
            if self._closed or self.info is None:
                return
            txt = self._txt_for(snap)
            self._last_update = time.monotonic()
            if txt != self.txt:
                self.txt = txt
                self.info = self._info(SERVICE_TYPE, self.info.name, self.port, txt)
                self.updates += 1
                log.info("TXT update: %d GPUs, %s free", len(snap.gpus), txt.get("free"))
                await self._republish(self.info)
            if self.hwsd_info is not None:
                props = encode_hwsd(node_id=self.daemon.node_id, hostname=self.daemon.hostname,
                                    session=self.daemon.config.session, count=len(snap.gpus))
                if props != self.hwsd_info.decoded_properties:
                    self.hwsd_info = self._info(HWSD_TYPE, self.hwsd_info.name, HWSD_PORT, props)
                    await self._republish(self.hwsd_info)

    async def _republish(self, info: "ServiceInfo") -> None:
        try:
            task = await self.zc.async_update_service(info)
            await asyncio.wait_for(task, 10)
        except Exception as exc:
            log.warning("TXT update of %s failed: %r", info.name, exc)

    # -- network changes ----------------------------------------------------------------------
    async def watch_network(self, every: float) -> None:
        """With all interfaces in use: follow address changes (DHCP renewals, a new NIC, a cable
        plugged in) by rebinding python-zeroconf and announcing the new addresses."""
        if self.pinned or every <= 0:
            return
        while not self._closed:
            await asyncio.sleep(every)
            try:
                addresses = await asyncio.get_running_loop().run_in_executor(None, local_ipv4_addresses)
            except Exception as exc:
                log.debug("cannot list addresses: %r", exc)
                continue
            if sorted(addresses) == sorted(self.addresses) or not addresses:
                continue
            log.info("network changed: addresses %s -> %s", ",".join(self.addresses), ",".join(addresses))
            self.addresses = addresses
            with contextlib.suppress(Exception):
                await self.zc.zeroconf.async_update_interfaces()
            async with self._lock:
                if self._closed or self.info is None:
                    return
                self.info = self._info(SERVICE_TYPE, self.info.name, self.port, self.txt)
                await self._republish(self.info)
                if self.hwsd_info is not None:
                    self.hwsd_info = self._info(HWSD_TYPE, self.hwsd_info.name, HWSD_PORT,
                                                dict(self.hwsd_info.decoded_properties))  # type: ignore[arg-type]
                    await self._republish(self.hwsd_info)
