"""Choosing GPUs: constraints, and the ranking by load.  Pure functions of a snapshot and the leases.

Ranking (documented in docs/allocation.md):

``load`` (default)
    ``0.5 * utilisation + 0.5 * memory in use (reserved memory of leases counted as in use)``, both as
    fractions, plus 0.02 per process already on the GPU.  Lowest first.
``util``
    Lowest window-averaged utilisation first, then least memory in use.
``memory``
    Most free memory (after reservations) first, then lowest utilisation.

Ties go to the lower index.  Which ``count`` of the ranked devices go together is
:mod:`gpusd.alloc.placement`'s choice (by topology for 2+ GPUs, ``--topology``).

Exclusive requests only consider GPUs nobody holds a lease on; shared
requests (``share=True``) pack onto GPUs already shared by other shared jobs while their memory fits
(best fit: the fullest GPU that still fits), and open an unleased GPU only when none fits.

Memory a lease asked for counts as used until the leaseholder's processes have allocated it: reserved
= lease memory minus what the holder's processes (its pid and descendants) already use on that GPU.
In a container that cannot see host pids the whole request stays counted (conservative).
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import os

from ..errors import ConfigError, NoGpuAvailable
from ..inventory.vendors import counts_cuda_visible, inherited_choice
from ..model import VENDORS, GpuInfo, HostSnapshot, LeaseInfo, MigInstance, reserved_memory
from ..record import field, fields, record

# its name here stays importable
from .candidate import Candidate as Candidate

# typing is not imported at run time: start-up time
TYPE_CHECKING = False

if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Callable, Iterable, Sequence

    from .placement import Pick

RANKINGS = ("load", "util", "memory")
# --vendor any: one job may mix vendors (by default it gets GPUs of one vendor)
ANY_VENDOR = "any"
# how a multi-GPU set is chosen: alloc.placement
TOPOLOGIES = ("auto", "any", "nvlink")


def _option(default: Any = None, *, help: str, flags: tuple[str, ...] = (), metavar: str | None = None,
            parse: Callable[[str], Any] | None = None, choices: Sequence[str] | None = None,
            keyword: str | None = None, switch: bool = False) -> Any:
    """A constraint field and how people give it: its command-line flags (none: API only), the
    keyword of :func:`gpusd.select` (default: the field name), and the help text."""
    return field(default=default, metadata={"help": help, "flags": flags, "metavar": metavar, "parse": parse,
                                            "choices": choices, "keyword": keyword, "switch": switch})


@record
class Constraints:
    """What a job asks of its GPUs: the one definition of the selection constraints.  The command-line
    flags (:func:`gpusd.cli.options.constraints`) and the keywords of :func:`gpusd.select` are derived
    from these fields; :meth:`build` parses and validates the values people give."""

    count: int = _option(1, flags=("-n", "--count"), parse=int, help="number of GPUs (default 1)")
    # bytes, or a ratio (0..1) of the total
    min_free: int | float | None = _option(
        flags=("--min-free", "--min-free-memory"), metavar="MEM",
        help="minimum free memory: bytes (8GiB) or a ratio of the total (0.5, 50%%)")
    # bytes the job will use, reserved in its lease
    memory: int | None = _option(
        flags=("--memory",), metavar="MEM",
        help="memory the job will use; reserved in the lease so later selections count it (default: --min-free)")
    max_util: float | None = _option(  # percent
        flags=("--max-util",), parse=float, metavar="PCT", help="maximum utilisation in percent (window average)")
    max_processes: int | None = _option(
        flags=("--max-processes",), parse=int, metavar="N", help="maximum number of processes already on the GPU")
    # indices (as text) or UUIDs
    include: Sequence[str] | None = _option(
        flags=("--include",), metavar="IDS", help="only these GPUs: indices or UUIDs, comma-separated")
    exclude: Sequence[str] | None = _option(
        flags=("--exclude",), metavar="IDS", help="never these GPUs: indices or UUIDs, comma-separated")
    mig: bool = _option(False, flags=("--mig",), switch=True, help="select MIG slices instead of whole GPUs")
    by: str = _option("load", flags=("--by",), choices=RANKINGS, help="ranking (default load)")
    shared: bool = _option(False, flags=("--share",), switch=True, keyword="share",
                           help="share GPUs with other --share jobs (packed by --memory) instead of an exclusive lease")
    topology: str = _option("auto", flags=("--topology",), choices=TOPOLOGIES,
                            help="for 2+ GPUs: auto (default: the best-connected set unless clearly more loaded than "
                            "the least-loaded one), any (load order only), nvlink (only GPUs all linked by NVLink)")
    within_visible: bool = _option(True, help="only inside an inherited CUDA_VISIBLE_DEVICES")
    vendor: str | None = _option(flags=("--vendor",), choices=(*VENDORS, ANY_VENDOR),
                                 help="only GPUs of this vendor: nvidia, amd or intel; any: GPUs of several vendors "
                                 "in one job (default: the best set of one vendor)")
    # seconds the GPUs are needed at most (gpusd run --time, its grace included): GPUs booked to start
    # later may be given to it (backfill, gpusd.alloc.bookings); None: no limit
    time_limit: float | None = _option(help="seconds the GPUs are needed at most (backfill before a booking)")

    @classmethod
    def from_keywords(cls, **values: Any) -> Constraints:
        """:meth:`build` from the keywords of :func:`gpusd.select` (``share`` for ``shared``...);
        keywords not given take the field's default."""
        by_keyword = _by_keyword()
        unknown = sorted(set(values) - set(by_keyword))
        if unknown:
            raise TypeError(f"unknown constraint {unknown[0]!r} (known: {', '.join(sorted(by_keyword))})")
        return cls.build(**{by_keyword[k]: v for k, v in values.items()})

    @classmethod
    def build(cls, count: int = 1, min_free: str | int | float | None = None, memory: str | int | None = None,
              max_util: float | None = None, max_processes: int | None = None,
              include: str | Iterable[int | str] | None = None, exclude: str | Iterable[int | str] | None = None,
              mig: bool = False, by: str = "load", shared: bool = False, topology: str = "auto",
              within_visible: bool = True, vendor: str | None = None,
              time_limit: float | None = None) -> Constraints:
        """Validate user-facing values (``"8GiB"``, ``"0,2"``...) into constraints; ConfigError if bad."""
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"count must be a positive integer, not {count!r}")
        if by not in RANKINGS:
            raise ConfigError(f"--by must be one of {', '.join(RANKINGS)}, not {by!r}")
        if topology not in TOPOLOGIES:
            raise ConfigError(f"--topology must be one of {', '.join(TOPOLOGIES)}, not {str(topology)[:20]!r}")
        if vendor is not None and vendor not in (*VENDORS, ANY_VENDOR):
            raise ConfigError(f"--vendor must be one of {', '.join((*VENDORS, ANY_VENDOR))}, "
                              f"not {str(vendor)[:40]!r}")
        try:
            mf = _memory(min_free) if isinstance(min_free, str) else min_free
        except ValueError as exc:
            raise ConfigError(f"--min-free: {exc}") from None
        try:
            mem = _memory(memory, ratio=False) if isinstance(memory, str) else memory
        except ValueError as exc:
            raise ConfigError(f"--memory: {exc}") from None
        if isinstance(mf, float) and not 0 <= mf <= 1:
            raise ConfigError(f"min_free={mf!r}: a float is a ratio of the total from 0 to 1; "
                              f"give bytes as an int or a string such as '{mf:g}GiB'")
        if isinstance(mem, float):
            raise ConfigError("--memory must be an amount such as 30GiB, not a ratio")
        if max_util is not None and not 0 <= max_util <= 100:
            raise ConfigError(f"--max-util is a percentage between 0 and 100, not {max_util}")
        if max_processes is not None and max_processes < 0:
            raise ConfigError("--max-processes cannot be negative")
        if time_limit is not None and (type(time_limit) not in (int, float) or not 0 < time_limit <= 20 * 365 * 86400):
            raise ConfigError(f"time_limit must be a number of seconds above 0, not {time_limit!r}")
        if mem is None and isinstance(mf, int):
            # reserve what the job says it needs
            mem = mf
        if isinstance(mem, int) and mf is None:
            mf = mem
        return cls(count=count, min_free=mf, memory=mem, max_util=max_util, max_processes=max_processes,
                   include=_ids(include), exclude=_ids(exclude), mig=mig, by=by, shared=shared,
                   topology=topology, within_visible=within_visible, vendor=vendor,
                   time_limit=None if time_limit is None else float(time_limit))


