"""Prometheus metrics of a host's GPUs, rendered from its latest :class:`~gpusd.model.HostSnapshot`.

Names and units follow Prometheus conventions: base units (bytes, watts, celsius), ratios 0-1 for
percentages, ``_info`` gauges with value 1 for descriptive labels.  Per-GPU series carry the labels
``host``, ``uuid``, ``index`` and ``model``.  A reading the GPU does not report is left out (no
series), never exported as 0.

Each daemon exports its own host only, so a Prometheus scraping every daemon (see
``gpusd export prometheus-sd``) gets each GPU exactly once.

Alongside, by default, the same readings under NVIDIA's DCGM exporter names (``DCGM_FI_DEV_GPU_UTIL``
...; :data:`DCGM_FIELDS`, :class:`DcgmCollector`) for NVIDIA GPUs, so that Grafana dashboards made for the
DCGM exporter work unchanged: every default counter of dcgm-exporter that NVML can give, with its type,
unit, integer values and labels, written by :func:`exporter_text` (another vendor's names can sit beside
as another tuple of :class:`ExporterField`); and under AMD's device-metrics-exporter names
(``gpu_gfx_activity``, ``gpu_used_vram`` ...; :class:`AmdExporterCollector`) for AMD GPUs.
:class:`UsageCollector`: the GPU-seconds used and held per GPU (:class:`~.gpuseconds.UsageCounters`),
and per user where the admin turned it on, for readers who may see private data.

Loaded on the first scrape: a daemon at rest counts GPU-seconds (:mod:`.gpuseconds`) without it.
"""

# Imports inside functions: optional or heavy packages.
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..inventory.vendors import AMD_EXPORTER, exporter_of
from ..model import GpuInfo, HostSnapshot, MigInstance
from ..sanitize import for_exposition, for_label, printable
from .gpuseconds import GPU_LABELS, UsageCounters, gpu_labels

