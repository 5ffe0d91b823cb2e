"""slurm.conf ``NodeName=`` lines and ``gres.conf`` lines from gpusd snapshots, and the comparison of
an existing slurm.conf with the fleet (docs/slurm.md).  Pure: strings in, strings out.

A snapshot comes from the network (a verified host's daemon), so every name that reaches a Slurm
file is checked against what Slurm's parser reads as one word: a host whose name is not a valid
Slurm node name is left out (with a comment saying so), a GPU model name is reduced to ``[a-z0-9_]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from ..inventory.vendors import slurm_file, slurm_flag
from ..model import GpuInfo, HostSnapshot, display_name
from ..topology import format_cpulist, link_between, parse_cpulist

# what slurm.conf takes as one node name
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
_ADDR = re.compile(r"^[0-9A-Fa-f.:]{2,45}$")
# every node gpusd writes has it (a Nodeset can gather them: docs/slurm.md)
FEATURE = "gpusd"


def node_name(hostname: str) -> str | None:
    """The Slurm node name of a host: its short name (before the first dot); None when that is not
    a name Slurm reads as one word."""
    short = hostname.split(".", 1)[0]
    return short if NODE_NAME.match(short) else None


def gpu_type(name: str | None) -> str:
    """The GRES type of a GPU model: ``NVIDIA A100-SXM4-80GB`` -> ``a100``, ``NVIDIA RTX A6000`` ->
    ``rtx_a6000``, ``Tesla T4`` -> ``t4``; ``gpu`` when the name says nothing usable."""
    shown = display_name(name).lower()
    if shown == "-":
        return "gpu"
    first = shown.split("-", 1)[0].strip()
    t = re.sub(r"[^a-z0-9]+", "_", first).strip("_")[:32]
    return t or "gpu"


def usable(gpu: GpuInfo) -> bool:
    """A GPU Slurm may be given: healthy, a whole GPU (MIG slices are not configured)."""
    return gpu.healthy and not gpu.mig_mode


def gres_counts(snap: HostSnapshot) -> dict[str, int]:
    """``{"a100": 2, "t4": 1}``: the usable GPUs of the host by GRES type, in index order."""
    out: dict[str, int] = {}
    for g in sorted(snap.gpus, key=lambda g: g.index):
        if usable(g):
            t = gpu_type(g.name)
            out[t] = out.get(t, 0) + 1
    return out


def gres_spec(snap: HostSnapshot) -> str:
    """``gpu:a100:2,gpu:t4:1`` (empty: no usable GPU)."""
    return ",".join(f"gpu:{t}:{n}" for t, n in gres_counts(snap).items())


def _mib(n: int | None) -> int | None:
    return n // (1024 * 1024) if n else None


def node_params(snap: HostSnapshot, address: str | None = None) -> list[str]:
    """The words after ``NodeName=X`` for ``snap``: NodeAddr, CPUs and their layout, RealMemory,
    Gres, Feature (what ``slurmd -C`` prints, plus what gpusd knows of the GPUs)."""
    words: list[str] = []
    if address and _ADDR.match(address):
        words.append(f"NodeAddr={address}")
    if snap.cpus:
        words.append(f"CPUs={snap.cpus}")
        if snap.sockets and snap.cores_per_socket and snap.threads_per_core:
            words += ["Boards=1", f"SocketsPerBoard={snap.sockets}", f"CoresPerSocket={snap.cores_per_socket}",
                      f"ThreadsPerCore={snap.threads_per_core}"]
    mem = _mib(snap.memory)
    if mem:
        words.append(f"RealMemory={mem}")
    spec = gres_spec(snap)
    if spec:
        words.append(f"Gres={spec}")
    words.append("Feature=" + ",".join([FEATURE, *gres_counts(snap)]))
    return words


def node_line(snap: HostSnapshot, address: str | None = None) -> str | None:
    """One slurm.conf line for the host (None: its name is not a Slurm node name)."""
    name = node_name(snap.hostname)
    if name is None:
        return None
    return " ".join([f"NodeName={name}", *node_params(snap, address), "State=UNKNOWN"])


def _cores(snap: HostSnapshot, gpu: GpuInfo) -> str | None:
    """Slurm's ``Cores=`` for ``gpu``: its local CPUs as Slurm's core indices (a CPU's core is its
    id modulo the number of cores, the kernel's usual numbering of hyperthreads), limited to the
    cores the host has; None when unknown or nothing is left."""
    if not gpu.local_cpus:
        return None
    try:
        cpus = parse_cpulist(gpu.local_cpus)
    except ValueError:
        return None
    total = snap.cpus or 0
    if snap.threads_per_core and snap.threads_per_core > 1 and total:
        total //= snap.threads_per_core
    cores = sorted({c % total for c in cpus} if total and snap.threads_per_core and snap.threads_per_core > 1
                   else {c for c in cpus if not total or c < total})
    if not cores:
        return None

    return format_cpulist(cores)


def gres_gpus(snap: HostSnapshot) -> list[GpuInfo]:
    """The GPUs gres.conf lists, in its order: Slurm's GPU N (``SLURM_JOB_GPUS``) is the N-th of them.
    A GPU left out (lost, unhealthy, MIG) shifts the ones after it: Slurm's numbers are positions in
    this list, never NVML's indices."""
    return sorted((g for g in snap.gpus if usable(g)), key=lambda g: g.index)


def gres_lines(snap: HostSnapshot, with_node: bool = True, device: str | None = None) -> list[str]:
    """The gres.conf lines of the host's usable GPUs (``with_node``: each scoped ``NodeName=X``, so
    one file serves the whole cluster), and a comment for each GPU left out.  ``File=`` and ``Flags=``
    are each vendor's (``inventory.vendors``); ``device`` replaces the device files' prefix (the
    number stays the vendor's: simulated GPUs get files a test makes)."""

    name = node_name(snap.hostname)
    if name is None:
        return [f"# left out a host whose name is not a Slurm node name ({len(snap.gpus)} GPU(s))"]
    gpus = gres_gpus(snap)
    out: list[str] = []
    def bond(a: GpuInfo, b: GpuInfo) -> int:
        link = link_between(a, b)
        return link.nvlink if link is not None else 0

    nvlink = any(bond(a, b) > 0 for a in gpus for b in gpus if a.index < b.index)
    for g in sorted(snap.gpus, key=lambda g: g.index):
        if not usable(g):
            why = "lost or unhealthy" if not g.healthy else "in MIG mode"
            out.append(f"# {name}: GPU {g.index} left out ({why})")
    for g in gpus:
        words = ([f"NodeName={name}"] if with_node else []) + [
            "Name=gpu", f"Type={gpu_type(g.name)}", f"File={slurm_file(g, device, None if snap.simulated else '/sys')}"]
        cores = _cores(snap, g)
        if cores:
            words.append(f"Cores={cores}")
        if nvlink:
            words.append("Links=" + ",".join("-1" if p.index == g.index else str(min(bond(g, p), 999))
                                             for p in gpus))
        words.append(f"Flags={slurm_flag(g.vendor)}")
        out.append(" ".join(words))
    return out


def slurm_conf(hosts: Iterable[tuple[HostSnapshot, str | None]]) -> str:
    """The slurm.conf part for ``hosts`` (snapshot, signed address): GresTypes and one NodeName line each."""
    lines = ["# generated by gpusd slurm conf (docs/slurm.md)", "GresTypes=gpu"]
    for snap, address in sorted(hosts, key=lambda t: t[0].hostname):
        line = node_line(snap, address)
        lines.append(line if line is not None else "# left out a host whose name is not a Slurm node name")
    return "\n".join(lines) + "\n"


def gres_conf(hosts: Iterable[HostSnapshot]) -> str:
    lines = ["# generated by gpusd slurm conf --gres (docs/slurm.md)"]
    for snap in sorted(hosts, key=lambda s: s.hostname):
        lines += gres_lines(snap)
    return "\n".join(lines) + "\n"


# -- comparing an existing slurm.conf with the fleet ------------------------------------------------
@dataclass
class Diff:
    # hosts in the fleet, not in the file
    added: list[str] = field(default_factory=list)
    # nodes in the file, not in the fleet
    gone: list[str] = field(default_factory=list)
    changed: list[tuple[str, str]] = field(default_factory=list)  # (node, what changed)

    @property
    def same(self) -> bool:
        return not (self.added or self.gone or self.changed)

    def lines(self) -> list[str]:
        out = [f"added: {n} (in the fleet, not in the file)" for n in self.added]
        out += [f"gone: {n} (in the file, not in the fleet)" for n in self.gone]
        out += [f"changed: {n}: {what}" for n, what in self.changed]
        return out or ["the file's nodes match the fleet"]


def _logical_lines(text: str) -> list[str]:
    """slurm.conf's lines: comments stripped, ``\\`` continuations joined."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            out.append(line)
    if pending.strip():
        out.append(pending.strip())
    return out


def _expand(names: str) -> list[str]:
    """``a,b,node[1-3,5]`` -> [a, b, node1, node2, node3, node5] (Slurm's host list, one bracket)."""
    out: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", names):
        m = re.match(r"^(.*)\[([0-9,\-]+)\](.*)$", part)
        if not m:
            out.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                continue
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{i:0{width}d}{suffix}")
                if len(out) > 65536:
                    return out
    return out


def parse_nodes(text: str) -> dict[str, dict[str, str]]:
    """The NodeName entries of a slurm.conf: node -> {key: value} (keys lower-case; DEFAULT applied)."""
    nodes: dict[str, dict[str, str]] = {}
    default: dict[str, str] = {}
    for line in _logical_lines(text):
        words = line.split()
        if not words or not words[0].lower().startswith("nodename="):
            continue
        params: dict[str, str] = {}
        for w in words[1:]:
            k, sep, v = w.partition("=")
            if sep:
                params[k.lower()] = v
        names = words[0].split("=", 1)[1]
        if names.upper() == "DEFAULT":
            default.update(params)
            continue
        for n in _expand(names):
            nodes[n] = {**default, **params}
    return nodes


def _gres_of(spec: str) -> dict[str, int]:
    """``gpu:a100:2,gpu:1`` -> {"a100": 2, "": 1} (only ``gpu`` GRES)."""
    out: dict[str, int] = {}
    for item in spec.split(","):
        parts = item.split(":")
        if not parts or parts[0] != "gpu":
            continue
        count = parts[-1] if len(parts) > 1 and parts[-1].isdigit() else "1"
        t = parts[1] if len(parts) == 3 or (len(parts) == 2 and not parts[1].isdigit()) else ""
        out[t] = out.get(t, 0) + int(count)
    return out


def check(text: str, hosts: Iterable[HostSnapshot]) -> Diff:
    """Compare the NodeName lines of a slurm.conf with the fleet's hosts."""
    nodes = parse_nodes(text)
    diff = Diff()
    seen: set[str] = set()
    for snap in sorted(hosts, key=lambda s: s.hostname):
        name = node_name(snap.hostname)
        if name is None:
            continue
        seen.add(name)
        have = nodes.get(name)
        if have is None:
            diff.added.append(name)
            continue
        want = gres_counts(snap)
        got = _gres_of(have.get("gres", ""))
        if sum(got.values()) != sum(want.values()) or any(t and got.get(t) != want.get(t) for t in got):
            diff.changed.append((name, f"Gres={have.get('gres', '(none)')} in the file, {gres_spec(snap) or '(none)'} "
                                       "in the fleet"))
        if snap.cpus and have.get("cpus", "").isdigit() and int(have["cpus"]) != snap.cpus:
            diff.changed.append((name, f"CPUs={have['cpus']} in the file, {snap.cpus} in the fleet"))
        mem = _mib(snap.memory)
        if mem and have.get("realmemory", "").isdigit() and int(have["realmemory"]) > mem:
            diff.changed.append((name, f"RealMemory={have['realmemory']} in the file, more than the "
                                       f"{mem} the host has"))
    diff.gone = sorted(n for n in nodes if n not in seen)
    return diff


__all__ = ["node_name", "gpu_type", "gres_spec", "node_line", "gres_gpus", "gres_lines", "slurm_conf", "gres_conf",
           "check",
           "parse_nodes", "Diff", "FEATURE"]