def _memory(text: str, ratio: bool = True) -> int | float:
    # here: most selections name no amount of memory
    from ..units import parse_memory

    return parse_memory(text, ratio=ratio)


def keyword_of(name: str) -> str:
    """The :func:`gpusd.select` keyword (and command-line ``dest``) of the constraint field ``name``."""
    for f in fields(Constraints):
        if f.name == name:
            return str(f.metadata.get("keyword") or f.name)
    raise KeyError(name)


# keyword -> field name, made on first use (the fields never change)
_KEYWORDS: dict[str, str] = {}


def _by_keyword() -> dict[str, str]:
    if not _KEYWORDS:
        _KEYWORDS.update({keyword_of(f.name): f.name for f in fields(Constraints)})
    return _KEYWORDS


def constraint_keywords() -> dict[str, Any]:
    """Every constraint keyword of :func:`gpusd.select`, with its default."""
    defaults = {f.name: f.default for f in fields(Constraints)}
    return {k: defaults[name] for k, name in _by_keyword().items()}


def _ids(value: str | Iterable[int | str] | None) -> list[str] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(v).strip() for v in items if str(v).strip()]


def visible_filter(env: dict[str, str] | None = None) -> list[str] | None:
    """The tokens of an inherited ``CUDA_VISIBLE_DEVICES`` (None: unset, all GPUs visible).  CUDA
    stops at the first invalid token; so do we."""
    raw = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    # here: most runs inherit no device list, and listing leases needs no ids
    from ..ids import GpuUuid

    out = []
    for tok in raw.split(","):
        tok = tok.strip()
        if not tok or not (tok.isdigit() or GpuUuid.names_one(tok)):
            break
        out.append(tok)
    return out