if TYPE_CHECKING:  # pragma: no cover
    from prometheus_client.registry import CollectorRegistry

    from ..thresholds import ThresholdEvent

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (help, reader returning base units or None)
_GPU_GAUGES: dict[str, tuple[str, Callable[[GpuInfo], float | None]]] = {
    "gpusd_gpu_utilization_ratio": (
        "GPU utilisation (fraction of time a kernel ran), 0-1, averaged over the daemon's window",
        lambda g: None if g.utilization_gpu is None else g.utilization_gpu / 100.0),
    "gpusd_gpu_memory_utilization_ratio": (
        "Fraction of time the memory controller was busy, 0-1",
        lambda g: None if g.utilization_memory is None else g.utilization_memory / 100.0),
    "gpusd_gpu_memory_used_bytes": ("GPU memory in use", lambda g: g.memory_used),
    "gpusd_gpu_memory_free_bytes": ("GPU memory free", lambda g: g.memory_available),  # the model's rule
    "gpusd_gpu_memory_total_bytes": ("GPU memory in total", lambda g: g.memory_total),
    "gpusd_gpu_memory_shared": ("1 when the GPU's memory is the host's (unified memory): the memory series "
                                "are the host's, shared with the CPU", lambda g: 1.0 if g.memory_shared else 0.0),
    "gpusd_gpu_temperature_celsius": ("GPU core temperature", lambda g: g.temperature),
    "gpusd_gpu_power_watts": ("GPU power draw", lambda g: g.power_draw),
    "gpusd_gpu_power_limit_watts": ("GPU power limit", lambda g: g.power_limit),
    "gpusd_gpu_fan_speed_ratio": ("Fan speed as a fraction of its maximum, 0-1",
                                  lambda g: None if g.fan_speed is None else g.fan_speed / 100.0),
    "gpusd_gpu_healthy": ("1 when the GPU answers NVML queries, 0 when it is lost or failing",
                          lambda g: 1.0 if g.healthy else 0.0),
    "gpusd_gpu_processes": ("Processes running on the GPU", lambda g: len(g.processes)),
    "gpusd_gpu_leases": ("gpusd leases held on the GPU", lambda g: len(g.leases)),
    "gpusd_gpu_sm_clock_hertz": ("SM clock", lambda g: None if g.clock_sm is None else g.clock_sm * 1e6),
    "gpusd_gpu_memory_clock_hertz": ("Memory clock",
                                     lambda g: None if g.clock_memory is None else g.clock_memory * 1e6),
    "gpusd_gpu_memory_temperature_celsius": ("GPU memory (HBM) temperature", lambda g: g.memory_temperature),
    "gpusd_gpu_memory_reserved_bytes": ("GPU memory the driver reserves", lambda g: g.memory_reserved),
    "gpusd_gpu_encoder_utilization_ratio": ("Video encoder utilisation, 0-1",
                                            lambda g: None if g.utilization_encoder is None
                                            else g.utilization_encoder / 100.0),
    "gpusd_gpu_decoder_utilization_ratio": ("Video decoder utilisation, 0-1",
                                            lambda g: None if g.utilization_decoder is None
                                            else g.utilization_decoder / 100.0),
    "gpusd_gpu_xid_last": ("The last XID error seen since the daemon started (0: none)", lambda g: g.xid_last),
    "gpusd_gpu_graphics_active_ratio": ("Graphics engine activity, 0-1 (NVML GPM, Hopper and newer)",
                                        lambda g: _ratio(g.gpm_graphics_util)),
    "gpusd_gpu_tensor_active_ratio": ("Tensor pipe activity, 0-1 (NVML GPM, Hopper and newer)",
                                      lambda g: _ratio(g.gpm_tensor_util)),
    "gpusd_gpu_dram_active_ratio": ("DRAM bandwidth use, 0-1 (NVML GPM, Hopper and newer)",
                                    lambda g: _ratio(g.gpm_dram_util)),
    "gpusd_gpu_pcie_tx_bytes_per_second": ("PCIe transmit rate (NVML GPM)", lambda g: g.pcie_tx_rate),
    "gpusd_gpu_pcie_rx_bytes_per_second": ("PCIe receive rate (NVML GPM)", lambda g: g.pcie_rx_rate),
    "gpusd_gpu_row_remap_failure": ("1 when remapping a row of GPU memory failed",
                                    lambda g: None if g.row_remap_failure is None else float(g.row_remap_failure)),
}
# name (without _total) -> (help, reader): counters
_GPU_COUNTERS: dict[str, tuple[str, Callable[[GpuInfo], float | None]]] = {
    "gpusd_gpu_energy_joules": ("Energy the GPU used since the driver loaded",
                                lambda g: None if g.energy is None else g.energy / 1000.0),
    "gpusd_gpu_pcie_replays": ("PCIe replays (retries)", lambda g: g.pcie_replays),
    "gpusd_gpu_nvlink_bytes": ("NVLink raw bytes sent and received, every link", lambda g: g.nvlink_bytes),
    "gpusd_gpu_xid_errors": ("XID errors seen since the daemon started", lambda g: g.xid_errors),
    "gpusd_gpu_remapped_rows_correctable": ("GPU memory rows remapped for correctable errors",
                                            lambda g: g.remapped_rows_correctable),
    "gpusd_gpu_remapped_rows_uncorrectable": ("GPU memory rows remapped for uncorrectable errors",
                                              lambda g: g.remapped_rows_uncorrectable),
}
# GPUs remembered so that one that vanishes keeps gpusd_gpu_healthy 0
_SEEN_MAX = 4096


