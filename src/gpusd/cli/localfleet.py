"""Every GPU on the LAN from this host's own daemon: its fleet view, without browsing.

A daemon already follows every host of its session (``GET /api/v1/fleet``, docs/wire-format.md).
Where one runs from this user's state directory (``gpusd.json`` there names its port and addresses,
see :mod:`gpusd.daemon.process`), ``gpusd list`` asks it instead of browsing mDNS itself: one local
HTTP request instead of a browse that has to wait for the answers to settle.  The request runs in a
thread (:func:`start_fleet_request`): where it has not answered within ``QUICK`` s (a fleet view that
is just starting, a daemon that hangs), the caller browses meanwhile; the daemon's answer is taken when
it comes within ``FLEET_TIMEOUT`` s (a fleet of 1,000 hosts takes about a second), the browse's otherwise.

Only the standard library is used (no aiohttp, no zeroconf: their imports alone cost more than the
answer).  Anything unexpected -- no daemon, another session, no answer within ``timeout``, an
answer that is not a valid fleet view, a host known only from an hwsd announcement (the fleet view
does not carry its TXT inventory) -- returns None, and the caller browses as before.

With the fleet secret (``key``) the request is signed like any other (:func:`gpusd.wire.http.fetch_json`,
the one blocking GET); without it, or where the daemon's answer carries no valid proof, process and
lease owners and command lines of *other* hosts are blanked: browsing without the secret gets them
blank from the other daemons too, while this host's own are shown (a reader on this machine sees them).
"""

from __future__ import annotations

import ipaddress
import logging
from typing import TYPE_CHECKING, Any

from ..discovery.types import Device, Filters, RemoteHost
from ..model import GpuInfo

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import Future

    from ..wire.signing import FleetKey

log = logging.getLogger(__name__)

FLEET_TIMEOUT = 2.0  # seconds for the whole answer (a cold fleet view settles first)
QUICK = 0.2  # the answer of a running fleet view comes in milliseconds: after this long, browse too

# (devices, hosts, hosts left out by the host filter)
Found = tuple[list[Device], list[RemoteHost], int]


def daemon_api_urls(session: str, interfaces: list[str] | None = None) -> tuple[list[str], str] | None:
    """The running local daemon's API bases to try (loopback first) and its node id, when it runs
    in ``session`` (and, with ``interfaces``, the addresses the user asked for, resolved: it browses on
    exactly those); None otherwise."""
    from ..daemon.process import status
    from ..identity import state_dir

    st = status(state_dir())
    info = st.info
    if not st.running or info.get("session") != session:
        return None
    if interfaces is not None:
        running = info.get("interfaces")
        if not isinstance(running, list) or sorted(map(str, running)) != sorted(interfaces):
            return None  # it browses elsewhere (or everywhere): its view is not what was asked for
    port, node_id = info.get("port"), info.get("node_id")
    if not isinstance(port, int) or not 0 < port < 65536 or not isinstance(node_id, str):
        return None
    hosts: list[str] = []
    if not info.get("interfaces"):  # bound to every address: loopback too
        hosts.append("127.0.0.1")
    addresses = info.get("addresses")
    for a in addresses if isinstance(addresses, list) else []:
        try:
            ip = ipaddress.ip_address(a)
        except (TypeError, ValueError):
            continue
        if ip.version == 4 and a not in hosts:
            hosts.append(str(ip))
    if not hosts:
        return None
    return [f"http://{h}:{port}/api/v1" for h in hosts[:4]], node_id


def _blank_private(gpus: list[GpuInfo]) -> None:
    for g in gpus:
        for p in g.processes:
            p.user = p.command = None
        for lease in g.leases:
            lease.user = lease.command = None