def _matches(tokens: Sequence[str], gpu: GpuInfo, mig: MigInstance | None, cuda: bool = False) -> bool:
    index = gpu.device_index if cuda else gpu.index
    for t in tokens:
        if t.isdigit():
            if mig is None and int(t) == index:
                return True
        elif mig is not None and mig.uuid.startswith(t):
            return True
        elif gpu.uuid.startswith(t):
            # a whole GPU given by UUID includes its MIG slices
            return True
    return False


def _family(pid: int) -> set[int]:
    pids = {pid}
    try:
        import psutil

        pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    except Exception:
        pass
    return pids


def candidates(snap: HostSnapshot, c: Constraints, leases: Sequence[LeaseInfo] | None = None,
               env: dict[str, str] | None = None) -> tuple[list[Candidate], list[str]]:
    """(qualifying devices ranked best first, one reason per rejected device).  A lease the snapshot
    itself shows (a simulation's, or one attached to it) counts as much as one in ``leases``."""
    shown = [le for g in snap.gpus for le in g.leases]
    if leases is None:
        leases = shown
    elif shown:
        # (none, mostly: the leases come in ``leases``; no set of them built then)
        known = {(le.lease_id, le.device) for le in leases}
        leases = [*leases, *(le for le in shown if (le.lease_id, le.device) not in known)]
    by_device: dict[str, list[LeaseInfo]] = {}
    for lease in leases:
        by_device.setdefault(lease.device or "", []).append(lease)
    visible = visible_filter(env) if c.within_visible else None
    # GPUs with the host's memory (unified memory) share it: a reservation on one is gone for all
    shared = [le for g in snap.gpus if g.memory_shared for le in by_device.get(g.uuid, [])]
    others = inherited_choice(snap.gpus, os.environ if env is None else env) if c.within_visible else {}
    ok: list[Candidate] = []
    rejected: list[str] = []

    for gpu in snap.gpus:
        gpu_leases = by_device.get(gpu.uuid, [])
        if c.mig:
            units: list[MigInstance | None] = list(gpu.mig_instances) if gpu.mig_mode else []
            if not units:
                rejected.append(f"GPU {gpu.index}: no MIG slices")
                continue
        else:
            units = [None]
        for mig in units:
            label = f"{gpu.index}:{mig.index}" if mig else str(gpu.index)
            uuid = mig.uuid if mig else gpu.uuid
            dev_leases = by_device.get(uuid, []) + (gpu_leases if mig else [])
            if mig is None:
                # a lease on any slice of this GPU also touches the GPU
                for m in gpu.mig_instances:
                    dev_leases = dev_leases + by_device.get(m.uuid, [])
            limit = others.get(gpu.vendor)
            why = (f"GPU {label}: outside the inherited {limit[0]}" if limit is not None and gpu.uuid not in limit[1]
                   else _reject(gpu, mig, c, visible, dev_leases, label, uuid))
            if why:
                rejected.append(why)
                continue
            total = mig.memory_total if mig else gpu.memory_total
            reserving = shared if gpu.memory_shared and mig is None else dev_leases
            free = (mig or gpu).free_after(reserved_memory(reserving, gpu.processes, _family))  # the model's rule
            cand = Candidate(gpu, mig, free, total, None if mig else gpu.utilization_gpu, dev_leases)
            need = _need(c, total)
            if need is not None and (free is None or free < need):
                from ..units import format_bytes

                rejected.append(f"GPU {label}: {format_bytes(free)} free (after reservations) < {format_bytes(need)}")
                continue
            ok.append(cand)

    for cand in ok:
        cand.score = _score(cand, c)
    ok.sort(key=lambda x: x.score)
    return ok, rejected


