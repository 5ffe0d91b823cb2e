"""Network plumbing shared by the daemon and the clients: interface choice and the one
``AsyncZeroconf`` per process.

Interfaces are given as IPv4 addresses or interface names (``--interface eth0``, repeatable, or
``$GPUSD_INTERFACES=eth0,10.0.0.5``); nothing given means every interface (python-zeroconf's
``InterfaceChoice.All``).  When interfaces are pinned, gpusd also turns off ``IP_MULTICAST_ALL`` on
the mDNS sockets so that they receive only the multicast of the pinned interfaces.

``$GPUSD_MDNS_FAST=1`` shrinks python-zeroconf's probe and announce intervals (as its own test suite
does) for tests and benchmarks that start many daemons; never set it in production.
"""

# Imports inside functions: optional or heavy packages; start-up (gpusd list imports this module).
from __future__ import annotations

import ipaddress
import os
import socket
from typing import TYPE_CHECKING, Sequence

from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from zeroconf.asyncio import AsyncZeroconf


INTERFACES_ENV = "GPUSD_INTERFACES"
FAST_ENV = "GPUSD_MDNS_FAST"
_IP_MULTICAST_ALL = getattr(socket, "IP_MULTICAST_ALL", 49)  # Linux


def interfaces_from_env() -> list[str]:
    text = os.environ.get(INTERFACES_ENV, "")
    return [p.strip() for p in text.split(",") if p.strip()]


def resolve_interfaces(specs: Sequence[str] | None) -> list[str] | None:
    """IPv4 addresses for ``specs`` (addresses or interface names); None: all interfaces.

    ``specs`` None means ``$GPUSD_INTERFACES`` (if set).  ``all`` in the list means all interfaces."""
    if specs is None:
        specs = interfaces_from_env()
    specs = [s.strip() for s in specs if s and s.strip()]
    if not specs or any(s.lower() in ("all", "*") for s in specs):
        return None
    out: list[str] = []
    by_name: dict[str, list[str]] | None = None
    for spec in specs:
        try:
            addr = ipaddress.ip_address(spec)
        except ValueError:
            addr = None
        if addr is not None:
            if addr.version != 4:
                raise ConfigError(f"--interface {spec}: only IPv4 addresses are supported")
            out.append(str(addr))
            continue
        if by_name is None:
            by_name = _addresses_by_interface()
        found = by_name.get(spec)
        if not found:
            known = ", ".join(sorted(by_name)) or "none"
            raise ConfigError(f"--interface {spec}: no such interface with an IPv4 address (known: {known})")
        out.extend(found)
    return list(dict.fromkeys(out))


def _addresses_by_interface() -> dict[str, list[str]]:
    import ifaddr

    out: dict[str, list[str]] = {}
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                out.setdefault(adapter.nice_name, []).append(ip.ip)
    return out


# Interfaces of containers and VMs on this machine: their addresses mean nothing to other hosts.
VIRTUAL_PREFIXES = ("docker", "veth", "virbr", "br-", "cni", "flannel", "cali", "vxlan", "podman", "lxcbr",
                    "kube-", "weave", "cilium")


def local_ipv4_addresses(include_loopback: bool = False) -> list[str]:
    """The IPv4 addresses to announce: every address of this machine (network namespace) except
    link-local ones and those of container/VM bridges; loopback only when there is nothing else."""
    addrs: list[str] = []
    loop: list[str] = []
    for name, ips in _addresses_by_interface().items():
        if name.startswith(VIRTUAL_PREFIXES):
            continue
        for ip in ips:
            try:
                a = ipaddress.IPv4Address(ip)
            except ValueError:
                continue
            if a.is_loopback:
                loop.append(ip)
            elif not a.is_link_local:
                addrs.append(ip)
    if include_loopback or not addrs:
        addrs.extend(loop)
    return list(dict.fromkeys(addrs))


def _local_networks() -> list[ipaddress.IPv4Network]:
    import ifaddr

    nets = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                try:
                    nets.append(ipaddress.IPv4Network(f"{ip.ip}/{ip.network_prefix}", strict=False))
                except ValueError:
                    continue
    return nets


def rank_addresses(addresses: Sequence[str]) -> list[str]:
    """A host's announced addresses in the order to try them: on one of our own networks first,
    loopback and link-local last (a peer's 127.0.0.1 is reachable only from the peer itself)."""
    # nothing to order (most hosts): no look at our own interfaces, which took
    if len(addresses) < 2:
        # ~1 ms a host, half a second for a one-shot list beside 500 services
        return list(addresses)
    try:
        nets = _local_networks()
    except Exception:
        # ifaddr trouble: keep the announced order
        nets = []

    def key(addr: str) -> int:
        try:
            a = ipaddress.IPv4Address(addr)
        except ValueError:
            return 3
        if a.is_loopback or a.is_link_local:
            return 2
        return 0 if any(a in n for n in nets if not n.network_address.is_loopback) else 1

    return sorted(addresses, key=key)


