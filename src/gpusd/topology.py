"""How the GPUs of one host connect: NVML's topology levels, ``nvidia-smi topo -m``'s notation, and
Linux CPU lists (docs/inventory.md, "Topology").  Pure functions of the data model; part of the core.

NVML's ``nvmlDeviceGetTopologyCommonAncestor`` says where the PCIe paths of two GPUs meet; NVLinks
are counted separately (``nvmlDeviceGetNvLinkState``/``RemotePciInfo``).  ``nvidia-smi topo -m``
writes a pair as ``NV#`` (# bonded NVLinks) where there are NVLinks, else by the PCIe level.
"""

from __future__ import annotations

from .model import GpuInfo, GpuLink, GpuTopology, HostSnapshot

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Iterable, Sequence

INTERNAL, SINGLE, MULTIPLE, HOSTBRIDGE, NODE, SYSTEM = 0, 10, 20, 30, 40, 50
# GpuTopology.pcie's groups, in order
PCIE_LEVELS = (INTERNAL, SINGLE, MULTIPLE, HOSTBRIDGE, NODE)
# GpuTopology.version this gpusd reads (docs/wire-format.md, "Topology v2")
TOPOLOGY_VERSION = 2

# nvidia-smi topo -m's words for NVML's levels (INTERNAL: two GPUs on one board, shown as PIX)
LEVEL_LABELS = {INTERNAL: "PIX", SINGLE: "PIX", MULTIPLE: "PXB", HOSTBRIDGE: "PHB", NODE: "NODE", SYSTEM: "SYS"}

LEGEND = """Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks"""

# CPU ids a CPU list may name (the kernel's NR_CPUS is at most 8192 today)
MAX_CPUS = 65536

# The rank of a link for placement (lower is better): NVLink, then the PCIe levels; unknown counts as
# SYSTEM, so a host that reports no topology ranks every set the same (load order decides).
_RANK = {INTERNAL: 1, SINGLE: 2, MULTIPLE: 3, HOSTBRIDGE: 4, NODE: 5, SYSTEM: 6}
WORST_RANK = 6


def link_between(a: GpuInfo, b: GpuInfo) -> GpuLink | None:
    """How ``a`` reaches ``b`` (GPUs of one snapshot): from their :class:`GpuTopology` where both have
    one, else what ``a`` says of its link to ``b`` (or ``b`` of ``a``) in ``links`` (an older daemon's
    form); None when neither says."""
    ta, tb = a.topology, b.topology
    if ta is not None and tb is not None:
        if ta.version != TOPOLOGY_VERSION or tb.version != TOPOLOGY_VERSION:
            # a form this gpusd cannot read: unknown, never misread
            return None
        return _from_topology(a.index, ta, b.index, tb)
    for x, y in ((a, b), (b, a)):
        for link in x.links:
            if link.peer == y.index:
                return link
    return None


def _from_topology(ia: int, ta: GpuTopology, ib: int, tb: GpuTopology) -> GpuLink | None:
    level = None
    if ta.pcie and tb.pcie:
        level = SYSTEM
        for lvl, ga, gb in zip(PCIE_LEVELS, ta.pcie, tb.pcie):
            if ga == gb:
                level = lvl
                break
    n = 0
    for x, peer in ((ta, ib), (tb, ia)):
        for bond in x.nvlink:
            if bond.peer == peer:
                n = bond.nvlink
                break
        if n:
            break
    if not n and ta.fabric is not None and ta.fabric == tb.fabric:
        # through the NVSwitches: a's links to them (as nvidia-smi counts it)
        n = ta.fabric_links
    if level is None and not n:
        return None
    return GpuLink(peer=ib, level=level, nvlink=n)


def compact(gpus: Sequence[GpuInfo]) -> None:
    """Each GPU's :class:`GpuTopology` from its pairwise ``links`` (which are then dropped): the form
    that travels.  PCIe levels form a tree, so "meets at or below level L" groups the GPUs; NVLinks
    that join a set of GPUs each to every other with the same number of links per GPU (NVSwitches,
    or a full mesh) become a fabric, the others stay direct bonds.  A GPU without links keeps none."""
    if not any(g.links for g in gpus):
        return
    by_index = {g.index: g for g in gpus}
    links = {g.index: {lk.peer: lk for lk in g.links if lk.peer in by_index and lk.peer != g.index} for g in gpus}

    def between(a: int, b: int) -> GpuLink | None:
        return links[a].get(b) or links[b].get(a)

    known = [g.index for g in gpus if any(lk.level is not None for lk in links[g.index].values())]
    pcie: dict[int, list[int]] = {i: [] for i in by_index}
    for lvl in PCIE_LEVELS:
        group: dict[int, int] = {}
        # union by the lowest index: a tree's levels are transitive
        for i in known:
            if i in group:
                continue
            members = [i] + [j for j in known if j != i and j not in group
                             and (lk := between(i, j)) is not None and lk.level is not None and lk.level <= lvl]
            for j in members:
                group[j] = i
        for i in known:
            pcie[i].append(group[i])
    nv = {i: {p: lk.nvlink for p, lk in links[i].items() if lk.nvlink > 0} for i in by_index}
    fabric: dict[int, tuple[int, int]] = {}
    for i in sorted(by_index):
        if i in fabric or len(nv[i]) < 2 or len(set(nv[i].values())) != 1:
            continue
        members = sorted({i, *nv[i]})
        count = next(iter(nv[i].values()))
        if all(set(nv[j]) | {j} == set(members) and set(nv[j].values()) == {count} for j in members
               if j not in fabric):
            for j in members:
                fabric.setdefault(j, (i, count))
    for g in gpus:
        i = g.index
        f = fabric.get(i)
        direct = [GpuLink(peer=p, nvlink=n) for p, n in sorted(nv[i].items())
                  if p > i and not (f is not None and fabric.get(p, (None,))[0] == f[0])]
        g.topology = GpuTopology(pcie=pcie[i], nvlink=direct, fabric=f[0] if f else None,
                                 fabric_links=f[1] if f else 0)
        g.links = []


