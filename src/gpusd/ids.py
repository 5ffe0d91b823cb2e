"""The identifiers gpusd makes and reads: one owner per format (docs/jobs.md, "Identifiers").

Each kind of id is a namespace with the same three functions::

    JobId.new()            -> "3f9c0a1b22de"    (the one format gpusd writes)
    JobId.parse(text)      -> text, or IdError  (every format accepted today, on disk and on the wire)
    JobId.is_valid(text)   -> bool

``parse`` accepts every id an older gpusd wrote or sent (the widest rule any part used to check), while
``new`` makes one format only; an id read from a file name is taken with :func:`from_file_name`.  No other
module compiles a regular expression for these ids (``tests/test_ids.py`` checks the source).

``JobId``        a gpusd job (``gpusd run``, a fleet run): written 12 lowercase hex digits; read 8 to 32.
``LeaseId``      a lease (local, through the daemon, or a daemon's remote lease): written 12 lowercase
                 hex digits; read 1 to 64 letters, digits, ``_`` or ``-`` (the lock directory's rule),
                 not starting with ``-`` (a lease id goes into ``gpusd fleet-job --lease ID`` lines).
``SlurmJobId``   a Slurm job or array task (``42``, ``42_3``): Slurm makes them, gpusd only reads them.
``GpuUuid``      a GPU's or MIG slice's UUID (``GPU-...``, ``MIG-...``): drivers make them, gpusd reads
                 1 to 120 letters, digits or ``-`` after the prefix.
``PlacementId``  the ``job_id`` of an engines placement (``gpusd launch``, ``hostfile``, ``ray up``):
                 a name for hostfiles and engines, not a gpusd job; written ``gpusd-`` and 8 hex digits,
                 read 1 to 64 letters, digits, ``.``, ``_`` or ``-`` (not starting with ``.`` or ``-``).
``ContainerId``  a container (docker, podman, containerd, CRI-O): 12 to 64 lowercase hex digits; the runtimes
                 make them, gpusd reads them (a cgroup, a ``--cidfile``, a job record).
``PodUid``       a Kubernetes pod's UID (``8-4-4-4-12`` lowercase hex digits), read from a cgroup.

Core: imports only :mod:`gpusd.errors`; cheap to import (a few compiled expressions, no typing).
"""

from __future__ import annotations

import os
import re

from .errors import IdError

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable
    from typing import TypeGuard


class _Id:
    """The shared functions of an id kind; subclasses set ``what``, ``rule`` and ``_match``."""

    what = "an id"
    rule = ""
    _match: Callable[[str], object]
    # the record's file name, the id its group 1
    _file: Callable[[str], re.Match[str] | None]

    @classmethod
    def is_valid(cls, text: object) -> TypeGuard[str]:
        return isinstance(text, str) and cls._match(text) is not None

    @classmethod
    def parse(cls, text: object, where: str | None = None) -> str:
        """``text`` when it is such an id; :class:`~gpusd.errors.IdError` (a ``ConfigError``, so a
        ``ValueError``) with a one-line message otherwise (``where``: what gave it, e.g. ``--job``)."""
        if isinstance(text, str) and cls._match(text) is not None:
            return text
        shown = repr(text[:40]) if isinstance(text, str) else type(text).__name__
        raise IdError(f"{where + ': ' if where else ''}not {cls.what}: {shown} ({cls.what} is {cls.rule})")

    @classmethod
    def optional(cls, value: object) -> str | None:
        """``value`` when it is such an id, else None (a field of a record another user wrote)."""
        return value if isinstance(value, str) and cls._match(value) is not None else None

    @classmethod
    def from_file_name(cls, name: str) -> str | None:
        """The id in a record's file name (``lease-<ID>.json``, ``job-<ID>.json``), or None when ``name``
        is not one (one match per directory entry: listing the lock directory stays cheap)."""
        m = cls._file(name)
        return m[1] if m is not None else None


def _hex12() -> str:
    # 48 bits: unique among the jobs and leases of one machine
    return os.urandom(6).hex()


class JobId(_Id):
    """A gpusd job's id (``job-<ID>.json``, ``GPUSD_JOB``, a lease record's ``job``)."""

    what = "a job id"
    rule = "8 to 32 lowercase hex digits"
    _match = re.compile(r"[0-9a-f]{8,32}").fullmatch
    # job-<ID>.json (gpusd.jobs.record)
    _file = re.compile(r"job-([0-9a-f]{8,32})\.json").fullmatch

    @staticmethod
    def new() -> str:
        return _hex12()


class LeaseId(_Id):
    """A lease's id (``lease-<ID>.json``, the lease socket's and the HTTP API's ``lease_id``)."""

    what = "a lease id"
    rule = "1 to 64 letters, digits, '_' or '-', not starting with '-' (gpusd makes 12 hex digits)"
    # the lock directory's 0.2 rule, less a leading '-' (never written by gpusd; an option on a command line)
    _match = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}").fullmatch
    _file = re.compile(r"lease-([A-Za-z0-9_][A-Za-z0-9_-]{0,63})\.json").fullmatch  # lease-<ID>.json

    @staticmethod
    def new() -> str:
        return _hex12()


class SlurmJobId(_Id):
    """A Slurm job id (``$SLURM_JOB_ID``), or an array task's (``42_3``); Slurm makes them."""

    what = "a Slurm job id"
    rule = "digits, or digits_digits for an array task"
    _match = re.compile(r"[0-9]{1,20}(?:_[0-9]{1,10})?").fullmatch


class PlacementId(_Id):
    """The ``job_id`` of an engines :class:`~gpusd.engines.placement.Placement`: a name hostfiles,
    DeepSpeed, Ray and ``GPUSD_JOB_ID`` carry (a placement file may name its own)."""

    what = "a placement's job id"
    rule = "1-64 letters, digits, '.', '_' or '-', not starting with '.' or '-'"
    _match = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}").fullmatch

    @staticmethod
    def new() -> str:
        return "gpusd-" + os.urandom(4).hex()


class GpuUuid(_Id):
    """A GPU's or a MIG slice's UUID as drivers write it (``GPU-<hex groups>``, ``MIG-<...>``; AMD's
    and Intel's are written in the same form by their backends): what a record, a placement, a Slurm
    job's device list or a checkpoint's device map may carry.  Never anything that could split a
    comma-separated list or a command line."""

    what = "a GPU UUID"
    rule = "GPU- or MIG- and 1 to 120 letters, digits or '-'"
    _match = re.compile(r"(?:GPU|MIG)-[0-9A-Za-z-]{1,120}").fullmatch

    @staticmethod
    def is_slice(text: str) -> bool:
        """Whether ``text`` names a MIG slice (addressed only by its UUID)."""
        return text.startswith("MIG-")

    @staticmethod
    def names_one(token: str) -> bool:
        """Whether a device-list token (``CUDA_VISIBLE_DEVICES``) is given by UUID: CUDA also takes a
        UUID's unique prefix, so this checks the form's start only."""
        return token.startswith(("GPU-", "MIG-"))


class ContainerId(_Id):
    """A container's id as its runtime writes it (``--cidfile``, the cgroup's name)."""

    what = "a container id"
    rule = "12 to 64 lowercase hexadecimal digits"
    _match = re.compile(r"[0-9a-f]{12,64}").fullmatch


class PodUid(_Id):
    """A Kubernetes pod's UID."""

    what = "a pod UID"
    rule = "8-4-4-4-12 lowercase hexadecimal digits"
    _match = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}").fullmatch


__all__ = ["JobId", "LeaseId", "SlurmJobId", "PlacementId", "GpuUuid", "ContainerId", "PodUid"]
