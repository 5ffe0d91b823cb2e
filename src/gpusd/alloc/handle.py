"""What holding a lease means, however it was taken: :class:`LeaseHandle` and :class:`Holder`.

A lease is held one of two ways (docs/allocation.md):

* in the lock directory (:class:`gpusd.alloc.leases.Lease`): this process holds the GPUs' flock
  descriptors and its record's, and rewrites the record itself (under the store's selection mutex);
* by the local daemon, the lease authority (:class:`gpusd.alloc.authority.RemoteLease`): it holds the
  descriptors and the record while this process keeps the lease socket's connection open.

Both are a :class:`LeaseHandle`: the GPUs held, who holds them, the descriptors that keep the lease
alive (handed to a job's command), giving one GPU back, updating the record, releasing, and a
context manager.  Code outside :mod:`gpusd.alloc` holds leases only through this handle: it never
opens a lock file nor writes a lease record (tests/alloc/test_lease_handle.py checks both).

Only ``abc`` and :mod:`gpusd.record` are imported (start-up time).
"""

from __future__ import annotations

import abc

from ..record import record

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

# the fields of a lease record that say who holds it beyond pid, user and command (docs/pool.md, docs/slurm.md)
EXTRA_FIELDS = ("remote_from", "expires", "job", "slurm_job")


@record(frozen=True)
class Holder:
    """Who a lease is for, as its record says it.  ``pid`` and ``user`` None: this process and its
    user (only root's records are believed to name someone else); ``uid``: whose bound of the
    priority policy applies (None: this process's); ``command``: what runs on the GPUs; ``job``:
    the gpusd job (:mod:`gpusd.jobs.record`); ``slurm_job``: the Slurm job whose lease the daemon
    holds; ``remote_from``/``expires``: a lease the daemon holds for a remote holder (docs/pool.md)."""

    pid: int | None = None
    user: str | None = None
    uid: int | None = None
    command: str | None = None
    job: str | None = None
    slurm_job: str | None = None
    remote_from: str | None = None
    expires: float | None = None

    def extra(self) -> dict[str, Any]:
        """The record's optional fields this holder sets (those not None)."""
        return {k: v for k in EXTRA_FIELDS if (v := getattr(self, k)) is not None}


class LeaseHandle(abc.ABC):
    """A lease held now: on :attr:`devices` (UUIDs), in one mode (:attr:`shared`), for
    :attr:`holder`, until :meth:`release` (or the end of a ``with`` block, or of the process)."""

    lease_id: str
    devices: list[str]
    shared: bool
    memory: int | None
    holder: Holder
    released: bool

    @property
    @abc.abstractmethod
    def fds(self) -> list[int]:
        """The descriptors that keep the lease alive, for a command to inherit (``pass_fds``): while
        any process holds a copy, the GPUs stay leased.  Empty once released."""

    @abc.abstractmethod
    def give_back(self, device: str) -> None:
        """Stop holding ``device`` (one of :attr:`devices`, not the last one) and stop recording it.
        GpusdError when it cannot (not held, the last one, the lease ended)."""

    @abc.abstractmethod
    def update(self, **changes: Any) -> None:
        """Replace the lease's record with one where ``changes`` apply (a remote lease renewed: its
        ``expires``).  GpusdError when this handle cannot change its record."""

    @abc.abstractmethod
    def release(self) -> None:
        """End the lease (idempotent)."""

    def epochs(self) -> dict[str, int]:
        """Each device's epoch: the fencing token of its grant (:mod:`gpusd.alloc.epoch`); empty
        where the granter gave none (a daemon before 0.4)."""
        return {}

    @property
    def epoch(self) -> int | None:
        """The lease's epoch (``GPUSD_LEASE_EPOCH``): the largest of its devices' epochs, so it is
        greater than every earlier grant's of each of its GPUs; None where the granter gave none."""
        values = self.epochs().values()
        return max(values) if values else None

    def __enter__(self) -> LeaseHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
