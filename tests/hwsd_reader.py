"""What GPU-SD/hwsd and Equalizer read from ``_gpu-sd._tcp`` and ``_net-sd._tcp`` records, restated
literally from their sources (never from gpusd's decoder), to check what a ``--gpusd-compat`` host
announces:

* hwsd/gpu/dns_sd/module.cpp and hwsd/net/dns_sd/module.cpp, through hwsd/detail/dns_sd_module.h:
  keys are looked up by their exact names (``GPU Count``, ``GPU<k> Type``, ``Net Count``,
  ``Net<k> IPv4``, ...; global ``NodeID``, ``Hostname``, ``Session``); an empty value is no value;
  a GPU without ``Type`` is skipped; ``NodeID`` is a ``lunchbox::uint128_t`` in hex (``high:low``).
* Equalizer's eq/server/config/resources.cpp: GPUs are grouped into nodes by ``NodeID``; in a
  cluster (session other than "local") a node is kept only when a net record with the same
  ``NodeID`` lists an interface that is up and not loopback; Ethernet gives a TCP/IP connection to
  its ``IPv4``.  ``GPU<k> Port`` and ``Device`` become the pipe's X display and screen.

Stricter than hwsd on purpose: our own numbers must be plain decimal, our types four characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


def txt_strings(raw: bytes) -> dict[str, str]:
    """TXT RDATA to ``{exact key: value}`` as Servus keeps it (first of duplicates)."""
    out: dict[str, str] = {}
    i = 0
    while i < len(raw):
        n = raw[i]
        item = raw[i + 1:i + 1 + n]
        i += 1 + n
        key, _, value = item.decode("utf-8").partition("=")
        out.setdefault(key, value)
    return out


def uint128(text: str) -> tuple[int, int]:
    """``lunchbox::uint128_t = std::string``: hex, optionally ``high:low``; must parse fully here."""
    m = re.fullmatch(r"([0-9a-fA-F]{1,16})(?::([0-9a-fA-F]{1,16}))?", text)
    assert m, f"NodeID {text!r} is not a lunchbox uint128_t"
    return (0, int(m.group(1), 16)) if m.group(2) is None else (int(m.group(1), 16), int(m.group(2), 16))


def unsigned(text: str) -> int:
    assert re.fullmatch(r"[0-9]{1,10}", text), f"{text!r} is not a plain unsigned number"
    value = int(text)
    assert value < 2**32
    return value


@dataclass
class Gpu:
    type: str
    port: int | None
    device: int | None


@dataclass
class Node:
    node_id: tuple[int, int]
    name: str
    session: str
    gpus: list[Gpu] = field(default_factory=list)
    connections: list[str] = field(default_factory=list)  # IPv4 addresses Equalizer connects to


def read_gpu_record(instance: str, txt: dict[str, str]) -> Node:
    """hwsd's gpu dns_sd discover() for one service instance."""
    def get(key: str) -> str | None:
        return txt.get(key) or None  # data.empty() -> not read

    count = get("GPU Count")
    node = Node(node_id=uint128(get("NodeID") or ""), name=(get("Hostname") or instance).split()[0],
                session=(get("Session") or "local").split()[0])
    for k in range(unsigned(count) if count else 0):
        kind = get(f"GPU{k} Type")
        if kind is None:
            continue
        assert len(kind) <= 4, kind
        port, device = get(f"GPU{k} Port"), get(f"GPU{k} Device")
        node.gpus.append(Gpu(kind, unsigned(port) if port else None, unsigned(device) if device else None))
    return node


@dataclass
class Net:
    node_id: tuple[int, int]
    type: str
    name: str | None
    ipv4: str | None
    up: bool


def read_net_record(txt: dict[str, str]) -> list[Net]:
    """hwsd's net dns_sd discover() for one service instance."""
    def get(key: str) -> str | None:
        return txt.get(key) or None

    count = get("Net Count")
    node_id = uint128(get("NodeID") or "")
    nets = []
    for k in range(unsigned(count) if count else 0):
        kind = get(f"Net{k} Type") or ""
        up = get(f"Net{k} Up")
        assert up in (None, "0", "1"), up  # a C++ bool read with >>
        nets.append(Net(node_id, kind if kind in ("ETHERNET", "INFINIBAND", "LOOPBACK") else "UNKNOWN",
                        get(f"Net{k} Name"), get(f"Net{k} IPv4"), up == "1"))
    return nets


def equalizer_nodes(gpu_nodes: list[Node], nets: list[Net]) -> list[Node]:
    """The render nodes Equalizer's auto-configuration makes for a cluster session (Ethernet)."""
    kept = []
    for node in gpu_nodes:
        for net in nets:
            if net.node_id != node.node_id or not net.up or net.type == "LOOPBACK":
                continue
            if net.type == "ETHERNET" and net.ipv4:  # CONNECTIONTYPE_TCPIP to IPv4
                node.connections.append(net.ipv4)
        if node.connections:  # "No suitable connection found for node ...; node will not be added"
            kept.append(node)
    return kept
