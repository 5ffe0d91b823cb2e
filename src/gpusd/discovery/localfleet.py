"""Every GPU on the LAN from this host's own daemon: its fleet view, without browsing.

A daemon already follows every host of its session (``GET /api/v1/fleet``, docs/wire-format.md).
Where one runs from this user's state directory (``gpusd.json`` there names its port and addresses,
see :mod:`gpusd.daemon.process`), ``gpusd list`` asks it instead of browsing mDNS itself: one local
HTTP request instead of a browse that has to wait for the answers to settle.  The request runs in a
thread (:func:`start_fleet_request`): where it has not answered within ``QUICK`` s (a fleet view that
is just starting, a daemon that hangs), the caller browses meanwhile and takes whichever comes first.

Only the standard library is used (no aiohttp, no zeroconf: their imports alone cost more than the
answer).  Anything unexpected -- no daemon, another session, no answer within ``timeout``, an
answer that is not a valid fleet view, a host known only from an hwsd announcement (the fleet view
does not carry its TXT inventory) -- returns None, and the caller browses as before.

No token is sent.  Process and lease owners and command lines of *other* hosts are blanked unless
``private`` is set (the caller has a token): browsing without a token gets them blank from the other
daemons too, while this host's own are shown either way (a reader on this machine sees them).
"""

from __future__ import annotations

import ipaddress
import json
import logging
from typing import TYPE_CHECKING

from ..model import GpuInfo, HostSnapshot
from .types import Device, Filters, RemoteHost

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import Future

log = logging.getLogger(__name__)

FLEET_TIMEOUT = 2.0  # seconds for the whole answer (a cold fleet view settles first)
QUICK = 0.2  # the answer of a running fleet view comes in milliseconds: after this long, browse too
MAX_BYTES = 64 * 2**20
_MAX_HOSTS = 10_000


def daemon_api_urls(session: str) -> tuple[list[str], str] | None:
    """The running local daemon's API bases to try (loopback first) and its node id, when it runs
    in ``session``; None otherwise."""
    from ..daemon.process import status
    from ..identity import state_dir

    st = status(state_dir())
    info = st.info
    if not st.running or info.get("session") != session:
        return None
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


def _get(url: str, timeout: float) -> bytes | None:
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path, headers={"Accept": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            log.debug("%s answered %d", url, resp.status)
            return None
        body = resp.read(MAX_BYTES + 1)
        return body if len(body) <= MAX_BYTES else None
    except (OSError, http.client.HTTPException) as exc:
        log.debug("%s: %s", url, exc)
        return None
    finally:
        conn.close()


def _blank_private(gpus: list[GpuInfo]) -> None:
    for g in gpus:
        for p in g.processes:
            p.user = p.command = None
        for lease in g.leases:
            lease.user = lease.command = None


def parse_fleet(body: bytes, filters: Filters, own_node: str, private: bool) -> tuple[list[Device], list[RemoteHost]] | None:
    """The devices and hosts of a fleet view answer, filtered like a browsing client's; None when
    the answer is not a usable fleet view."""
    from .txt import TxtRecord

    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("hosts"), list) or len(data["hosts"]) > _MAX_HOSTS:
        return None
    hosts: list[RemoteHost] = []
    devices: list[Device] = []
    for h in data["hosts"]:
        if not isinstance(h, dict) or h.get("source") != "gpusd" or not isinstance(h.get("snapshot"), dict):
            return None  # an hwsd host, or one without a snapshot yet: browsing tells more
        try:
            snap = HostSnapshot.from_dict(h["snapshot"])
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
        session, hostname, url = h.get("session"), h.get("hostname"), h.get("url")
        if not (isinstance(session, str) and isinstance(hostname, str) and len(hostname) <= 255
                and hostname.isprintable() and (url is None or isinstance(url, str) and len(url) < 300)):
            return None
        # the host name as announced (TXT), like a browsing client's
        txt = TxtRecord(node_id=snap.node_id, hostname=hostname, session=session, count=len(snap.gpus),
                        simulated=bool(snap.simulated))
        if not filters.host_ok(txt):
            continue
        if snap.node_id != own_node and not private:
            _blank_private(snap.gpus)
        host = RemoteHost(key=snap.node_id, txt=txt, url=url, snapshot=snap, alive=bool(h.get("alive", True)))
        hosts.append(host)
        seen: set[str] = set()
        for dev in host.devices():
            if filters.device_ok(dev.gpu) and dev.uuid not in seen:
                seen.add(dev.uuid)
                devices.append(dev)
    if not data["hosts"]:
        return None  # not even the daemon itself yet: it is still starting
    hosts.sort(key=lambda x: (x.hostname, x.node_id))
    devices.sort(key=lambda d: (d.hostname, d.node_id, d.index))
    return devices, hosts


def fleet_from_local_daemon(filters: Filters, *, private: bool = False,
                            timeout: float = FLEET_TIMEOUT) -> tuple[list[Device], list[RemoteHost]] | None:
    """The fleet as this host's running daemon sees it, or None (browse instead).  ``filters.session``
    must be set: a daemon's fleet view covers its own session only."""
    import time

    if filters.session is None:
        return None
    found = daemon_api_urls(filters.session)
    if found is None:
        return None
    urls, own_node = found
    deadline = time.monotonic() + timeout
    for base in urls:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        body = _get(base + "/fleet", left)
        if body is None:
            continue
        result = parse_fleet(body, filters, own_node, private)
        if result is not None:
            return result
        log.debug("%s/fleet: not a usable fleet view", base)
        return None
    return None


def start_fleet_request(filters: Filters, *, private: bool = False,
                        timeout: float = FLEET_TIMEOUT) -> Future[tuple[list[Device], list[RemoteHost]] | None]:
    """:func:`fleet_from_local_daemon` in a daemon thread (it never holds up the process's exit):
    the caller can browse meanwhile and take whichever answers first."""
    import threading
    from concurrent.futures import Future

    fut: Future[tuple[list[Device], list[RemoteHost]] | None] = Future()

    def run() -> None:
        try:
            fut.set_result(fleet_from_local_daemon(filters, private=private, timeout=timeout))
        except Exception as exc:  # noqa: BLE001  # a bug here must not stop the browse
            log.debug("local fleet view failed: %r", exc)
            fut.set_result(None)

    threading.Thread(target=run, name="gpusd-local-fleet", daemon=True).start()
    return fut
