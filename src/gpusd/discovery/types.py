"""What discovery hands to applications: hosts, devices (one GPU of one host) and events."""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

from ..model import GpuInfo, HostSnapshot, display_name, gpu_memory_available, name_matches
from ..sanitize import for_terminal, printable
from ..units import format_bytes
from ..wire.fleet import HostRecord
from ..wire.txt import TxtRecord

HOST_ADDED = "host_added"
HOST_REMOVED = "host_removed"
DEVICE_ADDED = "device_added"
DEVICE_REMOVED = "device_removed"
DEVICE_UPDATED = "device_updated"
THRESHOLD_EXCEEDED = "threshold_exceeded"
THRESHOLD_CLEARED = "threshold_cleared"
# a rebalancing decision of the daemon about a gpusd job (docs/jobs.md)
JOB = "job"
EVENTS = (HOST_ADDED, HOST_REMOVED, DEVICE_ADDED, DEVICE_REMOVED, DEVICE_UPDATED, THRESHOLD_EXCEEDED, THRESHOLD_CLEARED,
          JOB)


def event_names(event: str) -> tuple[str, ...]:
    """The events a handler registered for ``event`` receives (``*``: all of them)."""
    if event == "*":
        return EVENTS
    if event not in EVENTS:
        raise ValueError(f"unknown event {event!r}; known: {', '.join(EVENTS)}")
    return (event,)


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU of one host on the LAN.  ``gpu`` is the full :class:`~gpusd.model.GpuInfo`; the most
    used fields are repeated as properties.  ``live`` is False for GPUs known only from an
    announcement (hwsd hosts): no load, no memory use."""

    hostname: str
    node_id: str
    session: str
    gpu: GpuInfo
    url: str | None = None
    source: str = "gpusd"
    live: bool = True
    simulated: bool = False
    host_key: str = ""
    # the host proved it holds the fleet secret (see RemoteHost.verified)
    verified: bool | None = None
    # how its host was found (see RemoteHost.via)
    via: str = "mdns"
    # see RemoteHost.copy_of
    copy_of: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.host_key or self.node_id, self.gpu.uuid)

    @property
    def index(self) -> int:
        return self.gpu.index

    @property
    def uuid(self) -> str:
        return self.gpu.uuid

    @property
    def name(self) -> str | None:
        return self.gpu.name

    @property
    def memory_total(self) -> int | None:
        return self.gpu.memory_total

    @property
    def memory_used(self) -> int | None:
        return self.gpu.memory_used

    @property
    def memory_available(self) -> int | None:
        return self.gpu.memory_available  # the model's one rule

    memory_free = memory_available  # its older name

    @property
    def utilization(self) -> float | None:
        return self.gpu.utilization_gpu

    def to_dict(self) -> dict[str, Any]:
        return device_dict(self.hostname, self.node_id, self.session, self.url, self.source, self.live,
                           self.simulated, self.verified, self.via, self.copy_of, self.gpu.to_dict())

    def __str__(self) -> str:
        g = self.gpu
        util = f"{g.utilization_gpu:.0f}%" if g.utilization_gpu is not None else "-"
        mem = (f"{format_bytes(g.memory_used)}/{format_bytes(g.memory_total)}"
               if g.memory_total is not None else "-")
        name = for_terminal(display_name(g.name), 64)
        return f"{for_terminal(self.hostname, 64)}:{g.index} {name} util {util} mem {mem}"


def device_dict(hostname: str, node_id: str, session: str, url: str | None, source: str, live: bool,
                simulated: bool, verified: bool | None, via: str, copy_of: str | None,
                gpu: dict[str, Any]) -> dict[str, Any]:
    """A device as ``Device.to_dict`` (``gpusd list --json``) writes it, ``gpu`` its GPU's ``to_dict``."""
    return {"hostname": hostname, "node_id": node_id, "session": session, "url": url, "source": source, "live": live,
            "simulated": simulated, "verified": verified, "via": via, "copy_of": copy_of, "gpu": gpu}


@dataclass(frozen=True, slots=True)
class SignedIdentity:
    """Who a daemon proved it is: the node id, host name and addresses its signed answer carries
    (:class:`gpusd.wire.signing.Proof`).  The name and addresses a client acts on (ssh targets,
    placements, the ranking's tie-break) and shows for a verified host come from here, never from an
    announcement (docs/security.md, "What a client believes, and from whom")."""

    node_id: str
    hostname: str
    addresses: tuple[str, ...] = ()


