"""Per vendor: which variables make a chosen set of GPUs the only ones a job sees.

The inventory backend that reads a vendor's GPUs owns its visibility rule here (NVML's for NVIDIA,
amdsmi's for AMD, Level Zero's for Intel), so every path that hands GPUs to a job — ``gpusd env`` and
``run``, ``select().apply()``, ``set_cuda_visible_devices``, the seed's ``GpuOptimizer``, ``launch`` and
hostfiles per host, ``ray up`` — sets the same variables:

* **nvidia**: ``CUDA_VISIBLE_DEVICES`` (NVML indices, PCI bus order, or UUIDs; MIG slices by UUID)
  with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that CUDA counts as NVML does.
* **amd**: ``ROCR_VISIBLE_DEVICES`` by UUID (``GPU-<unique id>``): it masks at the lowest level (the
  ROCr runtime), and a UUID means the same GPU whatever renumbering comes after.  Never
  ``HIP_VISIBLE_DEVICES``/``CUDA_VISIBLE_DEVICES``/``GPU_DEVICE_ORDINAL`` by index as well: those count
  *after* the ROCr mask, so an inherited or added index can hide every GPU (SwarmUI #566,
  flux-core #4534): they are removed from the job's environment.  HIP honours ``CUDA_VISIBLE_DEVICES``
  too, which is why a non-NVIDIA GPU never gets one.
* **intel**: ``ZE_AFFINITY_MASK`` (Level Zero ordinals) with ``ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE``,
  so that an ordinal is a card as Sysman counts them (in the FLAT mode a Max 1550's two stacks are two
  devices); ``ONEAPI_DEVICE_SELECTOR=level_zero:*``: SYCL then takes the masked Level Zero devices only
  (no second copy through OpenCL) and never re-selects by an index that the mask has renumbered.

Engines that manage a vendor's variable themselves get what they read (``engine="ray"``): Ray reads
``HIP_VISIBLE_DEVICES`` on AMD and *raises* when ``ROCR_VISIBLE_DEVICES`` is set
(``ray/_private/accelerators/amd_gpu.py``), and reads only ``ZE_AFFINITY_MASK`` on Intel.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import os

from ..model import DEFAULT_VENDOR, VENDORS, GpuInfo
from ..record import record

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Callable, Iterable, Mapping, MutableMapping

# re-exported: other modules ask this one about vendors
__all__ = ["DEFAULT_VENDOR", "VENDORS"]

@record(frozen=True, slots=True)
class VendorRule:
    """What one vendor's runtimes read to choose the GPUs a process sees: the one owner of that
    knowledge (docs/allocation.md, "Vendors")."""

    vendor: str
    # the variable gpusd sets to the chosen devices
    device_variable: str
    # the one Ray reads (engine="ray")
    ray_variable: str
    # removed from a job's environment: each would count again after the mask
    cleared: tuple[str, ...]
    ray_cleared: tuple[str, ...]
    # Each runtime's own "no device at all": what a failing ``gpusd env`` exports so that
    # ``eval "$(gpusd env ...)"`` leaves no GPU of this vendor visible.  Unset would show them all, and
    # an empty value is "unset" to some runtimes (HIP, Level Zero), so each is the runtime's own:
    hide_all: tuple[tuple[str, str], ...]
    # Variables whose inherited value limits which of this vendor's GPUs gpusd may choose (a parent, or
    # Slurm, gave the job these GPUs only), checked in this order: the first one set decides.
    inherited: tuple[str, ...]
    # Every variable its environment builder (vendor_env) may set: what a job may take from a
    # daemon's lease answer.
    sets: tuple[str, ...] = ()
    # The metrics exporter whose names its GPUs get on /metrics (None: gpusd's own names only).
    exporter: str | None = None
    # Containers (gpusd.jobs.containers, docs/allocation.md "Containers"):
    # the kind of its CDI devices (``kind=name``), where its toolkit writes specs
    cdi_kind: str | None = None
    # device files every container of this vendor needs besides its GPUs'
    device_files: tuple[str, ...] = ()
    # each GPU is passed as its /dev/dri/renderD<N> (found through sysfs)
    render_nodes: bool = False
    # --group-add: the groups that may open those device files
    groups: tuple[str, ...] = ()
    # docker's ``--gpus`` (the NVIDIA container toolkit's hook) takes its GPUs
    docker_gpus: bool = False
    # the apptainer/singularity flag that binds its driver into the container
    apptainer_flag: str | None = None
    # device files that are its GPUs: a user's --device of one is refused
    gpu_device_prefixes: tuple[str, ...] = ()
    # container-toolkit variables that choose GPUs (refused in -e)
    runtime_variables: tuple[str, ...] = ()

    @property
    def counts_cuda_visible(self) -> bool:
        """Whether ``CUDA_VISIBLE_DEVICES`` numbers this vendor's GPUs (an inherited one limits them)."""
        return self.device_variable == CUDA_VARIABLE


