"""Where a distributed job runs: the hosts and GPUs chosen for it, in order (the head first).

A :class:`Placement` is what every engine generator and the launcher take.  The pool's reservation
(`gpusd reserve`) produces one: each reserved host becomes a :class:`HostSlot` with the NVML
indices (and UUIDs) of the GPUs leased there; until then ``gpusd hostfile``/``launch``/``ray`` read one
from a JSON file (``--placement FILE``, format below).

Every field ends up in a hostfile, a command line or a shell word on another machine, and comes from
the network (the names and addresses daemons sign), so :meth:`Placement.from_dict` is strict: host
names and SSH targets are plain DNS-ish names or IP addresses (never an option such as
``-oProxyCommand=...``, a URL, spaces or control characters: :func:`check_ssh_target`, the one check
of every ssh target gpusd uses, ``gpusd run --fleet`` included), GPU indices are small non-negative
integers, without duplicates, UUIDs are ``GPU-``/``MIG-`` words.

JSON form (``gpusd hostfile --format json`` prints the same)::

    {"job_id": "gpusd-3f2a", "hosts": [
        {"hostname": "node-1", "address": "10.0.0.1", "ssh_target": "node-1", "gpus": [0, 2],
         "uuids": ["GPU-...", "GPU-..."]},
        {"hostname": "node-2", "address": "10.0.0.2", "gpus": [1]},
        {"hostname": "mi300-1", "gpus": [0, 1], "vendor": "amd"}]}

``vendor`` (``nvidia`` when left out, ``amd``, ``intel``) says which visibility variables the host's
commands get (``gpusd.inventory.vendors``).

``ssh_target`` defaults to the host name (so the user's ssh config decides how to reach it);
``address`` defaults to the host name too (it is what other hosts dial: the rendezvous endpoint).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

# its name here stays importable
from ..errors import PlacementError as PlacementError
from ..ids import GpuUuid, PlacementId
from ..inventory.vendors import DEFAULT_VENDOR, DEVICE_VARIABLE, VENDORS, Visible, cleared, visible_env
from ..sanitize import ip_word
from ..topology import parse_cpulist

MAX_HOSTS = 1024
MAX_GPUS_PER_HOST = 256
# host names as DNS and /etc/hosts write them
_NAME = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,252})$")
_SSH_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")


def valid_host(text: str) -> bool:
    """A host name or an IP address safe in a hostfile, a command line and an ssh argument: never
    an option (a leading ``-``), ``user@``, a URL, a port, spaces or control characters."""
    if not isinstance(text, str) or not text:
        return False
    # an IPv6 scope id only of interface-name characters (never ``%;reboot``)
    if ip_word(text):
        return True
    return _NAME.fullmatch(text) is not None and ".." not in text


def _check_host(text: object, what: str) -> str:
    if not isinstance(text, str) or not valid_host(text):
        raise PlacementError(f"{what} must be a host name or an IP address, not {str(text)[:80]!r}")
    return text


def check_ssh_target(text: object, *, user: bool = False, what: str = "ssh_target") -> str:
    """The one check of an ssh target (``gpusd run --fleet``, ``launch``, ``hostfile``, ``ray up``):
    a DNS name or an IP address (:func:`valid_host`), returned as it is; PlacementError otherwise.
    ``user``: also ``name@host``, for the ``ssh_target`` of a placement file the user wrote
    (docs/engines.md); a name that came from the network (a daemon's signed host name) is checked
    without it, so it can never pick the login."""
    if not isinstance(text, str):
        raise PlacementError(f"{what} must be a string, not {type(text).__name__}")
    login, at, host = text.rpartition("@")
    if at and not user:
        raise PlacementError(f"{what} must be a host name or an IP address, not {text[:80]!r}")
    if at and _SSH_USER.fullmatch(login) is None:
        raise PlacementError(f"{what} has an unsafe user name: {text[:80]!r}")
    _check_host(host, what)
    return text


# characters in one GPU's CPU list
MAX_CPULIST = 4096


def valid_cpulist(text: object) -> bool:
    """A Linux CPU list (``0-3,8``) that :func:`gpusd.topology.parse_cpulist` reads, bounded."""

    if not isinstance(text, str) or not 0 < len(text) <= MAX_CPULIST:
        return False
    try:
        return bool(parse_cpulist(text))
    except ValueError:
        return False


@dataclass(frozen=True)
class HostSlot:
    """One host of a placement: the GPUs (NVML indices, PCI bus order) reserved there."""

    hostname: str
    address: str
    ssh_target: str
    gpus: tuple[int, ...]
    uuids: tuple[str, ...] = ()
    # whose GPUs they are: which visibility variables the host's commands get; ``gpus``
    # are then that vendor's own numbers (CUDA's, ROCm's, Level Zero's)
    vendor: str = DEFAULT_VENDOR
    # each GPU's local CPUs as the host's daemon claimed them (``nvmlDeviceGetCpuAffinity``: a Linux
    # CPU list such as ``0-15,32-47``; None: unknown), in ``gpus`` order; ``launch --bind-cpus`` binds
    # to them intersected, on the host, with the CPUs the command may use there (a claim, never more)
    local_cpus: tuple[str | None, ...] = ()

    def __post_init__(self) -> None:
        _check_host(self.hostname, "hostname")
        if self.vendor not in VENDORS:
            raise PlacementError(f"host {self.hostname}: vendor must be one of {', '.join(VENDORS)}, "
                                 f"not {str(self.vendor)[:40]!r}")
        _check_host(self.address, "address")
        check_ssh_target(self.ssh_target, user=True)
        if not self.gpus:
            raise PlacementError(f"host {self.hostname} has no GPU in the placement")
        if len(self.gpus) > MAX_GPUS_PER_HOST:
            raise PlacementError(f"host {self.hostname}: more than {MAX_GPUS_PER_HOST} GPUs")
        for g in self.gpus:
            if not isinstance(g, int) or isinstance(g, bool) or not 0 <= g < 4096:
                raise PlacementError(f"host {self.hostname}: a GPU index must be an integer 0-4095, not {g!r}")
        if len(set(self.gpus)) != len(self.gpus):
            raise PlacementError(f"host {self.hostname}: a GPU is listed twice: {list(self.gpus)}")
        if self.uuids:
            if len(self.uuids) != len(self.gpus):
                raise PlacementError(f"host {self.hostname}: {len(self.uuids)} UUIDs for {len(self.gpus)} GPUs")
            for u in self.uuids:
                if not GpuUuid.is_valid(u):
                    raise PlacementError(f"host {self.hostname}: not a GPU UUID: {str(u)[:80]!r}")
        if self.local_cpus:
            if len(self.local_cpus) != len(self.gpus):
                raise PlacementError(f"host {self.hostname}: {len(self.local_cpus)} CPU lists for "
                                     f"{len(self.gpus)} GPUs")
            for c in self.local_cpus:
                if c is not None and not valid_cpulist(c):
                    raise PlacementError(f"host {self.hostname}: not a CPU list: {str(c)[:80]!r}")

    @property
    def slots(self) -> int:
        return len(self.gpus)

    @property
    def ssh_host(self) -> str:
        """The host part of the SSH target: the name engines that ssh by themselves (MPI, DeepSpeed's
        pdsh) are given in their hostfiles, so that the user's ssh config applies to them too."""
        return self.ssh_target.rpartition("@")[2]

    def cuda_env(self) -> dict[str, str]:
        """The visibility variables for this host's GPUs: ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and
        ``CUDA_VISIBLE_DEVICES`` on NVIDIA (UUIDs for MIG slices, which CUDA addresses only by UUID),
        ``ROCR_VISIBLE_DEVICES`` on AMD, ``ZE_AFFINITY_MASK`` on Intel (:meth:`visible_env`)."""
        return self.visible_env()

    def visible(self) -> list[Visible]:
        uuids: Sequence[str | None] = self.uuids or [None] * len(self.gpus)
        return [Visible(self.vendor, g, u, bool(u and GpuUuid.is_slice(u))) for g, u in zip(self.gpus, uuids)]

    def visible_env(self, engine: str | None = None) -> dict[str, str]:
        """What makes this host's GPUs visible to a command (``engine="ray"``: what Ray reads)."""
        return visible_env(self.visible(), engine=engine)

    def cleared(self, engine: str | None = None) -> tuple[str, ...]:
        """Variables the host's commands must not inherit (they would mask again)."""
        return tuple(sorted(cleared([self.vendor], engine) - set(self.visible_env(engine))))

    @property
    def device_variable(self) -> str:
        """The variable that lists the devices (``CUDA_VISIBLE_DEVICES``, ``ROCR_VISIBLE_DEVICES``...)."""
        return DEVICE_VARIABLE[self.vendor]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hostname": self.hostname, "address": self.address, "ssh_target": self.ssh_target,
                               "gpus": list(self.gpus)}
        if self.uuids:
            out["uuids"] = list(self.uuids)
        # left out for the default, as older readers expect
        if self.vendor != DEFAULT_VENDOR:
            out["vendor"] = self.vendor
        if self.local_cpus:
            out["local_cpus"] = list(self.local_cpus)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HostSlot":
        if not isinstance(d, Mapping):
            raise PlacementError(f"a host must be an object, not {type(d).__name__}")
        hostname: Any = d.get("hostname")
        gpus = d.get("gpus")
        uuids = d.get("uuids") or ()
        cpus = d.get("local_cpus") or ()
        if not isinstance(gpus, list) or not isinstance(uuids, (list, tuple)) or not isinstance(cpus, (list, tuple)):
            raise PlacementError(f"host {str(hostname)[:80]!r}: gpus (and uuids, local_cpus) must be lists")
        if len(gpus) > MAX_GPUS_PER_HOST or len(uuids) > MAX_GPUS_PER_HOST or len(cpus) > MAX_GPUS_PER_HOST:
            raise PlacementError(f"host {str(hostname)[:80]!r}: more than {MAX_GPUS_PER_HOST} GPUs")
        # types and values are checked in __post_init__
        return cls(hostname=hostname, address=d.get("address") or hostname,
                   ssh_target=d.get("ssh_target") or hostname, gpus=tuple(gpus), uuids=tuple(uuids),
                   vendor=d.get("vendor") or DEFAULT_VENDOR, local_cpus=tuple(cpus))