@dataclass(slots=True, init=False)
class RemoteHost(HostRecord):
    """A host seen on the LAN: the one host record (:class:`gpusd.wire.fleet.HostRecord`: name, node,
    session, source, URL, snapshot, alive, verified, how it was found) and what a discovery client
    knows besides: the announcement (``txt``), its addresses and port, and what the daemon signed.

    ``hostname`` is the name the daemon signed (``identity``) once it proved itself, else the
    announced one (an unverified host's name is a claim, shown as such); it, ``node_id``,
    ``session`` and ``source`` follow ``txt`` and ``identity`` whenever those are set."""

    # the DNS-SD service name (unique on the LAN)
    key: str = ""
    _txt: TxtRecord | None = None
    addresses: list[str] = field(default_factory=list)
    port: int = 0
    # time.time() when this record was made
    added_at: float = 0.0
    # time.monotonic() of the last sign of life (the liveness bound's clock)
    heard_at: float = 0.0
    # what the daemon signed about itself (set with verified True, and only then)
    _identity: SignedIdentity | None = None
    # an announcement whose daemon proved it is another host: the signed name of the node it names
    # (it is unverified: a copy of that host's announcement under another name)
    copy_of: str | None = None

    def __init__(self, *, key: str, txt: TxtRecord, addresses: list[str] | None = None, port: int = 0,
                 url: str | None = None, snapshot: HostSnapshot | None = None, alive: bool = False,
                 verified: bool | None = None, via: str = "mdns", identity: SignedIdentity | None = None,
                 copy_of: str | None = None) -> None:
        # verified -- True: the daemon proved it holds the fleet secret (a signed answer for our signed
        # request); False: it did not (a stranger, or a daemon of another fleet): its private fields are
        # dropped; None: this client has no fleet secret, so nothing can be checked.  via -- "mdns"
        # (announced on this link), "peer" (--peer, GPUSD_PEERS, a peers file) or "dns-sd" (wide-area
        # DNS-SD, RFC 6763 §11).
        HostRecord.__init__(self, txt.hostname, txt.node_id, snapshot, txt.session, txt.source, url, alive, None,
                            verified, via)
        self.key = key
        self._txt = txt
        self.addresses = list(addresses) if addresses is not None else []
        self.port = port
        self.added_at = time.time()
        self.heard_at = 0.0
        self._identity = None
        self.copy_of = copy_of
        self.identity = identity

    @classmethod
    def from_record(cls, rec: HostRecord, snapshot: HostSnapshot, verified: bool | None = None) -> RemoteHost:
        """The host a daemon's fleet view reports (``rec``, its ``snapshot``): the record as it is (how
        it was found, when it was last heard, alive), its announcement as that daemon heard it (name,
        node, session, GPU count), ``verified`` as this reader may trust it."""
        txt = TxtRecord(node_id=snapshot.node_id, hostname=rec.hostname, session=rec.session or "",
                        count=len(snapshot.gpus), simulated=bool(snapshot.simulated))
        host = cls(key=snapshot.node_id, txt=txt, url=rec.url, snapshot=snapshot, alive=rec.alive,
                   verified=verified, via=rec.via)
        host.last_seen = rec.last_seen
        return host

    @property
    def txt(self) -> TxtRecord:
        assert self._txt is not None
        return self._txt

    @txt.setter
    def txt(self, txt: TxtRecord) -> None:
        self._txt = txt
        self.node_id, self.session, self.source = txt.node_id, txt.session, txt.source
        self.hostname = self._identity.hostname if self._identity is not None else txt.hostname

    @property
    def identity(self) -> SignedIdentity | None:
        return self._identity

    @identity.setter
    def identity(self, identity: SignedIdentity | None) -> None:
        self._identity = identity
        self.hostname = identity.hostname if identity is not None else self.txt.hostname

    def heard(self) -> None:
        """A sign of life now (a snapshot, a heartbeat, an event)."""
        self.heard_at = time.monotonic()
        self.last_seen = round(time.time(), 3)

    @property
    def signed_addresses(self) -> list[str]:
        """The addresses a client may act on (placements, hostfiles): the one this client reached
        the daemon at first (its signature covers that authority), then the others it signed; empty
        for a host that did not prove itself."""
        if self.identity is None:
            return []

        reached = urlsplit(self.url).hostname if self.url else None
        signed = list(self.identity.addresses)
        first = [reached] if reached and (reached in signed or not signed) else []
        return first + [a for a in signed if a not in first]

    @property
    def live(self) -> bool:
        return self.txt.source == "gpusd"

    def gpus(self) -> list[GpuInfo]:
        """Live GPUs for gpusd hosts; for hwsd hosts, GPUs made from the announcement."""
        if self.snapshot is not None:
            return list(self.snapshot.gpus)
        if self.txt.source == "hwsd":
            return [
                GpuInfo(index=i, uuid=f"hwsd-{self.txt.node_id or self.key}-{i}", name=model)
                for i, (model, _) in enumerate(self.txt.inventory)
            ]
        return []

    def devices(self) -> list[Device]:
        simulated = bool(self.snapshot.simulated) if self.snapshot is not None else self.txt.simulated
        return [
            Device(hostname=self.hostname, node_id=self.node_id, session=self.txt.session, gpu=g, url=self.url,
                   source=self.source, live=self.live, simulated=simulated, host_key=self.key, via=self.via,
                   copy_of=self.copy_of)
            for g in self.gpus()
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "hostname": self.hostname,
            "node_id": self.node_id,
            "session": self.session,
            "source": self.source,
            "via": self.via,
            "addresses": list(self.addresses),
            "port": self.port,
            "url": self.url,
            "alive": self.alive,
            "verified": self.verified,
            "copy_of": self.copy_of,
            "signed_addresses": self.signed_addresses,
            "txt": self.txt.to_dict(),
            "snapshot": self.snapshot.to_dict() if self.snapshot is not None else None,
        }

    def __str__(self) -> str:
        return (f"{for_terminal(self.hostname, 64)} ({for_terminal(self.node_id, 64)}, "
                f"session {for_terminal(self.session, 64)}, {self.txt.count} GPU(s))")


