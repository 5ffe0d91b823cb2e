"""The fleet view as served by ``GET /api/v1/fleet`` (docs/wire-format.md, "Fleet view"): one typed
record per host (:class:`HostRecord`, also the one record of a host seen remotely that discovery,
the views and the pool pass around), validated on the way in, so the daemon, ``gpusd top --url``,
``gpusd export prometheus-sd`` and the dashboard read the same fields the same way.

``HostRecord.from_dict`` validates every field against its type and bounds (the model's codec) and
raises :class:`ValueError` naming the bad field; ``FleetView.from_dict`` skips (and counts) hosts that
fail, so one bad host never hides the good ones.  A host whose snapshot is malformed is kept, without
a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, Callable

from ..errors import WireError
from ..model import MAX_NAME, HostSnapshot, check_schema, decode, encode
from ..sanitize import dumps

# version of this document; a reader refuses other versions
FLEET_SCHEMA = 1
MAX_FLEET_HOSTS = 4096  # hosts in one answer
# bytes of one fleet answer read at most: a host of 8 GPUs takes ~10.6 kB (bench/bench_fleet_scale.py),
# 1,000 of them ~10.6 MB, beyond the 4 MiB of other answers; 64 MiB covers 4,096 hosts of 8 GPUs
MAX_FLEET_BYTES = 64 * 2**20
# characters of a host's URL
MAX_URL = 2048


@dataclass(slots=True)
class HostRecord:
    """A host seen remotely: the one record of it every part passes around.

    It is what ``GET /api/v1/fleet`` serves per host (``to_dict``/``from_dict``, the wire form), what
    ``gpusd top`` shows (:class:`gpusd.views.top.HostView` adds what the screen remembers: alerts,
    sparklines, since when it is gone) and what a discovery client follows
    (:class:`gpusd.discovery.types.RemoteHost` adds what the announcement said and what the daemon
    signed: TXT, addresses, port, the signed identity); the pool ranks and asks those.  Everything
    here is a fact about the host as its reader knows it; the subclasses' extras never go on the
    fleet wire (:meth:`record`)."""

    hostname: str
    node_id: str
    # its last snapshot (None: none yet, or hwsd: none at all)
    snapshot: HostSnapshot | None = None
    session: str | None = None
    # "gpusd" (live snapshot over HTTP) or "hwsd" (announcement only)
    source: str = "gpusd"
    # HTTP API base, .../api/v1
    url: str | None = field(default=None, metadata={"max": MAX_URL})
    # the reader hears from this host (its event stream is up); absent: true
    alive: bool = True
    # seconds since the epoch of the last sign of life; None: never
    last_seen: float | None = None
    # True: the host proved to its reader that it holds the fleet secret (docs/security.md);
    # False: it did not (a stranger, another fleet); None: the reader has no secret to check.
    verified: bool | None = None
    # how its reader found it: "mdns", "peer" (a static peer) or "dns-sd" (wide-area DNS-SD)
    via: str = field(default="mdns", metadata={"max": 16})

    def record(self) -> HostRecord:
        """Just the record (a subclass's extras left out): what the fleet view serves."""
        if type(self) is HostRecord:
            return self
        return HostRecord(**{name: getattr(self, name) for name in RECORD_FIELDS})

    def to_dict(self) -> dict[str, Any]:
        d = encode(self.record())
        # last, as the fleet view has always sent it
        d["snapshot"] = d.pop("snapshot")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostRecord:
        if not isinstance(d, dict):
            raise WireError("a fleet host must be an object")
        snap = d.get("snapshot")
        host = decode(HostRecord, {k: v for k, v in d.items() if k != "snapshot"})
        if snap is not None:
            try:
                host.snapshot = HostSnapshot.from_dict(snap)
            except ValueError:
                # the host is still listed (and still alive or not): no data
                host.snapshot = None
        return host


RECORD_FIELDS = tuple(f.name for f in fields(HostRecord))


def snapshot_bytes(snap: HostSnapshot) -> bytes:
    """A snapshot as the fleet view sends it: compact, strict JSON."""

    return dumps(snap.to_dict(), separators=(",", ":")).encode()


def host_head(h: HostRecord) -> bytes:
    """A host's object as the fleet view sends it, up to its snapshot: ``{"hostname":...,"via":...``."""

    head = encode(HostRecord(**{k: getattr(h, k) for k in RECORD_FIELDS if k != "snapshot"}))
    # last, as to_dict sends it
    del head["snapshot"]
    return dumps(head, separators=(",", ":")).encode()[:-1]


def host_json(h: HostRecord, head: Callable[[HostRecord], bytes] = host_head,
              snapshot: bytes | None = None) -> bytes:
    """A host's whole object as the fleet view sends it: ``head(h)`` and its snapshot (``snapshot``:
    its bytes as :func:`snapshot_bytes` writes them, or a redacted copy; encoded here where None)."""
    if snapshot is None:
        snapshot = b"null" if h.snapshot is None else snapshot_bytes(h.snapshot)
    return head(h) + b',"snapshot":' + snapshot + b"}"


# the fields of a host's head that change as it lives, written at each answer; the others (name, node,
# session, source, URL, how it was found: what its announcement says) are kept encoded by HostHeads
_LIVE_FIELDS = ("alive", "last_seen", "verified")
_STATIC_FIELDS = tuple(k for k in RECORD_FIELDS if k != "snapshot" and k not in _LIVE_FIELDS)
_LIVE_MARK = b',"alive":true,"last_seen":null,"verified":null'


class HostHeads:
    """:func:`host_head` for many hosts, again and again (a fleet view's answers): the fields that change
    only when a host's announcement does are kept encoded, keyed by their values; ``alive``,
    ``last_seen`` and ``verified`` are written at each call.  Gives what :func:`host_head` gives, byte
    for byte.  :meth:`rotate` after each answer keeps only the heads it used."""

    __slots__ = ("_kept", "_static", "_used")

    def __init__(self) -> None:
        self._static = attrgetter(*_STATIC_FIELDS)
        self._kept: dict[Any, tuple[bytes, bytes]] = {}
        self._used: dict[Any, tuple[bytes, bytes]] = {}

    def __call__(self, h: HostRecord) -> bytes:
        alive, seen, verified = h.alive, h.last_seen, h.verified
        if type(alive) is not bool or type(seen) is not float or seen - seen != 0.0 or not (
                verified is None or type(verified) is bool):
            # not the plain case (never seen, a number not finite): the general code
            return host_head(h)
        static = self._static(h)
        parts = self._kept.get(static)
        if parts is None:
            parts = self._encode(h)
        self._used[static] = parts
        return b"".join((parts[0], b',"alive":true,"last_seen":' if alive else b',"alive":false,"last_seen":',
                         repr(seen).encode(), b',"verified":null' if verified is None else
                         b',"verified":true' if verified else b',"verified":false', parts[1]))

    @staticmethod
    def _encode(h: HostRecord) -> tuple[bytes, bytes]:
        """(the head before ``alive``, the head after ``verified``) as :func:`host_head` writes them."""
        fields = {k: getattr(h, k) for k in RECORD_FIELDS if k != "snapshot"}
        fields.update(alive=True, last_seen=None, verified=None)
        whole = host_head(HostRecord(**fields))
        # strings are escaped: the mark is found where the fields are
        start = whole.index(_LIVE_MARK)
        return whole[:start], whole[start + len(_LIVE_MARK):]

    def rotate(self) -> None:
        self._kept, self._used = self._used, {}


@dataclass(slots=True)
class FleetView:
    """A whole ``GET /api/v1/fleet`` answer."""

    session: str | None = None
    hosts: list[HostRecord] = field(default_factory=list, metadata={"max": MAX_FLEET_HOSTS})
    schema: int = FLEET_SCHEMA
    # announcements the daemon ignored: it already follows its cap of hosts
    hosts_dropped: int = 0
    # malformed hosts left out by from_dict (not sent)
    skipped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"schema": self.schema, "session": self.session, "hosts": [h.to_dict() for h in self.hosts],
                "hosts_dropped": self.hosts_dropped}

    def to_json(self, host_json: Callable[[HostRecord], bytes] | None = None) -> bytes:
        """:meth:`to_dict`'s document as compact, strict JSON (no NaN), written here without the dicts of
        every snapshot: each host's object comes from ``host_json`` (the fleet view's, which assembles
        it from the parts it keeps encoded: :class:`HostHeads` and each snapshot's bytes; default
        :func:`host_json`)."""

        one = host_json or globals()["host_json"]
        return b"".join((b'{"schema":', dumps(self.schema).encode(), b',"session":', dumps(self.session).encode(),
                         b',"hosts":[', b",".join([one(h) for h in self.hosts]), b'],"hosts_dropped":',
                         dumps(self.hosts_dropped).encode(), b"}"))

    @classmethod
    def from_dict(cls, d: Any) -> FleetView:
        """Validate an answer: the envelope strictly, the hosts one by one (bad ones skipped)."""
        session, raw, dropped = fleet_envelope(d)
        view = cls(session=session, hosts_dropped=dropped)
        for item in raw:
            try:
                view.hosts.append(HostRecord.from_dict(item))
            except ValueError:
                view.skipped += 1
        return view