class SnapshotCollector:
    """A prometheus-client custom collector over whatever ``snapshots()`` returns at scrape time.

    ``alerts()`` (optional) gives the threshold rules exceeded right now, exported as
    ``gpusd_threshold_active``."""

    def __init__(self, snapshots: Callable[[], Iterable[HostSnapshot | None]],
                 alerts: Callable[[], Sequence[ThresholdEvent]] | None = None) -> None:
        self._snapshots = snapshots
        self._alerts = alerts
        # (host, uuid) -> labels, of GPUs seen before
        self._seen: dict[tuple[str, str], list[str]] = {}

    def describe(self) -> list[Any]:
        # An empty describe() keeps registration from calling collect() (which may not be ready yet).
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

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
        counters = {name: CounterMetricFamily(name, help_, labels=list(GPU_LABELS))
                    for name, (help_, _) in _GPU_COUNTERS.items()}
        present: set[tuple[str, str]] = set()
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
                labels = gpu_labels(snap, g)
                mig = "" if g.mig_mode is None else ("enabled" if g.mig_mode else "disabled")
                gpu_info.add_metric([*labels, g.pci_bus_id or "", g.compute_mode or "", mig, g.vendor], 1.0)
                for name, (_, read) in _GPU_GAUGES.items():
                    value = read(g)
                    if value is not None:
                        gauges[name].add_metric(labels, float(value))
                for name, (_, read) in _GPU_COUNTERS.items():
                    value = read(g)
                    if value is not None:
                        counters[name].add_metric(labels, float(value))
                key = (snap.hostname, g.uuid)
                present.add(key)
                if key not in self._seen and len(self._seen) < _SEEN_MAX:
                    self._seen[key] = labels
                for m in g.mig_instances:
                    mlabels = [*labels, m.uuid, m.profile or ""]
                    if m.memory_used is not None:
                        mig_used.add_metric(mlabels, float(m.memory_used))
                    if m.memory_total is not None:
                        mig_total.add_metric(mlabels, float(m.memory_total))
        # A GPU seen before that the host no longer lists (fallen off the bus) keeps a health series: 0.
        hosts = {snap.hostname for snap in snaps}
        for key, labels in self._seen.items():
            if key[0] in hosts and key not in present:
                gauges["gpusd_gpu_healthy"].add_metric(labels, 0.0)
        yield host_info
        yield host_gpus
        yield host_ts
        yield gpu_info
        yield from gauges.values()
        yield from counters.values()
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


# NVIDIA's DCGM exporter names for the same readings, so that dashboards made for it (NVIDIA's "NVIDIA DCGM
# Exporter Dashboard", grafana/dcgm-exporter-dashboard.json, Grafana 12239) show a gpusd fleet unchanged.
# Every default counter of dcgm-exporter's etc/default-counters.csv that NVML can provide, in that file's
# order, with its type, help and unit (percent, MiB, degrees C, watts, MHz, mJ).  Values are integers
# where DCGM's fields are integers.  docs/monitoring.md has the side-by-side table.
_MIB = 1 << 20


@dataclass(frozen=True)
class ExporterField:
    """One series of another exporter's naming (DCGM's here; a vendor's beside it)."""

    name: str
    type: str  # "gauge" or "counter"
    help: str
    read: Callable[[GpuInfo], float | int | None]
    # also per MIG instance (read through _MigAsGpu)
    mig: bool = False


