"""Read the local AMD GPUs through AMD's own library: ``amdsmi`` (PyPI), over ROCm's ``libamd_smi.so``.

``amdsmi`` finds the library through ``ROCM_PATH``/``ROCM_HOME`` (``$ROCM_PATH/lib``), the loader path
or ``/opt/rocm/lib``, and needs the ``amdgpu`` driver.  It is imported only here, when a snapshot of
AMD GPUs is asked for (``pip install 'gpusd[amd]'``).

What each field comes from: name and UUID ``amdsmi_get_gpu_asic_info`` (market name; the UUID is
ROCm's ``GPU-<unique id>``, the form ``ROCR_VISIBLE_DEVICES`` takes), PCI bus id
``amdsmi_get_gpu_device_bdf``, memory ``amdsmi_get_gpu_vram_usage``, utilisation
``amdsmi_get_gpu_activity`` (GFX activity, averaged over the window from our own readings: amdsmi
keeps no sample buffer; UMC activity as the memory utilisation), temperature
``amdsmi_get_temp_metric`` (edge, else hotspot; each sensor also under its own name, with the memory's),
driver version ``amdsmi_get_gpu_driver_info``, board part number ``amdsmi_get_gpu_board_info``, energy
``amdsmi_get_energy_count`` (accumulator × resolution, µJ), clocks ``amdsmi_get_clock_info`` (GFX,
MEM), ECC totals ``amdsmi_get_gpu_total_ecc_count`` (correctable, uncorrectable, deferred), the PCIe
link ``amdsmi_get_pcie_info`` (speed and maximum speed, bandwidth, replay, recovery, rollover and NAK
counters), the instantaneous GFX busy of each XCC ``amdsmi_get_gpu_metrics_info`` (MI300-class, in
SPX mode); energy, clocks, ECC, PCIe and XCC busy only for the daemon (``telemetry=True``).  Power
and limit ``amdsmi_get_power_info``, processes ``amdsmi_get_gpu_process_list`` (VRAM per process),
partition modes
``amdsmi_get_gpu_compute_partition``/``..._memory_partition`` (SPX/DPX/QPX/CPX, NPS1/NPS4 on MI300).
No fan (data-centre parts have none), no compute mode, no MIG.

A query the GPU does not support leaves its field ``None`` and is not asked again; any other error
marks the GPU unhealthy (with the status) while the rest of the snapshot still comes back.  Without
``amdsmi`` or ``libamd_smi.so`` the backend is unavailable with a one-line reason (no sysfs fallback:
the amdgpu driver's sysfs has no per-process memory, and a partial reader would make ``is_free`` lie).
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import time
from typing import Any

from ..errors import BackendUnavailable
from ..model import GpuInfo, ProcessInfo
from .base import VendorBackend
from .base import VendorDevice as _Device
from .lost import GpuFailed as _GpuFailed
from .window import UtilWindow, utilisation

# amdsmi statuses (amdsmi_status_t) that mean "this field is not there on this GPU".
# NOT_SUPPORTED, NOT_YET_IMPLEMENTED, FAIL_LOAD_SYMBOL, NO_PERM, NO_DATA
_UNSUPPORTED = {2, 3, 5, 10, 40}
_DRIVER_NOT_LOADED = 34
_STATUS_NAMES = {6: "DRM error", 7: "API failed", 8: "timeout", 12: "I/O error", 18: "init error",
                 31: "not found", 32: "not initialised", 34: "driver not loaded", 51: "no driver"}


def import_amdsmi() -> Any:
    """The ``amdsmi`` module, or BackendUnavailable with why not.  Its import prints to stdout when
    the library is missing (and then fails with a KeyError): that line would break ``--json``."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import amdsmi
    except ImportError:
        raise BackendUnavailable("the amdsmi package is not installed (pip install 'gpusd[amd]')", hint=True) from None
    except (KeyError, OSError, AttributeError):
        where = os.environ.get("ROCM_PATH") or os.environ.get("ROCM_HOME") or "/opt/rocm"
        raise BackendUnavailable(f"no ROCm library libamd_smi.so (looked in {where}/lib and the loader path)",
                                 hint=True) from None
    return amdsmi