def _need(c: Constraints, total: int | None) -> int | None:
    if c.min_free is None:
        return None
    if isinstance(c.min_free, float):
        return int(c.min_free * total) if total else None
    return c.min_free


def _reject(gpu: GpuInfo, mig: MigInstance | None, c: Constraints, visible: list[str] | None,
            leases: list[LeaseInfo], label: str, uuid: str) -> str | None:
    if c.vendor is not None and c.vendor != ANY_VENDOR and gpu.vendor != c.vendor:
        return f"GPU {label}: {gpu.vendor}, not {c.vendor} (--vendor)"
    if not gpu.healthy:
        return f"GPU {label}: unhealthy ({gpu.error or 'unknown'})"
    # An inherited CUDA_VISIBLE_DEVICES counts NVIDIA GPUs (by their CUDA number) only.
    if visible is not None and counts_cuda_visible(gpu.vendor) and not _matches(visible, gpu, mig, cuda=True):
        return f"GPU {label}: outside the inherited CUDA_VISIBLE_DEVICES"
    if c.include is not None and not _matches(c.include, gpu, mig):
        return f"GPU {label}: not in --include"
    if c.exclude and _matches(c.exclude, gpu, mig):
        return f"GPU {label}: excluded"
    if mig is None and gpu.mig_mode:
        return f"GPU {label}: in MIG mode (use --mig to select its slices)"
    if gpu.compute_mode == "prohibited":
        return f"GPU {label}: compute mode is prohibited"
    if gpu.compute_mode in ("exclusive_process", "exclusive_thread") and gpu.processes:
        return f"GPU {label}: exclusive compute mode and already in use"
    if leases:
        damaged = [le for le in leases if le.unreadable]
        # held, for what is unknown: never joined, not even by a shared job
        if damaged:
            who = ", ".join(f"pid {le.pid} of {le.user or 'an unknown user'}" for le in damaged[:3])
            return f"GPU {label}: held by {who} (record unreadable: the lease's record is damaged)"
        holders = ", ".join(f"{le.user or '?'}:{le.pid}" for le in leases if not le.unleased)
        if not c.shared or not all(le.shared for le in leases):
            blockers = [le for le in leases if le.unleased]
            # not a lease: someone holds the lock file itself; say who, so that someone can act
            if blockers:
                who = ", ".join(f"pid {le.pid} of {le.user or 'an unknown user'}" for le in blockers[:3])
                return (f"GPU {label}: its lock file is held without a lease by {who}"
                        + (f" (and leased by {holders})" if holders else ""))
            return f"GPU {label}: leased by {holders}"
    if c.max_util is not None and mig is None:
        if gpu.utilization_gpu is not None and gpu.utilization_gpu > c.max_util:
            return f"GPU {label}: utilisation {gpu.utilization_gpu:.0f}% > {c.max_util:g}%"
    if c.max_processes is not None and len(gpu.processes) > c.max_processes:
        return f"GPU {label}: {len(gpu.processes)} processes > {c.max_processes}"
    return None


