"""Read the local GPUs through NVML (nvidia-ml-py), in-process.

NVML is initialised once per backend and device handles are cached, so a snapshot costs only the
queries themselves (no nvidia-smi subprocess).  A query the GPU does not support leaves its field
``None`` and is not asked again; a GPU that fails mid-query (GPU lost, reset required, unknown error)
is reported unhealthy while the rest of the snapshot still comes back.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import ctypes
import os
import sys
import time
from time import monotonic as _monotonic

from ..errors import BackendUnavailable
from ..model import SCHEMA_VERSION, GpuInfo, GpuLink, GpuTopology, HostSnapshot, MigInstance, ProcessInfo
from ..record import maker, record
from ..topology import PCIE_LEVELS, machine
from .base import VendorBackend, VendorDevice
from .lost import GpuFailed as _GpuFailed
from .lost import filled
from .window import UtilWindow, utilisation

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Callable, Sequence


def _log() -> Any:
    # lazily: the CLI's start-up time matters
    import logging

    return logging.getLogger(__name__)


# NVML return codes (nvml.h).
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
_DRIVER_NOT_LOADED = 9
_LIB_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_CORRUPTED_INFOROM = 14
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_NO_DATA = 21
_UNKNOWN = 999
# The field is simply unavailable on this GPU (or this driver): leave it None, do not ask again.
_UNSUPPORTED = {_NOT_SUPPORTED, _FUNCTION_NOT_FOUND, _NO_PERMISSION}
# The GPU itself is in trouble: mark it unhealthy.
_FATAL = {_GPU_IS_LOST, _RESET_REQUIRED, _CORRUPTED_INFOROM, _UNKNOWN}

_COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}

# A number read from one of nvidia-ml-py's structures without the library's Python hook on every
# attribute read (``_PrintableStructure.__getattribute__``, which decodes bytes: these are numbers, so
# the value is the same; ~0.7 us a read, several per GPU and snapshot).
_field = object.__getattribute__


def _unpacker(cls: Any, code: str, names: tuple[str, ...]) -> Any:
    """``struct.Struct(code).unpack_from``, where the bindings' structure ``cls`` is exactly the fields
    ``names`` in that order, unsigned integers at the offsets and sizes that ``code`` gives them: one
    call then reads them all from the structure's bytes, the same numbers as reading each field, in a
    third of the time.  None where it is not (the fields are then read one by one)."""
    # already imported by ctypes
    import struct

    layout = struct.Struct(code)
    try:
        fields = list(cls._fields_)
        if ctypes.sizeof(cls) != layout.size or [f[0] for f in fields] != list(names):
            return None
        offset = 0
        for (name, kind), char in zip(fields, code[1:]):
            size = struct.calcsize("=" + char)
            described = getattr(cls, name)
            unsigned = char in "BHIQ" and getattr(kind, "_type_", "") in ("B", "H", "I", "L", "Q")
            if not unsigned or ctypes.sizeof(kind) != size or described.offset != offset or described.size != size:
                return None
            offset += size
    except (AttributeError, TypeError, ValueError):
        return None
    return layout.unpack_from


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _bus_key(bus_id: str | None) -> tuple[int, int, int, int] | None:
    """A PCI bus id (``00000000:07:00.0``, ``0000:07:00.0``, ``07:00.0``) as numbers, to compare."""
    if not bus_id:
        return None
    try:
        head, _, fn = bus_id.strip().rpartition(".")
        parts = head.split(":")
        dom = int(parts[-3], 16) if len(parts) >= 3 else 0
        return dom, int(parts[-2], 16), int(parts[-1], 16), int(fn, 16)
    except (ValueError, IndexError):
        return None


# The records' fields that NvmlBackend passes positionally, in their order (construction costs less
# than with keywords; tests/inventory/test_nvml_backend.py checks them against the model).
_GPU_FIELDS = ("index", "uuid", "name", "pci_bus_id", "memory_total", "memory_used", "memory_free", "utilization_gpu",
               "utilization_memory", "utilization_window", "temperature", "power_draw", "power_limit", "fan_speed",
               "compute_mode", "mig_mode", "mig_instances", "processes", "leases", "healthy", "error", "numa_node",
               "local_cpus", "links", "topology")
_HOST_FIELDS = ("hostname", "node_id", "timestamp", "gpus", "driver_version", "cuda_version", "nvml_version", "backend",
                "schema", "cpus", "sockets", "cores_per_socket", "threads_per_core", "memory")
_PROCESS_FIELDS = ("pid", "used_memory", "type", "user", "command", "gpu_instance_id", "compute_instance_id")
# a process's GPU or compute instance id where it has none (not on a MIG slice)
_NO_ID = 0xFFFFFFFF


def _process_list(compute: Any, graphics: Any, make: Callable[..., ProcessInfo] = ProcessInfo) -> list[ProcessInfo]:
    """The GPU's processes from NVML's two lists (None: not supported), compute first; a process using
    both compute and graphics is listed twice by NVML, once here.  ``make``: :class:`ProcessInfo` or
    its :func:`~gpusd.record.maker`.  (The two lists' loops are the same, written out: a snapshot makes
    one such list per GPU with processes.)"""
    out: list[ProcessInfo] = []
    seen: set[int] = set()
    no_id = _NO_ID
    # both bindings' entries: pid, usedGpuMemory (None: unknown), the instance ids, ints
    for p in compute or ():
        pid = p.pid
        if pid not in seen:
            seen.add(pid)
            gi, ci = p.gpuInstanceId, p.computeInstanceId
            # positional, in the fields' order (_PROCESS_FIELDS)
            out.append(make(pid, p.usedGpuMemory, "compute", None, None, None if gi == no_id else gi,
                            None if ci == no_id else ci))
    for p in graphics or ():
        pid = p.pid
        if pid not in seen:
            seen.add(pid)
            gi, ci = p.gpuInstanceId, p.computeInstanceId
            out.append(make(pid, p.usedGpuMemory, "graphics", None, None, None if gi == no_id else gi,
                            None if ci == no_id else ci))
    return out


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


# nvmlDeviceGetFieldValues: memory temperature, then NVLink raw TX/RX (KiB) of every link.
_FI_MEMORY_TEMP = 82
_FI_NVLINK_RAW_TX, _FI_NVLINK_RAW_RX = 140, 141
_NVLINK_MAX_LINKS = 18
_FIELDS: list[Any] = [_FI_MEMORY_TEMP] + [(f, link) for link in range(_NVLINK_MAX_LINKS)
                                          for f in (_FI_NVLINK_RAW_TX, _FI_NVLINK_RAW_RX)]
# nvmlValueType_t -> the member of the value union that holds it
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


# NVML GPM metric ids (nvml.h): graphics engine, any tensor pipe, DRAM bandwidth (percent); PCIe MiB/s
_GPM_GRAPHICS, _GPM_ANY_TENSOR, _GPM_DRAM_BW, _GPM_PCIE_TX, _GPM_PCIE_RX = 1, 5, 10, 20, 21
_GPM_METRICS = (_GPM_GRAPHICS, _GPM_ANY_TENSOR, _GPM_DRAM_BW, _GPM_PCIE_TX, _GPM_PCIE_RX)


def _free_gpm(nv: Any, sample: Any) -> None:
    try:
        nv.nvmlGpmSampleFree(sample)
    except nv.NVMLError:
        pass


def _field_key(f: Any) -> tuple[int, int]:
    return (f[0], f[1]) if isinstance(f, tuple) else (int(f), 0)


def _field_value(v: Any) -> float | int | None:
    """One nvmlFieldValue_t's value, or None where NVML could not read it."""
    if int(v.nvmlReturn) != 0:
        return None
    member = _VALUE_MEMBERS.get(int(v.valueType))
    if member is None:
        return None
    value = getattr(v.value, member)
    return float(value) if member == "dVal" else int(value)