def apply_test_timings() -> None:
    """Shrink python-zeroconf's probe/announce/goodbye intervals when ``$GPUSD_MDNS_FAST`` is set."""
    if os.environ.get(FAST_ENV, "") in ("", "0"):
        return
    try:
        from zeroconf import _core

        _core._CHECK_TIME = 10  # type: ignore[attr-defined]
        _core._REGISTER_TIME = 10  # type: ignore[attr-defined]
        _core._UNREGISTER_TIME = 10  # type: ignore[attr-defined]
        _core._PROBE_RANDOM_DELAY_INTERVAL = (1, 5)
    except (ImportError, AttributeError):  # pragma: no cover - a future zeroconf
        # here: reading the interfaces (gpusd list) needs no logging
        import logging

        logging.getLogger(__name__).debug("cannot shrink zeroconf timings")


async def open_zeroconf(interfaces: list[str] | None) -> "AsyncZeroconf":
    """The process's ``AsyncZeroconf`` on ``interfaces`` (None: all), started.  Its answers to
    legacy unicast queries follow RFC 6762 §6.7 (:mod:`gpusd.wire.responder`)."""
    from zeroconf import InterfaceChoice, IPVersion
    from zeroconf.asyncio import AsyncZeroconf

    from .responder import ConformingZeroconf

    apply_test_timings()
    try:
        aiozc = AsyncZeroconf(zc=ConformingZeroconf(
            interfaces=list(interfaces) if interfaces else InterfaceChoice.All,
            ip_version=IPVersion.V4Only,
        ))
    except OSError as exc:
        raise ConfigError(f"cannot open the mDNS sockets on {interfaces or 'all interfaces'}: {exc}") from None
    await aiozc.zeroconf.async_wait_for_start()
    if interfaces:
        restrict_multicast(aiozc)
    return aiozc


def _sockets(aiozc: "AsyncZeroconf") -> list[socket.socket]:
    engine = aiozc.zeroconf.engine
    found: list[socket.socket] = []
    for wrapped in [*getattr(engine, "readers", []), *getattr(engine, "senders", [])]:
        sock = getattr(wrapped, "sock", None)
        if sock is not None and sock not in found:
            found.append(sock)
    return found


def widen_receive_buffer(aiozc: "AsyncZeroconf", size: int) -> int:
    """Ask for ``size`` bytes of receive buffer on ``aiozc``'s sockets (the kernel grants at most
    ``net.core.rmem_max``); the smallest granted, in bytes.  A one-shot query is answered by every
    responder at once: a responder with hundreds of services (a flood of fake ones) sends hundreds of
    datagrams in one burst, and a buffer of the default 208 KiB overflows while this process is still
    starting, dropping real hosts' answers with the rest."""
    granted = []
    for sock in _sockets(aiozc):
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
            granted.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
        except OSError:
            pass
    return min(granted, default=0)


def dropped(aiozc: "AsyncZeroconf") -> int:
    """How many datagrams the kernel dropped on ``aiozc``'s sockets, their receive buffers full (Linux:
    the ``drops`` column of /proc/self/net/udp; 0 where it cannot be read)."""
    inodes = set()
    for sock in _sockets(aiozc):
        try:
            inodes.add(os.fstat(sock.fileno()).st_ino)
        except (OSError, ValueError):
            continue
    total = 0
    try:
        with open("/proc/self/net/udp", encoding="ascii", errors="replace") as f:
            next(f, None)  # the header
            for line in f:
                fields = line.split()
                if len(fields) > 12 and fields[9].isdigit() and int(fields[9]) in inodes and fields[12].isdigit():
                    total += int(fields[12])
    except OSError:
        return 0
    return total


def restrict_multicast(aiozc: "AsyncZeroconf") -> None:
    """Receive only the multicast groups joined on the pinned interfaces (Linux ``IP_MULTICAST_ALL``
    defaults to 1: a socket bound to 0.0.0.0 would also get groups other sockets joined elsewhere)."""
    for sock in _sockets(aiozc):
        try:
            sock.setsockopt(socket.IPPROTO_IP, _IP_MULTICAST_ALL, 0)
        except OSError:
            pass
