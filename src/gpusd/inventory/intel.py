"""Read the local Intel GPUs (Data Center GPU Max, Arc) through Level Zero Sysman: ``pyzes`` (PyPI,
Intel's ctypes bindings) over the Level Zero loader ``libze_loader.so.1``.

``pyzes`` loads ``/usr/lib/x86_64-linux-gnu/libze_loader.so.1`` when imported (a path it hard-codes,
Debian's ``libze1``); ``$GPUSD_ZE_LIBRARY`` names another loader (``/opt/intel/oneapi/...``, or the
test suite's fake), which gpusd then hands to ``pyzes`` for the duration of its import.  Imported only
here (``pip install 'gpusd[intel]'``).  Sysman needs ``ZES_ENABLE_SYSMAN=1`` with older loaders when
zeInit is used; ``zesInit`` (used here) does not.

What each field comes from: name, UUID and stacks ``zesDeviceGetProperties`` (the UUID as
``GPU-xxxxxxxx-xxxx-...``), PCI bus id ``zesDevicePciGetProperties``, memory ``zesMemoryGetState``
(summed over the device's memory modules), utilisation ``zesEngineGetActivity`` of the
``ZES_ENGINE_GROUP_ALL`` engine group (else the compute groups) between two readings, temperature
``zesTemperatureGetState`` (the GPU sensor), power from two ``zesPowerGetEnergyCounter`` readings
and the sustained limit of ``zesPowerGetLimitsExt``, processes ``zesDeviceProcessesGetState``
(memory per process).  Missing (Sysman has no such thing, or gpusd does not read it): the memory
controller's utilisation, fan, compute mode, MIG-like partitions (a Max 1550's two stacks are
``subdevices``).  A first snapshot takes two readings 50 ms apart for utilisation and power.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from typing import Any

from ..errors import BackendUnavailable
from ..model import GpuInfo, ProcessInfo
from ..record import field, record
from .base import VendorBackend, VendorDevice
from .lost import GpuFailed as _GpuFailed
from .window import UtilWindow, utilisation

LIBRARY_ENV = "GPUSD_ZE_LIBRARY"
_HARD_CODED = "libze_loader.so.1"
# UNSUPPORTED_FEATURE, PERMISSIONS, NOT_AVAILABLE...
_UNSUPPORTED = {0x78000003, 0x70010000, 0x70010001, 0x70020000}
_NAMES = {0x70000001: "device lost", 0x78000001: "uninitialised", 0x7FFFFFFE: "unknown error",
          0x70020000: "dependency unavailable"}
_ENGINE_ALL, _ENGINE_COMPUTE_ALL = 0, 1
_TEMP_GPU = 1
_import_lock = threading.Lock()


def _result(code: int) -> str:
    name = _NAMES.get(code)
    return f"Level Zero result {code:#x}" + (f" ({name})" if name else "")


def import_pyzes(library: str | None = None) -> Any:
    """``pyzes``, loading ``library`` (``$GPUSD_ZE_LIBRARY``) as its Level Zero loader when given."""
    library = library or os.environ.get(LIBRARY_ENV) or None
    with _import_lock:
        if "pyzes" in sys.modules:
            return sys.modules["pyzes"]
        real = ctypes.CDLL

        class _Loader(real):  # type: ignore[valid-type,misc]
            def __init__(self, name: Any, *args: Any, **kwargs: Any) -> None:
                if library and str(name).endswith(_HARD_CODED):
                    name = library
                super().__init__(name, *args, **kwargs)

        ctypes.CDLL = _Loader  # type: ignore[misc]  # only while pyzes imports (its `from ctypes import *`)
        try:
            import pyzes
        except ImportError:
            raise BackendUnavailable("the pyzes package is not installed (pip install 'gpusd[intel]')",
                                     hint=True) from None
        except OSError:
            where = library or f"/usr/lib/x86_64-linux-gnu/{_HARD_CODED}"
            raise BackendUnavailable(f"no Level Zero loader ({where}; apt install libze1, or set {LIBRARY_ENV})",
                                     hint=True) from None
        finally:
            ctypes.CDLL = real  # type: ignore[misc]
        return pyzes


@record
class _Device(VendorDevice):
    subdevices: int | None = None
    engine: Any = None
    power: Any = None
    temp: Any = None
    memory: list[Any] = field(default_factory=list)
    # (activeTime, timestamp) microseconds
    last_activity: tuple[int, int] | None = None
    # (energy uJ, timestamp us)
    last_energy: tuple[int, int] | None = None


class IntelBackend(VendorBackend):
    """The local Intel GPUs through Level Zero Sysman."""

    backend = "levelzero"
    vendor = "intel"
    library = "Level Zero"

    def __init__(self, *, util_window: float = 5.0, processes: bool = True, library: str | None = None) -> None:
        super().__init__(util_window=util_window, processes=processes)
        ze = import_pyzes(library)
        self._ze = ze
        rc = ze.zesInit(0)
        if rc != 0:
            raise BackendUnavailable(f"Level Zero Sysman failed to start: {_result(rc)}", hint=True)

    def _list_reason(self, exc: BaseException) -> str | None:
        return exc.reason if isinstance(exc, _GpuFailed) else None

    # -- helpers ------------------------------------------------------------------------------
    def _handles(self, fn: Any, parent: Any, kind: Any) -> list[Any]:
        count = ctypes.c_uint32(0)
        rc = fn(parent, ctypes.byref(count), None)
        if rc != 0:
            raise _GpuFailed(_result(rc)) if rc not in _UNSUPPORTED else _Unsupported()
        if not count.value:
            return []
        arr = (kind * count.value)()
        rc = fn(parent, ctypes.byref(count), arr)
        if rc != 0:
            raise _GpuFailed(_result(rc)) if rc not in _UNSUPPORTED else _Unsupported()
        return [arr[i] for i in range(count.value)]

    def _call(self, dev: _Device, key: str, fn: Any, *args: Any) -> bool:
        """``fn(*args)``: True on success, False where unsupported; raises _GpuFailed otherwise."""
        if key in dev.unsupported:
            return False
        rc = fn(*args)
        if rc == 0:
            return True
        if rc in _UNSUPPORTED:
            dev.unsupported.add(key)
            return False
        raise _GpuFailed(f"{key}: {_result(rc)}")

    def _enum(self, dev: _Device, key: str, fn: Any, kind: Any) -> list[Any]:
        if key in dev.unsupported:
            return []
        try:
            return self._handles(fn, dev.handle, kind)
        except _Unsupported:
            dev.unsupported.add(key)
            return []

    def _refresh_devices(self) -> None:
        ze = self._ze
        handles = [h for d in self._drivers() for h in self._handles(ze.zesDeviceGet, d, ze.zes_device_handle_t)]
        if len(handles) == len(self._devices):
            return
        devices = []
        for i, h in enumerate(handles):
            dev = _Device(i, h, f"unknown-{i}", util=UtilWindow(self.util_window))
            try:
                self._describe(dev)
            except (_GpuFailed, _Unsupported):
                # the snapshot flags it (every query of a lost device fails again)
                pass
            devices.append(dev)
        self._devices = devices

    def _drivers(self) -> list[Any]:
        ze = self._ze
        count = ctypes.c_uint32(0)
        rc = ze.zesDriverGet(ctypes.byref(count), None)
        if rc != 0:
            raise BackendUnavailable(f"Level Zero cannot list drivers: {_result(rc)}", hint=True)
        arr = (ze.zes_driver_handle_t * count.value)()
        if count.value and ze.zesDriverGet(ctypes.byref(count), arr) != 0:
            raise BackendUnavailable("Level Zero cannot list drivers", hint=True)
        return [arr[i] for i in range(count.value)]

    def _describe(self, dev: _Device) -> None:
        ze = self._ze
        props = ze.zes_device_properties_t()
        props.stype = ze.ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES
        if self._call(dev, "properties", ze.zesDeviceGetProperties, dev.handle, ctypes.byref(props)):
            name = props.core.name.decode(errors="replace").strip() or props.modelName.decode(errors="replace")
            dev.name = name or None
            raw = bytes(props.core.uuid.id).hex()
            if raw.strip("0"):
                dev.uuid = f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:32]}"
            dev.subdevices = int(props.numSubdevices) or None
        pci = ze.zes_pci_properties_t()
        pci.stype = ze.ZES_STRUCTURE_TYPE_PCI_PROPERTIES
        if self._call(dev, "pci", ze.zesDevicePciGetProperties, dev.handle, ctypes.byref(pci)):
            a = pci.address
            dev.pci_bus_id = f"{a.domain:08X}:{a.bus:02X}:{a.device:02X}.{a.function:X}"
        engines = self._enum(dev, "engines", ze.zesDeviceEnumEngineGroups, ze.zes_engine_handle_t)
        by_type: dict[int, Any] = {}
        for e in engines:
            ep = ze.zes_engine_properties_t()
            ok = self._call(dev, "engine_properties", ze.zesEngineGetProperties, e, ctypes.byref(ep))
            if ok and not ep.onSubdevice:
                by_type.setdefault(int(ep.type), e)
        dev.engine = by_type.get(_ENGINE_ALL) or by_type.get(_ENGINE_COMPUTE_ALL)
        powers = self._enum(dev, "power_domains", ze.zesDeviceEnumPowerDomains, ze.zes_pwr_handle_t)
        dev.power = powers[0] if powers else None
        temps = self._enum(dev, "temperature_sensors", ze.zesDeviceEnumTemperatureSensors, ze.zes_temp_handle_t)
        for t in temps:
            tp = ze.zes_temp_properties_t()
            if self._call(dev, "temp_properties", ze.zesTemperatureGetProperties, t, ctypes.byref(tp)) \
                    and int(tp.type) == _TEMP_GPU and not tp.onSubdevice:
                dev.temp = t
                break
        dev.memory = self._enum(dev, "memory_modules", ze.zesDeviceEnumMemoryModules, ze.zes_mem_handle_t)

    # -- the snapshot -------------------------------------------------------------------------
    def _before_read(self) -> None:
        if any(d.last_activity is None and d.engine is not None for d in self._devices):
            # counters need two readings: take the first now
            for d in self._devices:
                self._counters(d)
            time.sleep(0.05)

    def _counters(self, dev: _Device) -> tuple[float | None, float | None]:
        """(utilisation %, power W) since the previous reading; updates it."""
        ze = self._ze
        util = power = None
        try:
            if dev.engine is not None:
                s = ze.zes_engine_stats_t()
                if self._call(dev, "activity", ze.zesEngineGetActivity, dev.engine, ctypes.byref(s)):
                    now = (int(s.activeTime), int(s.timestamp))
                    if dev.last_activity is not None and now[1] > dev.last_activity[1]:
                        util = 100.0 * (now[0] - dev.last_activity[0]) / (now[1] - dev.last_activity[1])
                        util = max(0.0, min(100.0, util))
                    dev.last_activity = now
            if dev.power is not None:
                e = ze.zes_power_energy_counter_t()
                if self._call(dev, "energy", ze.zesPowerGetEnergyCounter, dev.power, ctypes.byref(e)):
                    now = (int(e.energy), int(e.timestamp))
                    if dev.last_energy is not None and now[1] > dev.last_energy[1]:
                        power = (now[0] - dev.last_energy[0]) / (now[1] - dev.last_energy[1])  # uJ/us = W
                    dev.last_energy = now
        except _GpuFailed:
            # the snapshot's own reading flags the GPU
            pass
        return util, power

    def _gpu(self, dev: _Device) -> GpuInfo:
        gpu = super()._gpu(dev)
        gpu.subdevices = dev.subdevices
        return gpu

    def _fill(self, dev: _Device, gpu: GpuInfo) -> None:
        ze = self._ze
        # a device that answers nothing is lost: ask it for its properties once per snapshot
        props = ze.zes_device_properties_t()
        props.stype = ze.ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES
        rc = ze.zesDeviceGetProperties(dev.handle, ctypes.byref(props))
        if rc != 0 and rc not in _UNSUPPORTED:
            raise _GpuFailed(_result(rc))
        total = free = 0
        for m in dev.memory:
            st = ze.zes_mem_state_t()
            if self._call(dev, "memory", ze.zesMemoryGetState, m, ctypes.byref(st)):
                total, free = total + int(st.size), free + int(st.free)
        if dev.memory and total:
            gpu.memory_total, gpu.memory_free = total, free
            gpu.memory_used = max(0, total - free)
        now = time.time()
        util, power = self._counters(dev)
        assert dev.util is not None
        # no driver sample buffer: the window is built from our own readings
        gpu.utilization_gpu, gpu.utilization_window = utilisation(dev.util, now, self._util_since.get(dev.uuid),
                                                                  util, own=True)
        if self._detail:
            gpu.power_draw = round(power, 1) if power is not None else None
            if dev.temp is not None:
                t = ctypes.c_double()
                if self._call(dev, "temperature", ze.zesTemperatureGetState, dev.temp, ctypes.byref(t)):
                    gpu.temperature = int(t.value)
            if dev.power is not None:
                gpu.power_limit = self._limit(dev)
        if self.want_processes:
            gpu.processes = self._processes(dev)

    def _limit(self, dev: _Device) -> float | None:
        ze = self._ze
        count = ctypes.c_uint32(0)
        if not self._call(dev, "power_limit", ze.zesPowerGetLimitsExt, dev.power, ctypes.byref(count), None):
            return None
        if not count.value:
            return None
        arr = (ze.zes_power_limit_ext_desc_t * count.value)()
        for item in arr:
            item.stype = ze.ZES_STRUCTURE_TYPE_POWER_LIMIT_EXT_DESC
        if not self._call(dev, "power_limit", ze.zesPowerGetLimitsExt, dev.power, ctypes.byref(count), arr):
            return None
        for item in arr[: count.value]:
            if int(item.level) == 1 and int(item.limitUnit) == 2 and item.enabled:  # SUSTAINED, in mW
                return float(item.limit) / 1000.0
        return None

    def _processes(self, dev: _Device) -> list[ProcessInfo]:
        ze = self._ze
        count = ctypes.c_uint32(0)
        if not self._call(dev, "processes", ze.zesDeviceProcessesGetState, dev.handle, ctypes.byref(count), None):
            return []
        if not count.value:
            return []
        arr = (ze.zes_process_state_t * count.value)()
        for item in arr:
            item.stype = ze.ZES_STRUCTURE_TYPE_PROCESS_STATE
        if not self._call(dev, "processes", ze.zesDeviceProcessesGetState, dev.handle, ctypes.byref(count), arr):
            return []
        return [ProcessInfo(pid=int(p.processId), used_memory=int(p.memSize), type="compute")
                for p in arr[: count.value] if int(p.processId) > 0]

    # Sysman has no shutdown call: closing only refuses further snapshots

class _Unsupported(Exception):
    """An enumeration the device does not support."""
