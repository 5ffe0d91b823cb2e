"""What a ``--gpusd-compat`` host tells GPU-SD/hwsd clients and Equalizer (docs/wire-format.md,
"GPU-SD/hwsd compatibility"): the X display its GPUs would be opened on, and its network interfaces
as hwsd's ``net_sys`` module reports them (name, type, MAC, IPv4, up, link speed).  Linux only (sysfs);
elsewhere the interfaces come without type details.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import ipaddress
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..wire.txt import HwsdNet

log = logging.getLogger(__name__)

SYS_NET = Path("/sys/class/net")
# linux/if_arp.h hardware types, as hwsd's net_sys module maps them
_ARPHRD = {1: "ETHERNET", 32: "INFINIBAND", 772: "LOOPBACK"}
_IFF_UP = 0x1
_DISPLAY_RE = re.compile(r"(?:unix)?:([0-9]{1,5})(?:\.[0-9]{1,5})?")


def x_display(env: Mapping[str, str] | None = None) -> int:
    """The X display number hwsd clients should open: that of ``$DISPLAY`` when it names a local
    display (``:1``, ``:1.0``, ``unix:1``), else 0 (hwsd's "no X display" and the usual first X
    server).  A forwarded display (``localhost:10.0``) is no GPU's display: 0."""
    text = (env if env is not None else os.environ).get("DISPLAY", "").strip()
    m = _DISPLAY_RE.fullmatch(text)
    return int(m.group(1)) if m else 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()[:128]
    except OSError:
        # absent, or EINVAL (the speed of a link that is down)
        return None


def _interface_of(addresses: Sequence[str]) -> dict[str, str]:
    import ifaddr

    out: dict[str, str] = {}
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and ip.ip in addresses:
                out.setdefault(ip.ip, adapter.nice_name)
    return out


def describe(name: str, ipv4: str, sys_net: Path = SYS_NET) -> HwsdNet:
    """One interface, from sysfs: type (ARPHRD), MAC, up (IFF_UP), link speed (Mbit/s)."""
    base = sys_net / name
    # no sysfs (not Linux): an IPv4 interface Equalizer may reach over TCP
    kind = "ETHERNET"
    type_text = _read(base / "type")
    if type_text is not None and type_text.isdigit():
        kind = _ARPHRD.get(int(type_text), "UNKNOWN")
    up = True
    flags = _read(base / "flags")
    if flags is not None:
        try:
            up = bool(int(flags, 16) & _IFF_UP)
        except ValueError:
            pass
    speed_text = _read(base / "speed")
    speed = int(speed_text) if speed_text is not None and speed_text.isdigit() and 0 < int(speed_text) < 2**31 else None
    mac = _read(base / "address")
    if mac is not None and not re.fullmatch(r"[0-9a-f]{2}(?::[0-9a-f]{2}){5,19}", mac):
        mac = None
    return HwsdNet(name=name, ipv4=ipv4, type=kind, mac=mac, up=up, linkspeed=speed)


def interfaces(addresses: Sequence[str], sys_net: Path = SYS_NET) -> list[HwsdNet]:
    """The interfaces behind the addresses the daemon announces, in that order, loopback left out
    (hwsd's daemon drops it too, and Equalizer would not use it)."""
    try:
        names = _interface_of(addresses)
    except Exception as exc:
        # ifaddr trouble: announce the addresses alone
        log.debug("cannot list interfaces: %r", exc)
        names = {}
    out: list[HwsdNet] = []
    for address in addresses:
        try:
            if ipaddress.IPv4Address(address).is_loopback:
                continue
        except ValueError:
            continue
        name = names.get(address)
        net = describe(name, address, sys_net) if name else HwsdNet(name="", ipv4=address)
        if net.type != "LOOPBACK":
            out.append(net)
    return out
