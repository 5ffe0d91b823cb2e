"""Prometheus metrics of a host's GPUs, rendered from its latest :class:`~gpusd.model.HostSnapshot`.

Names and units follow Prometheus conventions: base units (bytes, watts, celsius), ratios 0-1 for
percentages, ``_info`` gauges with value 1 for descriptive labels.  Per-GPU series carry the labels
``host``, ``uuid``, ``index`` and ``model``.  A reading the GPU does not report is left out (no
series), never exported as 0.

Each daemon exports its own host only, so a Prometheus scraping every daemon (see
``gpusd export prometheus-sd``) gets each GPU exactly once.

Alongside, by default, the same readings under NVIDIA's DCGM exporter names (``DCGM_FI_DEV_GPU_UTIL``
...; :class:`DcgmCollector`) for NVIDIA GPUs, and under AMD's device-metrics-exporter names
(``gpu_gfx_activity``, ``gpu_used_vram`` ...; :class:`AmdExporterCollector`) for AMD GPUs, so that
Grafana dashboards made for either exporter work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..model import GpuInfo, HostSnapshot

if TYPE_CHECKING:  # pragma: no cover
    from prometheus_client.registry import CollectorRegistry

    from ..thresholds import ThresholdEvent

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

GPU_LABELS = ("host", "uuid", "index", "model")

# name -> (help, reader returning base units or None)
_GPU_GAUGES: dict[str, tuple[str, Callable[[GpuInfo], float | None]]] = {
    "gpusd_gpu_utilization_ratio": (
        "GPU utilisation (fraction of time a kernel ran), 0-1, averaged over the daemon's window",
        lambda g: None if g.utilization_gpu is None else g.utilization_gpu / 100.0),
    "gpusd_gpu_memory_utilization_ratio": (
        "Fraction of time the memory controller was busy, 0-1",
        lambda g: None if g.utilization_memory is None else g.utilization_memory / 100.0),
    "gpusd_gpu_memory_used_bytes": ("GPU memory in use", lambda g: g.memory_used),
    "gpusd_gpu_memory_free_bytes": ("GPU memory free", lambda g: g.memory_free),
    "gpusd_gpu_memory_total_bytes": ("GPU memory in total", lambda g: g.memory_total),
    "gpusd_gpu_temperature_celsius": ("GPU core temperature", lambda g: g.temperature),
    "gpusd_gpu_power_watts": ("GPU power draw", lambda g: g.power_draw),
    "gpusd_gpu_power_limit_watts": ("GPU power limit", lambda g: g.power_limit),
    "gpusd_gpu_fan_speed_ratio": ("Fan speed as a fraction of its maximum, 0-1",
                                  lambda g: None if g.fan_speed is None else g.fan_speed / 100.0),
    "gpusd_gpu_healthy": ("1 when the GPU answers NVML queries, 0 when it is lost or failing",
                          lambda g: 1.0 if g.healthy else 0.0),
    "gpusd_gpu_processes": ("Processes running on the GPU", lambda g: len(g.processes)),
    "gpusd_gpu_leases": ("gpusd leases held on the GPU", lambda g: len(g.leases)),
}


def _gpu_labels(snap: HostSnapshot, g: GpuInfo) -> list[str]:
    return [snap.hostname, g.uuid, str(g.index), g.name or ""]


class SnapshotCollector:
    """A prometheus-client custom collector over whatever ``snapshots()`` returns at scrape time.

    ``alerts()`` (optional) gives the threshold rules exceeded right now, exported as
    ``gpusd_threshold_active``."""

    def __init__(self, snapshots: Callable[[], Iterable[HostSnapshot | None]],
                 alerts: Callable[[], Sequence[ThresholdEvent]] | None = None) -> None:
        self._snapshots = snapshots
        self._alerts = alerts

    def describe(self) -> list[Any]:
        # An empty describe() keeps registration from calling collect() (which may not be ready yet).
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

        snaps = [s for s in self._snapshots() if s is not None]
        build = InfoMetricFamily("gpusd_build", "gpusd version", labels=["version"])
        build.add_metric([__version__], {})
        yield build

        host_info = GaugeMetricFamily(
            "gpusd_host_info", "A host running gpusd (value 1)",
            labels=["host", "node_id", "driver_version", "cuda_version", "backend", "simulated"])
        host_gpus = GaugeMetricFamily("gpusd_host_gpus", "GPUs on the host", labels=["host"])
        host_ts = GaugeMetricFamily("gpusd_host_snapshot_timestamp_seconds",
                                    "When the host's GPUs were last sampled (seconds since the epoch)",
                                    labels=["host"])
        gpu_info = GaugeMetricFamily("gpusd_gpu_info", "A GPU (value 1)",
                                     labels=[*GPU_LABELS, "pci_bus_id", "compute_mode", "mig_mode", "vendor"])
        gauges = {name: GaugeMetricFamily(name, help_, labels=list(GPU_LABELS))
                  for name, (help_, _) in _GPU_GAUGES.items()}
        mig_used = GaugeMetricFamily("gpusd_mig_memory_used_bytes", "Memory in use on a MIG instance",
                                     labels=[*GPU_LABELS, "mig_uuid", "profile"])
        mig_total = GaugeMetricFamily("gpusd_mig_memory_total_bytes", "Memory of a MIG instance",
                                      labels=[*GPU_LABELS, "mig_uuid", "profile"])
        for snap in snaps:
            host_info.add_metric([snap.hostname, snap.node_id, snap.driver_version or "", snap.cuda_version or "",
                                  snap.backend, "true" if snap.simulated else "false"], 1.0)
            host_gpus.add_metric([snap.hostname], float(len(snap.gpus)))
            host_ts.add_metric([snap.hostname], snap.timestamp)
            for g in snap.gpus:
                labels = _gpu_labels(snap, g)
                mig = "" if g.mig_mode is None else ("enabled" if g.mig_mode else "disabled")
                gpu_info.add_metric([*labels, g.pci_bus_id or "", g.compute_mode or "", mig, g.vendor], 1.0)
                for name, (_, read) in _GPU_GAUGES.items():
                    value = read(g)
                    if value is not None:
                        gauges[name].add_metric(labels, float(value))
                for m in g.mig_instances:
                    mlabels = [*labels, m.uuid, m.profile or ""]
                    if m.memory_used is not None:
                        mig_used.add_metric(mlabels, float(m.memory_used))
                    if m.memory_total is not None:
                        mig_total.add_metric(mlabels, float(m.memory_total))
        yield host_info
        yield host_gpus
        yield host_ts
        yield gpu_info
        yield from gauges.values()
        yield mig_used
        yield mig_total
        if self._alerts is not None:
            active = GaugeMetricFamily("gpusd_threshold_active",
                                       "1 while a threshold rule is exceeded on a GPU",
                                       labels=["host", "uuid", "index", "rule"])
            for ev in self._alerts():
                active.add_metric([ev.hostname, ev.gpu, "" if ev.index is None else str(ev.index), ev.rule.name],
                                  1.0)
            yield active


# NVIDIA's DCGM exporter names for the same readings, so that dashboards made for it (the community
# "NVIDIA DCGM Exporter Dashboard", Grafana 12239) show a gpusd fleet unchanged.  Units are DCGM's:
# percent, MiB, degrees C, watts.  name -> (help, reader)
_MIB = float(1 << 20)
_DCGM_GAUGES: dict[str, tuple[str, Callable[[GpuInfo], float | None]]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("GPU utilization (in %).", lambda g: g.utilization_gpu),
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("Memory utilization (in %).", lambda g: g.utilization_memory),
    "DCGM_FI_DEV_FB_USED": ("Framebuffer memory used (in MiB).",
                            lambda g: None if g.memory_used is None else g.memory_used / _MIB),
    "DCGM_FI_DEV_FB_FREE": ("Framebuffer memory free (in MiB).",
                            lambda g: None if g.memory_free is None else g.memory_free / _MIB),
    "DCGM_FI_DEV_GPU_TEMP": ("GPU temperature (in C).", lambda g: g.temperature),
    "DCGM_FI_DEV_POWER_USAGE": ("Power draw (in W).", lambda g: g.power_draw),
}
# The DCGM exporter's labels; "hostname" (newer exporters) beside "Hostname" (older ones and the dashboards).
DCGM_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname", "hostname", "pci_bus_id", "DCGM_FI_DRIVER_VERSION")


class DcgmCollector:
    """The DCGM exporter's series (``DCGM_FI_DEV_*``) for the GPUs of ``snapshots()`` (gpusd start
    ``--no-dcgm-metrics`` leaves them out).  A reading the GPU does not report is left out."""

    def __init__(self, snapshots: Callable[[], Iterable[HostSnapshot | None]]) -> None:
        self._snapshots = snapshots

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        families = {name: GaugeMetricFamily(name, help_, labels=list(DCGM_LABELS))
                    for name, (help_, _) in _DCGM_GAUGES.items()}
        for snap in self._snapshots():
            if snap is None:
                continue
            for g in snap.gpus:
                if g.vendor != "nvidia":
                    continue  # DCGM's names are NVIDIA's (AMD GPUs: AmdExporterCollector)
                n = g.device_index
                labels = [str(n), g.uuid, f"nvidia{n}", g.name or "", snap.hostname, snap.hostname,
                          g.pci_bus_id or "", snap.driver_version or ""]
                for name, (_, read) in _DCGM_GAUGES.items():
                    value = read(g)
                    if value is not None:
                        families[name].add_metric(labels, float(value))
        yield from families.values()


# AMD's device-metrics-exporter names (ROCm/device-metrics-exporter) for the same readings of AMD GPUs,
# so that AMD's Grafana dashboards show them.  Units are the exporter's: percent, MB (MiB), C, W.
_AMD_GAUGES: dict[str, tuple[str, Callable[[GpuInfo], float | None]]] = {
    "gpu_gfx_activity": ("Graphics engine activity (in %).", lambda g: g.utilization_gpu),
    "gpu_umc_activity": ("Memory controller activity (in %).", lambda g: g.utilization_memory),
    "gpu_used_vram": ("Used VRAM (in MB).", lambda g: None if g.memory_used is None else g.memory_used / _MIB),
    "gpu_free_vram": ("Free VRAM (in MB).", lambda g: None if g.memory_free is None else g.memory_free / _MIB),
    "gpu_total_vram": ("Total VRAM (in MB).", lambda g: None if g.memory_total is None else g.memory_total / _MIB),
    "gpu_edge_temperature": ("Edge temperature (in C).", lambda g: g.temperature),
    "gpu_package_power": ("Package power (in W).", lambda g: g.power_draw),
    "gpu_power_usage": ("Power usage (in W).", lambda g: g.power_draw),
}
AMD_LABELS = ("gpu_id", "gpu_uuid", "serial_number", "card_model", "card_vendor", "hostname", "gpu_partition_id",
              "gpu_compute_partition_type", "gpu_memory_partition_type", "driver_version")


class AmdExporterCollector:
    """The AMD device-metrics-exporter's series for the AMD GPUs of ``snapshots()`` (left out with
    the DCGM ones by ``--no-dcgm-metrics``).  A reading the GPU does not report is left out."""

    def __init__(self, snapshots: Callable[[], Iterable[HostSnapshot | None]]) -> None:
        self._snapshots = snapshots

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        families = {name: GaugeMetricFamily(name, help_, labels=list(AMD_LABELS))
                    for name, (help_, _) in _AMD_GAUGES.items()}
        for snap in self._snapshots():
            if snap is None:
                continue
            for g in snap.gpus:
                if g.vendor != "amd":
                    continue
                serial = g.uuid.removeprefix("GPU-") if g.uuid.startswith("GPU-") else ""
                labels = [str(g.device_index), g.uuid, serial, g.name or "", "AMD", snap.hostname, "0",
                          (g.compute_partition or "").lower(), (g.memory_partition or "").lower(),
                          snap.driver_version or ""]
                for name, (_, read) in _AMD_GAUGES.items():
                    value = read(g)
                    if value is not None:
                        families[name].add_metric(labels, float(value))
        # only families with series: a host without AMD GPUs exports none of these names
        yield from (f for f in families.values() if f.samples)


def make_registry(snapshots: Callable[[], Iterable[HostSnapshot | None]],
                  alerts: Callable[[], Sequence[ThresholdEvent]] | None = None,
                  process_metrics: bool = True, dcgm: bool = False) -> CollectorRegistry:
    """A registry holding the GPU collector (and, by default, the daemon's own process_* metrics; with
    ``dcgm``, the DCGM exporter's names too)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshots, alerts))
    if dcgm:
        registry.register(DcgmCollector(snapshots))
        registry.register(AmdExporterCollector(snapshots))
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text exposition format."""
    from prometheus_client import generate_latest

    return generate_latest(registry)


def render_snapshots(snaps: Iterable[HostSnapshot], alerts: Sequence[ThresholdEvent] | None = None,
                     dcgm: bool = False) -> bytes:
    """One-shot rendering (no process metrics), e.g. for tests or a textfile collector."""
    snaps = list(snaps)
    registry = make_registry(lambda: snaps, (lambda: alerts) if alerts is not None else None, process_metrics=False,
                             dcgm=dcgm)
    return render(registry)