@dataclass(frozen=True, slots=True)
class DiscoveryEvent:
    """What a handler registered with ``register_event_handler`` receives.

    ``device`` is set for device events (``previous``: the device before a ``device_updated``);
    ``changed`` names the GpuInfo fields that changed; ``data`` carries threshold details."""

    event: str
    host: RemoteHost
    device: Device | None = None
    previous: Device | None = None
    changed: tuple[str, ...] = ()
    data: dict[str, Any] | None = None
    ts: float = field(default_factory=time.time)

    @property
    def hostname(self) -> str:
        return self.host.hostname

    @property
    def node_id(self) -> str:
        return self.host.node_id

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "event": self.event,
            "ts": self.ts,
            "hostname": self.host.hostname,
            "node_id": self.host.node_id,
            "session": self.host.session,
            "url": self.host.url,
            "source": self.host.source,
            "via": self.host.via,
            "verified": self.host.verified,
            "gpu": self.device.gpu.to_dict() if self.device is not None else None,
        }
        # an unverified copy of that host's announcement
        if self.host.copy_of is not None:
            out["copy_of"] = self.host.copy_of
        if self.changed:
            out["changed"] = list(self.changed)
        if self.data is not None:
            out["data"] = self.data
        return out

    def __str__(self) -> str:
        if self.device is not None:
            extra = f" [{', '.join(self.changed)}]" if self.changed else ""
            line = f"{self.event} {self.device}{extra}"
        else:
            line = f"{self.event} {self.host}"
        if self.event.startswith("threshold_") and self.data:
            line += _rule_words(self.data)
        if self.event == JOB and self.data:
            line = f"job {self.host.hostname}: {_job_words(self.data)}"
        return line


def _job_words(data: dict[str, Any]) -> str:
    """A rebalancing decision in words, from a daemon's ``job`` event (bounded, printable)."""

    def text(v: Any, limit: int = 300) -> str:
        return printable(v, limit) if isinstance(v, str) else ""

    done = "done" if data.get("ok") is True else f"failed: {text(data.get('result'), 200)}"
    return f"{text(data.get('action'), 16)} {text(data.get('job'), 32)}: {text(data.get('reason'))} ({done})"


def _rule_words(data: dict[str, Any]) -> str:
    """`` rule 'busy: utilization>90% for 60s' (value 95)`` from a threshold event's data (sent by a
    daemon: typed, bounded and printable before it reaches a terminal)."""

    def text(v: Any) -> str | None:
        return printable(v, 120) if isinstance(v, str) and v else None

    name, expr = text(data.get("rule")), text(data.get("expr"))
    if name is None and expr is None:
        return ""
    spec = expr if name in (None, expr) else name if expr is None else f"{name}: {expr}"
    value = data.get("value")
    shown = f" (value {value:g})" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
    return f" rule {spec!r}{shown}"


@dataclass(slots=True)
class Filters:
    """Which hosts and GPUs a client reports.  ``session`` None: every session."""

    session: str | None = "default"
    # exact name or glob (``gpu-node-*``)
    hostname: str | None = None
    # case-insensitive substring or glob of the GPU name
    model: str | None = None
    min_free_memory: int | None = None  # bytes

    def host_ok(self, txt: TxtRecord) -> bool:
        if self.session is not None and txt.session != self.session:
            return False
        return self.name_ok(txt.hostname)

    def name_ok(self, hostname: str) -> bool:
        """The host name filter alone."""
        return not self.hostname or fnmatch.fnmatchcase(hostname.lower(), self.hostname.lower())

    def device_ok(self, gpu: GpuInfo) -> bool:
        return self._gpu_ok(gpu.name, lambda: gpu.memory_available)  # the model's one rule

    def gpu_dict_ok(self, gpu: dict[str, Any]) -> bool:
        """:meth:`device_ok` of a GPU as its ``to_dict`` (or :func:`gpusd.model.canonical_gpu`) writes it."""
        return self._gpu_ok(gpu["name"], lambda: gpu_memory_available(gpu))

    def _gpu_ok(self, name: str | None, free: Callable[[], int | None]) -> bool:
        if self.model and not name_matches(name, self.model):
            return False
        if self.min_free_memory is not None:
            left = free()
            if left is None or left < self.min_free_memory:
                return False
        return True