def _score(cand: Candidate, c: Constraints) -> tuple[float, ...]:
    util = (cand.util or 0.0) / 100.0
    used_frac = 1.0 - (cand.free / cand.total) if cand.free is not None and cand.total else 0.0
    index = float(cand.gpu.index) + (cand.mig.index / 100.0 if cand.mig else 0.0)
    if c.shared:
        # Pack: GPUs already shared first, fullest first (best fit); then fresh GPUs by load.
        if cand.leases:
            return (0.0, -used_frac, index)
        return (1.0, 0.5 * util + 0.5 * used_frac, index)
    if c.by == "util":
        return (util, used_frac, index)
    if c.by == "memory":
        return (-(cand.free or 0), util, index)
    return (0.5 * util + 0.5 * used_frac + 0.02 * len(cand.gpu.processes), index)


def score(cand: Candidate, c: Constraints) -> tuple[float, ...]:
    """The ranking key of one candidate (lower is better): what :func:`choose` sorts by, used by
    fleet selection to compare hosts (docs/pool.md)."""
    return _score(cand, c)


def choose(snap: HostSnapshot, c: Constraints, leases: Sequence[LeaseInfo] | None = None,
           env: dict[str, str] | None = None) -> list[Candidate]:
    """The best ``c.count`` devices, or NoGpuAvailable saying why each device was refused."""
    return explain(snap, c, leases, env).chosen


def explain(snap: HostSnapshot, c: Constraints, leases: Sequence[LeaseInfo] | None = None,
            env: dict[str, str] | None = None, confirm: Callable[[GpuInfo], bool] | None = None) -> Pick:
    """:func:`choose`, with the reasons: the ranked devices go to :func:`gpusd.alloc.placement.pick`,
    which chooses the set (by topology for 2+ GPUs, docs/allocation.md).

    ``confirm``: the snapshot's process lists are not read yet; ``confirm(gpu)`` reads one GPU's (and
    says whether it read them now).  A process only ever counts against a GPU (it raises the ``load``
    score, and refuses the GPU in an exclusive compute mode or past ``max_processes``), so the choice
    made while a list is unread is what its GPU could at best be: the chosen GPUs' lists are read, and
    where one shows processes the choice is made again, until every chosen GPU's list was read (and the
    least-loaded set's, from which a multi-GPU choice measures its tolerance) -- the choice the lists
    of all GPUs would have given, having read only those of the GPUs chosen (and of any ranked ahead of
    them that turned out busy).  A GPU whose reservations depend on its processes (a lease's memory
    less what the holder already uses) has its list read first."""
    if confirm is None:
        return _explain(snap, c, leases, env)
    held = {le.device for le in leases} if leases is not None else set()
    held.update(le.device for g in snap.gpus for le in g.leases)
    for g in snap.gpus:
        if g.memory_shared and held or g.uuid in held or any(m.uuid in held for m in g.mig_instances):
            confirm(g)
    # a whole GPU's label (a MIG slice's: "0:1", its own)
    by_index = {str(g.index): g for g in snap.gpus}
    while True:
        try:
            why = _explain(snap, c, leases, env)
        except NoGpuAvailable:
            # the reasons as every list would give them (a list can only refuse more: still none)
            if any([confirm(g) for g in snap.gpus]):
                return _explain(snap, c, leases, env)
            raise
        # the least-loaded set too: a multi-GPU choice's tolerance is measured from it (alloc.placement)
        weighed = [x.gpu for x in why.chosen] + [by_index[i] for i in why.least_loaded if i in by_index]
        if not any([confirm(g) and bool(g.processes) or not g.healthy for g in weighed]):
            return why


