"""Reading a daemon's fleet view (``GET /api/v1/fleet``, docs/wire-format.md "Fleet view").

A daemon already follows every host of its session.  Two readers ask one instead of browsing:

* :class:`LocalFleetView` -- this host's own daemon (``gpusd list``): one local HTTP request instead of
  a browse that has to wait for the answers to settle.  Where its daemon runs (a ``locate`` function
  gives the API bases and node id: :func:`gpusd.discovery.fleetsource.local_daemon_urls` reads them
  from the state directory), the request runs in a thread
  (:meth:`LocalFleetView.start`): where it has not answered within ``QUICK`` s (a fleet view that is just
  starting, a daemon that hangs), the caller browses meanwhile; the daemon's answer is taken when it
  comes within ``FLEET_TIMEOUT`` s (a fleet of 1,000 hosts takes about a second), the browse's otherwise.
  Anything unexpected -- no daemon, another session, no answer within ``timeout``, an answer that is
  not a valid fleet view, a host known only from an hwsd announcement (the fleet view does not carry its
  TXT inventory) -- reads as None, and the caller browses as before.  Without the fleet secret, or
  where the daemon's answer carries no valid proof, process and lease owners and command lines of
  *other* hosts are blanked: browsing without the secret gets them blank from the other daemons too,
  while this host's own are shown (a reader on this machine sees them).
* :class:`FleetReader` -- any daemon named by URL (``gpusd top --url``, ``gpusd export prometheus-sd
  --url``, ``gpusd report --url``): with the fleet secret over the daemon's TLS port, its certificate
  pinned to the fingerprint its signed proof names.

Only the standard library is used (no aiohttp, no zeroconf: their imports alone cost more than the
answer); every request is :func:`gpusd.wire.http.fetch_json` (signed with the fleet key where there is
one, bounded, checked).
"""

# Imports inside functions: start-up (gpusd list imports this module).
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from ..errors import GpusdError
from ..model import GpuInfo, canonical, canonical_snapshot, redact, redact_encoded
from ..wire.fleet import MAX_FLEET_BYTES, FleetView, HostRecord, fleet_envelope
from ..wire.http import SourceError, fetch, fetch_json
from .source import Listing
from .types import Device, Filters, RemoteHost, device_dict

if TYPE_CHECKING:  # pragma: no cover
    from ..wire.http import Answer, Fetched
    from ..wire.signing import FleetKey


def _debug(message: str, *args: object) -> None:
    """A debug line (``logging`` imported only then: ``gpusd list`` from its daemon needs none)."""
    import logging

    logging.getLogger(__name__).debug(message, *args)


# seconds for the whole answer (a cold fleet view settles first)
FLEET_TIMEOUT = 2.0
# the answer of a running fleet view comes in milliseconds: after this long, browse too
QUICK = 0.2

#: the running local daemon's API bases (loopback first) and its node id, or None (no such daemon)
Locate = Callable[[], "tuple[list[str], str] | None"]


def parse_fleet(data: Any, filters: Filters, own_node: str, private: bool) -> Listing | None:
    """The devices and hosts of a fleet view answer (:class:`gpusd.wire.fleet.FleetView`), filtered like
    a browsing client's; None when the answer is not a usable fleet view.  ``private``: the daemon proved
    it holds the fleet secret, so the other hosts' owners and commands are kept."""
    try:
        view = FleetView.from_dict(data)
    except (ValueError, RecursionError):
        return None
    if not view.hosts or view.skipped:
        # not even the daemon itself yet (still starting), or a damaged answer: browse
        return None
    hosts: list[RemoteHost] = []
    devices: list[Device] = []
    unmatched = 0
    for h in view.hosts:
        snap = h.snapshot
        if h.source != "gpusd" or snap is None or h.session is None:
            # an hwsd host, or one without a snapshot yet: browsing tells more
            return None
        if not h.hostname.isprintable():
            # a name no announcement could carry: browse instead
            return None
        host = RemoteHost.from_record(h, snap, h.verified if private else None)
        if filters.session is not None and host.txt.session != filters.session:
            continue
        if not filters.host_ok(host.txt):
            unmatched += 1
            continue
        if snap.node_id != own_node and not private:
            redact(snap)
        hosts.append(host)
        seen: set[str] = set()
        for dev in host.devices():
            if filters.device_ok(dev.gpu) and dev.uuid not in seen:
                seen.add(dev.uuid)
                devices.append(dev)
    hosts.sort(key=lambda x: (x.hostname, x.node_id))
    devices.sort(key=lambda d: (d.hostname, d.node_id, d.index))
    return Listing(devices, hosts, unmatched)