CUDA_VARIABLE = "CUDA_VISIBLE_DEVICES"
# NVIDIA's dcgm-exporter
DCGM_EXPORTER = "dcgm"
# AMD's device-metrics-exporter
AMD_EXPORTER = "amd-device-metrics"

RULES: dict[str, VendorRule] = {
    # CUDA: only the devices listed are visible; an empty list hides every one (and CUDA's own numbers
    # are made nvidia-smi's by CUDA_DEVICE_ORDER).
    "nvidia": VendorRule("nvidia", "CUDA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", (), (),
                         (("CUDA_VISIBLE_DEVICES", ""), ("CUDA_DEVICE_ORDER", "PCI_BUS_ID")),
                         ("CUDA_VISIBLE_DEVICES",), ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES"), DCGM_EXPORTER,
                         # nvidia-ctk cdi generate names each GPU by index and UUID (and "all"); docker's
                         # --gpus goes through the toolkit's hook, which also obeys NVIDIA_VISIBLE_DEVICES --
                         # an image's own "all" included, so gpusd sets it too.
                         cdi_kind="nvidia.com/gpu", docker_gpus=True, apptainer_flag="--nv",
                         gpu_device_prefixes=("/dev/nvidia",), runtime_variables=("NVIDIA_VISIBLE_DEVICES",)),
    # ROCr filters when ROCR_VISIBLE_DEVICES is *set*, empty or not (ROCR-Runtime core/inc/flag.h:
    # filter_visible_gpus_ = IsEnvVarSet(...)): "" hides every agent.  HIP (clr, rocdevice.cpp
    # Device::init) reads HIP_VISIBLE_DEVICES, or CUDA_VISIBLE_DEVICES when that is empty, and stops at
    # the first index out of range: "-1" leaves none; GPU_DEVICE_ORDINAL is the same list for OpenCL.
    "amd": VendorRule("amd", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                      ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"),
                      ("ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"),
                      (("ROCR_VISIBLE_DEVICES", ""), ("HIP_VISIBLE_DEVICES", "-1"), ("GPU_DEVICE_ORDINAL", "-1")),
                      ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"), ("ROCR_VISIBLE_DEVICES",), AMD_EXPORTER,
                      # ROCm in a container: /dev/kfd (the compute interface) and each GPU's render node,
                      # opened by the video (and render) group; AMD's container toolkit names CDI devices
                      # amd.com/gpu=<n>, matched here by their render node, not by the number.
                      cdi_kind="amd.com/gpu", device_files=("/dev/kfd",), render_nodes=True,
                      groups=("video",), apptainer_flag="--rocm", gpu_device_prefixes=("/dev/kfd", "/dev/dri"),
                      runtime_variables=("AMD_VISIBLE_DEVICES",)),
    # Level Zero (intel/compute-runtime, ExecutionEnvironment::parseAffinityMask): an empty mask is no
    # mask (every device); entries naming no device are skipped, and a mask that enables none leaves
    # none: "-1" names none.  SYCL then sees Level Zero devices only (no second copy through OpenCL).
    "intel": VendorRule("intel", "ZE_AFFINITY_MASK", "ZE_AFFINITY_MASK", (), ("ONEAPI_DEVICE_SELECTOR",),
                        (("ZE_AFFINITY_MASK", "-1"), ("ONEAPI_DEVICE_SELECTOR", "level_zero:*")),
                        ("ZE_AFFINITY_MASK",),
                        ("ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY", "ONEAPI_DEVICE_SELECTOR"),
                        # Level Zero opens the card's render node only
                        render_nodes=True, gpu_device_prefixes=("/dev/dri",)),
}

# The tables other modules read, derived from the rules above (one owner per fact).
CLEARED: dict[str, tuple[str, ...]] = {v: r.cleared for v, r in RULES.items()}
RAY_CLEARED: dict[str, tuple[str, ...]] = {v: r.ray_cleared for v, r in RULES.items()}
# Per vendor: its backend (module of gpusd.inventory, class: gpusd.inventory.backend.Backend) and the
# Python package it needs (None: a dependency of gpusd).  A new vendor is a row here, a row in each
# table of this module, its name in model.VENDORS and its backend module -- allocation, discovery and
# the views do not change.
BACKENDS: dict[str, tuple[str, str]] = {"nvidia": ("nvml", "NvmlBackend"), "amd": ("amd", "AmdBackend"),
                                        "intel": ("intel", "IntelBackend")}