class _XidWatcher:
    """XID errors from NVML's events (``nvmlEventSetWait``), in a thread of its own: the last XID and
    how many were seen per GPU since the daemon started.  GPUs whose driver offers no events read None."""

    _TIMEOUT_MS = 500

    def __init__(self, nv: Any) -> None:
        # here: the quick commands, which read no XID, do not import it
        import threading

        self._nv = nv
        self._set: Any = None
        self._lock = threading.Lock()
        # handle address -> uuid
        self._registered: dict[int, str] = {}
        # handles whose driver has no XID events
        self._refused: set[int] = set()
        # uuid -> (last, count)
        self._seen: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, devices: list[_Device]) -> None:
        nv = self._nv
        try:
            if self._set is None:
                self._set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            _log().debug("no NVML event set: %s", exc)
            return
        for dev in devices:
            if dev.handle is None:
                continue
            key = ctypes.cast(dev.handle, ctypes.c_void_p).value or 0
            with self._lock:
                if self._registered.get(key) == dev.uuid or key in self._refused:
                    continue
            try:
                nv.nvmlDeviceRegisterEvents(dev.handle, nv.nvmlEventTypeXidCriticalError, self._set)
            except nv.NVMLError as exc:
                _log().debug("GPU %d: no XID events: %s", dev.index, exc)
                if getattr(exc, "value", None) in _UNSUPPORTED:
                    self._refused.add(key)
                continue
            with self._lock:
                self._registered[key] = dev.uuid
                self._seen.setdefault(dev.uuid, (0, 0))
        if self._thread is None and self._registered:
            import threading

            self._thread = threading.Thread(target=self._run, name="gpusd-nvml-xid", daemon=True)
            self._thread.start()

    def read(self, uuid: str) -> tuple[int | None, int | None]:
        with self._lock:
            seen = self._seen.get(uuid)
        return (None, None) if seen is None else seen

    def _run(self) -> None:
        nv = self._nv
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait(self._set, self._TIMEOUT_MS)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) == 10:  # NVML_ERROR_TIMEOUT
                    continue
                _log().debug("NVML event wait failed: %s", exc)
                self._stop.wait(1.0)
                continue
            if not int(data.eventType) & nv.nvmlEventTypeXidCriticalError:
                continue
            key = ctypes.cast(data.device, ctypes.c_void_p).value or 0
            xid = int(data.eventData)
            with self._lock:
                uuid = self._registered.get(key)
                if uuid is not None:
                    self._seen[uuid] = (xid, self._seen.get(uuid, (0, 0))[1] + 1)
            _log().warning("GPU %s: XID %d", uuid or "?", xid)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._TIMEOUT_MS / 1000)
        if self._set is not None and (self._thread is None or not self._thread.is_alive()):
            try:
                self._nv.nvmlEventSetFree(self._set)
            except self._nv.NVMLError:
                pass


@record
class _Device(VendorDevice):
    # newest driver sample seen (microseconds)
    samples_ts: int = 0
    # topology: read once per device list (it does not change while the driver runs)
    numa_node: int | None = None
    local_cpus: str | None = None
    topo: GpuTopology | None = None
    # told its identity: a GPU that did not (lost) is left out of the topology
    answered: bool = True
    # the field values this GPU answers (None: not asked yet)
    fields: list[Any] | None = None
    # the last GPM sample taken (Hopper and newer)
    gpm_prev: Any = None
    # read once call by call: what it does not support is known (NvmlBackend._read_all)
    probed: bool = False
    # the compute and MIG modes as last read (a pick reads them again only every _FACTS_TTL s)
    mode: Any = None
    mig: Any = None