def fleet_rows(data: Any, filters: Filters, own_node: str, private: bool) -> tuple[list[dict[str, Any]], int] | None:
    """``gpusd list --json``'s devices of a fleet view answer, straight from its JSON: what
    :func:`parse_fleet` gives as ``[d.to_dict() for d in devices]``, with the number of its hosts, without
    a model object.  Each record is checked by the model's rules (:func:`gpusd.model.canonical`), the
    filters and the redaction are :func:`parse_fleet`'s; None wherever :func:`parse_fleet` gives None."""

    rows: list[dict[str, Any]] = []
    listed = 0
    try:
        raw = fleet_envelope(data)[1]
        if not raw:
            # not even the daemon itself yet (still starting): browse
            return None
        for item in raw:
            if type(item) is not dict:
                # a damaged answer: browse
                return None
            rec = canonical(HostRecord, {k: v for k, v in item.items() if k != "snapshot"})
            snap = item.get("snapshot")
            if snap is None or rec["source"] != "gpusd" or rec["session"] is None:
                # an hwsd host, or one without a snapshot yet: browsing tells more
                return None
            head, simulated, gpus = canonical_snapshot(snap)
            hostname, session = rec["hostname"], rec["session"]
            if not hostname.isprintable():
                # a name no announcement could carry: browse instead
                return None
            if (filters.session is not None and session != filters.session) or not filters.name_ok(hostname):
                continue
            listed += 1
            node = head["node_id"]
            hide = node != own_node and not private
            seen: set[str] = set()
            for gpu in gpus:
                if hide:
                    redact_encoded(GpuInfo, gpu)
                if filters.gpu_dict_ok(gpu) and gpu["uuid"] not in seen:
                    seen.add(gpu["uuid"])
                    rows.append(device_dict(hostname, node, session, rec["url"], "gpusd", True, simulated, None,
                                            rec["via"], None, gpu))
    except (ValueError, RecursionError):
        # a host the model refuses: parse_fleet skips it, and browses
        return None
    rows.sort(key=lambda r: (r["hostname"], r["node_id"], r["gpu"]["index"]))
    return rows, listed