def fleet_envelope(d: Any) -> tuple[str | None, list[Any], int]:
    """A fleet answer's envelope, checked (:class:`WireError`): its session, its hosts as received (each
    still to be checked: :meth:`HostRecord.from_dict`) and how many hosts its daemon dropped."""
    # 0.1 daemons send no schema: the same fields
    d = check_schema(d, "a fleet answer", "fleet", FLEET_SCHEMA)
    session = d.get("session")
    if session is not None and (not isinstance(session, str) or len(session) > MAX_NAME):
        raise WireError("field 'session' must be a short string")
    raw = d.get("hosts")
    if not isinstance(raw, list):
        raise WireError("the fleet answer has no 'hosts' list")
    if len(raw) > MAX_FLEET_HOSTS:
        raise WireError(f"the fleet answer has {len(raw)} hosts, more than {MAX_FLEET_HOSTS}")
    dropped = d.get("hosts_dropped", 0)
    if not isinstance(dropped, int) or isinstance(dropped, bool) or not 0 <= dropped < 2**63:
        raise WireError("field 'hosts_dropped' must be a count")
    return session, raw, dropped


__all__ = ["FLEET_SCHEMA", "MAX_FLEET_BYTES", "MAX_FLEET_HOSTS", "RECORD_FIELDS", "FleetView", "HostHeads",
           "fleet_envelope",
           "HostRecord", "host_head", "host_json", "snapshot_bytes"]