# How long a pick (a snapshot without detail) trusts what changes only by an administrator's hand (the
# number of GPUs, a GPU's compute and MIG modes: nvidia-smi -c / -mig, the latter only after a reset),
# in seconds on the monotonic clock: a process that picks again within it asks the driver only for what
# a pick weighs that changes by itself (memory, utilisation, processes), four calls per GPU.
_FACTS_TTL = 5.0
# seconds: the longest period a driver averages one utilisation reading over (NOTES.md)
_INSTANT = 1.0

# "nvidia-ml-py": every backend through the library (default: auto)
BINDINGS = "GPUSD_NVML_BINDINGS"


def _with_older(nv: Any, name: str) -> Callable[[Any], Any]:
    """``nv``'s process-list function ``name``, asking its ``_v2`` where the driver lacks the newest
    (nvidia-ml-py asks ``_v3``, which drivers before R510 do not have: the list would read as
    unsupported, a busy GPU as free).  nvmlfast goes down the versions itself."""
    newest = getattr(nv, name)
    older = getattr(nv, f"{name}_v2", None)
    if older is None:
        return newest  # type: ignore[no-any-return]
    error = nv.NVMLError
    # what its unversioned name raises then
    mismatch = getattr(nv, "NVMLLibraryMismatchError", ())

    def call(handle: Any) -> Any:
        try:
            return newest(handle)
        except mismatch:
            return older(handle)
        except error as exc:
            if getattr(exc, "value", None) != _FUNCTION_NOT_FOUND:
                raise
            return older(handle)

    return call


def bindings(telemetry: bool = False) -> Any:
    """The NVML bindings a backend calls: nvidia-ml-py (``pynvml``) where it reads telemetry (the
    daemon: clocks, fields, GPM, XID events) or where ``$GPUSD_NVML_BINDINGS`` is ``nvidia-ml-py``;
    else :mod:`gpusd.inventory.nvmlfast`, the same calls without the library's import (a one-shot
    command's start-up)."""
    choice = os.environ.get(BINDINGS, "").strip().lower()
    if choice not in ("", "auto", "nvidia-ml-py", "pynvml"):
        raise BackendUnavailable(f"{BINDINGS}: {choice[:20]!r} is not a choice (auto, nvidia-ml-py)")
    if not telemetry and choice in ("", "auto") and sys.platform.startswith("linux"):
        from . import nvmlfast

        return nvmlfast
    try:
        import pynvml
    except ImportError:  # pragma: no cover - a dependency of gpusd
        raise BackendUnavailable("the nvidia-ml-py package is not installed", hint=True) from None
    return pynvml


def load_library(path: str | None = None) -> None:
    """Load libnvidia-ml.so.1 from an explicit path (``GPUSD_NVML_LIBRARY``) before nvidia-ml-py looks
    for it by name: the dynamic loader then finds the loaded library by its soname."""
    path = path or os.environ.get("GPUSD_NVML_LIBRARY")
    if path:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise BackendUnavailable(f"cannot load the NVML library {path} ({exc})", hint=True) from None