class LocalFleetView:
    """The fleet as this host's running daemon sees it (a :class:`~.source.HostListing`).
    ``filters.session`` must be set: a daemon's fleet view covers its own session only.  The options
    given still hold: ``locate`` finds only a daemon on the interfaces asked for, and with the fleet
    secret (``key``) the daemon must prove it holds it too -- otherwise it cannot tell which hosts do,
    and the client browses, checking each host's proof itself."""

    via = "fleet"

    def __init__(self, locate: Locate, filters: Filters, *, key: FleetKey | None = None,
                 timeout: float = FLEET_TIMEOUT) -> None:
        self.locate = locate
        self.filters = filters
        self.key = key
        self.timeout = timeout

    def read(self) -> Listing | None:
        return self.parse(self.fetch())

    def fetch(self, sent: Callable[[], None] | None = None) -> tuple[Fetched, str] | None:
        """The daemon's answer as received (parsed and checked by :meth:`parse`) and the daemon's node
        id; None where no daemon of the session answers within ``timeout``.  ``sent``: called once the
        request is on its way to a daemon (it accepted the connection)."""

        if self.filters.session is None:
            return None
        found = self.locate()
        if found is None:
            return None
        urls, own_node = found
        deadline = time.monotonic() + self.timeout
        for base in urls:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return fetch(base + "/fleet", key=self.key, timeout=left, node_id=own_node,
                             max_bytes=MAX_FLEET_BYTES, sent=sent), own_node
            except SourceError as exc:
                _debug("%s", exc)
        return None

    def parse(self, fetched: tuple[Fetched, str] | None) -> Listing | None:
        """The listing of a :meth:`fetch`'s answer; None where it cannot be used (browse instead)."""
        answer = self._answer(fetched)
        if answer is None:
            return None
        result = parse_fleet(answer[0].data, self.filters, answer[1], private=answer[0].verified is True)
        if result is None:
            _debug("not a usable fleet view: browsing")
        return result

    def rows(self, fetched: tuple[Fetched, str] | None) -> tuple[list[dict[str, Any]], int] | None:
        """``gpusd list --json``'s devices of a :meth:`fetch`'s answer and its number of hosts
        (:func:`fleet_rows`): what :meth:`parse` gives, without model objects; None where :meth:`parse`
        gives None."""
        answer = self._answer(fetched)
        if answer is None:
            return None
        return fleet_rows(answer[0].data, self.filters, answer[1], private=answer[0].verified is True)

    def _answer(self, fetched: tuple[Fetched, str] | None) -> tuple[Answer, str] | None:
        """A :meth:`fetch`'s answer, parsed and checked, and the daemon's node id; None where unusable."""

        if fetched is None:
            return None
        try:
            answer, own_node = fetched[0].answer(), fetched[1]
        except SourceError as exc:
            _debug("%s", exc)
            return None
        if self.key is not None and answer.verified is not True:
            _debug("the daemon did not prove it holds the fleet secret: browsing")
            return None
        return answer, own_node

    def start(self) -> Reading:
        """:meth:`fetch` in a daemon thread (it never holds up the process's exit): the caller can
        browse meanwhile and take whichever answers first; the answer is parsed by whoever takes it
        (:meth:`Reading.result`)."""
        reading = Reading(self)

        def run() -> None:
            fetched = None
            try:
                fetched = self.fetch(reading.sent.set)
            except Exception as exc:  # noqa: BLE001  # a bug here must not stop the browse
                _debug("local fleet view failed: %r", exc)
            reading.finish(fetched)

        threading.Thread(target=run, name="gpusd-local-fleet", daemon=True).start()
        return reading


