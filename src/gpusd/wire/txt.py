"""The DNS-SD TXT records gpusd announces, and the validated reading of them (docs/wire-format.md).

Two schemas:

* gpusd's own, version 1, on ``_gpusd._tcp.local.``: a compact summary (node id, host, session, GPU
  count, inventory runs, free GPUs).  Live load travels over HTTP, never here.
* the original GPU-SD's (Eyescale hwsd), on ``_gpu-sd._tcp.local.`` and ``_net-sd._tcp.local.``:
  announced on request (``--gpusd-compat``, what Equalizer needs), and read so that hwsd daemons
  show up in ``gpusd list`` -- as leniently as hwsd reads them, within our bounds.

Everything read from the network goes through :func:`decode_txt` / :func:`decode_hwsd` /
:func:`decode_hwsd_net`, which raise :class:`TxtError` (a ``ValueError``) naming the problem: the
caller logs it and skips the record.
This module imports nothing but the standard library and :mod:`gpusd.model`.
"""

# Imports inside functions: start-up (gpusd list imports this module).
from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Mapping

# re-exported: defined in gpusd.errors
from ..errors import TxtError as TxtError
from ..model import HostSnapshot
from ..sanitize import printable

SERVICE_TYPE = "_gpusd._tcp.local."
HWSD_TYPE = "_gpu-sd._tcp.local."
HWSD_PORT = 4242
TXT_VERSION = 1
DEFAULT_SESSION = "default"
API_PREFIX = "/api/v1"

# RFC 6763 §6.1: one length byte per string
MAX_STRING = 255
# RFC 6763 §6.2: a TXT record should fit a single packet
MAX_RECORD = 1300
# hwsd records grow ~60 bytes per GPU; the mDNS packet limit bounds them
MAX_HWSD_RECORD = 8900
MAX_GPUS = 256
# characters of a model name kept in the TXT record
MAX_MODEL = 48

_SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:{}-]{0,127}")
_RUN_RE = re.compile(r"(?:(\d{1,3})\*)?([^;]{1,64});(\d{1,9})")
_G_KEY_RE = re.compile(r"g(\d{1,3})")


def valid_session(name: str) -> bool:
    return bool(_SESSION_RE.fullmatch(name))


@dataclass(slots=True)
class TxtRecord:
    """What one announcement says about a host (either schema)."""

    node_id: str
    hostname: str
    session: str
    count: int
    free: int | None = None
    # one (model, memory in MiB) per GPU in index order; empty when the record carries no inventory
    inventory: list[tuple[str, int | None]] = field(default_factory=list)
    api: str = API_PREFIX
    gpusd_version: str | None = None
    simulated: bool = False
    auth: bool = False
    # the daemon's HTTPS port (``tls``), when it serves TLS
    tls_port: int | None = None
    # its certificate's SHA-256 fingerprint (``fp``): pinned by clients
    cert_fp: str | None = None
    version: int = TXT_VERSION
    source: str = "gpusd"  # "gpusd" or "hwsd"
    # hwsd only: (type, port, device) per GPU listed; port/device HWSD_NO_VALUE when not announced
    hwsd_gpus: list[tuple[str, int, int]] = field(default_factory=list)
    # an hwsd record announced by a gpusd daemon in compat mode
    gpusd_marker: bool = False

    def to_dict(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "hostname": self.hostname,
            "session": self.session,
            "count": self.count,
            "free": self.free,
            "inventory": [{"model": m, "memory_mib": mib} for m, mib in self.inventory],
            "api": self.api,
            "gpusd_version": self.gpusd_version,
            "simulated": self.simulated,
            "auth": self.auth,
            "tls_port": self.tls_port,
            "cert_fp": self.cert_fp,
            "version": self.version,
            "source": self.source,
        }


# --------------------------------------------------------------------------------------------
# encoding (the daemon's side)
# --------------------------------------------------------------------------------------------


def short_model(name: str | None) -> str:
    """``NVIDIA A100-SXM4-80GB`` -> ``A100-SXM4-80GB``; no ``;`` or ``*``; at most 48 characters."""
    text = (name or "unknown").strip()
    if text.startswith("NVIDIA "):
        text = text[7:]
    text = text.replace(";", " ").replace("*", " ").replace("=", " ")
    text = printable(text, replace="").strip() or "unknown"
    return text[:MAX_MODEL]


