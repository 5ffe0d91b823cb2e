"""The daemon's DNS-SD announcement: one ``_gpusd._tcp`` service per host (and, opt-in, hwsd's
``_gpu-sd._tcp`` and ``_net-sd._tcp`` for GPU-SD clients and Equalizer), its host name probed
(:class:`gpusd.wire.responder.HostNameGuard`) together with the service's instance name, TXT
updates only when the summary changes and at most every ``txt_min_interval`` seconds, goodbye
packets on stop, and a re-announcement when the machine's addresses change.
"""

# Imports inside functions: optional or heavy packages; memory at rest (loaded on request).
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..identity import HostIdentity
from ..model import HostSnapshot
from ..wire.mdns import local_ipv4_addresses
from ..wire.responder import HostNameGuard
from ..wire.txt import (
    API_PREFIX,
    HWSD_NET_TYPE,
    HWSD_PORT,
    HWSD_TYPE,
    SERVICE_TYPE,
    count_free,
    encode_hwsd,
    encode_hwsd_net,
    encode_txt,
    instance_name,
    inventory_of,
)

if TYPE_CHECKING:  # pragma: no cover
    from zeroconf import ServiceInfo
    from zeroconf.asyncio import AsyncZeroconf

    from ..wire.responder import HostNameGuard
    from .config import DaemonConfig

log = logging.getLogger(__name__)


