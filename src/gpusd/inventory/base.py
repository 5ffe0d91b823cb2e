"""What every vendor library's backend shares (NVML, amdsmi, Level Zero): the device list kept between
snapshots, the one lock, a query that remembers what a GPU does not support, a GPU that fails
mid-snapshot flagged (:mod:`.lost`), process owners resolved once per snapshot, and closing.

A vendor's backend subclasses :class:`VendorBackend` and writes only what its library says:
``_refresh_devices`` (the handles, read again when their number changes), ``_fill`` (one GPU's
readings), and where it needs them ``_before_read`` (once per snapshot, under the lock),
``_host`` (the snapshot's host fields) and ``_shutdown``.  It implements
:class:`gpusd.inventory.backend.Backend`.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

# a lock alone: importing threading costs a one-shot command ~1.5 ms
import _thread
import time

from ..errors import BackendUnavailable
from ..identity import hostname, node_id
from ..model import GpuInfo, HostSnapshot, ProcessInfo
from ..record import field, record
from .lost import GpuFailed, filled
from .processes import ProcessResolver
from .window import UtilWindow

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Callable, Mapping, Sequence


@record
class VendorDevice:
    """One GPU as a backend keeps it between snapshots (a vendor adds its own handles)."""

    index: int
    handle: Any
    uuid: str
    name: str | None = None
    pci_bus_id: str | None = None
    # queries this GPU does not answer: not asked again
    unsupported: set[str] = field(default_factory=set)
    util: UtilWindow | None = None


class VendorBackend:
    """The shared part of a vendor library's backend.  Thread-safe; one instance per process is enough."""

    # the name snapshots carry
    backend = ""
    # GpuInfo.vendor of every GPU it reads (its visibility rule: inventory.vendors)
    vendor = "nvidia"
    # for messages: "NVML", "amdsmi", "Level Zero"
    library = ""
    # what failed when the device list cannot be read
    listing = "cannot list GPUs"
    # the library's exception type(s), for _query
    _error: Any = ()
    # reads a GPU's process lists apart from its snapshot (_processes_of)
    _defers_processes = False

    def __init__(self, *, util_window: float = 5.0, processes: bool = True) -> None:
        self.util_window = util_window
        self.want_processes = processes
        self._lock = _thread.allocate_lock()
        self._devices: list[Any] = []
        self._resolver = ProcessResolver()
        self._util_since: Mapping[str, float] = {}
        self._detail = True
        # this snapshot reads the process lists (pick_snapshot: later, GPU by GPU)
        self._processes_now = True
        # this snapshot wants the topology of GPU pairs (pick_snapshot)
        self._pairs_now = True
        self._closed = False
        self.driver_version: str | None = None
        self.hostname = hostname()
        self.node_id = node_id()

    @property
    def vendors(self) -> tuple[str, ...]:
        return (self.vendor,)

    # -- what a vendor writes -----------------------------------------------------------------
    def _refresh_devices(self) -> None:
        raise NotImplementedError

    def _fill(self, dev: Any, gpu: GpuInfo) -> None:
        raise NotImplementedError

    def _list_reason(self, exc: BaseException) -> str | None:
        """Why the device list could not be read, where ``exc`` is the library's error (else None)."""
        return None

    def _unsupported(self, exc: BaseException) -> bool:
        """Whether the library's error ``exc`` means "this GPU has no such reading"."""
        return False

    def _failed(self, dev: Any, key: str, exc: BaseException) -> str | None:
        """The reason the GPU itself failed, from the library's error ``exc`` (None: a missing reading)."""
        return f"{key}: {exc}"

    def _before_read(self) -> None:
        """Once per snapshot, under the lock, after the device list is read."""

    def _host(self, gpus: list[GpuInfo]) -> HostSnapshot:
        return HostSnapshot(hostname=self.hostname, node_id=self.node_id, timestamp=time.time(), gpus=gpus,
                            driver_version=self.driver_version, backend=self.backend)

    def _shutdown(self) -> None:
        """The library's own shutdown, once, under the lock."""

    # -- shared -------------------------------------------------------------------------------
    def _query(self, dev: Any, key: str, fn: Any, *args: Any) -> Any:
        """``fn(handle, *args)``; None where unsupported (not asked again) or missing; raises
        :class:`~gpusd.inventory.lost.GpuFailed` where the GPU failed."""
        if key in dev.unsupported:
            return None
        try:
            return fn(dev.handle, *args)
        except self._error as exc:
            if self._unsupported(exc):
                dev.unsupported.add(key)
                return None
            reason = self._failed(dev, key, exc)
            if reason is not None:
                raise GpuFailed(reason) from None
            return None

    def _gpu(self, dev: Any) -> GpuInfo:
        return GpuInfo(index=dev.index, uuid=dev.uuid, name=dev.name, pci_bus_id=dev.pci_bus_id, vendor=self.vendor)

    def _read(self, dev: Any) -> GpuInfo:
        return filled(self._gpu(dev), self._fill, dev)

    def _read_all(self, devices: Sequence[Any]) -> list[GpuInfo]:
        """Every GPU's record, in the device list's order (a vendor may read them in one loop)."""
        return [self._read(dev) for dev in devices]

    def snapshot(self, util_since: Mapping[str, float] | None = None, detail: bool = True) -> HostSnapshot:
        """All GPUs now (see :meth:`gpusd.inventory.backend.Backend.snapshot`)."""
        return self._snapshot(util_since, detail)[0]

    def pick_snapshot(self, util_since: Mapping[str, float] | None = None,
                      pairs: bool = True) -> tuple[HostSnapshot, Callable[[GpuInfo], bool] | None]:
        """What a pick reads (``snapshot(util_since, detail=False)``), with the process lists left to be
        read GPU by GPU where the vendor can (``_processes_of``): (the snapshot, ``confirm``).  A GPU's
        ``processes`` are empty until ``confirm(gpu)`` reads them (into the record; a GPU that fails
        then is flagged unhealthy); ``confirm`` says whether it read them now (False: read before).
        None: every list was read.  ``pairs=False``: a one-GPU pick, which needs no GPU pair's topology
        (a vendor may leave it unread)."""
        defer = self._defers_processes and self.want_processes
        snap, devices = self._snapshot(util_since, False, processes=not defer, pairs=pairs)
        if not defer:
            return snap, None
        pending = {g.uuid: dev for g, dev in zip(snap.gpus, devices) if g.healthy}

        def confirm(gpu: GpuInfo) -> bool:
            dev = pending.pop(gpu.uuid, None)
            if dev is None:
                return False
            with self._lock:
                if self._closed:
                    raise BackendUnavailable(f"the {self.library} backend is closed")
                try:
                    gpu.processes = self._processes_of(dev)
                except GpuFailed as exc:
                    gpu.healthy, gpu.error = False, exc.reason
            return True

        return snap, confirm

    def _processes_of(self, dev: Any) -> list[ProcessInfo]:
        """One GPU's processes, read apart from its snapshot (``pick_snapshot``); under the lock."""
        raise NotImplementedError

    def _snapshot(self, util_since: Mapping[str, float] | None, detail: bool, processes: bool = True,
                  pairs: bool = True) -> tuple[HostSnapshot, list[Any]]:
        """(The snapshot, the devices its GPUs were read from, in its order); ``processes=False``: no
        process list read (``pick_snapshot``); ``pairs``: see there."""
        with self._lock:
            self._util_since = util_since or {}
            self._detail = detail
            self._processes_now, self._pairs_now = processes, pairs
            if self._closed:
                raise BackendUnavailable(f"the {self.library} backend is closed")
            try:
                self._refresh_devices()
            except Exception as exc:
                reason = self._list_reason(exc)
                if reason is None:
                    raise
                raise BackendUnavailable(f"{self.library} {self.listing}: {reason}", hint=True) from None
            self._before_read()
            devices = self._devices
            gpus = self._read_all(devices)
            unified_memory(gpus, devices)
        if detail:
            self._resolver.fill_gpus(gpus)
        return self._host(gpus), devices

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._shutdown()

    def __enter__(self) -> VendorBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unified_memory(gpus: Sequence[GpuInfo], devices: Sequence[VendorDevice]) -> None:
    """The host's memory for each GPU whose driver has no memory of its own to report (a unified-memory
    GPU answers the memory query "not supported"): what it can allocate is the host's available memory.
    Marked ``memory_shared``, so that every view says so and selection counts reservations host-wide."""
    host = None
    for gpu, dev in zip(gpus, devices):
        if gpu.memory_total is not None or "memory" not in dev.unsupported or not gpu.healthy:
            continue
        if host is None:
            from ..topology import host_memory

            host = host_memory() or (0, 0)
        total, available = host
        if total:
            gpu.memory_total, gpu.memory_free, gpu.memory_used = total, available, total - available
            gpu.memory_shared = True