PACKAGES: dict[str, str | None] = {"nvidia": None, "amd": "amdsmi", "intel": "pyzes"}
# The variable that lists the devices, per vendor (and for Ray).
DEVICE_VARIABLE = {v: r.device_variable for v, r in RULES.items()}
RAY_DEVICE_VARIABLE = {v: r.ray_variable for v, r in RULES.items()}


# Inherited device lists other than CUDA's that limit the choice: sent to the daemon, which cannot see
# the client's environment.
INHERITED_OTHERS = tuple(n for r in RULES.values() for n in r.inherited if n != CUDA_VARIABLE)
# Every variable some vendor's environment builder sets.
SET_VARIABLES = tuple(dict.fromkeys(n for r in RULES.values() for n in r.sets))


def rule(vendor: str) -> VendorRule:
    """The rule of ``vendor`` (ValueError for one gpusd does not know)."""
    return RULES[check_vendor(vendor)]


def counts_cuda_visible(vendor: str) -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES`` numbers ``vendor``'s GPUs (False for a vendor gpusd does not know)."""
    r = RULES.get(vendor)
    return r is not None and r.counts_cuda_visible


def exporter_of(vendor: str) -> str | None:
    """The metrics exporter whose names ``vendor``'s GPUs get on /metrics (None: none)."""
    r = RULES.get(vendor)
    return r.exporter if r is not None else None


def device_order_env() -> dict[str, str]:
    """What makes CUDA count GPUs as gpusd does (NVML's PCI bus order; CUDA's own order is fastest
    first): what a distributed engine exports to every rank besides each rank's device list."""
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def hide_all() -> dict[str, str]:
    """The variables that leave no GPU of any vendor gpusd knows visible, each runtime's own way."""
    out: dict[str, str] = {}
    for rule in RULES.values():
        out.update(rule.hide_all)
    return out