def available() -> bool:
    """Whether an AMD backend could be tried here without importing anything heavy."""
    return importlib.util.find_spec("amdsmi") is not None


def _code(exc: BaseException) -> int | None:
    code = getattr(exc, "err_code", None)
    return code if isinstance(code, int) else None


def _status(exc: BaseException) -> str:
    code = _code(exc)
    name = _STATUS_NAMES.get(code or -1)
    return f"amdsmi status {code}" + (f" ({name})" if name else "") if code is not None else f"amdsmi: {exc}"


def _number(value: Any) -> float | None:
    """amdsmi's value, or None where it says N/A."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _clock(info: Any) -> int | None:
    """MHz from amdsmi's clock info (None where it says N/A)."""
    value = _number(info.get("clk")) if isinstance(info, dict) else None
    return int(value) if value is not None else None


def _count(value: Any) -> int | None:
    """A counter or integer reading (None where amdsmi says N/A: its all-ones value)."""
    number = _number(value)
    return int(number) if number is not None and number >= 0 else None


def _gts(value: Any) -> float | None:
    """GT/s from amdsmi's PCIe speed in MT/s (16000 for Gen4); 0 where the link is not up: None."""
    number = _number(value)
    return number / 1000 if number else None


class AmdBackend(VendorBackend):
    """The local AMD GPUs through amdsmi.  Thread-safe; one instance per process is enough."""

    backend = "amdsmi"
    vendor = "amd"
    library = "amdsmi"
    # takes telemetry=: energy and clocks for /metrics (inventory.combined.open_vendor)
    telemetry_counters = True

    def __init__(self, *, util_window: float = 5.0, processes: bool = True, telemetry: bool = False) -> None:
        super().__init__(util_window=util_window, processes=processes)
        # the daemon's: what AMD's exporter serves beyond gpusd's own fields
        self.telemetry = telemetry
        # UUID -> board part number (read with the device list)
        self._boards: dict[str, str | None] = {}
        smi = import_amdsmi()
        self._smi = smi
        self._error = smi.AmdSmiException
        try:
            smi.amdsmi_init(smi.AmdSmiInitFlags.INIT_AMD_GPUS)
        except smi.AmdSmiException as exc:
            if _code(exc) == _DRIVER_NOT_LOADED:
                raise BackendUnavailable("the amdgpu driver is not loaded", hint=True) from None
            raise BackendUnavailable(f"amdsmi failed to start: {_status(exc)}", hint=True) from None

    # -- what amdsmi's errors mean ------------------------------------------------------------
    def _unsupported(self, exc: BaseException) -> bool:
        return _code(exc) in _UNSUPPORTED

    def _failed(self, dev: Any, key: str, exc: BaseException) -> str | None:
        return f"{key}: {_status(exc)}"

    def _list_reason(self, exc: BaseException) -> str | None:
        return _status(exc) if isinstance(exc, self._error) else None

    def _refresh_devices(self) -> None:
        smi = self._smi
        handles = smi.amdsmi_get_processor_handles()
        if len(handles) == len(self._devices):
            return
        devices = []
        for i, h in enumerate(handles):
            dev = _Device(i, h, f"unknown-{i}", None, None, util=UtilWindow(self.util_window))
            try:
                asic = self._query(dev, "asic", smi.amdsmi_get_gpu_asic_info)
            except _GpuFailed:
                asic = None
            if asic:
                name = asic.get("market_name")
                dev.name = str(name) if name and name != "N/A" else None
                serial = str(asic.get("asic_serial") or "")
                try:
                    # ROCm's UUID (rocminfo, ROCR_VISIBLE_DEVICES)
                    dev.uuid = f"GPU-{int(serial, 16):016x}"
                except ValueError:
                    pass
            try:
                bdf = self._query(dev, "bdf", smi.amdsmi_get_gpu_device_bdf)
                dev.pci_bus_id = str(bdf).upper().replace("0X", "") if bdf else None
                board = self._query(dev, "board", smi.amdsmi_get_gpu_board_info)
                model = board.get("model_number") if isinstance(board, dict) else None
                self._boards[dev.uuid] = str(model)[:64] if model and model != "N/A" else None
                if self.driver_version is None:
                    driver = self._query(dev, "driver", smi.amdsmi_get_gpu_driver_info)
                    version = driver.get("driver_version") if isinstance(driver, dict) else None
                    self.driver_version = str(version)[:64] if version and version != "N/A" else None
            except _GpuFailed:
                pass
            devices.append(dev)
        self._devices = devices

    # -- one GPU ------------------------------------------------------------------------------
    def _fill(self, dev: _Device, gpu: GpuInfo) -> None:
        smi, q = self._smi, self._query
        vram = q(dev, "vram", smi.amdsmi_get_gpu_vram_usage)
        if vram is not None:
            total, used = _number(vram.get("vram_total")), _number(vram.get("vram_used"))
            if total is not None and used is not None:  # MiB
                gpu.memory_total, gpu.memory_used = int(total) << 20, int(used) << 20
                gpu.memory_free = max(0, gpu.memory_total - gpu.memory_used)
        activity = q(dev, "activity", smi.amdsmi_get_gpu_activity)
        now = time.time()
        gfx = _number(activity.get("gfx_activity")) if activity else None
        if activity:
            gpu.utilization_memory = _number(activity.get("umc_activity"))
        assert dev.util is not None
        # no driver sample buffer: the window is built from our own readings
        gpu.utilization_gpu, gpu.utilization_window = utilisation(dev.util, now, self._util_since.get(dev.uuid),
                                                                  gfx, own=True)
        if self._detail:
            kinds = smi.AmdSmiTemperatureType
            current = smi.AmdSmiTemperatureMetric.CURRENT
            edge = q(dev, "temp_edge", smi.amdsmi_get_temp_metric, kinds.EDGE, current)
            hotspot = q(dev, "temp_hotspot", smi.amdsmi_get_temp_metric, kinds.HOTSPOT, current)
            memory = q(dev, "temp_vram", smi.amdsmi_get_temp_metric, kinds.VRAM, current)
            gpu.edge_temperature = int(edge) if isinstance(edge, int) else None
            gpu.junction_temperature = int(hotspot) if isinstance(hotspot, int) else None
            gpu.memory_temperature = int(memory) if isinstance(memory, int) else None
            gpu.temperature = gpu.edge_temperature if gpu.edge_temperature is not None else gpu.junction_temperature
            power = q(dev, "power", smi.amdsmi_get_power_info)
            if power:
                draw = _number(power.get("current_socket_power"))
                gpu.power_draw = draw if draw is not None else _number(power.get("average_socket_power"))
                gpu.power_limit = _number(power.get("power_limit"))
            if self.telemetry:
                self._telemetry(dev, gpu)
        gpu.board_model = self._boards.get(dev.uuid)
        gpu.compute_partition = self._partition(dev, "compute_partition", smi.amdsmi_get_gpu_compute_partition)
        gpu.memory_partition = self._partition(dev, "memory_partition", smi.amdsmi_get_gpu_memory_partition)
        if self._detail and self.telemetry:
            gpu.gfx_busy_xcc = self._gfx_busy(dev, gpu.compute_partition)
        if self.want_processes:
            gpu.processes = self._processes(dev)

    def _telemetry(self, dev: _Device, gpu: GpuInfo) -> None:
        """The daemon's extra readings, as AMD's exporter serves them: energy (the accumulator times its
        resolution, µJ; gpusd keeps mJ), the GFX and memory clocks, the ECC totals and the PCIe link."""
        smi, q = self._smi, self._query
        energy = q(dev, "energy", smi.amdsmi_get_energy_count)
        if isinstance(energy, dict):
            acc, res = _number(energy.get("energy_accumulator")), _number(energy.get("counter_resolution"))
            if acc is not None and res is not None:
                gpu.energy = round(acc * res / 1000)
        clocks = smi.AmdSmiClkType
        gpu.clock_sm = _clock(q(dev, "clock_gfx", smi.amdsmi_get_clock_info, clocks.GFX))
        gpu.clock_memory = _clock(q(dev, "clock_mem", smi.amdsmi_get_clock_info, clocks.MEM))
        ecc = q(dev, "ecc", smi.amdsmi_get_gpu_total_ecc_count)
        if isinstance(ecc, dict):
            gpu.ecc_correctable = _count(ecc.get("correctable_count"))
            gpu.ecc_uncorrectable = _count(ecc.get("uncorrectable_count"))
            gpu.ecc_deferred = _count(ecc.get("deferred_count"))
        pcie = q(dev, "pcie", smi.amdsmi_get_pcie_info)
        static = pcie.get("pcie_static") if isinstance(pcie, dict) else None
        metric = pcie.get("pcie_metric") if isinstance(pcie, dict) else None
        if isinstance(static, dict):
            gpu.pcie_max_speed = _gts(static.get("max_pcie_speed"))
        if isinstance(metric, dict):
            gpu.pcie_speed = _gts(metric.get("pcie_speed"))
            gpu.pcie_bandwidth = _count(metric.get("pcie_bandwidth"))
            gpu.pcie_replays = _count(metric.get("pcie_replay_count"))
            gpu.pcie_recoveries = _count(metric.get("pcie_l0_to_recovery_count"))
            gpu.pcie_replay_rollovers = _count(metric.get("pcie_replay_roll_over_count"))
            gpu.pcie_nak_sent = _count(metric.get("pcie_nak_sent_count"))
            gpu.pcie_nak_received = _count(metric.get("pcie_nak_received_count"))

    def _gfx_busy(self, dev: _Device, partition: str | None) -> list[float] | None:
        """The instantaneous GFX busy percent of each XCC (MI300-class), from the GPU metrics table's
        first XCP entry: the whole GPU in SPX mode.  A GPU split into DPX/QPX/CPX partitions is left out:
        the table has an entry per partition, and telling which is this GPU's would take the KFD
        partition id (``amdsmi_get_gpu_kfd_info``), which gpusd does not read."""
        if partition not in (None, "SPX"):
            return None
        table = self._query(dev, "gpu_metrics", self._smi.amdsmi_get_gpu_metrics_info)
        xcps = table.get("xcp_stats.gfx_busy_inst") if isinstance(table, dict) else None
        first = xcps[0] if isinstance(xcps, list) and xcps and isinstance(xcps[0], list) else []
        busy = [v for v in (_number(x) for x in first) if v is not None]
        return busy or None

    def _partition(self, dev: _Device, key: str, fn: Any) -> str | None:
        value = self._query(dev, key, fn)
        return str(value)[:16] if value else None

    def _processes(self, dev: _Device) -> list[ProcessInfo]:
        out: list[ProcessInfo] = []
        for p in self._query(dev, "processes", self._smi.amdsmi_get_gpu_process_list) or []:
            pid = p.get("pid") if isinstance(p, dict) else None
            if not isinstance(pid, int) or pid <= 0:
                continue
            usage = p.get("memory_usage") or {}
            used = _number(usage.get("vram_mem")) if isinstance(usage, dict) else None
            if used is None:
                used = _number(p.get("mem"))
            out.append(ProcessInfo(pid=pid, used_memory=int(used) if used is not None else None, type="compute"))
        return out

    def _shutdown(self) -> None:
        try:
            self._smi.amdsmi_shut_down()
        except self._error:
            pass
