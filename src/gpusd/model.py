"""The data model every part of gpusd passes around: one host and its GPUs.

A :class:`HostSnapshot` is what the inventory backends produce, what selection ranks, what the daemon
serves over HTTP and what discovery clients receive.  Units are base units throughout: bytes, watts,
degrees Celsius, percent (0-100) for utilisation, seconds since the epoch for times.  A field the GPU
does not support is ``None`` — never 0 and never an exception.

``to_dict``/``from_dict`` convert losslessly to and from JSON-compatible dicts.  ``from_dict`` is the
entry point for data from the network: it validates types and raises :class:`ValueError` with a
message naming the bad field, so a malformed record can be logged and skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, TypeVar

SCHEMA_VERSION = 1

T = TypeVar("T")


def _check(value: Any, kinds: tuple[type, ...], name: str, optional: bool) -> Any:
    if value is None:
        if optional:
            return None
        raise ValueError(f"field {name!r} is required")
    # bool is an int subclass: never accept it where a number is meant, and vice versa.
    if isinstance(value, bool) and bool not in kinds:
        raise ValueError(f"field {name!r} must be {'/'.join(k.__name__ for k in kinds)}, got bool")
    if not isinstance(value, kinds):
        raise ValueError(
            f"field {name!r} must be {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}"
        )
    if float in kinds and isinstance(value, int):
        return float(value)
    return value


def _get(d: dict[str, Any], name: str, kinds: tuple[type, ...], optional: bool = True, default: Any = None) -> Any:
    return _check(d.get(name, default), kinds, name, optional)


def _list(d: dict[str, Any], name: str, parse: Callable[[Any], T], limit: int = 4096) -> list[T]:
    raw = d.get(name) or []
    if not isinstance(raw, list):
        raise ValueError(f"field {name!r} must be a list")
    if len(raw) > limit:
        raise ValueError(f"field {name!r} has {len(raw)} entries, more than {limit}")
    out = []
    for item in raw:
        if not isinstance(item, dict):
            raise ValueError(f"entries of {name!r} must be objects")
        out.append(parse(item))
    return out


INT = (int,)
NUM = (int, float)
STR = (str,)
BOOL = (bool,)


@dataclass(slots=True)
class ProcessInfo:
    """A process running on a GPU (or on one of its MIG instances)."""

    pid: int
    used_memory: int | None = None
    type: str = "compute"  # "compute" or "graphics"
    user: str | None = None  # None where the host cannot tell (containers without host PIDs)
    command: str | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "used_memory": self.used_memory,
            "type": self.type,
            "user": self.user,
            "command": self.command,
            "gpu_instance_id": self.gpu_instance_id,
            "compute_instance_id": self.compute_instance_id,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProcessInfo:
        return cls(
            pid=_get(d, "pid", INT, optional=False),
            used_memory=_get(d, "used_memory", INT),
            type=_get(d, "type", STR, default="compute"),
            user=_get(d, "user", STR),
            command=_get(d, "command", STR),
            gpu_instance_id=_get(d, "gpu_instance_id", INT),
            compute_instance_id=_get(d, "compute_instance_id", INT),
        )


@dataclass(slots=True)
class MigInstance:
    """A MIG slice of a GPU.  NVML reports no utilisation per slice."""

    index: int
    uuid: str
    profile: str | None = None  # e.g. "1g.10gb"
    memory_total: int | None = None
    memory_used: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    @property
    def memory_free(self) -> int | None:
        if self.memory_total is None or self.memory_used is None:
            return None
        return max(0, self.memory_total - self.memory_used)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "profile": self.profile,
            "memory_total": self.memory_total,
            "memory_used": self.memory_used,
            "gpu_instance_id": self.gpu_instance_id,
            "compute_instance_id": self.compute_instance_id,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MigInstance:
        return cls(
            index=_get(d, "index", INT, optional=False),
            uuid=_get(d, "uuid", STR, optional=False),
            profile=_get(d, "profile", STR),
            memory_total=_get(d, "memory_total", INT),
            memory_used=_get(d, "memory_used", INT),
            gpu_instance_id=_get(d, "gpu_instance_id", INT),
            compute_instance_id=_get(d, "compute_instance_id", INT),
        )


@dataclass(slots=True)
class LeaseInfo:
    """A lease held on a GPU by a job on this host (see :mod:`gpusd.alloc.leases`)."""

    lease_id: str
    pid: int
    user: str | None = None
    started: float | None = None  # seconds since the epoch
    memory: int | None = None  # bytes the job asked for; None: not stated
    shared: bool = False
    command: str | None = None
    device: str | None = None  # UUID of the leased GPU or MIG slice

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "device": self.device,
            "pid": self.pid,
            "user": self.user,
            "started": self.started,
            "memory": self.memory,
            "shared": self.shared,
            "command": self.command,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LeaseInfo:
        return cls(
            lease_id=_get(d, "lease_id", STR, optional=False),
            pid=_get(d, "pid", INT, optional=False),
            user=_get(d, "user", STR),
            started=_get(d, "started", NUM),
            memory=_get(d, "memory", INT),
            shared=_get(d, "shared", BOOL, default=False),
            command=_get(d, "command", STR),
            device=_get(d, "device", STR),
        )


@dataclass(slots=True)
class GpuInfo:
    """One physical GPU as seen at one moment."""

    index: int  # NVML index, which is nvidia-smi's (PCI bus) order
    uuid: str
    name: str | None = None
    pci_bus_id: str | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    memory_free: int | None = None
    utilization_gpu: float | None = None  # percent, averaged over utilization_window seconds
    utilization_memory: float | None = None  # percent (memory controller busy)
    utilization_window: float | None = None  # seconds the average covers; None: a single reading
    temperature: int | None = None  # degrees C
    power_draw: float | None = None  # watts
    power_limit: float | None = None  # watts
    fan_speed: int | None = None  # percent
    compute_mode: str | None = None  # "default", "exclusive_process", "prohibited"
    mig_mode: bool | None = None  # None: the GPU has no MIG support
    mig_instances: list[MigInstance] = field(default_factory=list)
    processes: list[ProcessInfo] = field(default_factory=list)
    leases: list[LeaseInfo] = field(default_factory=list)
    healthy: bool = True
    error: str | None = None  # why the GPU is unhealthy, or which query failed

    @property
    def memory_used_ratio(self) -> float | None:
        if not self.memory_total or self.memory_used is None:
            return None
        return self.memory_used / self.memory_total

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "pci_bus_id": self.pci_bus_id,
            "memory_total": self.memory_total,
            "memory_used": self.memory_used,
            "memory_free": self.memory_free,
            "utilization_gpu": self.utilization_gpu,
            "utilization_memory": self.utilization_memory,
            "utilization_window": self.utilization_window,
            "temperature": self.temperature,
            "power_draw": self.power_draw,
            "power_limit": self.power_limit,
            "fan_speed": self.fan_speed,
            "compute_mode": self.compute_mode,
            "mig_mode": self.mig_mode,
            "mig_instances": [m.to_dict() for m in self.mig_instances],
            "processes": [p.to_dict() for p in self.processes],
            "leases": [lease.to_dict() for lease in self.leases],
            "healthy": self.healthy,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuInfo:
        if not isinstance(d, dict):
            raise ValueError("a GPU must be an object")
        return cls(
            index=_get(d, "index", INT, optional=False),
            uuid=_get(d, "uuid", STR, optional=False),
            name=_get(d, "name", STR),
            pci_bus_id=_get(d, "pci_bus_id", STR),
            memory_total=_get(d, "memory_total", INT),
            memory_used=_get(d, "memory_used", INT),
            memory_free=_get(d, "memory_free", INT),
            utilization_gpu=_get(d, "utilization_gpu", NUM),
            utilization_memory=_get(d, "utilization_memory", NUM),
            utilization_window=_get(d, "utilization_window", NUM),
            temperature=_get(d, "temperature", INT),
            power_draw=_get(d, "power_draw", NUM),
            power_limit=_get(d, "power_limit", NUM),
            fan_speed=_get(d, "fan_speed", INT),
            compute_mode=_get(d, "compute_mode", STR),
            mig_mode=_get(d, "mig_mode", BOOL),
            mig_instances=_list(d, "mig_instances", MigInstance.from_dict, limit=64),
            processes=_list(d, "processes", ProcessInfo.from_dict),
            leases=_list(d, "leases", LeaseInfo.from_dict),
            healthy=_get(d, "healthy", BOOL, default=True),
            error=_get(d, "error", STR),
        )


@dataclass(slots=True)
class HostSnapshot:
    """One host and all its GPUs at one moment."""

    hostname: str
    node_id: str  # stable across restarts of the same machine (or state directory)
    timestamp: float
    gpus: list[GpuInfo] = field(default_factory=list)
    driver_version: str | None = None
    cuda_version: str | None = None  # e.g. "12.4"
    nvml_version: str | None = None
    backend: str = "nvml"  # "nvml" or "simulated"
    simulated: bool = False
    schema: int = SCHEMA_VERSION

    def gpu(self, key: int | str) -> GpuInfo:
        """The GPU with this index or UUID."""
        for g in self.gpus:
            if g.index == key or g.uuid == key:
                return g
        raise KeyError(key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "hostname": self.hostname,
            "node_id": self.node_id,
            "timestamp": self.timestamp,
            "driver_version": self.driver_version,
            "cuda_version": self.cuda_version,
            "nvml_version": self.nvml_version,
            "backend": self.backend,
            "simulated": self.simulated,
            "gpus": [g.to_dict() for g in self.gpus],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostSnapshot:
        if not isinstance(d, dict):
            raise ValueError("a host snapshot must be an object")
        schema = _get(d, "schema", INT, default=SCHEMA_VERSION)
        if schema != SCHEMA_VERSION:
            raise ValueError(f"unsupported snapshot schema {schema} (this gpusd reads {SCHEMA_VERSION})")
        return cls(
            schema=schema,
            hostname=_get(d, "hostname", STR, optional=False),
            node_id=_get(d, "node_id", STR, optional=False),
            timestamp=_get(d, "timestamp", NUM, optional=False),
            driver_version=_get(d, "driver_version", STR),
            cuda_version=_get(d, "cuda_version", STR),
            nvml_version=_get(d, "nvml_version", STR),
            backend=_get(d, "backend", STR, default="nvml"),
            simulated=_get(d, "simulated", BOOL, default=False),
            gpus=_list(d, "gpus", GpuInfo.from_dict, limit=256),
        )

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> HostSnapshot:
        import json

        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        return cls.from_dict(data)


__all__ = [
    "SCHEMA_VERSION",
    "HostSnapshot",
    "GpuInfo",
    "MigInstance",
    "ProcessInfo",
    "LeaseInfo",
]

# Keep the list of fields in one place for documentation tools.
FIELD_NAMES = {cls.__name__: [f.name for f in fields(cls)] for cls in (HostSnapshot, GpuInfo, MigInstance, ProcessInfo, LeaseInfo)}


# -- how a GPU's name is shown -----------------------------------------------------------------------
_NAME_PREFIXES = ("NVIDIA ",)  # the vendor, then at most one brand
_BRAND_PREFIXES = ("GeForce ", "Tesla ")


def display_name(name: str | None) -> str:
    """A GPU's name as every gpusd table shows it (``devices``, ``list``, ``scan``, ``watch``, ``top``,
    the dashboard): NVML's name without the vendor and brand prefixes.  ``NVIDIA A100-SXM4-80GB`` ->
    ``A100-SXM4-80GB``, ``NVIDIA GeForce RTX 4090`` -> ``RTX 4090``, ``Tesla T4`` -> ``T4``; ``-`` when
    unknown.  ``--json`` output keeps NVML's full name."""
    if not name:
        return "-"
    for prefix in _NAME_PREFIXES:
        name = name.removeprefix(prefix)
    for prefix in _BRAND_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return name or "-"


def name_matches(name: str | None, pattern: str) -> bool:
    """``--model``/``--filter``: does ``pattern`` match this GPU?  Case-insensitive; a glob (``*?[``)
    must match the whole shown name or the whole full name, other text is a substring of either."""
    p = pattern.lower()
    candidates = (display_name(name).lower(), (name or "").lower())
    if any(c in p for c in "*?["):
        from fnmatch import fnmatchcase

        return any(fnmatchcase(c, p) for c in candidates)
    return any(p in c for c in candidates)