class NvmlBackend(VendorBackend):
    """The local GPUs through NVML.  Thread-safe; one instance per process is enough."""

    backend = "nvml"
    vendor = "nvidia"
    library = "NVML"
    listing = "cannot count GPUs"
    # takes telemetry=: the DCGM-named metrics (inventory.combined.open_vendor)
    telemetry_counters = True
    # a pick reads the process lists of the GPUs it is about to choose only
    _defers_processes = True

    def __init__(self, *, util_window: float = 5.0, processes: bool = True, library: str | None = None,
                 telemetry: bool = False) -> None:
        super().__init__(util_window=util_window, processes=processes)
        self._count = -1
        # when the number of GPUs was read (monotonic): _refresh_devices
        self._facts_at = 0.0
        # whether this snapshot read it (and so the modes) again
        self._facts_fresh = True
        self._xids: _XidWatcher | None = None
        # the GPU pairs' topology of this device list (a one-GPU pick needs none)
        self._pairs_read = False
        # read what the DCGM-named metrics need (docs/monitoring.md)
        self.telemetry = telemetry
        self._nv = pynvml = bindings(telemetry)
        self._error = pynvml.NVMLError
        self._compute_processes = _with_older(pynvml, "nvmlDeviceGetComputeRunningProcesses")
        self._graphics_processes = _with_older(pynvml, "nvmlDeviceGetGraphicsRunningProcesses")
        # the memory (total, free, used) and utilisation (gpu, memory) structures read in one call each
        self._unpack_memory = _unpacker(getattr(pynvml, "c_nvmlMemory_t", None), "=QQQ", ("total", "free", "used"))
        self._unpack_rates = _unpacker(getattr(pynvml, "c_nvmlUtilization_t", None), "=II", ("gpu", "memory"))
        load_library(library)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == _LIB_NOT_FOUND:
                msg = "no NVIDIA driver library (libnvidia-ml.so.1 not found)"
            elif code == _DRIVER_NOT_LOADED:
                msg = "the NVIDIA driver is not loaded"
            else:
                msg = f"NVML failed to start: {_text(exc)}"
            raise BackendUnavailable(msg, hint=True) from None
        nv = pynvml
        # this machine's CPUs and memory, read once (as topology.with_machine adds them)
        self._machine = machine()
        # the snapshot's records made without the class call (gpusd.record.maker: a seventh less each); the
        # processes' maker on first use (a one-shot command on idle GPUs makes none)
        self._make_gpu = maker(GpuInfo)
        self._make_process: Callable[..., ProcessInfo] | None = None
        self.driver_version = self._global(nv.nvmlSystemGetDriverVersion)
        self.nvml_version = self._global(nv.nvmlSystemGetNVMLVersion)
        cuda = self._global(nv.nvmlSystemGetCudaDriverVersion)
        self.cuda_version = f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda is not None else None

    # -- what NVML's errors mean (VendorBackend._query) -----------------------------------------
    def _global(self, fn: Any) -> Any:
        try:
            value = fn()
        except self._nv.NVMLError:
            return None
        return _text(value) if isinstance(value, bytes | str) else value

    def _unsupported(self, exc: BaseException) -> bool:
        return getattr(exc, "value", None) in _UNSUPPORTED

    def _failed(self, dev: Any, key: str, exc: BaseException) -> str | None:
        if getattr(exc, "value", None) in _FATAL:
            return _text(exc)
        _log().debug("GPU %d: %s failed: %s", dev.index, key, exc)
        return None

    def _list_reason(self, exc: BaseException) -> str | None:
        return _text(exc) if isinstance(exc, self._nv.NVMLError) else None

    def _refresh_devices(self) -> None:
        nv = self._nv
        now = _monotonic()
        if not self._detail and self._count >= 0 and now - self._facts_at < _FACTS_TTL:
            self._facts_fresh = False
            return
        self._facts_fresh = True
        self._facts_at = now
        count = nv.nvmlDeviceGetCount()
        if count == self._count:
            return
        devices: list[_Device] = []
        for i in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
            except nv.NVMLError as exc:
                devices.append(_Device(i, None, f"unknown-{i}", None, None))
                _log().warning("GPU %d: no handle: %s", i, exc)
                continue
            dev = _Device(i, handle, "", None, None, util=UtilWindow(self.util_window))
            try:
                dev.uuid = _text(nv.nvmlDeviceGetUUID(handle))
            except nv.NVMLError:
                dev.uuid = f"unknown-{i}"
                dev.answered = False
            dev.name = self._query_safe(dev, "name", nv.nvmlDeviceGetName)
            pci = self._query_safe(dev, "pci", nv.nvmlDeviceGetPciInfo)
            dev.pci_bus_id = _text(pci.busId) if pci is not None else None
            devices.append(dev)
        for old in self._devices:
            if old.gpm_prev is not None:
                _free_gpm(nv, old.gpm_prev)
        self._devices = devices
        self._count = count
        self._pairs_read = False
        self._topology(devices)

    # -- topology (docs/inventory.md, "Topology"): read once per device list ---------------------
    def _topology(self, devices: list[_Device]) -> None:
        """Each GPU's NUMA node and CPUs; its links with the other GPUs: :meth:`_pair_topology`."""
        nv = self._nv
        # 1024 CPUs at least: ids can be sparse
        words = max(16, ((os.cpu_count() or 64) + 63) // 64)
        for dev in devices:
            if dev.handle is None:
                continue
            try:
                node = int(nv.nvmlDeviceGetNumaNodeId(dev.handle))
                dev.numa_node = node if 0 <= node < 65536 else None
            except (nv.NVMLError, AttributeError, TypeError, ValueError):
                pass
            try:
                mask = nv.nvmlDeviceGetCpuAffinity(dev.handle, words)
                cpus = [w * 64 + b for w, word in enumerate(mask) for b in range(64) if (int(word) >> b) & 1]
                if cpus:
                    from ..model import MAX_NAME
                    from ..topology import format_cpulist

                    text = format_cpulist(cpus)
                    # a list longer than a wire string is unknown: cut, it would name other CPUs
                    dev.local_cpus = text if len(text) <= MAX_NAME else None
            except (nv.NVMLError, AttributeError, TypeError, ValueError):
                pass

    def _pair_topology(self, devices: list[_Device]) -> None:
        """How the GPUs connect (PCIe groups, NVLinks, NVSwitch fabrics): read by the first snapshot that
        wants it (a one-GPU pick does not: each GPU's 18 NVLinks are most of a one-shot pick's calls)."""
        nv = self._nv
        live = [d for d in devices if d.handle is not None and d.answered]
        pcie = self._pcie_groups(live)
        by_bus = {_bus_key(d.pci_bus_id): d.index for d in devices if d.pci_bus_id}
        remote = {d.index: self._nvlinks(d) for d in live}
        to_switch = {i: sum(1 for bus in mine if bus not in by_bus) for i, mine in remote.items()}
        # NVSwitch fabrics: GPUs with links to switches, grouped by NVML's P2P status over NVLink with
        # the group's first GPU (a fabric manager that is down leaves them apart): one call per GPU
        fabric: dict[int, int] = {}
        waiting = [d for d in live if to_switch[d.index]]
        while waiting:
            first, rest = waiting[0], waiting[1:]
            fabric[first.index] = first.index
            apart = []
            for b in rest:
                try:
                    ok = nv.nvmlDeviceGetP2PStatus(first.handle, b.handle, nv.NVML_P2P_CAPS_INDEX_NVLINK) == 0
                except (nv.NVMLError, AttributeError, TypeError, ValueError):
                    ok = False
                if ok:
                    fabric[b.index] = first.index
                else:
                    apart.append(b)
            waiting = apart
        for a in devices:
            a.topo = None
            if a.handle is None or not a.answered:
                continue
            bonds: dict[int, int] = {}
            for bus in remote.get(a.index, []):
                peer = by_bus.get(bus)
                if peer is not None and peer != a.index:
                    bonds[peer] = bonds.get(peer, 0) + 1
            f = fabric.get(a.index)
            if a.index not in pcie and not bonds and f is None:
                continue
            a.topo = GpuTopology(pcie=pcie.get(a.index, []), nvlink=[GpuLink(peer=p, nvlink=n) for p, n in
                                                                    sorted(bonds.items())],
                                 fabric=f, fabric_links=to_switch.get(a.index, 0) if f is not None else 0)

    def _pcie_groups(self, live: list[_Device]) -> dict[int, list[int]]:
        """Each GPU's groups at NVML's levels (:class:`GpuTopology`'s ``pcie``), from
        ``nvmlDeviceGetTopologyNearestGpus``: from the widest level down, one query per group that
        may split (a GPU alone at a level is alone below it), so the calls grow with the GPUs, not
        their pairs.  Empty where the driver cannot tell."""
        nv = self._nv
        nearest = getattr(nv, "nvmlDeviceGetTopologyNearestGpus", None)
        if nearest is None or len(live) < 2:
            return {}
        index_of = {ctypes.cast(d.handle, ctypes.c_void_p).value: d.index for d in live}
        blocks = [list(live)]
        groups: dict[int, list[int]] = {d.index: [] for d in live}
        for level in reversed(PCIE_LEVELS):
            split: list[list[_Device]] = []
            for block in blocks:
                rest = block
                while rest:
                    a = rest[0]
                    if len(rest) == 1:
                        split.append([a])
                        break
                    try:
                        near = {index_of.get(ctypes.cast(h, ctypes.c_void_p).value) for h in nearest(a.handle, level)}
                    except (nv.NVMLError, AttributeError, TypeError, ValueError):
                        return {}
                    members = [a] + [b for b in rest[1:] if b.index in near]
                    split.append(members)
                    rest = [b for b in rest[1:] if b.index not in near]
            for members in split:
                low = min(d.index for d in members)
                for d in members:
                    groups[d.index].append(low)
            blocks = split
        # PCIE_LEVELS' order: INTERNAL first
        return {i: g[::-1] for i, g in groups.items()}

    def _nvlinks(self, dev: _Device) -> list[tuple[int, int, int, int]]:
        """The remote PCI address of each active NVLink of ``dev`` (empty: none, or no NVLink)."""
        nv = self._nv
        out: list[tuple[int, int, int, int]] = []
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if not nv.nvmlDeviceGetNvLinkState(dev.handle, link):
                    continue
                pci = nv.nvmlDeviceGetNvLinkRemotePciInfo(dev.handle, link)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) == _NOT_SUPPORTED and link > 0:
                    continue  # this link only
                # no NVLink on this GPU, or past its last link (INVALID_ARGUMENT)
                break
            except (AttributeError, TypeError):
                break
            key = _bus_key(_text(pci.busId))
            if key is not None:
                out.append(key)
        return out

    def _query_safe(self, dev: _Device, key: str, fn: Any) -> Any:
        try:
            value = self._query(dev, key, fn)
        except _GpuFailed:
            return None
        return _text(value) if isinstance(value, bytes) else value

    # -- the snapshot (VendorBackend.snapshot) ---------------------------------------------------
    def _before_read(self) -> None:
        if self._pairs_now and not self._pairs_read:
            self._pairs_read = True
            self._pair_topology(self._devices)
        if self._detail and self.telemetry:
            if self._xids is None:
                self._xids = _XidWatcher(self._nv)
            self._xids.register(self._devices)

    def _host(self, gpus: list[GpuInfo]) -> HostSnapshot:
        m = self._machine
        # positional, in the fields' order (_HOST_FIELDS): half the cost of the keywords
        return HostSnapshot(self.hostname, self.node_id, time.time(), gpus, self.driver_version, self.cuda_version,
                            self.nvml_version, "nvml", SCHEMA_VERSION, m["cpus"], m["sockets"], m["cores_per_socket"],
                            m["threads_per_core"], m["memory"])

    def _blank(self, dev: _Device) -> GpuInfo:
        """The GPU's record before any reading: what the device list knows."""
        return self._make_gpu(dev.index, dev.uuid, dev.name, dev.pci_bus_id, numa_node=dev.numa_node,
                              local_cpus=dev.local_cpus, topology=dev.topo)

    def _read(self, dev: _Device) -> GpuInfo:
        return self._read_all((dev,))[0]

    def _read_all(self, devices: Sequence[_Device]) -> list[GpuInfo]:
        """Each GPU's record, read in straight-line calls for a GPU that answers every call it supports
        (the usual case), the readings kept in locals and the record made once, from its fields in order
        (:data:`_GPU_FIELDS`), all GPUs in one loop: the snapshot within 1.2x of raw NVML.
        Where a call fails, the GPU is read again call by call (:meth:`_fill`), to tell unsupported from
        failed (the former are not asked again); a GPU's first reading is call by call (a one-shot
        command's one snapshot would otherwise stop at the first query the GPU does not answer, a fan's
        on a data-centre board, and read the GPU twice).  A GPU that fails in the sample buffer or the MIG
        slices (:class:`_GpuFailed`) has the fields read before it, as with :meth:`_fill`.  With telemetry:
        :meth:`_read_telemetry`.  The same records either way (tests/inventory/test_nvml_backend.py).
        Numbers are read from nvidia-ml-py's structures with :data:`_unpacker` (else :data:`_field`)."""
        if self.telemetry:
            return [self._read_telemetry(dev) for dev in devices]
        nv = self._nv
        error_type = nv.NVMLError
        detail, own_window = self._detail, not self._util_since
        want_processes = self.want_processes and self._processes_now
        fresh = detail or self._facts_fresh
        unpack_memory, unpack_rates = self._unpack_memory, self._unpack_rates
        make_gpu, make_process = self._make_gpu, self._make_process
        clock = time.time
        out: list[GpuInfo] = []
        for dev in devices:
            h = dev.handle
            if h is None:
                out.append(self._no_handle(dev))
                continue
            # its first reading: call by call, which learns what it does not support (a
            if not dev.probed:
                # straight-line read would stop at the first such call and read it again)
                dev.probed = True
                out.append(filled(self._blank(dev), self._fill, dev))
                continue
            uns = dev.unsupported
            total = used = free = util_memory = reading = temperature = power = limit = fan = mode = mig = None
            processes: list[ProcessInfo] = []
            try:
                if "memory" not in uns:
                    mem = nv.nvmlDeviceGetMemoryInfo(h)
                    if unpack_memory is not None:
                        total, free, used = unpack_memory(mem)
                    else:
                        total, used, free = _field(mem, "total"), _field(mem, "used"), _field(mem, "free")
                # A pick (no detail) weighs the utilisation over the window, which the driver's sample
                # buffer gives alone: the instant reading only where it has no buffer, or gave nothing yet.
                rates_later = not detail and "samples" not in uns
                if "utilization" not in uns and not rates_later:
                    rates = nv.nvmlDeviceGetUtilizationRates(h)
                    if unpack_rates is not None:
                        reading, util_memory = unpack_rates(rates)
                        reading, util_memory = float(reading), float(util_memory)
                    else:
                        util_memory, reading = float(_field(rates, "memory")), float(_field(rates, "gpu"))
                if detail:
                    if "temperature" not in uns:
                        temperature = nv.nvmlDeviceGetTemperature(h, 0)
                    if "power" not in uns:
                        power = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
                    if "power_limit" not in uns:
                        limit = nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
                    if "fan" not in uns:
                        fan = nv.nvmlDeviceGetFanSpeed(h)
                if "compute_mode" not in uns:
                    if fresh or dev.mode is None:
                        dev.mode = nv.nvmlDeviceGetComputeMode(h)
                    mode = _COMPUTE_MODES.get(dev.mode)
                if "mig_mode" not in uns:
                    if fresh or dev.mig is None:
                        dev.mig = nv.nvmlDeviceGetMigMode(h)
                    mig = dev.mig
                if want_processes:
                    compute = self._compute_processes(h) if "processes_compute" not in uns else None
                    graphics = (self._graphics_processes(h) if "processes_graphics" not in uns
                                else None)
                    if compute or graphics:
                        if make_process is None:
                            make_process = self._make_process = maker(ProcessInfo)
                        processes = _process_list(compute, graphics, make_process)
            except error_type:
                out.append(filled(self._blank(dev), self._fill, dev))
                continue
            # Past the last direct call: what follows raises no NVMLError (only _GpuFailed), so a GPU read
            # again by _fill never adds a second reading to its utilisation window.
            util = covered = mig_mode = error = None
            migs: list[MigInstance] = []
            try:
                if reading is not None and own_window and "samples" in uns:
                    # no driver sample buffer: the window from our own readings (_utilization, inline)
                    util, covered = dev.util.add_mean(clock(), reading)  # type: ignore[union-attr]
                else:
                    util, covered = self._utilization(dev, reading, clock())
                    if util is None and rates_later and "utilization" not in uns:
                        util, covered = self._instant(dev, clock())
                if mig is not None:
                    mig_mode = bool(mig[0])
                    if mig_mode:
                        migs = self._migs(dev)
            except _GpuFailed as exc:
                error = exc.reason
            # positional, in the fields' order (_GPU_FIELDS); the topology is shared: nobody edits it
            out.append(make_gpu(dev.index, dev.uuid, dev.name, dev.pci_bus_id, total, used, free, util, util_memory,
                                covered, temperature, power, limit, fan, mode, mig_mode, migs, processes, [],
                                error is None, error, dev.numa_node, dev.local_cpus, [], dev.topo))
        return out

    def _instant(self, dev: _Device, now: float) -> tuple[float | None, float | None]:
        """A pick's utilisation where the driver's buffer gave no sample in its window (since a lease on
        the GPU ended, or at all): the instant reading, as a snapshot with detail gives it.  The driver
        averages that reading over its last 1/6 to 1 s, as it does each sample: a sample at most
        :data:`_INSTANT` s old is that reading, and saves the call.  Raises _GpuFailed only."""
        window = dev.util
        assert window is not None
        since = self._util_since.get(dev.uuid) if self._util_since else None
        newest = window.newest(now, _INSTANT)
        if newest is not None:
            return utilisation(window, now, since, newest)
        rates = self._query(dev, "utilization", self._nv.nvmlDeviceGetUtilizationRates)
        if rates is None:
            return None, None
        reading = float(_field(rates, "gpu"))
        if window.last_ts() is None:
            window.add(now, reading)
        return utilisation(window, now, since, reading)

    def _no_handle(self, dev: _Device) -> GpuInfo:
        gpu = self._blank(dev)
        gpu.healthy, gpu.error = False, "no NVML handle"
        return gpu

    def _read_telemetry(self, dev: _Device) -> GpuInfo:
        """:meth:`_read` with telemetry: the record made first and filled by :meth:`_fill_fast`, whose
        order of calls (telemetry before the compute mode, MIG and processes) decides what a GPU that
        fails in its telemetry still shows."""
        if dev.handle is None:
            return self._no_handle(dev)
        gpu = self._blank(dev)
        try:
            self._fill_fast(dev, gpu)
            return gpu
        except _GpuFailed as exc:
            # from the sample buffer or the MIG slices
            gpu.healthy = False
            gpu.error = exc.reason
            return gpu
        except self._nv.NVMLError:
            # a call failed: again, call by call
            pass
        return filled(self._blank(dev), self._fill, dev)

    def _fill_fast(self, dev: _Device, gpu: GpuInfo) -> None:
        """:meth:`_fill` with telemetry in straight-line calls, for a GPU that answers every call it
        supports (the usual case): the same readings, without a wrapper per call.  The first error
        raises; :meth:`_read_telemetry` then reads the GPU with :meth:`_fill`.  The numbers are read from
        nvidia-ml-py's structures with :data:`_field` (see there)."""
        nv = self._nv
        h = dev.handle
        uns = dev.unsupported
        if "memory" not in uns:
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            gpu.memory_total, gpu.memory_used, gpu.memory_free = _field(mem, "total"), _field(mem, "used"), \
                _field(mem, "free")
        reading = None
        if "utilization" not in uns:
            rates = nv.nvmlDeviceGetUtilizationRates(h)
            gpu.utilization_memory = float(_field(rates, "memory"))
            reading = float(_field(rates, "gpu"))
        if self._detail:
            if "temperature" not in uns:
                gpu.temperature = nv.nvmlDeviceGetTemperature(h, 0)
            if "power" not in uns:
                gpu.power_draw = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
            if "power_limit" not in uns:
                gpu.power_limit = nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
            if "fan" not in uns:
                gpu.fan_speed = nv.nvmlDeviceGetFanSpeed(h)
            if self.telemetry:
                self._telemetry(dev, gpu)
        if "compute_mode" not in uns:
            gpu.compute_mode = _COMPUTE_MODES.get(nv.nvmlDeviceGetComputeMode(h))
        mig = nv.nvmlDeviceGetMigMode(h) if "mig_mode" not in uns else None
        if self.want_processes and self._processes_now:
            compute = (self._compute_processes(h) if "processes_compute" not in uns else None)
            graphics = (self._graphics_processes(h) if "processes_graphics" not in uns else None)
            if compute or graphics:
                gpu.processes = _process_list(compute, graphics)
        # Past the last direct call: what follows raises no NVMLError (only _GpuFailed), so a GPU read
        # again by _fill never adds a second reading to its utilisation window.
        gpu.utilization_gpu, gpu.utilization_window = self._utilization(dev, reading, time.time())
        if mig is not None:
            gpu.mig_mode = bool(mig[0])
            if gpu.mig_mode:
                gpu.mig_instances = self._migs(dev)

    def _fill(self, dev: _Device, gpu: GpuInfo) -> None:
        nv = self._nv
        q = self._query
        mem = q(dev, "memory", nv.nvmlDeviceGetMemoryInfo)
        if mem is not None:
            gpu.memory_total, gpu.memory_used, gpu.memory_free = int(mem.total), int(mem.used), int(mem.free)
        rates = q(dev, "utilization", nv.nvmlDeviceGetUtilizationRates)
        now = time.time()
        if rates is not None:
            gpu.utilization_memory = float(rates.memory)
        gpu.utilization_gpu, gpu.utilization_window = self._utilization(
            dev, float(rates.gpu) if rates is not None else None, now)
        if not self._detail and "samples" not in dev.unsupported:
            # as _read_all, which a pick spares the call that reads it
            gpu.utilization_memory = None
        if self._detail:
            gpu.temperature = q(dev, "temperature", nv.nvmlDeviceGetTemperature, 0)
            power = q(dev, "power", nv.nvmlDeviceGetPowerUsage)
            gpu.power_draw = power / 1000.0 if power is not None else None
            limit = q(dev, "power_limit", nv.nvmlDeviceGetEnforcedPowerLimit)
            gpu.power_limit = limit / 1000.0 if limit is not None else None
            gpu.fan_speed = q(dev, "fan", nv.nvmlDeviceGetFanSpeed)
            if self.telemetry:
                self._telemetry(dev, gpu)
        mode = dev.mode = q(dev, "compute_mode", nv.nvmlDeviceGetComputeMode)
        gpu.compute_mode = _COMPUTE_MODES.get(mode) if mode is not None else None
        mig = dev.mig = q(dev, "mig_mode", nv.nvmlDeviceGetMigMode)
        if mig is not None:
            self._mig_mode(dev, gpu, mig)
        if self.want_processes and self._processes_now:
            gpu.processes = _process_list(q(dev, "processes_compute", self._compute_processes),
                                          q(dev, "processes_graphics", self._graphics_processes))

    def _processes_of(self, dev: _Device) -> list[ProcessInfo]:
        if dev.handle is None:
            return []
        compute = self._query(dev, "processes_compute", self._compute_processes)
        graphics = self._query(dev, "processes_graphics", self._graphics_processes)
        if not (compute or graphics):
            return []
        if self._make_process is None:
            self._make_process = maker(ProcessInfo)
        return _process_list(compute, graphics, self._make_process)

    def _mig_mode(self, dev: _Device, gpu: GpuInfo, mig: Any) -> None:
        """The GPU's MIG mode (NVML's [current, pending]) and, where it is on, its MIG instances: the
        same on both paths."""
        gpu.mig_mode = bool(mig[0])
        if gpu.mig_mode:
            gpu.mig_instances = self._migs(dev)

    def _telemetry(self, dev: _Device, gpu: GpuInfo) -> None:
        """What the DCGM exporter's default counters read (docs/monitoring.md): clocks, memory
        temperature, reserved memory, energy, PCIe replays, encoder/decoder, NVLink, remapped rows, XIDs."""
        nv = self._nv
        q = self._query
        gpu.clock_sm = _int(q(dev, "clock_sm", nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM))
        gpu.clock_memory = _int(q(dev, "clock_mem", nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM))
        mem2 = q(dev, "memory_v2", nv.nvmlDeviceGetMemoryInfo, nv.nvmlMemory_v2)
        gpu.memory_reserved = _int(getattr(mem2, "reserved", None))
        gpu.energy = _int(q(dev, "energy", nv.nvmlDeviceGetTotalEnergyConsumption))
        gpu.pcie_replays = _int(q(dev, "pcie_replay", nv.nvmlDeviceGetPcieReplayCounter))
        enc = q(dev, "encoder", nv.nvmlDeviceGetEncoderUtilization)
        gpu.utilization_encoder = _int(enc[0]) if enc is not None else None
        dec = q(dev, "decoder", nv.nvmlDeviceGetDecoderUtilization)
        gpu.utilization_decoder = _int(dec[0]) if dec is not None else None
        rows = q(dev, "remapped_rows", nv.nvmlDeviceGetRemappedRows)
        if rows is not None:
            corr, unc, pending, failure = rows
            gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable = int(corr), int(unc)
            gpu.row_remap_pending, gpu.row_remap_failure = bool(pending), bool(failure)
        ids = _FIELDS if dev.fields is None else dev.fields
        values = q(dev, "fields", nv.nvmlDeviceGetFieldValues, ids) if ids else None
        if values is not None:
            read = {(int(v.fieldId), int(v.scopeId)): _field_value(v) for v in values}
            # ask only for what the GPU answered from now on (most have no NVLink)
            if dev.fields is None:
                dev.fields = [f for f in _FIELDS if read.get(_field_key(f)) is not None]
            gpu.memory_temperature = _int(read.get((_FI_MEMORY_TEMP, 0)))
            links = [v for (fid, _), v in read.items() if fid != _FI_MEMORY_TEMP and v is not None]
            gpu.nvlink_bytes = int(sum(links)) * 1024 if links else None  # KiB -> bytes
        if self._xids is not None:
            gpu.xid_last, gpu.xid_errors = self._xids.read(dev.uuid)
        gpm = self._gpm(dev)
        gpu.gpm_graphics_util = gpm.get(_GPM_GRAPHICS)
        gpu.gpm_tensor_util = gpm.get(_GPM_ANY_TENSOR)
        gpu.gpm_dram_util = gpm.get(_GPM_DRAM_BW)
        for attr, mid in (("pcie_tx_rate", _GPM_PCIE_TX), ("pcie_rx_rate", _GPM_PCIE_RX)):
            value = gpm.get(mid)
            setattr(gpu, attr, None if value is None else value * 2**20)  # MiB/s -> bytes/s

    def _gpm(self, dev: _Device) -> dict[int, float]:
        """GPM metrics (``nvmlGpmMetricsGet``) between the previous sample of this GPU and a new one;
        empty on the first call and where the GPU has no GPM (before Hopper)."""
        nv = self._nv
        if "gpm" in dev.unsupported or not hasattr(nv, "nvmlGpmSampleAlloc"):
            return {}
        try:
            if dev.gpm_prev is None and not nv.nvmlGpmQueryDeviceSupport(dev.handle).isSupportedDevice:
                dev.unsupported.add("gpm")
                return {}
            sample = nv.nvmlGpmSampleAlloc()
            try:
                nv.nvmlGpmSampleGet(dev.handle, sample)
            except nv.NVMLError:
                nv.nvmlGpmSampleFree(sample)
                raise
        except nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in _FATAL:
                raise _GpuFailed(_text(exc)) from None
            if code in _UNSUPPORTED:
                dev.unsupported.add("gpm")
            return {}
        prev, dev.gpm_prev = dev.gpm_prev, sample
        if prev is None:
            return {}
        try:
            mg = nv.c_nvmlGpmMetricsGet_t()
            mg.version = nv.NVML_GPM_METRICS_GET_VERSION
            mg.numMetrics = len(_GPM_METRICS)
            mg.sample1, mg.sample2 = prev, sample
            for i, mid in enumerate(_GPM_METRICS):
                mg.metrics[i].metricId = mid
            nv.nvmlGpmMetricsGet(mg)
            return {int(m.metricId): float(m.value) for m in mg.metrics[:len(_GPM_METRICS)]
                    if int(m.nvmlReturn) == 0}
        except nv.NVMLError as exc:
            _log().debug("GPU %d: GPM metrics failed: %s", dev.index, exc)
            return {}
        finally:
            _free_gpm(nv, prev)

    def _utilization(self, dev: _Device, reading: float | None, now: float) -> tuple[float | None, float | None]:
        """The GPU's utilisation over the window and the seconds it covers (``reading``: this instant's,
        None where unsupported), as :func:`~gpusd.inventory.window.utilisation` gives them."""
        window = dev.util
        assert window is not None
        since = self._util_since.get(dev.uuid) if self._util_since else None
        uns = dev.unsupported
        # no driver sample buffer: the window from our own readings
        if "samples" in uns:
            return utilisation(window, now, since, reading, own=True)
        samples = None
        since_us = max(dev.samples_ts, int((now - self.util_window) * 1e6))
        try:
            _, samples = self._nv.nvmlDeviceGetSamples(dev.handle, self._nv.NVML_GPU_UTILIZATION_SAMPLES, since_us)
        except self._nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in _FATAL:
                raise _GpuFailed(_text(exc)) from None
            if code in _UNSUPPORTED:
                uns.add("samples")
            samples = None
        if samples:
            for s in samples:
                ts = int(_field(s, "timeStamp"))
                if ts > dev.samples_ts:
                    window.add(ts / 1e6, float(_field(_field(s, "sampleValue"), "uiVal")))
                    dev.samples_ts = ts
        elif reading is not None and ("samples" in uns or window.last_ts() is None):
            # No driver sample buffer: build the window from our own readings.
            window.add(now, reading)
        return utilisation(window, now, since, reading)

    def _migs(self, dev: _Device) -> list[MigInstance]:
        nv = self._nv
        out: list[MigInstance] = []
        count = self._query(dev, "mig_count", nv.nvmlDeviceGetMaxMigDeviceCount) or 0
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetMigDeviceHandleByIndex(dev.handle, i)
            except nv.NVMLError:
                # an empty slot answers NOT_FOUND
                continue
            mig = MigInstance(index=i, uuid="")
            try:
                mig.uuid = _text(nv.nvmlDeviceGetUUID(h))
            except nv.NVMLError:
                continue
            try:
                name = _text(nv.nvmlDeviceGetName(h))
                mig.profile = name.rsplit(" MIG ", 1)[1] if " MIG " in name else name
            except nv.NVMLError:
                pass
            try:
                m = nv.nvmlDeviceGetMemoryInfo(h)
                mig.memory_total, mig.memory_used = int(m.total), int(m.used)
            except nv.NVMLError:
                pass
            for attr, fn in (("gpu_instance_id", nv.nvmlDeviceGetGpuInstanceId),
                             ("compute_instance_id", nv.nvmlDeviceGetComputeInstanceId)):
                try:
                    setattr(mig, attr, int(fn(h)))
                except nv.NVMLError:
                    pass
            out.append(mig)
        return out

    def _shutdown(self) -> None:
        if self._xids is not None:
            self._xids.close()
        for dev in self._devices:
            if dev.gpm_prev is not None:
                _free_gpm(self._nv, dev.gpm_prev)
                dev.gpm_prev = None
        try:
            self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            pass