def count_free(snap: HostSnapshot) -> int:
    """The free GPUs, by the model's one rule (:attr:`gpusd.model.GpuInfo.is_free`)."""
    return sum(1 for g in snap.gpus if g.is_free)


def inventory_of(snap: HostSnapshot) -> list[tuple[str, int | None]]:
    return [
        (short_model(g.name), g.memory_total // 2**20 if g.memory_total is not None else None)
        for g in snap.gpus
    ]


def _runs(inventory: list[tuple[str, int | None]]) -> list[str]:
    """Runs of identical GPUs: ``8*A100-SXM4-80GB;81920`` (the count is left out when 1)."""
    out: list[str] = []
    for (model, mib), run in groupby(inventory):
        count = len(list(run))
        prefix = f"{count}*" if count > 1 else ""
        out.append(f"{prefix}{model};{mib if mib is not None else 0}")
    return out


def encode_txt(
    *,
    node_id: str,
    hostname: str,
    session: str,
    inventory: list[tuple[str, int | None]],
    free: int,
    api: str = API_PREFIX,
    gpusd_version: str | None = None,
    simulated: bool = False,
    auth: bool = False,
    tls_port: int | None = None,
    cert_fp: str | None = None,
) -> dict[str, str]:
    """The TXT properties, in a stable order.  Guaranteed: every string ≤ 255 bytes and the record
    ≤ 1300 bytes (inventory runs are dropped, last first, when they would not fit)."""
    props: dict[str, str] = {
        "v": str(TXT_VERSION),
        "id": node_id[:64],
        "host": announced_host(hostname),
        "session": session,
        "n": str(len(inventory)),
        "free": str(free),
    }
    tail: dict[str, str] = {"api": api}
    if gpusd_version:
        tail["ver"] = gpusd_version[:32]
    if simulated:
        tail["sim"] = "1"
    if auth:
        tail["auth"] = "1"
    if tls_port and cert_fp:
        tail["tls"] = str(tls_port)
        tail["fp"] = cert_fp
    runs = _runs(inventory)
    budget = MAX_RECORD - record_size({**props, **tail})
    kept: dict[str, str] = {}
    for k, run in enumerate(runs):
        cost = 1 + len(f"g{k}={run}".encode())
        if cost > budget:
            # a partial inventory would lie about the count: send none
            kept = {}
            break
        kept[f"g{k}"] = run
        budget -= cost
    return {**props, **kept, **tail}


def announced_host(hostname: str) -> str:
    """The ``host`` value a TXT record carries for ``hostname`` (clipped to fit a TXT string): what a
    client compares with the name a daemon signs (docs/security.md)."""
    return _clip(hostname, MAX_STRING - len("host="))


def _clip(text: str, limit: int) -> str:
    data = text.encode()[:limit]
    return data.decode(errors="ignore")


def record_size(props: Mapping[str, str | None]) -> int:
    """Bytes of the TXT RDATA for these properties (one length byte per string)."""
    total = 0
    for k, v in props.items():
        total += 1 + len(k.encode()) + (0 if v is None else 1 + len(v.encode()))
    return total


HWSD_NET_TYPE = "_net-sd._tcp.local."
# what Equalizer opens on a Linux GPU: an X screen
HWSD_WINDOW_SYSTEM = "GLX"
MAX_HWSD_NETS = 32
# hwsd's NetInfo::setType names
HWSD_NET_TYPES = ("ETHERNET", "INFINIBAND", "LOOPBACK", "UNKNOWN")


def hwsd_node_id(node_id: str) -> str:
    """Our node id as hwsd writes a ``lunchbox::uint128_t``: hex, ``high:low`` beyond 64 bits."""
    return node_id if len(node_id) <= 16 else f"{node_id[:16]}:{node_id[16:32]}"


def encode_hwsd(*, node_id: str, hostname: str, session: str, count: int, display: int = 0) -> dict[str, str]:
    """hwsd's ``_gpu-sd._tcp`` keys for our GPUs, as hwsd's daemon writes them (hwsd/gpu/dns_sd):
    type ``GLX`` (the window system Equalizer will open), port = X display number ``display``,
    device = X screen = the GPU's NVML index (one screen per GPU in PCI order, as
    ``nvidia-xconfig --enable-all-gpus`` makes them).  ``GPUSD=1`` marks the record as ours so
    gpusd clients list the host once, through ``_gpusd._tcp``."""
    props = {"NodeID": hwsd_node_id(node_id), "Hostname": _clip(hostname, MAX_STRING - len("Hostname=")),
             "Session": session, "GPU Count": str(count)}
    for i in range(count):
        props[f"GPU{i} Type"] = HWSD_WINDOW_SYSTEM
        props[f"GPU{i} Port"] = str(display)
        props[f"GPU{i} Device"] = str(i)
    props["GPUSD"] = "1"
    return props


@dataclass(slots=True, frozen=True)
class HwsdNet:
    """One network interface as hwsd's ``_net-sd._tcp`` record describes it (hwsd/netInfo.h)."""

    name: str
    ipv4: str
    # one of HWSD_NET_TYPES
    type: str = "ETHERNET"
    mac: str | None = None  # aa:bb:cc:dd:ee:ff
    up: bool = True
    linkspeed: int | None = None  # Mbit/s


def encode_hwsd_net(*, node_id: str, hostname: str, session: str, nets: list[HwsdNet]) -> dict[str, str]:
    """hwsd's ``_net-sd._tcp`` keys (hwsd/net/dns_sd): Equalizer uses a host's GPUs only when a
    record with the same ``NodeID`` lists an interface that is up and not loopback, whose ``IPv4``
    it then connects to.  At most 32 interfaces."""
    nets = nets[:MAX_HWSD_NETS]
    props = {"NodeID": hwsd_node_id(node_id), "Hostname": _clip(hostname, MAX_STRING - len("Hostname=")),
             "Session": session, "Net Count": str(len(nets))}
    for k, net in enumerate(nets):
        props[f"Net{k} Type"] = net.type if net.type in HWSD_NET_TYPES else "UNKNOWN"
        props[f"Net{k} Name"] = _clip(net.name, 64)
        if net.mac:
            props[f"Net{k} MAC"] = _clip(net.mac, 64)
        props[f"Net{k} IPv4"] = net.ipv4
        if net.linkspeed is not None:
            props[f"Net{k} Linkspeed"] = str(net.linkspeed)
        # hwsd writes a bool with <<: 1 or 0
        props[f"Net{k} Up"] = "1" if net.up else "0"
    props["GPUSD"] = "1"
    return props


# --------------------------------------------------------------------------------------------
# decoding (the client's side): never trust the network
# --------------------------------------------------------------------------------------------


def parse_txt_bytes(raw: bytes, limit: int = MAX_RECORD, *, lenient: bool = False) -> dict[str, bytes | None]:
    """Split TXT RDATA into ``{lower-case key: value}`` (RFC 6763 §6: keys are case-insensitive,
    the first of duplicate keys wins, a key without ``=`` is a boolean attribute: value None).
    ``lenient``: skip a string with an empty, non-ASCII or unprintable key instead of refusing the
    record (RFC 6763 §6.4 says to silently ignore a string without a key; hwsd ignores them all)."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TxtError("TXT data is not bytes")
    raw = bytes(raw)
    if len(raw) > limit:
        raise TxtError(f"TXT record of {len(raw)} bytes exceeds {limit}")
    out: dict[str, bytes | None] = {}
    i = 0
    while i < len(raw):
        n = raw[i]
        i += 1
        if i + n > len(raw):
            raise TxtError("TXT string runs past the end of the record")
        item = raw[i : i + n]
        i += n
        if not item:
            # an empty string is allowed (the empty record is a single \x00)
            continue
        key_b, eq, value = item.partition(b"=")
        try:
            if not key_b:
                raise TxtError("TXT string with an empty key")
            try:
                key = key_b.decode("ascii")
            except UnicodeDecodeError:
                raise TxtError("TXT key is not ASCII") from None
            if not key.isprintable():
                raise TxtError(f"TXT key {key!r} has control characters")
        except TxtError:
            if lenient:
                continue
            raise
        key = key.lower()
        if key not in out:
            out[key] = value if eq else None
    return out


def _props_from_mapping(props: Mapping[bytes | str, bytes | str | None], limit: int,
                        lenient: bool = False) -> dict[str, bytes | None]:
    """The same, from python-zeroconf's ``ServiceInfo.properties`` (already split)."""
    out: dict[str, bytes | None] = {}
    size = 0
    for k, v in props.items():
        kb = k.encode() if isinstance(k, str) else bytes(k)
        vb = v.encode() if isinstance(v, str) else (None if v is None else bytes(v))
        length = len(kb) + (0 if vb is None else 1 + len(vb))
        if length > MAX_STRING:
            raise TxtError(f"TXT string for key {kb[:20]!r} is {length} bytes (limit {MAX_STRING})")
        size += 1 + length
        try:
            key = kb.decode("ascii").lower()
        except UnicodeDecodeError:
            if lenient:
                continue
            raise TxtError("TXT key is not ASCII") from None
        out.setdefault(key, vb)
    if size > limit:
        raise TxtError(f"TXT record of {size} bytes exceeds {limit}")
    return out


def _props(raw: bytes | Mapping[bytes | str, bytes | str | None], limit: int,
           lenient: bool = False) -> dict[str, bytes | None]:
    if isinstance(raw, Mapping):
        return _props_from_mapping(raw, limit, lenient)
    return parse_txt_bytes(raw, limit, lenient=lenient)


def _text(props: dict[str, bytes | None], key: str, *, required: bool = False) -> str | None:
    value = props.get(key)
    if value is None:
        if required:
            raise TxtError(f"TXT key {key!r} is missing")
        return None
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise TxtError(f"TXT value of {key!r} is not UTF-8") from None
    if not text.isprintable():
        raise TxtError(f"TXT value of {key!r} has control characters")
    return text


def _int(props: dict[str, bytes | None], key: str, lo: int, hi: int, *, required: bool = False) -> int | None:
    text = _text(props, key, required=required)
    if text is None:
        return None
    text = text.strip()
    # str.isdigit() admits "²", which int() refuses
    if not (text.isascii() and text.isdigit()) or len(text) > 9:
        raise TxtError(f"TXT value of {key!r} is not a number: {text[:20]!r}")
    value = int(text)
    if not lo <= value <= hi:
        raise TxtError(f"TXT value of {key!r} out of range: {value}")
    return value


def decode_txt(raw: bytes | Mapping[bytes | str, bytes | str | None]) -> TxtRecord:
    """Validate a ``_gpusd._tcp`` TXT record (raw RDATA bytes or a property mapping)."""
    props = _props(raw, MAX_RECORD)
    version_text = _text(props, "v", required=True)
    if version_text != str(TXT_VERSION):
        raise TxtError(f"TXT schema version {version_text[:10]!r} is not supported (this gpusd reads {TXT_VERSION})"
                       if version_text is not None else "no TXT version")
    node_id = _text(props, "id", required=True) or ""
    if not _NODE_RE.fullmatch(node_id):
        raise TxtError(f"bad node id {node_id[:40]!r}")
    host = _text(props, "host", required=True) or ""
    if not host or len(host) > 253:
        raise TxtError("bad host name")
    session = _text(props, "session") or DEFAULT_SESSION
    if not valid_session(session):
        raise TxtError(f"bad session name {session[:40]!r}")
    count = _int(props, "n", 0, MAX_GPUS, required=True)
    assert count is not None
    free = _int(props, "free", 0, MAX_GPUS)
    if free is not None and free > count:
        raise TxtError(f"{free} free GPUs but only {count} GPUs")
    inventory = _decode_runs(props, count)
    api = _text(props, "api") or API_PREFIX
    if not api.startswith("/") or len(api) > 64 or any(c in api for c in " ?#"):
        raise TxtError(f"bad API path {api[:40]!r}")
    return TxtRecord(
        node_id=node_id,
        hostname=host,
        session=session,
        count=count,
        free=free,
        inventory=inventory,
        api=api.rstrip("/") or API_PREFIX,
        gpusd_version=_text(props, "ver"),
        simulated="sim" in props and props["sim"] != b"0",
        auth="auth" in props and props["auth"] != b"0",
        **_decode_tls(props),
    )


def _decode_tls(props: dict[str, bytes | None]) -> dict[str, Any]:
    """``tls`` and ``fp``: both valid, or neither (a half or garbled pair is ignored: no TLS)."""
    port = _text(props, "tls")
    fp = _text(props, "fp")
    if not port or not fp or not port.isdigit() or not 0 < int(port) < 65536:
        return {}
    from .signing import fingerprint_bytes

    if fingerprint_bytes(fp) is None:
        return {}
    return {"tls_port": int(port), "cert_fp": fp}


def _decode_runs(props: dict[str, bytes | None], count: int) -> list[tuple[str, int | None]]:
    keys = sorted(int(m.group(1)) for k in props if (m := _G_KEY_RE.fullmatch(k)))
    if not keys:
        return []
    if keys != list(range(len(keys))):
        raise TxtError("inventory keys g0, g1, ... are not contiguous")
    inventory: list[tuple[str, int | None]] = []
    for k in keys:
        text = _text(props, f"g{k}") or ""
        m = _RUN_RE.fullmatch(text)
        if not m:
            raise TxtError(f"bad inventory entry g{k}={text[:40]!r}")
        n = int(m.group(1) or 1)
        if n < 1 or len(inventory) + n > count:
            raise TxtError(f"inventory lists more GPUs than n={count}")
        mib = int(m.group(3))
        inventory.extend([(m.group(2), mib or None)] * n)
    if len(inventory) != count:
        raise TxtError(f"inventory lists {len(inventory)} GPUs but n={count}")
    return inventory


# hwsd reads every value with ``std::istringstream >> value`` (hwsd/detail/dns_sd_module.h): a
# number is an optional sign and leading digits after white space, trailing text is ignored, no
# digits give 0 and an overflow gives UINT_MAX (C++11 num_get); a string is its first word.  hwsd
# skips a GPU without a (non-empty) ``GPU<i> Type`` and reads a missing ``GPU Count`` as 0.
UINT_MAX = 2**32 - 1
# hwsd's GPUInfo::defaultValue: port/device not announced
HWSD_NO_VALUE = UINT_MAX
# keys as hwsd writes them: GPU<k>, k decimal
_HWSD_TYPE_KEY_RE = re.compile(r"gpu(0|[1-9][0-9]{0,9}) type")
_CXX_SPACE = b" \t\n\v\f\r"


def hwsd_uint(value: bytes) -> int:
    """``value`` read the way hwsd reads an ``unsigned`` (libstdc++ ``istream >> unsigned``)."""
    text = value.lstrip(_CXX_SPACE)
    negative = text[:1] == b"-"
    if text[:1] in (b"+", b"-"):
        text = text[1:]
    digits = re.match(rb"0*[0-9]{0,11}", text)
    run = digits.group(0) if digits else b""
    if not run:
        return 0
    run = run.lstrip(b"0") or b"0"
    # more than 10 significant digits is always an overflow
    if len(run) > 10 or int(run) > UINT_MAX:
        return UINT_MAX
    number = int(run)
    # unsigned arithmetic: -1 reads as UINT_MAX
    return (-number) % 2**32 if negative else number


def hwsd_word(value: bytes, limit: int = 64) -> str:
    """The first word of ``value`` (hwsd reads strings with ``>>``), NUL-terminated as hwsd's
    four-character codes are, made printable (``?`` for anything else) and at most ``limit`` long."""
    words = value.split(None, 1)
    word = words[0].split(b"\x00", 1)[0] if words else b""
    text = word[: limit * 4].decode("utf-8", errors="replace")
    return printable(text, limit)


def decode_hwsd(raw: bytes | Mapping[bytes | str, bytes | str | None]) -> TxtRecord:
    """Read an hwsd ``_gpu-sd._tcp`` TXT record as leniently as hwsd itself: a missing or garbled
    ``GPU Count`` is 0 GPUs, a GPU without ``Type`` is skipped, numbers are read like C++ streams
    do (up to ``UINT_MAX``), strings are their first word.  What stays refused: a record that is not
    TXT data, one over 8900 bytes, a string over 255 bytes, and more than 256 GPUs."""
    props = _props(raw, MAX_HWSD_RECORD, lenient=True)

    def value(key: str) -> bytes | None:
        v = props.get(key)
        # hwsd: an empty value is no value
        return v if v else None

    count_raw = value("gpu count")
    count = hwsd_uint(count_raw) if count_raw is not None else 0
    indices = sorted(int(m.group(1)) for k in props if (m := _HWSD_TYPE_KEY_RE.fullmatch(k)))
    gpus: list[tuple[str, int, int]] = []
    for i in indices:
        if i >= count:
            # hwsd reads GPU0 .. GPU<count - 1> only
            continue
        type_raw = value(f"gpu{i} type")
        kind = hwsd_word(type_raw, 4) if type_raw is not None else ""
        if not kind:
            # hwsd skips it (an all-blank Type would make a nameless GPU there)
            continue
        if len(gpus) == MAX_GPUS:
            raise TxtError(f"more than {MAX_GPUS} GPUs")
        port_raw, device_raw = value(f"gpu{i} port"), value(f"gpu{i} device")
        gpus.append((kind, hwsd_uint(port_raw) if port_raw is not None else HWSD_NO_VALUE,
                     hwsd_uint(device_raw) if device_raw is not None else HWSD_NO_VALUE))
    node_raw, host_raw, session_raw = value("nodeid"), value("hostname"), value("session")
    node_id = hwsd_word(node_raw, 128) if node_raw is not None else ""
    if not _NODE_RE.fullmatch(node_id):
        # hwsd would hash something out of it; the client names the host by its instance
        node_id = ""
    hostname = hwsd_word(host_raw, 253) if host_raw is not None else ""
    session = (hwsd_word(session_raw) if session_raw is not None else "") or DEFAULT_SESSION
    return TxtRecord(
        node_id=node_id,
        hostname=hostname,
        session=session,
        count=len(gpus),
        free=None,
        inventory=[(hwsd_display(kind, port, device), None) for kind, port, device in gpus],
        api="",
        version=0,
        source="hwsd",
        hwsd_gpus=gpus,
        gpusd_marker="gpusd" in props,
    )


def hwsd_display(kind: str, port: int, device: int) -> str:
    """How a GPU of an hwsd record is shown: ``GLX :0.1`` (type, X display, screen); a port or
    device that was not announced is left out."""
    text = kind
    if port != HWSD_NO_VALUE:
        text += f" :{port}"
        if device != HWSD_NO_VALUE:
            text += f".{device}"
    elif device != HWSD_NO_VALUE:
        text += f" device {device}"
    return text


@dataclass(slots=True)
class HwsdNetRecord:
    """What an hwsd ``_net-sd._tcp`` record says (read as hwsd/net/dns_sd reads it)."""

    node_id: str
    hostname: str
    session: str
    nets: list[HwsdNet]
    gpusd_marker: bool = False


def decode_hwsd_net(raw: bytes | Mapping[bytes | str, bytes | str | None]) -> HwsdNetRecord:
    """Read an hwsd ``_net-sd._tcp`` TXT record with hwsd's rules (see :func:`decode_hwsd`):
    ``Net Count`` missing is 0, every field of an interface is optional, ``Up`` is a C++ bool
    (a number, non-zero is true), an unknown ``Type`` is ``UNKNOWN``.  At most 32 interfaces."""
    props = _props(raw, MAX_HWSD_RECORD, lenient=True)

    def value(key: str) -> bytes | None:
        v = props.get(key)
        return v if v else None

    count_raw = value("net count")
    count = min(hwsd_uint(count_raw) if count_raw is not None else 0, MAX_HWSD_NETS)
    nets: list[HwsdNet] = []
    for k in range(count):
        fields = {f: value(f"net{k} {f}") for f in ("type", "name", "mac", "ipv4", "linkspeed", "up")}
        kind = hwsd_word(fields["type"] or b"", 16)
        speed = fields["linkspeed"]
        nets.append(HwsdNet(
            name=hwsd_word(fields["name"] or b""),
            ipv4=hwsd_word(fields["ipv4"] or b""),
            type=kind if kind in HWSD_NET_TYPES else "UNKNOWN",
            mac=hwsd_word(fields["mac"]) if fields["mac"] else None,
            up=fields["up"] is not None and hwsd_uint(fields["up"]) != 0,
            linkspeed=hwsd_uint(speed) if speed is not None else None,
        ))
    node_raw, host_raw, session_raw = value("nodeid"), value("hostname"), value("session")
    node_id = hwsd_word(node_raw, 128) if node_raw is not None else ""
    return HwsdNetRecord(
        node_id=node_id if _NODE_RE.fullmatch(node_id) else "",
        hostname=hwsd_word(host_raw, 253) if host_raw is not None else "",
        session=(hwsd_word(session_raw) if session_raw is not None else "") or DEFAULT_SESSION,
        nets=nets,
        gpusd_marker="gpusd" in props,
    )


def instance_name(hostname: str, node_id: str) -> str:
    """``<hostname>-<node id first 8>``: DNS-SD instance label (≤ 63 bytes, no dots)."""
    base = re.sub(r"[^A-Za-z0-9-]", "-", hostname.split(".")[0]) or "gpusd"
    suffix = "-" + re.sub(r"[^A-Za-z0-9]", "", node_id)[:8]
    return base[: 63 - len(suffix)] + suffix
