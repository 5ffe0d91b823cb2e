"""Hosts beyond the mDNS link: static peers and wide-area DNS-SD (docs/daemon.md, "Beyond one link").

mDNS stops at a router.  Two more sources feed the same host-following path of
:class:`~gpusd.discovery.client.AsyncClient` (event stream, signed requests, ``verified``):

* **Static peers** (``--peer host[:port]``, ``$GPUSD_PEERS``, ``--peers-file``): a host name or an IPv4
  address and the daemon's HTTP port (default 4780).  What an announcement would say (node id, host
  name, session, TLS port and certificate fingerprint) is read from the daemon's public
  ``GET /healthz`` and ``GET /api/v1/host`` and passed through the same validated TXT codec
  (:func:`gpusd.wire.txt.decode_txt`); trust comes only from the signed event stream, as for mDNS.
* **Wide-area DNS-SD** (RFC 6763 §11): ``PTR _gpusd._tcp.<domain>`` lists service instances, each
  with an ``SRV`` (target host, port), a ``TXT`` (the same schema as on mDNS) and the target's ``A``
  records, in an ordinary unicast DNS zone, read with dnspython.

Everything here is bounded: at most :data:`MAX_PEERS` peers and :data:`MAX_DNS_SD` instances, names
and ports validated, every query under a timeout.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..wire.txt import SERVICE_TYPE, TxtError, TxtRecord, count_free, decode_txt, encode_txt, inventory_of

if TYPE_CHECKING:  # pragma: no cover
    import aiohttp

log = logging.getLogger(__name__)

# the daemon's default HTTP port (daemon.config.DEFAULT_PORT)
DEFAULT_PORT = 4780
# static peers at most (more are refused with a clear error)
MAX_PEERS = 256
# wide-area DNS-SD instances followed at most per domain (as many as a client follows)
MAX_DNS_SD = 1024
# bytes of a peers file read at most
MAX_PEERS_FILE = 64 * 1024
# seconds between wide-area DNS-SD queries (at most; a shorter TTL re-queries sooner)
DNS_SD_INTERVAL = 30.0
# ... but never more often than this
DNS_SD_MIN_INTERVAL = 5.0
# seconds one DNS lookup may take
DNS_TIMEOUT = 3.0
# wide-area DNS-SD instances looked up at once
DNS_CONCURRENCY = 16
# seconds between checks of the peers file for changes
PEERS_FILE_CHECK = 5.0
# seconds for a peer's /healthz and /api/v1/host
FETCH_TIMEOUT = 3.0
# bytes of /api/v1/host read at most
MAX_FETCH = 256 * 1024
SERVICE = SERVICE_TYPE.removesuffix("local.")  # "_gpusd._tcp."

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


@dataclass(frozen=True)
class PeerSpec:
    """One static peer: a host name or an IPv4 address, and a port."""

    host: str
    port: int = DEFAULT_PORT

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def valid_hostname(name: str) -> bool:
    """A DNS host name (RFC 1123 labels, at most 253 characters; a trailing dot allowed)."""
    name = name[:-1] if name.endswith(".") else name
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))


def parse_peer(spec: str) -> PeerSpec:
    """``host``, ``host:port``, ``198.18.2.2:4780`` -> :class:`PeerSpec`; :class:`ConfigError` when bad."""
    text = spec.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = text, ""
    if ":" in host or host.startswith("["):
        raise ConfigError(f"peer {spec[:80]!r}: IPv6 peers are not supported (use a host name or an IPv4 address)")
    port = DEFAULT_PORT
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ConfigError(f"peer {spec[:80]!r}: bad port {port_text[:10]!r} (1-65535)")
        port = int(port_text)
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        if not valid_hostname(host) or host.replace(".", "").isdigit():
            raise ConfigError(f"peer {spec[:80]!r}: not a host name or an IPv4 address") from None
        return PeerSpec(host.rstrip(".").lower(), port)
    if addr.is_unspecified or addr.is_multicast:
        raise ConfigError(f"peer {spec[:80]!r}: {addr} cannot be a peer")
    return PeerSpec(str(addr), port)


def parse_peers(specs: list[str] | tuple[str, ...]) -> list[PeerSpec]:
    """Validate and de-duplicate peers (order kept); at most :data:`MAX_PEERS`."""
    out: list[PeerSpec] = []
    for spec in specs:
        p = parse_peer(spec)
        if p not in out:
            out.append(p)
    if len(out) > MAX_PEERS:
        raise ConfigError(f"{len(out)} peers: at most {MAX_PEERS}")
    return out


def peers_from_env(env: dict[str, str] | None = None) -> list[str]:
    """``$GPUSD_PEERS``: comma-separated ``host[:port]``."""
    raw = (env if env is not None else os.environ).get("GPUSD_PEERS", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def read_peers_file(path: str | Path) -> list[str]:
    """A peers file: one ``host[:port]`` per line; blank lines and ``#`` comments ignored.  A missing
    file is an empty list; an unreadable one raises :class:`ConfigError`."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEERS_FILE + 1)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigError(f"cannot read the peers file {str(path)[:200]}: {exc.strerror}") from None
    if len(data) > MAX_PEERS_FILE:
        raise ConfigError(f"the peers file {str(path)[:200]} is larger than {MAX_PEERS_FILE} bytes")
    out = []
    for line in data.decode(errors="replace").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def file_stamp(path: str | Path) -> tuple[int, int, int] | None:
    """What tells that the peers file changed (inode, size, mtime), or None when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def valid_domain(domain: str) -> str:
    """A wide-area DNS-SD browsing domain (``lab.example``), normalised with a trailing dot."""
    d = domain.strip().rstrip(".").lower()
    if not valid_hostname(d):
        raise ConfigError(f"bad DNS-SD domain {domain[:80]!r}")
    if d == "local" or d.endswith(".local"):
        raise ConfigError(f"{domain[:80]!r} is the mDNS domain: wide-area DNS-SD needs a unicast DNS domain")
    return d + "."


def valid_dns_server(server: str) -> str:
    try:
        return str(ipaddress.ip_address(server.strip()))
    except ValueError:
        raise ConfigError(f"--dns-server {server[:80]!r}: not an IP address") from None


# -- static peers ------------------------------------------------------------------------------------
async def addresses_of(host: str) -> list[str]:
    """IPv4 addresses of a peer (an address literal, or a name through the system resolver)."""
    try:
        ipaddress.IPv4Address(host)
        return [host]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(loop.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM),
                                   DNS_TIMEOUT)
    out: list[str] = []
    for info in infos:
        addr = str(info[4][0])
        if addr not in out:
            out.append(addr)
    return out[:16]


async def _get_json(http: "aiohttp.ClientSession", url: str) -> Any:
    async with http.get(url, timeout=_timeout(), allow_redirects=False) as resp:
        if resp.status != 200:
            raise ValueError(f"{url} answered {resp.status}")
        body = b""
        while chunk := await resp.content.read(MAX_FETCH + 1 - len(body)):
            body += chunk
            if len(body) > MAX_FETCH:
                raise ValueError(f"{url}: answer larger than {MAX_FETCH} bytes")
        return json.loads(body)


def _timeout() -> Any:
    import aiohttp

    return aiohttp.ClientTimeout(total=FETCH_TIMEOUT)


async def peer_txt(http: "aiohttp.ClientSession", address: str, port: int) -> TxtRecord:
    """What a static peer would announce, from its public ``/healthz`` and ``/api/v1/host``, decoded
    by the same validated codec as an mDNS TXT record.  Raises ValueError (or a network error)."""
    base = f"http://{address}:{port}"
    health = await _get_json(http, base + "/healthz")
    info = await _get_json(http, base + "/api/v1/host")
    if not isinstance(health, dict) or not isinstance(info, dict):
        raise ValueError("not a gpusd daemon")
    snap = info.get("snapshot")
    gpus = snap.get("gpus") if isinstance(snap, dict) else None
    props: dict[bytes | str, bytes | str | None] = {"v": "1"}
    for key, value in (("id", info.get("node_id")), ("host", info.get("hostname")),
                       ("session", info.get("session")), ("ver", info.get("gpusd_version"))):
        if isinstance(value, str):
            props[key] = value
    props["n"] = str(len(gpus)) if isinstance(gpus, list) else "0"
    if isinstance(health.get("tls_port"), int) and isinstance(health.get("cert_fp"), str):
        props["tls"], props["fp"] = str(health["tls_port"]), health["cert_fp"]
    if health.get("node_id") != props.get("id"):
        raise ValueError("/healthz and /api/v1/host name different nodes")
    try:
        return decode_txt(props)
    except TxtError as exc:
        raise ValueError(str(exc)) from None


# -- wide-area DNS-SD --------------------------------------------------------------------------------
@dataclass
class DnsSdInstance:
    """One ``_gpusd._tcp`` service instance of a unicast DNS zone."""

    # the instance's full name, e.g. "node-b._gpusd._tcp.lab.example."
    name: str
    target: str
    port: int
    txt: TxtRecord
    addresses: list[str]
    # the smallest TTL of its records (seconds)
    ttl: float


def _resolver(server: str | None, port: int = 53) -> Any:
    import dns.asyncresolver

    if server is None:
        r = dns.asyncresolver.Resolver()
    else:
        r = dns.asyncresolver.Resolver(configure=False)
        r.nameservers = [server]
        r.port = port
    r.lifetime = DNS_TIMEOUT
    r.timeout = DNS_TIMEOUT
    # TTLs are honoured by the browse loop itself
    r.cache = None
    return r


@dataclass
class Browse:
    """One wide-area browse: the valid instances, the smallest TTL seen (seconds until the next
    query), the problems met, and the instances that could not be looked up this time (the DNS server
    did not answer: the caller keeps what it had for them).  ``complete`` is False when the PTR query
    itself failed: nothing is known, nothing is to be dropped."""

    found: list[DnsSdInstance]
    ttl: float
    problems: list[str]
    unknown: set[str]
    complete: bool = True


async def browse_dns_sd(domain: str, server: str | None = None, port: int = 53) -> Browse:
    """One wide-area browse of ``_gpusd._tcp.<domain>`` (bad records are skipped and named in
    ``problems``, never raised)."""
    import dns.exception
    import dns.resolver

    r = _resolver(server, port)
    problems: list[str] = []
    ttl = DNS_SD_INTERVAL
    service = SERVICE + domain
    try:
        ptr = await r.resolve(service, "PTR")
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return Browse([], ttl, problems, set())
    except dns.exception.DNSException as exc:
        return Browse([], DNS_SD_MIN_INTERVAL, [f"{service}: {exc.__class__.__name__}"], set(), complete=False)
    ttl = min(ttl, float(ptr.rrset.ttl)) if ptr.rrset is not None else ttl
    names = []
    for rr in ptr:
        name = rr.target.to_text()
        if name.endswith("." + service) and name not in names:
            names.append(name)
    if len(names) > MAX_DNS_SD:
        problems.append(f"{len(names)} instances under {service}: following the first {MAX_DNS_SD}")
        names = names[:MAX_DNS_SD]
    out: list[DnsSdInstance] = []
    unknown: set[str] = set()
    gate = asyncio.Semaphore(DNS_CONCURRENCY)

    async def lookup(name: str) -> tuple[str, Any, list[float]]:
        """("ok", instance, TTLs), ("unknown", problem, []) or ("bad", problem, [])."""
        async with gate:
            try:
                srv = await r.resolve(name, "SRV")
                txt_answer = await r.resolve(name, "TXT")
                rec = sorted(srv, key=lambda s: (s.priority, -s.weight))[0]
                target = rec.target.to_text()
                port = int(rec.port)
                if not 0 < port < 65536 or not valid_hostname(target):
                    raise ValueError(f"bad SRV target {target[:80]!r}:{port}")
                raw = b"".join(bytes([len(s)]) + s for rr in txt_answer for s in rr.strings)
                txt = decode_txt(raw)
                a = await r.resolve(target, "A")
                addresses = [rr.address for rr in a][:16]
                ttls = [float(x.rrset.ttl) for x in (srv, txt_answer, a) if x.rrset is not None]
            except (dns.exception.Timeout, dns.resolver.NoNameservers) as exc:
                # not an answer: keep what was known
                return "unknown", f"{name[:120]}: {exc.__class__.__name__}", []
            except (dns.exception.DNSException, ValueError, TxtError, IndexError) as exc:
                return "bad", f"{name[:120]}: {str(exc)[:200] or exc.__class__.__name__}", []
            return "ok", DnsSdInstance(name, target, port, txt, addresses, min(ttls) if ttls else ttl), ttls

    # DNS_CONCURRENCY instances looked up at a time, in the zone's order (1,000 one after the other took
    # ~3 s of round trips on loopback: 3 queries each)
    for name, (kind, found, ttls) in zip(names, await asyncio.gather(*(lookup(n) for n in names))):
        if kind == "ok":
            ttl = min([ttl, *ttls])
            out.append(found)
            continue
        if kind == "unknown":
            unknown.add(name)
        problems.append(found)
    return Browse(out, max(DNS_SD_MIN_INTERVAL, ttl), problems, unknown)


# -- publishing: the zone records of known hosts --------------------------------------------------------
def instance_label(hostname: str, node_id: str) -> str:
    """A DNS label for a host: its name made of ``a-z0-9-``, and the first 8 characters of its node id
    (unique where two hosts share a name), as the mDNS instance names are."""
    base = re.sub(r"[^a-z0-9-]+", "-", hostname.lower()).strip("-")[:40] or "gpu"
    tag = re.sub(r"[^a-z0-9]+", "", node_id.lower())[:8]
    return f"{base}-{tag}" if tag else base


def zone_records(hosts: list[Any], domain: str, ttl: int = 300) -> list[str]:
    """Zone-file lines (absolute names) that publish ``hosts`` (:class:`~gpusd.discovery.types.RemoteHost`
    of gpusd daemons with an IPv4 address) under ``_gpusd._tcp.<domain>``: PTR, SRV, TXT (the host's own
    TXT schema, re-encoded) and A.  Every name and string is escaped by dnspython: host names and TXT
    values come from the network."""
    import dns.name
    import dns.rdataclass
    import dns.rdatatype
    from dns.rdtypes.ANY.TXT import TXT


    zone = dns.name.from_text(valid_domain(domain))
    service = dns.name.Name(("_gpusd", "_tcp")).concatenate(zone)
    out: list[str] = []
    seen: set[str] = set()
    for h in sorted(hosts, key=lambda h: (h.hostname, h.node_id)):
        addresses = [a for a in h.addresses if _ipv4(a)]
        if h.source != "gpusd" or not addresses or not 0 < int(h.port) < 65536:
            continue
        label = instance_label(h.hostname, h.node_id)
        if label in seen:
            continue
        seen.add(label)
        instance = dns.name.Name((label,)).concatenate(service)
        target = dns.name.Name((label,)).concatenate(zone)
        t = h.txt
        # the live snapshot where there is one: a --peer host's TXT is made up from its HTTP API and
        # names no inventory (n=0 free=0 for a host with 2 GPUs)
        snap = h.snapshot
        inventory = inventory_of(snap) if snap is not None else list(t.inventory)
        free = count_free(snap) if snap is not None else (t.free or 0)
        props = encode_txt(node_id=t.node_id, hostname=t.hostname, session=t.session, inventory=inventory,
                           free=free, api=t.api, gpusd_version=t.gpusd_version, simulated=t.simulated,
                           auth=t.auth, tls_port=t.tls_port, cert_fp=t.cert_fp)
        strings = [f"{k}={v}".encode() for k, v in props.items()]
        txt = TXT(dns.rdataclass.IN, dns.rdatatype.TXT, strings).to_text()
        out += [f"{service} {ttl} IN PTR {instance}",
                f"{instance} {ttl} IN SRV 0 0 {int(h.port)} {target}",
                f"{instance} {ttl} IN TXT {txt}"]
        out += [f"{target} {ttl} IN A {a}" for a in addresses[:16]]
    return out


def _ipv4(address: str) -> bool:
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        return False
    return True


__all__ = [
    "DNS_SD_INTERVAL", "MAX_DNS_SD", "MAX_PEERS", "Browse", "DnsSdInstance", "PeerSpec", "browse_dns_sd", "file_stamp",
    "parse_peer", "parse_peers", "peer_txt", "peers_from_env", "read_peers_file", "valid_dns_server",
    "valid_domain", "valid_hostname", "zone_records",
]