def _explain(snap: HostSnapshot, c: Constraints, leases: Sequence[LeaseInfo] | None = None,
             env: dict[str, str] | None = None) -> Pick:
    ok, rejected = candidates(snap, c, leases, env)
    vendors = {cand.gpu.vendor for cand in ok}
    if c.vendor is None and c.count > 1 and len(vendors) > 1:
        return _one_vendor(snap, ok, c, sorted(vendors))
    if len(ok) >= c.count:
        from .placement import pick

        return pick(snap, ok, c)
    what = "MIG slice" if c.mig else "GPU"
    reasons = "; ".join(rejected[:8]) + (f"; and {len(rejected) - 8} more" if len(rejected) > 8 else "")
    reasons = never(snap, c) or reasons
    raise NoGpuAvailable(
        f"no {what}s available: need {c.count}, {len(ok)} qualify" + (f" ({reasons})" if reasons else "")
    )


def _one_vendor(snap: HostSnapshot, ok: list[Candidate], c: Constraints, vendors: list[str]) -> Pick:
    """A multi-GPU job on a host with several vendors gets GPUs of one vendor (a job's framework speaks
    one runtime: CUDA or ROCm or Level Zero): the best set each vendor can give, by the summed ranking of
    its members, then the vendor's name; ``--vendor any`` mixes."""
    from .placement import pick

    picks = []
    for vendor in vendors:
        mine = [cand for cand in ok if cand.gpu.vendor == vendor]
        if len(mine) >= c.count:
            try:
                picks.append(pick(snap, mine, c))
            except NoGpuAvailable:
                continue
    if not picks:
        have = ", ".join(f"{sum(1 for cand in ok if cand.gpu.vendor == v)} {v}" for v in vendors)
        raise NoGpuAvailable(f"no GPUs available: need {c.count} of one vendor, {have} qualify "
                             "(--vendor any to mix vendors in one job)")
    best = min(picks, key=lambda p: (sum(_score(x, c)[0] for x in p.chosen), p.chosen[0].gpu.vendor))
    best.reason = f"{best.reason}; GPUs of one vendor ({best.chosen[0].gpu.vendor}; --vendor any mixes)"
    return best


def never(snap: HostSnapshot, c: Constraints) -> str | None:
    """Why ``c`` can never be met on this machine, whatever the load and the leases (a wait would
    wait for ever): ``--include 7`` on a 4-GPU host, ``-n 5`` on one with 4, no GPU at all."""
    if not snap.gpus:
        return "this machine has no GPU"
    units = [(g, m) for g in snap.gpus for m in ([None, *g.mig_instances])]
    absent = [t for t in c.include or () if not any(_matches([t], g, m) for g, m in units)]
    have = f"this machine has GPU{'s' if len(snap.gpus) != 1 else ''} " + ",".join(str(g.index) for g in snap.gpus)
    if absent and c.count > len(c.include or ()) - len(absent):
        # not "not in --include" for every GPU
        return f"no GPU {', '.join(absent)} here; {have}"
    if not c.mig and c.count > len(snap.gpus):
        return f"this machine has only {len(snap.gpus)} GPU(s)"
    return None