class Reading:
    """The answer of a :class:`LocalFleetView` fetched in a thread, once it is there (a plain event and a
    value: ``concurrent.futures`` and ``asyncio`` are not imported where the daemon answers at once,
    their imports cost more than the answer).  :meth:`done` once the daemon's answer is in (or none
    will come): parsing it is the caller's own work (1,000 hosts: ~0.5 s), not a wait on the daemon,
    so a caller does not browse meanwhile."""

    __slots__ = ("_arrived", "_done", "_fetched", "_parsed", "_result", "_view", "sent")

    def __init__(self, view: LocalFleetView) -> None:
        self._view = view
        # the request is on its way: a daemon accepted the connection
        self.sent = threading.Event()
        self._done = threading.Event()
        self._fetched: tuple[Fetched, str] | None = None
        self._parsed = False
        self._result: Listing | None = None
        self._arrived: bool | None = None

    def finish(self, fetched: tuple[Fetched, str] | None) -> None:
        self._fetched = fetched
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def arrived(self) -> bool:
        """Whether the daemon answered in time: within ``QUICK``, or within ``FLEET_TIMEOUT`` where it
        took the request (waits that long, once: the verdict is kept, so asking again does not wait)."""
        if self._arrived is None:
            self._arrived = self.wait(QUICK) or (self.sent.is_set() and self.wait(FLEET_TIMEOUT))
        return self._arrived

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the answer is there (waiting at most ``timeout`` s for it)."""
        return self._done.wait(timeout)

    def rows(self) -> tuple[list[dict[str, Any]], int] | None:
        """``gpusd list --json``'s devices and the number of hosts (:meth:`LocalFleetView.rows`); call once
        :meth:`done`.  None: none from this answer; :meth:`result` then decides, as if not called."""
        if self._parsed:
            return None
        try:
            return self._view.rows(self._fetched)
        except Exception as exc:  # noqa: BLE001  # a bug here must not stop the listing
            _debug("local fleet view failed: %r", exc)
            return None

    def result(self) -> Listing | None:
        """The listing (None: no usable answer); call once :meth:`done`.  Parsed on the first call."""
        if not self._parsed:
            self._parsed = True
            try:
                self._result = self._view.parse(self._fetched)
            except Exception as exc:  # noqa: BLE001  # a bug here must not stop the browse
                _debug("local fleet view failed: %r", exc)
            self._fetched = None
        return self._result


# -- any daemon, by URL -------------------------------------------------------------------------------
def strip_api(path: str) -> str:
    """``/api/v1`` or ``/prefix/api/v1/`` -> ``""`` or ``/prefix``: the daemon's root path."""
    path = path.rstrip("/")
    return path.removesuffix("/api/v1")


def base_url(url: str) -> str:
    """``host:4780``, ``http://host:4780/`` or ``http://host:4780/api/v1`` -> ``http://host:4780``."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GpusdError(f"not a daemon URL: {url!r} (example: http://gpu-node-1:4780)")
    return f"{parts.scheme}://{parts.netloc}{strip_api(parts.path)}"


class FleetReader:
    """One daemon's fleet view, by URL (``gpusd top --url http://gpu-node-1:4780``)."""

    def __init__(self, url: str, key: FleetKey | None = None, timeout: float = 5.0) -> None:
        self.url = base_url(url)
        self.key = key
        self.timeout = timeout
        # whether the daemon proved itself on the last answer
        self.verified: bool | None = None
        # (URL, pinned fingerprint) once looked up
        self._tls: tuple[str, str | None] | None = None

    def fetch(self) -> dict[str, Any]:
        """The answer (an object; :class:`~gpusd.wire.http.SourceError` otherwise), and ``verified``."""

        url, pin = self.secure_url()
        answer = fetch_json(f"{url}/api/v1/fleet", self.key, self.timeout, pin=pin, max_bytes=MAX_FLEET_BYTES)
        if not isinstance(answer.data, dict):
            raise SourceError(f"{self.url}/api/v1/fleet: expected an object")
        self.verified = answer.verified
        return answer.data

    def secure_url(self) -> tuple[str, str | None]:
        """With the fleet secret and a plain ``http://`` URL: the daemon's HTTPS URL and certificate
        fingerprint as its ``/healthz`` says (private fields travel over TLS only; the fingerprint is
        checked against the daemon's signed proof, so a forged /healthz gains nothing)."""

        if self.key is None or not self.url.startswith("http://"):
            return self.url, None
        if self._tls is None:
            self._tls = (self.url, None)
            try:
                health = fetch_json(f"{self.url}/healthz", None, self.timeout).data
            except SourceError:
                return self.url, None
            port, fp = (health.get("tls_port"), health.get("cert_fp")) if isinstance(health, dict) else (None, None)
            if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 and isinstance(fp, str):
                parts = urlsplit(self.url)
                host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
                self._tls = (f"https://{host}:{port}{parts.path}", fp)
        return self._tls


__all__ = ["FLEET_TIMEOUT", "QUICK", "FleetReader", "LocalFleetView", "Reading", "base_url", "fleet_rows",
           "parse_fleet", "strip_api"]