def parse_fleet(data: Any, filters: Filters, own_node: str, private: bool) -> Found | None:
    """The devices and hosts of a fleet view answer (:class:`gpusd.wire.fleet.FleetView`), filtered like
    a browsing client's; None when the answer is not a usable fleet view.  ``private``: the daemon proved
    it holds the fleet secret, so the other hosts' owners and commands are kept."""
    from ..wire.fleet import FleetView
    from ..wire.txt import TxtRecord

    try:
        view = FleetView.from_dict(data)
    except (ValueError, RecursionError):
        return None
    if not view.hosts or view.skipped:
        return None  # not even the daemon itself yet (still starting), or a damaged answer: browse
    hosts: list[RemoteHost] = []
    devices: list[Device] = []
    unmatched = 0
    for h in view.hosts:
        snap = h.snapshot
        if h.source != "gpusd" or snap is None or h.session is None:
            return None  # an hwsd host, or one without a snapshot yet: browsing tells more
        if not h.hostname.isprintable():
            return None  # a name no announcement could carry: browse instead
        # the host name as announced (TXT), like a browsing client's
        txt = TxtRecord(node_id=snap.node_id, hostname=h.hostname, session=h.session, count=len(snap.gpus),
                        simulated=bool(snap.simulated))
        if filters.session is not None and txt.session != filters.session:
            continue
        if not filters.host_ok(txt):
            unmatched += 1
            continue
        if snap.node_id != own_node and not private:
            _blank_private(snap.gpus)
        host = RemoteHost(key=snap.node_id, txt=txt, url=h.url, snapshot=snap, alive=h.alive,
                          verified=h.verified if private else None)
        hosts.append(host)
        seen: set[str] = set()
        for dev in host.devices():
            if filters.device_ok(dev.gpu) and dev.uuid not in seen:
                seen.add(dev.uuid)
                devices.append(dev)
    hosts.sort(key=lambda x: (x.hostname, x.node_id))
    devices.sort(key=lambda d: (d.hostname, d.node_id, d.index))
    return devices, hosts, unmatched


def fleet_from_local_daemon(filters: Filters, *, key: FleetKey | None = None,
                            timeout: float = FLEET_TIMEOUT, interfaces: list[str] | None = None) -> Found | None:
    """The fleet as this host's running daemon sees it, or None (browse instead).  ``filters.session``
    must be set: a daemon's fleet view covers its own session only.  The options given still hold:
    ``interfaces`` (resolved addresses, None: any) must be the daemon's own, and with the fleet secret
    (``key``) the daemon must prove it holds it too -- otherwise it cannot tell which hosts do, and
    the client browses, checking each host's proof itself."""
    import time

    from ..wire.fleet import MAX_FLEET_BYTES
    from ..wire.http import SourceError, fetch_json

    if filters.session is None:
        return None
    found = daemon_api_urls(filters.session, interfaces)
    if found is None:
        return None
    urls, own_node = found
    deadline = time.monotonic() + timeout
    for base in urls:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            answer = fetch_json(base + "/fleet", key=key, timeout=left, node_id=own_node, max_bytes=MAX_FLEET_BYTES)
        except SourceError as exc:
            log.debug("%s", exc)
            continue
        if key is not None and answer.verified is not True:
            log.debug("%s/fleet: the daemon did not prove it holds the fleet secret: browsing", base)
            return None
        result = parse_fleet(answer.data, filters, own_node, private=answer.verified is True)
        if result is not None:
            return result
        log.debug("%s/fleet: not a usable fleet view", base)
        return None
    return None


def start_fleet_request(filters: Filters, *, key: FleetKey | None = None, timeout: float = FLEET_TIMEOUT,
                        interfaces: list[str] | None = None) -> Future[Found | None]:
    """:func:`fleet_from_local_daemon` in a daemon thread (it never holds up the process's exit):
    the caller can browse meanwhile and take whichever answers first."""
    import threading
    from concurrent.futures import Future

    fut: Future[Found | None] = Future()

    def run() -> None:
        try:
            fut.set_result(fleet_from_local_daemon(filters, key=key, timeout=timeout, interfaces=interfaces))
        except Exception as exc:  # noqa: BLE001  # a bug here must not stop the browse
            log.debug("local fleet view failed: %r", exc)
            fut.set_result(None)

    threading.Thread(target=run, name="gpusd-local-fleet", daemon=True).start()
    return fut
