"""A device the ranking found for a job (:class:`Candidate`): the record :mod:`gpusd.alloc.select` ranks
and :mod:`gpusd.alloc.placement` chooses sets from, kept below both so that neither imports the other's
module for it."""

from __future__ import annotations

from ..model import GpuInfo, LeaseInfo, MigInstance
from ..record import field, record


@record
class Candidate:
    """A device that could be given to the job: a whole GPU or a MIG slice."""

    gpu: GpuInfo
    mig: MigInstance | None
    # free memory after reservations
    free: int | None
    total: int | None
    util: float | None
    leases: list[LeaseInfo] = field(default_factory=list)
    # the ranking key (lower is better): gpusd.alloc.select.score
    score: tuple[float, ...] = ()

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid

    @property
    def label(self) -> str:
        return f"{self.gpu.index}:{self.mig.index}" if self.mig else str(self.gpu.index)
