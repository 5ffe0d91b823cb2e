"""Simulated GPUs for demos, docs and trying gpusd on a machine without a GPU.

``--simulate 4xA100-80GB`` (or ``2xH100-80GB,1xRTX4090``) gives GPUs whose load and memory drift
smoothly over time; ``--simulate scenario.json`` describes each GPU (see docs/simulation.md).  Loads
are a function of wall-clock time, so every process simulating the same host sees the same values.
Every snapshot of a simulated host carries ``simulated = true`` and every CLI output says so.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import ConfigError
from ..identity import hostname as local_hostname
from ..identity import node_id as local_node_id
from ..model import MAX_NAME, GpuInfo, GpuLink, HostSnapshot, LeaseInfo, MigInstance, ProcessInfo
from ..topology import with_machine
from ..units import format_bytes, parse_bytes

GiB = 1024**3

# model key -> (NVML name, memory bytes, power limit W, MIG capable)
MODELS: dict[str, tuple[str, int, float, bool]] = {
    "A100-80GB": ("NVIDIA A100-SXM4-80GB", 80 * GiB, 400.0, True),
    "A100-40GB": ("NVIDIA A100-SXM4-40GB", 40 * GiB, 400.0, True),
    "H100-80GB": ("NVIDIA H100 80GB HBM3", 80 * GiB, 700.0, True),
    "H200-141GB": ("NVIDIA H200", 141 * GiB, 700.0, True),
    "L40S": ("NVIDIA L40S", 48 * GiB, 350.0, False),
    "A6000": ("NVIDIA RTX A6000", 48 * GiB, 300.0, False),
    "RTX4090": ("NVIDIA GeForce RTX 4090", 24 * GiB, 450.0, False),
    "RTX3090": ("NVIDIA GeForce RTX 3090", 24 * GiB, 350.0, False),
    "V100-32GB": ("Tesla V100-SXM2-32GB", 32 * GiB, 300.0, False),
    "T4": ("Tesla T4", 16 * GiB, 70.0, False),
    # AMD and Intel: as amd-smi and Sysman name them.  An MI250X module is two GCDs, which
    # the driver shows as two GPUs of 64 GiB each: one model entry is one GCD.
    "MI300X": ("AMD Instinct MI300X", 192 * GiB, 750.0, False),
    "MI250X": ("AMD Instinct MI250X", 64 * GiB, 560.0, False),
    "MAX1550": ("Intel(R) Data Center GPU Max 1550", 128 * GiB, 600.0, False),
}
# model key -> (vendor, compute partition, memory partition, subdevices) for the non-NVIDIA models:
# an MI300X in its default SPX/NPS1 mode (one GPU of 8 XCDs; CPX would show 8 GPUs), a Max 1550
# card with its two stacks (tiles).
VENDOR_MODELS: dict[str, tuple[str, str | None, str | None, int | None]] = {
    "MI300X": ("amd", "SPX", "NPS1", None),
    "MI250X": ("amd", None, None, None),
    "MAX1550": ("intel", None, None, 2),
}
# The AMD boards' part numbers (amdsmi's board_info.model_number), which AMD's dashboards match as card_model
AMD_BOARDS = {"MI300X": "102-G30211-00", "MI250X": "102-D65209-0C"}
# How GPUs of a model connect in the boxes they usually come in (docs/simulation.md, "Topology"):
# SXM boards sit on NVSwitches (DGX/HGX A100: 12 NVLinks per GPU, H100/H200: 18), workstation boards
# with NVLink bridges in pairs (A6000, RTX 3090: NV4; V100 simplified to NV2 pairs), the rest on PCIe only.
NVLINK: dict[str, tuple[str, int]] = {
    "A100-80GB": ("nvswitch", 12), "A100-40GB": ("nvswitch", 12), "H100-80GB": ("nvswitch", 18),
    "H200-141GB": ("nvswitch", 18), "A6000": ("pairs", 4), "RTX3090": ("pairs", 4), "V100-32GB": ("pairs", 2),
}
# simulated CPUs per NUMA node: node k has CPUs 32k..32k+31
CPUS_PER_NODE = 32

_ALIASES = {k.lower().replace("-", ""): k for k in MODELS} | {
    "a100": "A100-80GB", "h100": "H100-80GB", "h200": "H200-141GB", "v100": "V100-32GB"}


def _model(key: str) -> str:
    k = _ALIASES.get(key.lower().replace("-", "").replace("_", ""))
    if k is None:
        raise ConfigError(f"unknown simulated GPU model {key!r}; known: {', '.join(MODELS)}")
    return k


@dataclass
class _Signal:
    """A value over time: constant, a sine between min and max, or steps cycling every N seconds."""

    base: float
    low: float | None = None
    high: float | None = None
    period: float = 60.0
    phase: float = 0.0
    steps: list[float] | None = None

    def __post_init__(self) -> None:
        values = [self.base, self.low, self.high, self.period, self.phase, *(self.steps or [])]
        if not all(v is None or math.isfinite(v) for v in values):
            raise ValueError("values must be finite numbers (no NaN or Infinity)")

    def at(self, t: float) -> float:
        if self.steps:
            return self.steps[int(t // self.period) % len(self.steps)]
        if self.low is None or self.high is None:
            return self.base
        x = 0.5 + 0.5 * math.sin(2 * math.pi * (t / self.period) + self.phase)
        return self.low + (self.high - self.low) * x


def _extremes(sig: _Signal) -> tuple[float, float]:
    """The lowest and highest value ``sig`` takes."""
    values = list(sig.steps or []) or [v for v in (sig.low, sig.high) if v is not None] or [sig.base]
    return min(values), max(values)


def _signal(spec: Any, what: str, convert: Any = float, phase: float = 0.0) -> _Signal:
    try:
        if isinstance(spec, dict):
            if "steps" in spec:
                steps = [float(convert(v)) for v in spec["steps"]]
                if not steps:
                    raise ValueError("steps is empty")
                return _Signal(steps[0], steps=steps, period=float(spec.get("every", 5)))
            missing = [k for k in ("min", "max") if k not in spec]
            if missing:
                raise ConfigError(f"bad {what} in scenario: {spec!r} is missing the key {missing[0]!r} "
                                  "(a varying value needs both 'min' and 'max', or 'steps')")
            low, high = float(convert(spec["min"])), float(convert(spec["max"]))
            return _Signal(low, low, high, float(spec.get("period", 60)), phase)
        return _Signal(float(convert(spec)))
    except ConfigError:
        # already says what is wrong (and is a ValueError: not wrapped in itself again)
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"bad {what} in scenario: {spec!r} ({exc})") from None


@dataclass
class _SimGpu:
    model: str
    util: _Signal
    memory: _Signal
    temperature: _Signal | None = None
    mig: list[str] = field(default_factory=list)
    processes: list[dict[str, Any]] = field(default_factory=list)
    leases: list[dict[str, Any]] = field(default_factory=list)
    lost: bool = False


@dataclass
class _Topology:
    """Per GPU: NUMA node, PCIe switch, local CPUs; per pair: NVLinks."""

    numa: list[int]
    switch: list[int]
    cpus: list[str]
    nvlinks: dict[tuple[int, int], int]

    def links(self, i: int) -> list[GpuLink]:
        out = []
        for j in range(len(self.numa)):
            if j == i:
                continue
            if self.switch[i] == self.switch[j] and self.numa[i] == self.numa[j]:
                level = 10
            elif self.numa[i] == self.numa[j]:
                level = 40
            else:
                level = 50
            out.append(GpuLink(peer=j, level=level, nvlink=self.nvlinks.get((min(i, j), max(i, j)), 0)))
        return out


def default_topology(models: list[str], preset: str | None = None) -> _Topology:
    """The usual box for these GPUs: two NUMA nodes (the first half of the GPUs on node 0) when there
    are four or more, PCIe switches shared by pairs, NVLinks as the model has them (:data:`NVLINK`)
    or as ``preset`` says (``nvswitch``, ``pairs``, ``pcie``)."""
    n = len(models)
    numa = [0 if n < 4 or i < (n + 1) // 2 else 1 for i in range(n)]
    switch = [i // 2 for i in range(n)]
    cpus = [f"{CPUS_PER_NODE * k}-{CPUS_PER_NODE * k + CPUS_PER_NODE - 1}" for k in numa]
    nvlinks: dict[tuple[int, int], int] = {}
    i = 0
    # each run of one model is one NVLink domain
    while i < n:
        j = i
        while j < n and models[j] == models[i]:
            j += 1
        kind, count = NVLINK.get(models[i], ("pcie", 0))
        if preset is not None:
            kind = preset
            count = count or (18 if preset == "nvswitch" else 4)
        if kind == "nvswitch":
            nvlinks.update({(a, b): count for a in range(i, j) for b in range(a + 1, j)})
        elif kind == "pairs":
            nvlinks.update({(a, a + 1): count for a in range(i, j - 1, 2)})
        i = j
    return _Topology(numa, switch, cpus, nvlinks)


_PRESETS = ("nvswitch", "pairs", "pcie")


def _scenario_topology(spec: Any, models: list[str], path: Path) -> _Topology:
    """A scenario's ``topology``: a preset name, or an object with ``preset``, ``nvlink`` (a list of
    [a, b, links]), ``numa`` and ``pcie_switch`` (one number per GPU) and ``cpus`` (a CPU list per GPU)."""
    if spec is None or isinstance(spec, str):
        if spec is not None and spec not in _PRESETS:
            raise ConfigError(f"scenario {path}: topology must be one of {', '.join(_PRESETS)} or an object")
        return default_topology(models, spec)
    if not isinstance(spec, dict):
        raise ConfigError(f"scenario {path}: topology must be a preset name or an object")
    preset = spec.get("preset")
    if preset is not None and preset not in _PRESETS:
        raise ConfigError(f"scenario {path}: topology.preset must be one of {', '.join(_PRESETS)}")
    topo = default_topology(models, preset)
    n = len(models)
    for key, attr in (("numa", "numa"), ("pcie_switch", "switch")):
        if key in spec:
            v = spec[key]
            if (not isinstance(v, list) or len(v) != n
                    or not all(type(x) is int and 0 <= x < 1024 for x in v)):
                raise ConfigError(f"scenario {path}: topology.{key} must list one number (0-1023) per GPU")
            setattr(topo, attr, list(v))
            if key == "numa" and "cpus" not in spec:
                topo.cpus = [f"{CPUS_PER_NODE * k}-{CPUS_PER_NODE * k + CPUS_PER_NODE - 1}" for k in v]
    if "cpus" in spec:
        from ..topology import parse_cpulist

        v = spec["cpus"]
        if not isinstance(v, list) or len(v) != n or not all(isinstance(x, str) for x in v):
            raise ConfigError(f"scenario {path}: topology.cpus must list one CPU list (\"0-15\") per GPU")
        for x in v:
            try:
                parse_cpulist(x)
            except ValueError as exc:
                raise ConfigError(f"scenario {path}: topology.cpus: {exc}") from None
            # it could not go on the wire
            if len(x) > MAX_NAME:
                raise ConfigError(f"scenario {path}: topology.cpus: a CPU list of at most {MAX_NAME} characters")
        topo.cpus = list(v)
    if "nvlink" in spec:
        v = spec["nvlink"]
        ok = isinstance(v, list) and all(
            isinstance(e, list) and len(e) == 3 and all(type(x) is int for x in e)
            and 0 <= e[0] < n and 0 <= e[1] < n and e[0] != e[1] and 1 <= e[2] <= 18 for e in v)
        if not ok:
            raise ConfigError(f"scenario {path}: topology.nvlink must be a list of [gpu, gpu, links (1-18)]")
        topo.nvlinks = {(min(a, b), max(a, b)): k for a, b, k in v}
    return topo


def _active(entry: dict[str, Any], elapsed: float) -> bool:
    """Whether a scenario process or lease with optional ``from``/``until`` is there ``elapsed``
    seconds after the backend started."""
    start, until = entry.get("from"), entry.get("until")
    return (start is None or elapsed >= start) and (until is None or elapsed < until)


def _uuid(host: str, index: int) -> str:
    h = hashlib.sha1(f"gpusd-sim:{host}:{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _vendor_fields(gpu: GpuInfo, model: str, before: list[_SimGpu]) -> None:
    """Vendor, vendor index (its number among the host's GPUs of the same vendor), partitioning and a
    UUID of the vendor's form (ROCm's ``GPU-<16 hex digits>``) for a simulated GPU."""
    vendor, compute, memory, subdevices = VENDOR_MODELS.get(model, ("nvidia", None, None, None))
    gpu.vendor = vendor
    same = sum(1 for b in before if VENDOR_MODELS.get(b.model, ("nvidia",))[0] == vendor)
    gpu.vendor_index = same if same != gpu.index else None
    gpu.compute_partition, gpu.memory_partition, gpu.subdevices = compute, memory, subdevices
    if vendor == "amd":
        gpu.uuid = "GPU-" + gpu.uuid.removeprefix("GPU-").replace("-", "")[:16]


def parse_spec(spec: str) -> tuple[str | None, list[_SimGpu], _Topology]:
    """``4xA100-80GB[,2xRTX4090]`` or a scenario JSON file -> (host name or None, GPUs, topology)."""
    path = Path(spec)
    if spec.endswith(".json") or path.is_file():
        return _parse_scenario(path)
    gpus: list[_SimGpu] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?([A-Za-z0-9_\-]+)\s*", part)
        if not m:
            raise ConfigError(f"bad --simulate value {spec!r}; "
                              "examples: 4xA100-80GB, 2xH100-80GB,1xRTX4090, scenario.json")
        count = int(m.group(1) or 1)
        if not 1 <= count <= 64:
            raise ConfigError(f"--simulate: between 1 and 64 GPUs per model, not {count}")
        model = _model(m.group(2))
        total = MODELS[model][1]
        for _ in range(count):
            i = len(gpus)
            # Each GPU drifts on its own period and phase so a demo fleet looks alive and varied;
            # every fourth one idles, as in any real fleet.
            if i % 4 == 3:
                util = _Signal(0, 0.0, 3.0, 40.0 + 13 * i, 1.7 * i)
                mem = _Signal(0, 0.004 * total, 0.01 * total, 90.0 + 17 * i, 0.9 * i)
            else:
                util = _Signal(0, 5.0 + 7 * (i % 3), 35.0 + 20 * (i % 4), 40.0 + 13 * i, 1.7 * i)
                mem = _Signal(0, 0.02 * total, (0.15 + 0.2 * (i % 4)) * total, 90.0 + 17 * i, 0.9 * i)
            gpus.append(_SimGpu(model, util, mem))
    return None, gpus, default_topology([g.model for g in gpus])


def _parse_scenario(path: Path) -> tuple[str | None, list[_SimGpu], _Topology]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read scenario {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"scenario {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list) or not data["gpus"]:
        raise ConfigError(f"scenario {path}: expected an object with a non-empty 'gpus' list")
    gpus = []
    for i, g in enumerate(data["gpus"]):
        if not isinstance(g, dict):
            raise ConfigError(f"scenario {path}: gpus[{i}] must be an object")
        model = _model(str(g.get("model", "A100-80GB")))
        temp = _signal(g["temperature"], "temperature") if "temperature" in g else None
        mig = g.get("mig") or []
        procs = g.get("processes") or []
        leases = g.get("leases") or []
        if not isinstance(mig, list) or not isinstance(procs, list) or not isinstance(leases, list):
            raise ConfigError(f"scenario {path}: gpus[{i}].mig, .processes and .leases must be lists")
        for what, entries in (("processes", procs), ("leases", leases)):
            for k, p in enumerate(entries):
                for key in ("from", "until"):
                    v = p.get(key) if isinstance(p, dict) else None
                    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0):
                        raise ConfigError(f"scenario {path}: gpus[{i}].{what}[{k}].{key} must be seconds >= 0")
        util = _signal(g.get("util", 0), f"gpus[{i}].util", phase=i)
        low, high = _extremes(util)
        if not 0 <= low <= high <= 100:
            raise ConfigError(f"scenario {path}: gpus[{i}].util must stay between 0 and 100 (percent)")
        memory = _signal(g.get("memory_used", 0), f"gpus[{i}].memory_used", convert=parse_bytes, phase=i)
        total = MODELS[model][1]
        if _extremes(memory)[1] > total:
            peak = format_bytes(int(_extremes(memory)[1]))
            raise ConfigError(f"scenario {path}: gpus[{i}].memory_used reaches {peak}, "
                              f"more than the {format_bytes(total)} of model {model}")
        in_procs = 0
        for k, p in enumerate(procs):
            try:
                in_procs += parse_bytes(p.get("memory", 0)) if isinstance(p, dict) else 0
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"scenario {path}: gpus[{i}].processes[{k}].memory: {exc}") from None
        if in_procs > total:
            raise ConfigError(f"scenario {path}: the processes of gpus[{i}] use {format_bytes(in_procs)}, "
                              f"more than the {format_bytes(total)} of model {model}")
        gpus.append(_SimGpu(
            model=model,
            util=util,
            memory=memory,
            temperature=temp,
            mig=[str(p) for p in mig],
            processes=[p for p in procs if isinstance(p, dict)],
            leases=[p for p in leases if isinstance(p, dict)],
            lost=bool(g.get("lost", False)),
        ))
    host = data.get("hostname")
    topology = _scenario_topology(data.get("topology"), [g.model for g in gpus], path)
    return (str(host) if host else None), gpus, topology


class SimulatedBackend:
    """The :class:`~gpusd.inventory.backend.Backend` on simulated GPUs (any vendor's)."""

    backend = "simulated"

    def __init__(self, spec: str, *, host: str | None = None, node: str | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        """``clock``: where the time comes from (default ``time.time``; tests inject simulated time).
        A scenario's processes and leases with ``from``/``until`` (seconds after this backend was
        made) come and go on that clock."""
        self._clock = clock or time.time
        self._t0 = self._clock()
        # GPU -> (time, mJ): the energy counter
        self._energy: dict[int, tuple[float, float]] = {}
        scenario_host, self._gpus, self._topology = parse_spec(spec)
        # a scenario file's, when it was last read
        self._stamp: tuple[int, int, int] | None = None
        if spec.endswith(".json") or Path(spec).is_file():
            try:
                st = Path(spec).stat()
                self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            except OSError:
                pass
        # each GPU's topology in the form that travels (gpusd.topology.compact), made once
        from ..topology import compact

        pairs = [GpuInfo(index=i, uuid="", links=self._topology.links(i)) for i in range(len(self._gpus))]
        compact(pairs)
        self._topologies = [g.topology for g in pairs]
        self.hostname = host or scenario_host or local_hostname()
        self.node_id = node or local_node_id()
        self.spec = spec
        self.driver_version = "550.54.15-sim"
        self.cuda_version = "12.4"
        # the vendors of the simulated GPUs, in their order (each has its visibility rule: inventory.vendors)
        self.vendors = tuple(dict.fromkeys(VENDOR_MODELS.get(g.model, ("nvidia",))[0] for g in self._gpus)) or (
            "nvidia",)

    def _reread_lost(self) -> None:
        """A scenario file edited while the backend runs: its GPUs' ``lost`` take effect (a GPU falls off
        the bus and comes back, docs/simulation.md); the rest of the scenario stays as it was read.  A
        file that no longer parses, or lists other GPUs, changes nothing."""
        path = Path(self.spec)
        try:
            st = path.stat()
        except OSError:
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            _, gpus, _ = _parse_scenario(path)
        except ConfigError:
            return
        if [g.model for g in gpus] == [g.model for g in self._gpus]:
            for mine, new in zip(self._gpus, gpus):
                mine.lost = new.lost

    def snapshot(self, util_since: Mapping[str, float] | None = None, detail: bool = True) -> HostSnapshot:
        if self._stamp is not None:
            self._reread_lost()
        t = self._clock()
        gpus = [self._gpu(i, g, t) for i, g in enumerate(self._gpus)]
        return with_machine(HostSnapshot(
            hostname=self.hostname,
            node_id=self.node_id,
            timestamp=t,
            gpus=gpus,
            driver_version=self.driver_version,
            # CUDA only where an NVIDIA GPU is simulated (an MI300X-only host has none)
            cuda_version=self.cuda_version if any(g.vendor == "nvidia" for g in gpus) else None,
            nvml_version=None,
            # HostSnapshot.simulated
            backend="simulated",
        ))

    def _gpu(self, i: int, g: _SimGpu, t: float) -> GpuInfo:
        name, total, plimit, mig_capable = MODELS[g.model]
        topo = self._topology
        gpu = GpuInfo(index=i, uuid=_uuid(self.hostname, i), name=name,
                      pci_bus_id=f"00000000:{0x10 + i * 0x10:02X}:00.0",
                      numa_node=topo.numa[i], local_cpus=topo.cpus[i], topology=self._topologies[i])
        _vendor_fields(gpu, g.model, self._gpus[:i])
        if g.lost:
            gpu.healthy, gpu.error = False, "GPU is lost (simulated)"
            return gpu
        util = max(0.0, min(100.0, g.util.at(t)))
        used = int(max(0, min(total, g.memory.at(t))))
        gpu.memory_total, gpu.memory_used, gpu.memory_free = total, used, total - used
        gpu.utilization_gpu = round(util, 1)
        gpu.utilization_window = 5.0
        gpu.utilization_memory = round(util * 0.6, 1)
        gpu.temperature = int(g.temperature.at(t)) if g.temperature else int(32 + util * 0.45)
        gpu.power_limit = plimit
        gpu.power_draw = round(plimit * (0.15 + 0.8 * util / 100), 1)
        gpu.fan_speed = (None if "A100" in g.model or "H" in g.model[:1] or g.model in VENDOR_MODELS
                         else int(30 + util * 0.5))
        gpu.compute_mode = "default"
        gpu.mig_mode = bool(g.mig) if mig_capable else None
        for k, profile in enumerate(g.mig):
            m = re.search(r"(\d+)gb", profile)
            mem = int(m.group(1)) * GiB if m else None
            gpu.mig_instances.append(MigInstance(
                index=k, uuid="MIG-" + _uuid(self.hostname, i * 100 + k)[4:], profile=profile,
                memory_total=mem, memory_used=0, gpu_instance_id=k + 1, compute_instance_id=0,
            ))
        for p in g.processes:
            if not _active(p, t - self._t0):
                continue
            try:
                gpu.processes.append(ProcessInfo(
                    pid=int(p.get("pid", 0)),
                    used_memory=parse_bytes(p.get("memory", 0)),
                    user=p.get("user"),
                    command=p.get("command"),
        ))
            except (TypeError, ValueError):
                continue
        for k, p in enumerate(g.leases):
            if not _active(p, t - self._t0):
                continue
            try:
                gpu.leases.append(LeaseInfo(
                    lease_id=str(p.get("lease_id") or f"sim{i}-{k}")[:64], pid=int(p.get("pid", 0)),
                    user=p.get("user"), started=self._t0 + float(p.get("from", 0)), command=p.get("command"),
                    device=gpu.uuid))
            except (TypeError, ValueError):
                continue
        in_procs = sum(p.used_memory or 0 for p in gpu.processes)
        if in_procs > used:
            gpu.memory_used, gpu.memory_free = min(total, in_procs), max(0, total - in_procs)
        # what the NVML backend reads; amdsmi and Sysman read none of it
        if gpu.vendor == "nvidia":
            self._telemetry(i, g.model, gpu, util, t)
        elif gpu.vendor == "amd":
            self._amd(i, g.model, gpu, util, t)
        return gpu

    def _amd(self, i: int, model: str, gpu: GpuInfo, util: float, t: float) -> None:
        """What the amdsmi backend reads beyond gpusd's common fields, as AMD's boards have it: the board's
        part number (the OAM MI300X's and MI250X's), no edge sensor on an MI300X (its temperature is the
        hotspot's), a memory sensor, clocks, energy integrated from the power draw, no ECC errors, a
        PCIe link, and the busy of each XCC on an MI300X."""
        gpu.board_model = AMD_BOARDS.get(model)
        core = gpu.temperature
        gpu.junction_temperature = core
        gpu.edge_temperature = None if model == "MI300X" or core is None else core - 8
        gpu.memory_temperature = None if core is None else core - 4
        gpu.clock_sm, gpu.clock_memory = int(2100 * (0.6 + 0.4 * util / 100)), 1300
        last_t, mj = self._energy.get(i, (self._t0, 1e9))
        mj += max(0.0, t - last_t) * (gpu.power_draw or 0.0) * 1000.0
        self._energy[i] = (max(t, last_t), mj)
        gpu.energy = int(mj)
        # no errors; a Gen5 x16 link (Gen4 on an MI250X) carrying traffic with the load
        gpu.ecc_correctable, gpu.ecc_uncorrectable, gpu.ecc_deferred = 0, 0, 0
        gpu.pcie_max_speed = gpu.pcie_speed = 16.0 if model == "MI250X" else 32.0
        gpu.pcie_bandwidth = int(64_000 * util / 100)
        gpu.pcie_replays, gpu.pcie_recoveries, gpu.pcie_replay_rollovers = 0, 0, 0
        gpu.pcie_nak_sent, gpu.pcie_nak_received = 0, 0
        # an MI300X in SPX mode: 8 compute dies (XCCs), each about as busy as the whole GPU
        if model == "MI300X":
            gpu.gfx_busy_xcc = [round(max(0.0, min(100.0, util + k - 3.5)), 1) for k in range(8)]

    def _telemetry(self, i: int, model: str, gpu: GpuInfo, util: float, t: float) -> None:
        """What the DCGM-named metrics read, made up consistently: clocks, a growing energy counter
        (the power draw integrated), no errors; GPM activity on Hopper and newer."""
        boost = 1980 if model[:1] == "H" else 1410
        gpu.clock_sm = int(boost * (0.6 + 0.4 * util / 100))
        gpu.clock_memory = 2619 if model[:1] == "H" else 1593
        gpu.memory_temperature = None if gpu.temperature is None else gpu.temperature + 4
        gpu.memory_reserved = 512 * 2**20
        last_t, mj = self._energy.get(i, (self._t0, 1e9))
        mj += max(0.0, t - last_t) * (gpu.power_draw or 0.0) * 1000.0
        self._energy[i] = (max(t, last_t), mj)
        gpu.energy = int(mj)
        gpu.pcie_replays, gpu.utilization_encoder, gpu.utilization_decoder = 0, 0, 0
        gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable = 0, 0
        gpu.row_remap_pending, gpu.row_remap_failure = False, False
        gpu.xid_last, gpu.xid_errors = 0, 0
        if model[:1] == "H":
            gpu.gpm_graphics_util = util
            gpu.gpm_tensor_util, gpu.gpm_dram_util = round(util * 0.5, 1), round(util * 0.6, 1)

    def close(self) -> None:
        pass

    def __enter__(self) -> SimulatedBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