def label(link: GpuLink | None) -> str:
    """``NV4``, ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS`` (nvidia-smi's words); ``N/A`` unknown."""
    if link is None:
        return "N/A"
    if link.nvlink > 0:
        return f"NV{min(link.nvlink, 999)}"
    if link.level is None:
        return "N/A"
    return LEVEL_LABELS.get(link.level, "N/A")


def rank(link: GpuLink | None) -> int:
    """0 for NVLink, 1 (same board) .. 6 (across sockets, or unknown): lower connects better."""
    if link is None:
        return WORST_RANK
    if link.nvlink > 0:
        return 0
    return _RANK.get(link.level if link.level is not None else SYSTEM, WORST_RANK)


def parse_cpulist(text: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11}; ValueError when it is not a CPU list."""
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for part in text.split(","):
        lo_s, sep, hi_s = part.partition("-")
        if not lo_s.isdigit() or (sep and not hi_s.isdigit()) or len(lo_s) > 6 or len(hi_s) > 6:
            raise ValueError(f"not a CPU list: {text[:40]!r}")
        lo = int(lo_s)
        hi = int(hi_s) if sep else lo
        if not lo <= hi < MAX_CPUS or len(cpus) + hi - lo >= MAX_CPUS:
            raise ValueError(f"not a CPU list: {text[:40]!r}")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 8} -> ``"0-3,8"`` (the kernel's and nvidia-smi's form)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def local_cpus(gpu: GpuInfo) -> frozenset[int] | None:
    """The CPUs close to ``gpu`` (None: unknown, or a CPU list that does not parse)."""
    if not gpu.local_cpus:
        return None
    try:
        return parse_cpulist(gpu.local_cpus)
    except ValueError:
        return None


def has_topology(snap: HostSnapshot) -> bool:
    return any(g.links or g.topology is not None for g in snap.gpus)


_machine: dict[str, int | None] | None = None


def machine(sysfs: str = "/sys/devices/system/cpu") -> dict[str, int | None]:
    """This machine's CPUs and memory, as ``slurmd -C`` reports them: ``cpus`` (online logical
    CPUs), ``sockets``, ``cores_per_socket``, ``threads_per_core`` and ``memory`` (bytes of RAM, from
    /proc/meminfo).  Read once per process; a field that cannot be read is None."""
    global _machine
    if _machine is not None and sysfs == "/sys/devices/system/cpu":
        return dict(_machine)
    import os

    out: dict[str, int | None] = {"cpus": None, "sockets": None, "cores_per_socket": None,
                                  "threads_per_core": None, "memory": None}

    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read(4096).strip()
        except OSError:
            return None

    online = read(f"{sysfs}/online")
    try:
        cpus = sorted(parse_cpulist(online)) if online else []
    except ValueError:
        cpus = []
    if not cpus:
        n = os.cpu_count()
        cpus = list(range(n)) if n else []
    out["cpus"] = len(cpus) or None
    packages: set[str] = set()
    for c in cpus:
        pkg = read(f"{sysfs}/cpu{c}/topology/physical_package_id")
        if pkg is not None:
            packages.add(pkg)
    siblings = read(f"{sysfs}/cpu{cpus[0]}/topology/thread_siblings_list") if cpus else None
    try:
        threads = len(parse_cpulist(siblings)) if siblings else None
    except ValueError:
        threads = None
    if cpus and packages and threads and len(cpus) % (len(packages) * threads) == 0:
        out["sockets"], out["threads_per_core"] = len(packages), threads
        out["cores_per_socket"] = len(cpus) // (len(packages) * threads)
    meminfo = read("/proc/meminfo") or ""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                out["memory"] = int(parts[1]) * 1024
    if sysfs == "/sys/devices/system/cpu":
        _machine = dict(out)
    return out


def host_memory(path: str = "/proc/meminfo") -> tuple[int, int] | None:
    """This machine's memory now, ``(total, available)`` in bytes (``MemTotal``, ``MemAvailable``): what a
    GPU without memory of its own (unified memory: DGX Spark, Jetson) can allocate.  None where unreadable."""
    try:
        with open(path, "rb") as f:
            text = f.read(8192)
    except OSError:
        return None
    found: dict[bytes, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(b":")
        if key in (b"MemTotal", b"MemAvailable"):
            parts = rest.split()
            if parts and parts[0].isdigit():
                found[key] = int(parts[0]) * 1024
    total, available = found.get(b"MemTotal"), found.get(b"MemAvailable")
    if total is None or available is None:
        return None
    return total, min(available, total)


def with_machine(snap: HostSnapshot) -> HostSnapshot:
    """``snap`` with this machine's CPUs and memory (:func:`machine`) filled in."""
    m = machine()
    snap.cpus, snap.sockets, snap.cores_per_socket = m["cpus"], m["sockets"], m["cores_per_socket"]
    snap.threads_per_core, snap.memory = m["threads_per_core"], m["memory"]
    return snap


__all__ = ["INTERNAL", "SINGLE", "MULTIPLE", "HOSTBRIDGE", "NODE", "SYSTEM", "LEVEL_LABELS", "LEGEND",
           "link_between", "label", "rank", "parse_cpulist", "format_cpulist", "local_cpus", "has_topology",
           "machine", "with_machine"]