def inherited_limits(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Vendor -> (variable, value) of the inherited variable that limits the choice of its GPUs (the
    first of :attr:`VendorRule.inherited` that ``env`` sets); vendors without one are absent."""
    out: dict[str, tuple[str, str]] = {}
    for vendor, rule in RULES.items():
        for name in rule.inherited:
            value = env.get(name)
            if value is not None:
                out[vendor] = (name, value)
                break
    return out


@record(frozen=True, slots=True)
class Visible:
    """One device a job is to see: its vendor, its number in that vendor's runtime, its UUID."""

    vendor: str
    index: int
    uuid: str | None = None
    # a MIG slice (addressed only by UUID)
    is_slice: bool = False

    @classmethod
    def of(cls, gpu: GpuInfo, uuid: str | None = None, is_slice: bool = False) -> Visible:
        return cls(gpu.vendor, gpu.device_index, uuid or gpu.uuid, is_slice)


def inherited_choice(gpus: Iterable[GpuInfo], env: Mapping[str, str]) -> dict[str, tuple[str, set[str]]]:
    """Vendor -> (the inherited variables, the UUIDs of the GPUs they leave visible), for the vendors
    not counted by ``CUDA_VISIBLE_DEVICES``: an inherited ``ROCR_VISIBLE_DEVICES``/
    ``HIP_VISIBLE_DEVICES``/``ZE_AFFINITY_MASK`` limits the choice exactly as an inherited
    ``CUDA_VISIBLE_DEVICES`` does for NVIDIA (a parent or Slurm gave the job these GPUs only), read as
    the runtime reads it (docs/allocation.md, "The right environment").  Vendors without one are absent."""
    out: dict[str, tuple[str, set[str]]] = {}
    gpus = list(gpus)
    amd = sorted((g for g in gpus if g.vendor == "amd"), key=lambda g: g.device_index)
    rocr, hip = env.get("ROCR_VISIBLE_DEVICES"), env.get("HIP_VISIBLE_DEVICES")
    if amd and (rocr is not None or hip):
        # ROCr filters whenever its variable is set (empty: no GPU); HIP then numbers what is left,
        # and an empty HIP_VISIBLE_DEVICES is no mask.  Both stop at the first token they cannot use.
        seen = amd if rocr is None else _pick(amd, rocr, lambda g: g.device_index)
        names = "ROCR_VISIBLE_DEVICES" if rocr is not None else ""
        if hip:
            positions = {id(g): i for i, g in enumerate(seen)}
            seen = _pick(seen, hip, lambda g: positions[id(g)])
            names = f"{names} and HIP_VISIBLE_DEVICES" if names else "HIP_VISIBLE_DEVICES"
        out["amd"] = (names, {g.uuid for g in seen})
    intel = [g for g in gpus if g.vendor == "intel"]
    mask = env.get("ZE_AFFINITY_MASK")
    # Level Zero: an empty mask is no mask; entries naming no device are skipped
    if intel and mask:
        roots = set()
        for tok in mask.split(","):
            root = tok.strip().split(".", 1)[0]
            if root.isdigit():
                roots.add(int(root))
        out["intel"] = ("ZE_AFFINITY_MASK", {g.uuid for g in intel if g.device_index in roots})
    return out


def _pick(gpus: list[GpuInfo], raw: str, number: Callable[[GpuInfo], int]) -> list[GpuInfo]:
    """The GPUs a runtime's device list ``raw`` names, in its order: by number or by UUID (``GPU-...``,
    either case: ROCr writes them in lower case); the list ends at the first token that names none."""
    out: list[GpuInfo] = []
    for tok in raw.split(","):
        tok = tok.strip()
        if tok.isdigit():
            found = [g for g in gpus if number(g) == int(tok)]
        elif tok.upper().startswith("GPU-") and len(tok) > 4:
            found = [g for g in gpus if g.uuid.lower().startswith(tok.lower())]
        else:
            found = []
        if not found:
            break
        out.extend(g for g in found[:1] if g not in out)
    return out


def check_vendor(vendor: str) -> str:
    if vendor not in VENDORS:
        raise ValueError(f"unknown GPU vendor {vendor!r}; known: {', '.join(VENDORS)}")
    return vendor


def _amd_token(d: Visible) -> str:
    # ROCm's UUIDs are GPU-<16 hex digits>; anything else (a simulated or unreadable one) by index.
    u = d.uuid or ""
    return u if u.startswith("GPU-") and len(u) <= 40 else str(d.index)


def vendor_env(vendor: str, devices: list[Visible], *, use_uuid: bool = False,
               engine: str | None = None) -> dict[str, str]:
    """The variables for ``devices``, all of ``vendor``."""
    check_vendor(vendor)
    if vendor == "nvidia":
        by_uuid = use_uuid or any(d.is_slice for d in devices)
        items = [d.uuid if by_uuid and d.uuid else str(d.index) for d in devices]
        return {**device_order_env(), CUDA_VARIABLE: ",".join(items)}
    if vendor == "amd":
        if engine == "ray":
            return {"HIP_VISIBLE_DEVICES": ",".join(str(d.index) for d in devices)}
        return {"ROCR_VISIBLE_DEVICES": ",".join(_amd_token(d) for d in devices)}
    mask = {"ZE_AFFINITY_MASK": ",".join(str(d.index) for d in devices), "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"}
    if engine == "ray":
        return mask
    return {**mask, "ONEAPI_DEVICE_SELECTOR": "level_zero:*"}


def by_vendor(devices: Iterable[Visible]) -> dict[str, list[Visible]]:
    out: dict[str, list[Visible]] = {}
    for d in devices:
        out.setdefault(d.vendor, []).append(d)
    return out


def visible_env(devices: Iterable[Visible], *, use_uuid: bool = False, engine: str | None = None) -> dict[str, str]:
    """The variables that make exactly ``devices`` visible, each vendor's by its own rule (a job on
    GPUs of two vendors gets both).  No device at all: NVIDIA's form (``CUDA_VISIBLE_DEVICES=``)."""
    groups = by_vendor(devices)
    if not groups:
        return vendor_env("nvidia", [], engine=engine)
    out: dict[str, str] = {}
    for vendor, group in groups.items():
        out.update(vendor_env(vendor, group, use_uuid=use_uuid, engine=engine))
    return out


def cleared(vendors: Iterable[str], engine: str | None = None) -> set[str]:
    """Variables to remove from a job's inherited environment for GPUs of ``vendors``."""
    table = RAY_CLEARED if engine == "ray" else CLEARED
    out: set[str] = set()
    for v in vendors:
        out.update(table.get(v, ()))
    return out


# -- one rank's GPU (GPUSD_RANK_GPUS, read by gpusd.engines.rank_gpu) ---------------------------------
# mpirun gives every rank the same variables, so each entry of the per-rank map says which vendor's
# variables its rank needs: the default vendor's entries are bare (the map's first form), another's carry
# its name (``amd:GPU-...``, ``intel:0``).
RANK_VENDOR_SEPARATOR = ":"


def rank_entry(vendor: str, device: str) -> str:
    """The per-rank map's entry for ``device`` (an index or UUID) of ``vendor``."""
    check_vendor(vendor)
    return device if vendor == DEFAULT_VENDOR else f"{vendor}{RANK_VENDOR_SEPARATOR}{device}"


def rank_entry_env(entry: str) -> tuple[dict[str, str], set[str]]:
    """The variables that make the device of a per-rank map entry (:func:`rank_entry`) visible, and
    those the rank must not inherit (they would mask again).  ValueError for an entry that names no
    known vendor or no device (an index, or a UUID: :class:`gpusd.ids.GpuUuid`)."""
    # here: the quick commands that name no rank need no ids
    from ..ids import GpuUuid

    vendor, sep, token = entry.partition(RANK_VENDOR_SEPARATOR)
    if not sep:
        vendor, token = DEFAULT_VENDOR, entry
    check_vendor(vendor)
    by_index = token.isascii() and token.isdigit()
    if not (by_index or GpuUuid.is_valid(token)):
        raise ValueError(f"not a GPU: {token[:40]!r}")
    visible = (Visible(vendor, int(token)) if by_index
               else Visible(vendor, 0, token, GpuUuid.is_slice(token)))
    variables = vendor_env(vendor, [visible], use_uuid=not by_index)
    return variables, cleared([vendor]) - set(variables)


def job_environ(base: Mapping[str, str], devices: Iterable[Visible], *, use_uuid: bool = False,
                engine: str | None = None) -> dict[str, str]:
    """``base`` (a job's inherited environment) with the variables of ``devices`` set and those that
    would count again after the mask removed."""
    devs = list(devices)
    variables = visible_env(devs, use_uuid=use_uuid, engine=engine)
    env = dict(base)
    for name in cleared({d.vendor for d in devs}, engine) - set(variables):
        env.pop(name, None)
    env.update(variables)
    return env


def apply_cleared(environ: MutableMapping[str, str], vendors: Iterable[str], keep: Iterable[str] = ()) -> None:
    """Remove from ``environ`` what :func:`cleared` names for ``vendors`` (but ``keep``)."""
    for name in cleared(vendors) - set(keep):
        environ.pop(name, None)


# -- Slurm's view of a vendor's GPUs (gres.conf(5), docs/slurm.md) ------------------------------------
@record(frozen=True, slots=True)
class SlurmGres:
    """How a vendor's GPU is written in gres.conf: its device file and the ``Flags=`` that makes Slurm
    export that vendor's variable (and no other vendor's) to the job."""

    # File= is this prefix and the device's number
    device_prefix: str
    # the number is the GPU's DRM render minor (/dev/dri/renderD128 and up)
    render_node: bool
    # gres.conf Flags=: the variable Slurm sets, from the job's positions in gres.conf
    flag: str


SLURM: dict[str, SlurmGres] = {
    # the NVIDIA driver's /dev/nvidiaN (N: the device minor, NVML's index order); Slurm sets CUDA_VISIBLE_DEVICES
    "nvidia": SlurmGres("/dev/nvidia", False, "nvidia_gpu_env"),
    # Slurm's gpu/rsmi plugin names an AMD GPU by its render node (rsmi_dev_drm_render_minor_get ->
    # /dev/dri/renderD<minor>); amd_gpu_env sets ROCR_VISIBLE_DEVICES only: without it Slurm also sets
    # CUDA_VISIBLE_DEVICES, which HIP applies a second time after ROCr's mask (gres.conf(5))
    "amd": SlurmGres("/dev/dri/renderD", True, "amd_gpu_env"),
    # Level Zero GPUs are render nodes too (gpu/oneapi); intel_gpu_env sets ZE_AFFINITY_MASK only
    "intel": SlurmGres("/dev/dri/renderD", True, "intel_gpu_env"),
}
# the kernel numbers render nodes from 128 (drm_minor.c: DRM_MINOR_RENDER)
FIRST_RENDER_MINOR = 128


def _render_minor(gpu: GpuInfo, sysfs: str | None) -> int:
    """The DRM render minor of ``gpu``: read from sysfs by its PCI address where the kernel shows one
    (``sysfs`` None: not this machine's GPU); else 128 plus its number among the vendor's GPUs (the
    kernel's order when each GPU has one node)."""
    node = render_node(gpu.pci_bus_id, sysfs) if sysfs is not None else None
    if node is not None:
        return int(node.rsplit("renderD", 1)[1])
    return FIRST_RENDER_MINOR + gpu.device_index


def slurm_file(gpu: GpuInfo, prefix: str | None = None, sysfs: str | None = "/sys") -> str:
    """gres.conf's ``File=`` of ``gpu`` (``prefix``: another directory and name for the device files,
    the number unchanged: simulated GPUs, odd layouts; ``sysfs`` None: not this machine's GPU, no
    render node read from sysfs)."""
    rule = SLURM[check_vendor(gpu.vendor)]
    number = _render_minor(gpu, sysfs) if rule.render_node else gpu.device_index
    return f"{prefix or rule.device_prefix}{number}"


def slurm_flag(vendor: str) -> str:
    """gres.conf's ``Flags=`` for a GPU of ``vendor``."""
    return SLURM[check_vendor(vendor)].flag

# -- containers (gpusd.jobs.containers asks these; docs/allocation.md "Containers") ------------------------
def cdi_kinds() -> dict[str, str]:
    """CDI kind -> vendor, for the vendors whose toolkits write CDI specs."""
    return {r.cdi_kind: v for v, r in RULES.items() if r.cdi_kind}


def is_gpu_device(path: str) -> bool:
    """Whether a device path (``--device`` of a container runtime; ``HOST[:CONTAINER[:PERMS]]``) or CDI
    name (``kind=name``) is a GPU of a vendor gpusd knows: passing it would bypass the lease."""
    if not path.startswith("/"):
        return "=" in path and path.split("=", 1)[0] in cdi_kinds()
    host = os.path.normpath(path.split(":", 1)[0])
    return any(host.startswith(p) for r in RULES.values() for p in r.gpu_device_prefixes)


def selects_gpus(variable: str) -> bool:
    """Whether a variable set in a container (``-e NAME=...``) chooses GPUs: gpusd sets these itself."""
    return any(variable == r.device_variable or variable in r.runtime_variables or variable in r.cleared
               for r in RULES.values())


def _sysfs_bus_id(pci_bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` as sysfs names it (``0000:3b:00.0``); "" when it is not one."""
    parts = pci_bus_id.strip().lower().split(":")
    if len(parts) == 2:
        parts = ["0000", *parts]
    if len(parts) != 3 or len(pci_bus_id) > 32:
        return ""
    return f"{parts[0][-4:].rjust(4, '0')}:{parts[1]}:{parts[2]}"


def render_node(pci_bus_id: str | None, sysfs: str | None = None) -> str | None:
    """``/dev/dri/renderD<N>`` of the GPU at ``pci_bus_id``, from sysfs (``$GPUSD_SYSFS``, default
    ``/sys``: a test's own tree); None when there is none."""
    if not pci_bus_id:
        return None
    bdf = _sysfs_bus_id(pci_bus_id)
    if not bdf or any(c not in "0123456789abcdef:." for c in bdf):
        return None
    root = sysfs or os.environ.get("GPUSD_SYSFS") or "/sys"
    try:
        names = sorted(n for n in os.listdir(f"{root}/bus/pci/devices/{bdf}/drm") if n.startswith("renderD"))
    except OSError:
        return None
    for n in names:
        if n[7:].isdigit() and len(n) <= 16:
            return f"/dev/dri/{n}"
    return None


def container_env(devices: list[Visible], *, isolated: bool) -> dict[str, str]:
    """The variables that choose ``devices`` inside a container.  ``isolated``: the container has only
    these GPUs (docker/podman/nerdctl were given them), so a runtime that counts from 0 sees them as
    0..n-1 in this order; otherwise (apptainer binds the host's /dev) by the host's numbers.  UUIDs
    wherever the vendor's variable takes them: they mean the same GPU on both sides."""
    out: dict[str, str] = {}
    for vendor, group in by_vendor(devices).items():
        if isolated:
            group = [Visible(d.vendor, i, d.uuid, d.is_slice) for i, d in enumerate(group)]
        out.update(vendor_env(vendor, group, use_uuid=True))
        r = RULES[vendor]
        # the container toolkit's own choice, an image's "all" overridden
        for name in r.runtime_variables:
            if r.docker_gpus:
                out[name] = ",".join(d.uuid or str(d.index) for d in group)
    return out