class Announcer:
    """Announces one host.  It gets what it uses: the daemon's configuration, its identity, the
    addresses and port to announce, and whether the interfaces are pinned (then addresses are not
    followed)."""

    def __init__(self, config: "DaemonConfig", identity: HostIdentity, zc: "AsyncZeroconf",
                 addresses: list[str], port: int, *, pinned: bool = False, tls_port: int | None = None,
                 cert_fp: str | None = None) -> None:
        self.config = config
        self.identity = identity
        self.zc = zc
        self.addresses = addresses
        self.port = port
        # HTTPS port and certificate fingerprint, announced for pinning
        self.tls_port = tls_port
        self.cert_fp = cert_fp
        self.pinned = pinned
        self.instance = instance_name(identity.hostname, identity.node_id)
        # the SRV target; probed (and renamed) in start()
        self.server = f"{self.instance}.local."
        self.guard: HostNameGuard | None = None
        self._renaming = False
        self.info: ServiceInfo | None = None
        self.hwsd_info: ServiceInfo | None = None
        self.hwsd_net_info: ServiceInfo | None = None
        self.txt: dict[str, str] = {}
        # TXT updates sent (not counting the first announcement)
        self.updates = 0
        self._last_update = 0.0
        self._pending: HostSnapshot | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lock = asyncio.Lock()
        self._closed = False
        self._host_probe: asyncio.Future[str] | None = None

    # -- building records ---------------------------------------------------------------------
    def _txt_for(self, snap: HostSnapshot) -> dict[str, str]:
        cfg = self.config
        return encode_txt(
            node_id=self.identity.node_id,
            hostname=self.identity.hostname,
            session=cfg.session,
            inventory=inventory_of(snap),
            free=count_free(snap),
            api=API_PREFIX,
            gpusd_version=__version__,
            simulated=snap.simulated,
            auth=bool(cfg.token),
            tls_port=self.tls_port,
            cert_fp=self.cert_fp,
        )

    def _info(self, type_: str, name: str, port: int, props: dict[str, str]) -> "ServiceInfo":
        from zeroconf import ServiceInfo

        return ServiceInfo(
            type_,
            name,
            port=port,
            properties=props,
            server=self.server,
            parsed_addresses=self.addresses,
        )

    # -- life cycle ---------------------------------------------------------------------------
    async def start(self, snap: HostSnapshot) -> None:
        """Probe for our host and service names and announce.  Returns when the first announcement
        is sent.

        The host name (:class:`~gpusd.wire.responder.HostNameGuard`) and the service instance name
        (python-zeroconf's ``async_check_service``) are probed together, not one after the other
        (RFC 6762 §8.1 allows probing several records at once): a new host is visible about one
        probing round (~0.75-1 s) sooner.  The service is announced only once both are ours; its SRV
        record points to the host name the probe settled on."""
        host_probe = self._host_probe if self._host_probe is not None else self.probe_host()
        # may move to "-2", ...
        self.server = self.guard.name if self.guard is not None else self.server
        self.txt = self._txt_for(snap)
        self.info = self._info(SERVICE_TYPE, f"{self.instance}.{SERVICE_TYPE}", self.port, self.txt)
        zc = self.zc.zeroconf
        await zc.async_wait_for_start()
        try:
            # renames the instance on a conflict
            await zc.async_check_service(self.info, True)
            server = await host_probe
        finally:
            if not host_probe.done():
                host_probe.cancel()
                with contextlib.suppress(BaseException):
                    await host_probe
        # our first host name was taken: the SRV names the one we own
        if server != self.server:
            self.server = server
            self.info = self._info(SERVICE_TYPE, self.info.name, self.port, self.txt)
        # both names are probed: announce without probing the service a second time
        task = await self.zc.async_register_service(self.info, cooperating_responders=True)
        self._keep(task)
        self._last_update = time.monotonic()
        if self.config.gpusd_compat:
            await self._start_hwsd(snap)
        # let the first announcement go out
        await asyncio.sleep(0.01)
        log.info("announced %s on %s port %d", self.info.name, ",".join(self.addresses), self.port)

    def probe_host(self) -> "asyncio.Future[str]":
        """Start probing for our host name (the daemon calls this as soon as mDNS is open, so the
        probe runs while it reads its GPUs and starts HTTP); :meth:`start` awaits it."""
        if self._host_probe is None:
            self.guard = HostNameGuard(self.zc.zeroconf, self.instance, self.addresses,
                                       on_conflict=self._host_conflict)
            self._host_probe = asyncio.ensure_future(self.guard.probe())
        return self._host_probe

    def _hwsd_props(self, count: int) -> dict[str, str]:
        from .hwsd import x_display

        return encode_hwsd(node_id=self.identity.node_id, hostname=self.identity.hostname,
                           session=self.config.session, count=count, display=x_display())

    def _hwsd_net_props(self) -> dict[str, str] | None:
        """hwsd's interface record for our announced addresses; None when there is none to list
        (loopback only), as hwsd's daemon does."""
        from .hwsd import interfaces

        nets = interfaces(self.addresses)
        if not nets:
            return None
        return encode_hwsd_net(node_id=self.identity.node_id, hostname=self.identity.hostname,
                               session=self.config.session, nets=nets)

    async def _start_hwsd(self, snap: HostSnapshot) -> None:
        self.hwsd_info = self._info(HWSD_TYPE, f"{self.instance}.{HWSD_TYPE}", HWSD_PORT,
                                    self._hwsd_props(len(snap.gpus)))
        try:
            self._keep(await self.zc.async_register_service(self.hwsd_info, allow_name_change=True))
        except Exception as exc:
            # compatibility is a bonus: never fatal
            log.warning("cannot announce the GPU-SD compatibility service: %s", exc)
            self.hwsd_info = None
            return
        # Equalizer uses a host's GPUs only with hwsd's _net-sd._tcp record of the same NodeID.
        net_props = self._hwsd_net_props()
        if net_props is None:
            log.warning("GPU-SD compatibility: no network interface but loopback to announce; "
                        "Equalizer will not use this host")
            return
        self.hwsd_net_info = self._info(HWSD_NET_TYPE, f"{self.instance}.{HWSD_NET_TYPE}", HWSD_PORT, net_props)
        try:
            self._keep(await self.zc.async_register_service(self.hwsd_net_info, allow_name_change=True))
        except Exception as exc:
            log.warning("cannot announce the GPU-SD network service: %s", exc)
            self.hwsd_net_info = None

    def _host_conflict(self, name: str) -> None:
        """Another host announced an address for our host name (RFC 6762 §9): probe for a new one
        (one rename at a time, whatever the number of conflicting packets)."""
        if not self._closed and not self._renaming:
            self._renaming = True
            self._keep(self._rename_host())

    async def _rename_host(self) -> None:
        try:
            await self._rename_host_locked()
        finally:
            self._renaming = False

    async def _rename_host_locked(self) -> None:
        async with self._lock:
            if self._closed or self.guard is None or self.info is None:
                return
            old = self.server
            self.server = await self.guard.probe(rename=True)
            if self._closed or self.server == old:
                return
            log.warning("host name %s is taken by another host: now announced as %s", old, self.server)
            self.guard.goodbye(old)
            self.info = self._info(SERVICE_TYPE, self.info.name, self.port, self.txt)
            await self._republish(self.info)
            for attr, type_ in (("hwsd_info", HWSD_TYPE), ("hwsd_net_info", HWSD_NET_TYPE)):
                info = getattr(self, attr)
                if info is not None:
                    info = self._info(type_, info.name, HWSD_PORT, dict(info.decoded_properties))
                    setattr(self, attr, info)
                    await self._republish(info)

    async def stop(self, timeout: float = 3.0) -> None:
        """Send the goodbye packets (and wait for them: an un-awaited unregister sends none)."""
        self._closed = True
        if self._host_probe is not None and not self._host_probe.done():
            self._host_probe.cancel()
        if self.guard is not None:
            self.guard.close()
        if self._timer is not None:
            self._timer.cancel()
        for t in list(self._tasks):
            t.cancel()
        for info in (self.info, self.hwsd_info, self.hwsd_net_info):
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
            # an update is already scheduled; it will use the newest sample
            return
        wait = self._last_update + self.config.txt_min_interval - time.monotonic()
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
                props = self._hwsd_props(len(snap.gpus))
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
            if self.guard is not None:
                self.guard.set_addresses(addresses)
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
                if self.hwsd_net_info is not None:
                    net_props = self._hwsd_net_props()
                    # (interfaces gone: keep the last record until stop)
                    if net_props is not None:
                        self.hwsd_net_info = self._info(HWSD_NET_TYPE, self.hwsd_net_info.name, HWSD_PORT, net_props)
                        await self._republish(self.hwsd_net_info)
