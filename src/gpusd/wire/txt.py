"""The DNS-SD TXT records gpusd announces, and the validated reading of them (docs/wire-format.md).

Two schemas:

* gpusd's own, version 1, on ``_gpusd._tcp.local.``: a compact summary (node id, host, session, GPU
  count, inventory runs, free GPUs).  Live load travels over HTTP, never here.
* the original GPU-SD's (Eyescale hwsd), on ``_gpu-sd._tcp.local.``: announced on request
  (``--gpusd-compat``) and read so that hwsd daemons show up in ``gpusd list``.

Everything read from the network goes through :func:`decode_txt` / :func:`decode_hwsd`, which raise
:class:`TxtError` (a ``ValueError``) naming the problem: the caller logs it and skips the record.
This module imports nothing but the standard library and :mod:`gpusd.model`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Mapping

from ..model import HostSnapshot

SERVICE_TYPE = "_gpusd._tcp.local."
HWSD_TYPE = "_gpu-sd._tcp.local."
HWSD_PORT = 4242
TXT_VERSION = 1
DEFAULT_SESSION = "default"
API_PREFIX = "/api/v1"

MAX_STRING = 255  # RFC 6763 §6.1: one length byte per string
MAX_RECORD = 1300  # RFC 6763 §6.2: a TXT record should fit a single packet
MAX_HWSD_RECORD = 8900  # hwsd records grow ~60 bytes per GPU; the mDNS packet limit bounds them
MAX_GPUS = 256
MAX_MODEL = 48  # characters of a model name kept in the TXT record
FREE_UTIL = 5.0  # a GPU below this utilisation (percent), without processes or leases, is free

_SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:{}-]{0,127}")
_RUN_RE = re.compile(r"(?:(\d{1,3})\*)?([^;]{1,64});(\d{1,9})")
_G_KEY_RE = re.compile(r"g(\d{1,3})")
_HWSD_GPU_KEY_RE = re.compile(r"gpu(\d{1,3}) (type|port|device|flags|x|y|width|height)")


class TxtError(ValueError):
    """A TXT record that is malformed, oversized, of another version, or inconsistent."""


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
    tls_port: int | None = None  # the daemon's HTTPS port (``tls``), when it serves TLS
    cert_fp: str | None = None  # its certificate's SHA-256 fingerprint (``fp``): pinned by clients
    version: int = TXT_VERSION
    source: str = "gpusd"  # "gpusd" or "hwsd"
    # hwsd only: (type, port, device) per GPU
    hwsd_gpus: list[tuple[str, int, int]] = field(default_factory=list)
    gpusd_marker: bool = False  # an hwsd record announced by a gpusd daemon in compat mode

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
    text = "".join(ch for ch in text if ch.isprintable()).strip() or "unknown"
    return text[:MAX_MODEL]


def count_free(snap: HostSnapshot) -> int:
    """GPUs that are healthy, without lease or process, and below 5 % utilisation."""
    n = 0
    for g in snap.gpus:
        if not g.healthy or g.leases or g.processes:
            continue
        if g.utilization_gpu is not None and g.utilization_gpu >= FREE_UTIL:
            continue
        n += 1
    return n


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
        "host": _clip(hostname, MAX_STRING - len("host=")),
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
            kept = {}  # a partial inventory would lie about the count: send none
            break
        kept[f"g{k}"] = run
        budget -= cost
    return {**props, **kept, **tail}


def _clip(text: str, limit: int) -> str:
    data = text.encode()[:limit]
    return data.decode(errors="ignore")


def record_size(props: Mapping[str, str | None]) -> int:
    """Bytes of the TXT RDATA for these properties (one length byte per string)."""
    total = 0
    for k, v in props.items():
        total += 1 + len(k.encode()) + (0 if v is None else 1 + len(v.encode()))
    return total


def encode_hwsd(*, node_id: str, hostname: str, session: str, count: int) -> dict[str, str]:
    """hwsd's keys for our GPUs: type ``CUDA``, port 0 (no X display), device = CUDA index.
    ``GPUSD=1`` marks the record as ours so gpusd clients list the host once, not twice."""
    props = {"Session": session, "NodeID": node_id, "Hostname": hostname[:200], "GPU Count": str(count)}
    for i in range(count):
        props[f"GPU{i} Type"] = "CUDA"
        props[f"GPU{i} Port"] = "0"
        props[f"GPU{i} Device"] = str(i)
    props["GPUSD"] = "1"
    return props


# --------------------------------------------------------------------------------------------
# decoding (the client's side): never trust the network
# --------------------------------------------------------------------------------------------


def parse_txt_bytes(raw: bytes, limit: int = MAX_RECORD) -> dict[str, bytes | None]:
    """Split TXT RDATA into ``{lower-case key: value}`` (RFC 6763 §6: keys are case-insensitive,
    the first of duplicate keys wins, a key without ``=`` is a boolean attribute: value None)."""
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
            continue  # an empty string is allowed (the empty record is a single \x00)
        key_b, eq, value = item.partition(b"=")
        if not key_b:
            raise TxtError("TXT string with an empty key")
        try:
            key = key_b.decode("ascii")
        except UnicodeDecodeError:
            raise TxtError("TXT key is not ASCII") from None
        if not key.isprintable():
            raise TxtError(f"TXT key {key!r} has control characters")
        key = key.lower()
        if key not in out:
            out[key] = value if eq else None
    return out


def _props_from_mapping(props: Mapping[bytes | str, bytes | str | None], limit: int) -> dict[str, bytes | None]:
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
            raise TxtError("TXT key is not ASCII") from None
        out.setdefault(key, vb)
    if size > limit:
        raise TxtError(f"TXT record of {size} bytes exceeds {limit}")
    return out


def _props(raw: bytes | Mapping[bytes | str, bytes | str | None], limit: int) -> dict[str, bytes | None]:
    if isinstance(raw, Mapping):
        return _props_from_mapping(raw, limit)
    return parse_txt_bytes(raw, limit)


def _text(props: dict[str, bytes | None], key: str, *, required: bool = False, strip_nul: bool = False) -> str | None:
    value = props.get(key)
    if value is None:
        if required:
            raise TxtError(f"TXT key {key!r} is missing")
        return None
    if strip_nul:
        value = value.rstrip(b"\x00")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise TxtError(f"TXT value of {key!r} is not UTF-8") from None
    if not text.isprintable():
        raise TxtError(f"TXT value of {key!r} has control characters")
    return text


def _int(props: dict[str, bytes | None], key: str, lo: int, hi: int, *, required: bool = False,
         strip_nul: bool = False) -> int | None:
    text = _text(props, key, required=required, strip_nul=strip_nul)
    if text is None:
        return None
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 9:  # str.isdigit() admits "²", which int() refuses
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


def decode_hwsd(raw: bytes | Mapping[bytes | str, bytes | str | None]) -> TxtRecord:
    """Validate an hwsd ``_gpu-sd._tcp`` TXT record.  Values may end in NUL bytes (hwsd writes
    four-character codes as fixed-size strings): they are stripped."""
    props = _props(raw, MAX_HWSD_RECORD)
    count = _int(props, "gpu count", 0, MAX_GPUS, required=True, strip_nul=True)
    assert count is not None
    node_id = _text(props, "nodeid", strip_nul=True) or ""
    hostname = _text(props, "hostname", strip_nul=True) or ""
    if node_id and not _NODE_RE.fullmatch(node_id):
        raise TxtError(f"bad NodeID {node_id[:40]!r}")
    if len(hostname) > 253:
        raise TxtError("bad Hostname")
    session = _text(props, "session", strip_nul=True) or DEFAULT_SESSION
    if not session or len(session) > 64:
        raise TxtError("bad Session")
    indices = {int(m.group(1)) for k in props if (m := _HWSD_GPU_KEY_RE.fullmatch(k))}
    if any(i >= count for i in indices):
        raise TxtError(f"GPU keys beyond GPU Count={count}")
    gpus: list[tuple[str, int, int]] = []
    for i in range(count):
        kind = _text(props, f"gpu{i} type", strip_nul=True)
        if kind is None:
            raise TxtError(f"GPU Count={count} but no 'GPU{i} Type'")
        kind = kind.strip()
        if not kind or len(kind) > 8:
            raise TxtError(f"bad 'GPU{i} Type'")
        port = _int(props, f"gpu{i} port", 0, 2**32 - 1, strip_nul=True) or 0
        device = _int(props, f"gpu{i} device", 0, 2**32 - 1, strip_nul=True) or 0
        gpus.append((kind, port, device))
    return TxtRecord(
        node_id=node_id,
        hostname=hostname,
        session=session,
        count=count,
        free=None,
        inventory=[(f"{kind} :{port}.{device}", None) for kind, port, device in gpus],
        api="",
        version=0,
        source="hwsd",
        hwsd_gpus=gpus,
        gpusd_marker="gpusd" in props,
    )


def instance_name(hostname: str, node_id: str) -> str:
    """``<hostname>-<node id first 8>``: DNS-SD instance label (≤ 63 bytes, no dots)."""
    base = re.sub(r"[^A-Za-z0-9-]", "-", hostname.split(".")[0]) or "gpusd"
    suffix = "-" + re.sub(r"[^A-Za-z0-9]", "", node_id)[:8]
    return base[: 63 - len(suffix)] + suffix