@dataclass(frozen=True)
class Placement:
    """The hosts of one job, in order: ``hosts[0]`` is the head (rendezvous, MPI launch, Ray head)."""

    job_id: str
    hosts: tuple[HostSlot, ...]

    def __post_init__(self) -> None:
        if not PlacementId.is_valid(self.job_id):
            raise PlacementError(f"job_id must be 1-64 letters, digits, '.', '_' or '-', not {str(self.job_id)[:80]!r}")
        if not self.hosts:
            raise PlacementError("a placement needs at least one host")
        if len(self.hosts) > MAX_HOSTS:
            raise PlacementError(f"more than {MAX_HOSTS} hosts in a placement")
        names = [h.hostname for h in self.hosts]
        if len(set(names)) != len(names):
            raise PlacementError(f"a host is listed twice: {names}")

    @property
    def head(self) -> HostSlot:
        return self.hosts[0]

    @property
    def total_gpus(self) -> int:
        return sum(h.slots for h in self.hosts)

    @property
    def uniform(self) -> bool:
        """Every host has the same number of GPUs (torchrun's ``--nproc-per-node`` is one number)."""
        return len({h.slots for h in self.hosts}) == 1

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "hosts": [h.to_dict() for h in self.hosts]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Placement":
        if not isinstance(d, Mapping):
            raise PlacementError("a placement must be a JSON object")
        hosts = d.get("hosts")
        if not isinstance(hosts, list):
            raise PlacementError("a placement needs a list of hosts")
        if len(hosts) > MAX_HOSTS:
            raise PlacementError(f"more than {MAX_HOSTS} hosts in a placement")
        return cls(job_id=d.get("job_id") or PlacementId.new(), hosts=tuple(HostSlot.from_dict(h) for h in hosts))

    @classmethod
    def load(cls, path: str | Path) -> "Placement":
        """Read a placement file (at most 1 MiB)."""
        try:
            with open(path, "rb") as f:
                raw = f.read((1 << 20) + 1)
        except OSError as e:
            raise PlacementError(f"cannot read the placement {path}: {e.strerror or e}") from None
        if len(raw) > 1 << 20:
            raise PlacementError(f"the placement {path} is larger than 1 MiB")
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise PlacementError(f"the placement {path} is not JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def of(cls, hosts: Sequence[tuple[str, Sequence[int]]], job_id: str | None = None) -> "Placement":
        """A placement from ``[(hostname, [gpu, ...]), ...]`` (address and ssh target = host name)."""
        return cls(job_id or PlacementId.new(), tuple(HostSlot(h, h, h, tuple(g)) for h, g in hosts))