def _round(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def _ratio(percent: float | None) -> float | None:
    return None if percent is None else percent / 100.0


def _mib(value: int | None) -> int | None:
    return None if value is None else int(value) // _MIB


def _used_v2(g: Any) -> int | None:
    """Memory used as DCGM counts it (NVML's memory v2: total = used + free + reserved); gpusd's
    ``memory_used`` is NVML v1's, which counts the reserved memory as used."""
    if g.memory_used is None:
        return None
    return max(0, int(g.memory_used) - int(g.memory_reserved or 0))


def _flag(value: bool | None) -> int | None:
    return None if value is None else int(value)


DCGM_FIELDS: tuple[ExporterField, ...] = (
    ExporterField("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", lambda g: g.clock_sm),
    ExporterField("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", lambda g: g.clock_memory),
    ExporterField("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).",
                  lambda g: g.memory_temperature),
    ExporterField("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda g: g.temperature),
    ExporterField("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda g: g.power_draw),
    ExporterField("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter",
                  "Total energy consumption since boot (in mJ).", lambda g: g.energy),
    ExporterField("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.",
                  lambda g: g.pcie_replays),
    ExporterField("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda g: _round(g.utilization_gpu)),
    ExporterField("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).",
                  lambda g: _round(g.utilization_memory)),
    ExporterField("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", lambda g: g.utilization_encoder),
    ExporterField("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", lambda g: g.utilization_decoder),
    ExporterField("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.",
                  lambda g: g.xid_last),
    ExporterField("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).",
                  lambda g: _mib(g.memory_free), mig=True),
    ExporterField("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).",
                  lambda g: _mib(_used_v2(g)), mig=True),
    ExporterField("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).",
                  lambda g: _mib(g.memory_reserved), mig=True),
    ExporterField("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter",
                  "Total number of NVLink bandwidth counters for all lanes.", lambda g: g.nvlink_bytes),
    ExporterField("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
                  "Number of remapped rows for uncorrectable errors", lambda g: g.remapped_rows_uncorrectable),
    ExporterField("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
                  "Number of remapped rows for correctable errors", lambda g: g.remapped_rows_correctable),
    ExporterField("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed",
                  lambda g: _flag(g.row_remap_failure)),
    # DCGM's profiling counters, from NVML's GPM where the GPU has it (Hopper and newer; docs/monitoring.md)
    ExporterField("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.",
                  lambda g: _ratio(g.gpm_graphics_util)),
    ExporterField("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active.",
                  lambda g: _ratio(g.gpm_tensor_util)),
    ExporterField("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
                  "Ratio of cycles the device memory interface is active sending or receiving data.",
                  lambda g: _ratio(g.gpm_dram_util)),
    ExporterField("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", "The rate of data transmitted over the PCIe bus - "
                  "including both protocol headers and data payloads - in bytes per second.",
                  lambda g: _round(g.pcie_tx_rate)),
    ExporterField("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", "The rate of data received over the PCIe bus - "
                  "including both protocol headers and data payloads - in bytes per second.",
                  lambda g: _round(g.pcie_rx_rate)),
)


class _MigAsGpu:
    """A MIG instance read by the FB fields (memory used, free; nothing reserved)."""

    def __init__(self, m: MigInstance) -> None:
        self.memory_used = m.memory_used
        self.memory_free = m.memory_free
        self.memory_reserved = 0 if m.memory_total is not None else None


def _escape(value: str) -> str:
    """A label value in the text exposition format: the one rule for labels (a GPU's name comes from
    its driver; a user or host name from the network), :func:`gpusd.sanitize.for_label`."""
    return for_label(value)


def _number(value: float | int) -> str:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return str(value)
    # readings are finite (gpusd.model.finite)
    return repr(float(value))


LabelsFn = Callable[[HostSnapshot, GpuInfo, "MigInstance | None"], Sequence[tuple[str, str]]]


def dcgm_labels(snap: HostSnapshot, g: GpuInfo, mig: MigInstance | None) -> list[tuple[str, str]]:
    """dcgm-exporter's labels for a GPU, or one of its MIG instances (``GPU_I_PROFILE``, ``GPU_I_ID``), in
    its order (internal/pkg/rendermetrics/render_metrics.go).  ``hostname`` is lower case since
    dcgm-exporter d5e5f51 (May 2026, "Rename Hostname label to hostname"): gpusd follows the current
    exporter and sends ``Hostname`` no more (docs/monitoring.md has a relabel rule for dashboards that
    want it).  ``gpu`` is the GPU's CUDA number (``device_index``: on a host with GPUs of several vendors,
    ``index`` runs over all of them)."""
    n = g.device_index
    out = [("gpu", str(n)), ("UUID", g.uuid), ("pci_bus_id", g.pci_bus_id or ""),
           ("device", f"nvidia{n}"), ("modelName", g.name or "")]
    if mig is not None:
        out += [("GPU_I_PROFILE", mig.profile or ""),
                ("GPU_I_ID", "" if mig.gpu_instance_id is None else str(mig.gpu_instance_id))]
    return out + [("hostname", snap.hostname), ("DCGM_FI_DRIVER_VERSION", snap.driver_version or "")]


def exporter_text(fields: Sequence[ExporterField], snaps: Iterable[HostSnapshot | None],
                  labels: LabelsFn = dcgm_labels, vendor: str | None = "nvidia") -> str:
    """The series of ``fields`` for every GPU of ``snaps`` in the text exposition format, labelled by
    ``labels`` (DCGM's by default; another exporter's naming passes its own), written as dcgm-exporter
    writes them: a counter's samples carry the family's own name (no ``_total``, which prometheus_client
    would add) and integer fields are integers.  A reading a GPU does not report (a lost GPU reports
    none) is left out; a field no GPU reports has no family.  Only GPUs of ``vendor`` (None: every
    GPU): DCGM's names are NVIDIA's (AMD GPUs get :class:`AmdExporterCollector`'s)."""
    rows: dict[str, list[str]] = {f.name: [] for f in fields}
    for snap in snaps:
        if snap is None:
            continue
        for g in snap.gpus:
            if vendor is not None and g.vendor != vendor:
                continue
            text = _labels(labels(snap, g, None))
            for f in fields:
                value = f.read(g)
                if value is not None:
                    rows[f.name].append(f"{f.name}{{{text}}} {_number(value)}")
            for m in g.mig_instances:
                mtext = _labels(labels(snap, g, m))
                mig = _MigAsGpu(m)
                for f in fields:
                    if f.mig:
                        value = f.read(mig)  # type: ignore[arg-type]
                        if value is not None:
                            rows[f.name].append(f"{f.name}{{{mtext}}} {_number(value)}")
    out = []
    for f in fields:
        if rows[f.name]:
            out.append(f"# HELP {f.name} {f.help}\n# TYPE {f.name} {f.type}\n")
            out.append("".join(line + "\n" for line in rows[f.name]))
    return "".join(out)


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    return ",".join(f'{n}="{_escape(v)}"' for n, v in pairs)


class DcgmCollector:
    """The DCGM exporter's series (``DCGM_FI_DEV_*``) for the NVIDIA GPUs of ``snapshots()`` (gpusd start
    ``--no-dcgm-metrics`` leaves them out), rendered by :func:`exporter_text`: prometheus_client cannot
    write a counter without ``_total``, and DCGM's names have none.  ``vendor``: whose GPUs (None: all)."""

    def __init__(self, snapshots: Callable[[], Iterable[HostSnapshot | None]],
                 fields: Sequence[ExporterField] = DCGM_FIELDS, labels: LabelsFn = dcgm_labels,
                 vendor: str | None = "nvidia") -> None:
        self._snapshots = snapshots
        self.fields = tuple(fields)
        self.labels = labels
        self.vendor = vendor

    def text(self) -> str:
        return exporter_text(self.fields, self._snapshots(), self.labels, self.vendor)


class UsageCollector:
    """:class:`UsageCounters` as ``gpusd_gpu_used_seconds_total``/``gpusd_gpu_held_seconds_total`` (per
    GPU, for everyone) and, where ``per_user()`` is true (the admin's ``--user-metrics`` and a reader
    who may see private data), ``gpusd_user_gpu_seconds_total{host, user, kind="used"|"held"}``."""

    def __init__(self, counters: UsageCounters, per_user: Callable[[], bool] = lambda: False) -> None:
        self.counters = counters
        self.per_user = per_user

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        used = CounterMetricFamily("gpusd_gpu_used_seconds", "Seconds a process ran on the GPU, since the "
                                   "daemon started", labels=list(GPU_LABELS))
        held = CounterMetricFamily("gpusd_gpu_held_seconds", "Seconds a gpusd lease held the GPU, since the "
                                   "daemon started", labels=list(GPU_LABELS))
        for labels, (u, h) in self.counters.gpu.items():
            used.add_metric(list(labels), u)
            held.add_metric(list(labels), h)
        yield used
        yield held
        if self.per_user():
            per = CounterMetricFamily("gpusd_user_gpu_seconds", "GPU-seconds a user's processes used (kind=used) "
                                      "or a user's leases held (kind=held), since the daemon started",
                                      labels=["host", "user", "kind"])
            for (host, user), (u, h) in self.counters.user.items():
                per.add_metric([host, user, "used"], u)
                per.add_metric([host, user, "held"], h)
            yield per


class LeaseCollector:
    """Who holds what: ``gpusd_gpu_lease_info`` (value 1) per lease on each GPU, with the GPU's labels and
    the lease, its gpusd job, its Slurm job and its holder, so that a dashboard joins a GPU's load to the
    work on it (``* on (host, uuid) group_left (user, gpusd_job) gpusd_gpu_lease_info``; not ``job``, which is
    Prometheus's own label), as dcgm-exporter's pod
    labels and AMD's exporter's Slurm labels do.  The holder (``user``) is private: filled only where
    ``per_user()`` is true (as ``gpusd_user_gpu_seconds_total``), empty otherwise.  Also the policy's caps
    (``gpusd_policy_max_gpus_per_user``, ``gpusd_policy_fleet_max_gpus_per_user``), which the shipped alert
    rules compare the leases with (docs/prometheus-rules.yml)."""

    # series per scrape: a host has a lease per GPU or MIG slice, a few per shared GPU
    MAX_LEASES = 4096

    def __init__(self, snapshots: Callable[[], Iterable[HostSnapshot | None]],
                 per_user: Callable[[], bool] = lambda: False,
                 policy: Callable[[], Any] | None = None) -> None:
        self.snapshots = snapshots
        self.per_user = per_user
        self.policy = policy

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily


        info = GaugeMetricFamily("gpusd_gpu_lease_info", "A lease held on a GPU (value 1): the lease, its gpusd "
                                 "job, its Slurm job and its holder (the holder only for readers who may see it)",
                                 labels=[*GPU_LABELS, "lease", "gpusd_job", "slurm_job", "user", "remote"])
        private = self.per_user()
        n = 0
        hosts = []
        for snap in self.snapshots():
            if snap is None:
                continue
            hosts.append(snap.hostname)
            for g in snap.gpus:
                labels = gpu_labels(snap, g)
                for le in g.leases:
                    if le.unleased or n >= self.MAX_LEASES:
                        continue
                    n += 1
                    user = printable(le.user or "", 64, "") if private else ""
                    info.add_metric([*labels, printable(le.lease_id, 64, ""), printable(le.job or "", 64, ""),
                                     printable(le.slurm_job or "", 32, ""), user,
                                     "true" if le.remote_from else "false"], 1.0)
        yield info
        yield self._processes(private)
        policy = self.policy() if self.policy is not None else None
        for name, attr, help_ in (
                ("gpusd_policy_max_gpus_per_user", "max_gpus_per_user", "GPUs one user may hold on this host"),
                ("gpusd_policy_fleet_max_gpus_per_user", "fleet_max_gpus_per_user",
                 "GPUs one user may hold on the whole fleet")):
            cap = getattr(policy, attr, None) if policy is not None else None
            if isinstance(cap, int):
                fam = GaugeMetricFamily(name, f"The policy's cap: {help_}", labels=["host"])
                for host in hosts:
                    fam.add_metric([host], float(cap))
                yield fam


    def _processes(self, private: bool) -> Any:
        """``gpusd_gpu_process_info`` (value 1, added in 0.4): each GPU process with the GPU's labels, its
        pid, its container (id, runtime, Kubernetes pod; empty for a process of the host: docs/inventory.md,
        "Containers"), whether a lease covers it, and its user (private, as for the leases)."""
        from prometheus_client.core import GaugeMetricFamily


        fam = GaugeMetricFamily("gpusd_gpu_process_info", "A process on a GPU (value 1): its pid, its container "
                                "and whether a lease covers it (its user only for readers who may see it)",
                                labels=[*GPU_LABELS, "pid", "container", "container_runtime", "pod", "user",
                                        "unleased"])
        n = 0
        for snap in self.snapshots():
            if snap is None:
                continue
            for g in snap.gpus:
                labels = gpu_labels(snap, g)
                for p in g.processes:
                    if n >= self.MAX_LEASES:
                        return fam
                    n += 1
                    fam.add_metric([*labels, str(p.pid), printable(p.container or "", 128, ""),
                                    printable(p.container_runtime or "", 32, ""), printable(p.pod or "", 64, ""),
                                    printable(p.user or "", 64, "") if private else "",
                                    "true" if p.unleased else "false"], 1.0)
        return fam


# registry -> the exporter-named collectors :func:`render` appends (written by exporter_text, not by
# prometheus_client: see DcgmCollector)
_EXPORTERS: weakref.WeakKeyDictionary[Any, list[DcgmCollector]] = weakref.WeakKeyDictionary()


# AMD's device-metrics-exporter names (ROCm/device-metrics-exporter) for the same readings of AMD GPUs,
# so that AMD's Grafana dashboards show them.  Units are the exporter's: percent, MB (MiB), C, W, µJ,
# GT/s and Mb/s for the PCIe link.
_AMD_GAUGES: dict[str, tuple[str, Callable[[GpuInfo], float | None]]] = {
    "gpu_gfx_activity": ("Graphics engine activity (in %).", lambda g: g.utilization_gpu),
    "gpu_umc_activity": ("Memory controller activity (in %).", lambda g: g.utilization_memory),
    "gpu_used_vram": ("Used VRAM (in MB).", lambda g: None if g.memory_used is None else g.memory_used / _MIB),
    "gpu_free_vram": ("Free VRAM (in MB).", lambda g: None if g.memory_free is None else g.memory_free / _MIB),
    "gpu_total_vram": ("Total VRAM (in MB).", lambda g: None if g.memory_total is None else g.memory_total / _MIB),
    # each sensor under its own name, only where the GPU has it (no edge sensor on an MI300X: its hotspot
    # is gpu_junction_temperature, as AMD's exporter serves it)
    "gpu_edge_temperature": ("Current edge temperature in Celsius", lambda g: g.edge_temperature),
    "gpu_junction_temperature": ("Current junction/hotspot temperature in Celsius", lambda g: g.junction_temperature),
    "gpu_memory_temperature": ("Current memory temperature in Celsius", lambda g: g.memory_temperature),
    "gpu_health": ("Health of the GPU (0 = Unhealthy | 1 = Healthy)", lambda g: 1.0 if g.healthy else 0.0),
    "gpu_energy_consumed": ("Accumulated energy consumed by the GPU in uJ",
                            lambda g: None if g.energy is None else g.energy * 1000.0),
    "gpu_package_power": ("Package power (in W).", lambda g: g.power_draw),
    "gpu_power_usage": ("Power usage (in W).", lambda g: g.power_draw),
    # ECC totals and the PCIe link: gauges in AMD's exporter though they count (its names, help and types)
    "gpu_ecc_correct_total": ("Total Correctable error count", lambda g: g.ecc_correctable),
    "gpu_ecc_uncorrect_total": ("Total Uncorrectable error count", lambda g: g.ecc_uncorrectable),
    "gpu_ecc_deferred_total": ("Total accumulated deferred ECC errors across all GPU blocks",
                               lambda g: g.ecc_deferred),
    "pcie_speed": ("Current PCIe speed in GT/s", lambda g: g.pcie_speed),
    "pcie_max_speed": ("Maximum PCIe speed in GT/s", lambda g: g.pcie_max_speed),
    "pcie_bandwidth": ("Current PCIe bandwidth in Mb/s", lambda g: g.pcie_bandwidth),
    "pcie_replay_count": ("Total number of PCIe replays", lambda g: g.pcie_replays),
    "pcie_recovery_count": ("Total number of PCIe recoveries", lambda g: g.pcie_recoveries),
    "pcie_replay_rollover_count": ("PCIe replay accumulated count", lambda g: g.pcie_replay_rollovers),
    "pcie_nack_sent_count": ("PCIe NAK sent accumulated count", lambda g: g.pcie_nak_sent),
    "pcie_nack_received_count": ("PCIe NAK received accumulated count", lambda g: g.pcie_nak_received),
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
        clock = GaugeMetricFamily("gpu_clock", "Current clock frequency in MHz",
                                  labels=["clock_index", "clock_type", *AMD_LABELS])
        busy = GaugeMetricFamily("gpu_gfx_busy_instantaneous", "Gfx busy instantaneous per accelerated compute "
                                 "processor(xcp) per compute core (xcc), as per partitioning of the system",
                                 labels=["xcc_index", *AMD_LABELS])
        for snap in self._snapshots():
            if snap is None:
                continue
            for g in snap.gpus:
                if exporter_of(g.vendor) != AMD_EXPORTER:
                    continue
                serial = g.uuid.removeprefix("GPU-") if g.uuid.startswith("GPU-") else ""
                # card_model: the board's part number, else the market name (as AMD's exporter falls back to
                # the card series): AMD's dashboards match part numbers such as 102-G30211-00
                labels = [str(g.device_index), g.uuid, serial, g.board_model or g.name or "", "AMD", snap.hostname, "0",
                          (g.compute_partition or "").lower(), (g.memory_partition or "").lower(),
                          snap.driver_version or ""]
                for name, (_, read) in _AMD_GAUGES.items():
                    value = read(g)
                    if value is not None:
                        families[name].add_metric(labels, float(value))
                for i, (kind, mhz) in enumerate((("SYSTEM", g.clock_sm), ("MEMORY", g.clock_memory))):
                    if mhz is not None:
                        clock.add_metric([str(i), kind, *labels], float(mhz))
                for i, percent in enumerate(g.gfx_busy_xcc or ()):
                    busy.add_metric([str(i), *labels], float(percent))
        # only families with series: a host without AMD GPUs exports none of these names
        yield from (f for f in (*families.values(), clock, busy) if f.samples)


def make_registry(snapshots: Callable[[], Iterable[HostSnapshot | None]],
                  alerts: Callable[[], Sequence[ThresholdEvent]] | None = None,
                  process_metrics: bool = True, dcgm: bool = False,
                  extra: Sequence[Any] = ()) -> CollectorRegistry:
    """A registry holding the GPU collector (and, by default, the daemon's own process_* metrics; with
    ``dcgm``, the DCGM exporter's names too, which :func:`render` appends); ``extra``: more collectors
    (the usage counters)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshots, alerts))
    for c in extra:
        registry.register(c)
    if dcgm:
        _EXPORTERS[registry] = [DcgmCollector(snapshots)]  # NVIDIA GPUs only
        registry.register(AmdExporterCollector(snapshots))  # AMD GPUs only
    if process_metrics:
        ProcessCollector(registry=registry)
    return registry


def process_registry() -> CollectorRegistry:
    """A registry of the daemon's own process_* series alone (CPU, memory, descriptors: read at every
    scrape, unlike the GPUs' series, which change with a sample)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text exposition format, then the exporter-named series; no
    control byte in it but the newlines (:func:`gpusd.sanitize.for_exposition`)."""
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    for exporter in _EXPORTERS.get(registry, ()):
        text += exporter.text()
    # the boundary: the one rule for /metrics (gpusd.sanitize)
    return for_exposition(text).encode()


def render_snapshots(snaps: Iterable[HostSnapshot], alerts: Sequence[ThresholdEvent] | None = None,
                     dcgm: bool = False) -> bytes:
    """One-shot rendering (no process metrics), e.g. for tests or a textfile collector."""
    snaps = list(snaps)
    registry = make_registry(lambda: snaps, (lambda: alerts) if alerts is not None else None, process_metrics=False,
                             dcgm=dcgm)
    return render(registry)
