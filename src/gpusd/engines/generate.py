"""What each engine reads, generated from a :class:`~.placement.Placement` (pure functions).

- DeepSpeed: a hostfile (``host slots=S``) and ``--include "h1:0,2@h2:1"`` naming the chosen GPUs; its
  launcher sets ``CUDA_VISIBLE_DEVICES`` on each node from ``--include`` (an exported variable is ignored
  there), and it checks every index against ``range(slots)``, so ``slots`` is the highest chosen index
  + 1, not the number of GPUs chosen.  ``gpusd launch`` runs it per host (``--no_ssh --node_rank=I``).
- Open MPI: a hostfile (``host slots=K``, K = GPUs chosen there), an ``-x``-ready environment, and the
  per-rank wrapper :mod:`gpusd.engines.rank_gpu` that gives each rank its own GPU.
- Horovod: ``-H h1:2,h2:1`` plus the same wrapper; a ``--host-discovery-script`` for elastic mode.
- torchrun: one command line per host (``--nnodes``, ``--nproc-per-node``, c10d rendezvous on the head
  at port 29400, ``--rdzv-id`` = the job id) with that host's ``CUDA_VISIBLE_DEVICES``, and
  ``GLOO_SOCKET_IFNAME`` set there to the interface of the host's placement address (as DeepSpeed's).
- Ray: ``ray start --head`` on the head and ``ray start --address`` elsewhere, each ``--num-gpus`` with
  its ``CUDA_VISIBLE_DEVICES``.
- JSON: the placement plus each host's environment, for anything else.

Host names in files are :attr:`HostSlot.ssh_host` (what the engine will ssh to); addresses that other
hosts dial (rendezvous, Ray head, DeepSpeed master) are :attr:`HostSlot.address`.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from ..inventory.vendors import device_order_env, rank_entry
from ..topology import format_cpulist, parse_cpulist
from .placement import HostSlot, Placement

# torchrun's c10d rendezvous
RDZV_PORT = 29400
# DeepSpeed's (torch.distributed's) master port
DS_MASTER_PORT = 29500
RAY_PORT = 6379
# read by gpusd.engines.rank_gpu
RANK_GPUS_VAR = "GPUSD_RANK_GPUS"
# the same, each GPU's local CPUs (launch --bind-cpus)
RANK_CPUS_VAR = "GPUSD_RANK_CPUS"
# the interface torch.distributed's gloo binds
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
# in an argv word: the private temporary directory the launcher writes ``files`` to
FILES = "@GPUSD_FILES@"


@dataclass(frozen=True)
class HostCommand:
    """One command to start on one host of a placement (``rank`` = the host's position)."""

    slot: HostSlot
    rank: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # name -> content, written before the command starts
    files: dict[str, str] = field(default_factory=dict)
    # variables set on the host to the network interface that carries the slot's address, unless the
    # host's environment or --env sets them (GLOO_SOCKET_IFNAME: gloo otherwise binds the address the
    # machine's own name resolves to, which is loopback where /etc/hosts says 127.0.1.1)
    iface_env: tuple[str, ...] = ()
    # variables the command must not inherit (an AMD host's HIP_VISIBLE_DEVICES...)
    unset: tuple[str, ...] = ()

    def shell(self) -> str:
        """One line for a POSIX shell on that host: ``VAR=value ... argv`` (after ``unset VAR;``
        for what must not be inherited)."""
        words = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()] + [shlex.quote(a) for a in self.argv]
        head = f"unset {' '.join(self.unset)}; " if self.unset else ""
        return head + " ".join(words)


# -- DeepSpeed ------------------------------------------------------------------------------------------
def deepspeed_hostfile(p: Placement) -> str:
    return "".join(f"{h.ssh_host} slots={max(h.gpus) + 1}\n" for h in p.hosts)


def deepspeed_include(p: Placement) -> str:
    return "@".join(f"{h.ssh_host}:{','.join(str(g) for g in h.gpus)}" for h in p.hosts)


def deepspeed_env_file(p: Placement) -> str:
    """Lines for DeepSpeed's ``.deepspeed_env`` (exported to every node by its pdsh launcher): NVML's
    indices are PCI bus order, so CUDA must count the same way."""
    return "".join(f"{name}={value}\n" for name, value in device_order_env().items())


def deepspeed_argv(p: Placement, hostfile: str, args: Sequence[str], node_rank: int | None = None,
                   master_port: int = DS_MASTER_PORT) -> list[str]:
    """``deepspeed --hostfile=... --include=... --master_addr=HEAD ...``; with ``node_rank``, the
    per-host form (``--no_ssh --node_rank=I``) that ``gpusd launch`` starts on every host itself."""
    argv = ["deepspeed", f"--hostfile={hostfile}", f"--include={deepspeed_include(p)}",
            f"--master_addr={p.head.address}", f"--master_port={master_port}"]
    if node_rank is not None:
        argv += ["--no_ssh", f"--node_rank={node_rank}"]
    return argv + list(args)


def deepspeed_commands(p: Placement, args: Sequence[str], master_port: int = DS_MASTER_PORT) -> list[HostCommand]:
    """Per host: ``deepspeed --no_ssh --node_rank=I`` with the hostfile written on that host first."""
    files = {"hostfile": deepspeed_hostfile(p)}
    return [HostCommand(h, i, deepspeed_argv(p, f"{FILES}/hostfile", args, i, master_port),
                        device_order_env(), files, iface_env=(GLOO_IFNAME,))
            for i, h in enumerate(p.hosts)]


# -- Open MPI and Horovod -----------------------------------------------------------------------------
def mpi_hostfile(p: Placement) -> str:
    return "".join(f"{h.ssh_host} slots={h.slots}\n" for h in p.hosts)


def rank_gpus(p: Placement) -> str:
    """``GPUSD_RANK_GPUS``: each host's GPUs, in placement order: ``node-1=0,2;node-2=1`` (UUIDs where
    the placement has MIG slices)."""
    parts = []
    for h in p.hosts:
        # each entry says whose GPU it is: the wrapper sets that vendor's variables (rank_gpu)
        devices = ",".join(rank_entry(h.vendor, d) for d in h.cuda_env()[h.device_variable].split(","))
        parts.append(f"{h.ssh_host}={devices}")
    return ";".join(parts)


def mpi_env(p: Placement, bind_cpus: bool = False) -> dict[str, str]:
    """The variables every rank needs (``mpirun -x NAME`` each): the wrapper's map and the CUDA order
    (``bind_cpus``: and each GPU's local CPUs, :func:`rank_cpus`)."""
    env = {RANK_GPUS_VAR: rank_gpus(p), **device_order_env()}
    if bind_cpus:
        env[RANK_CPUS_VAR] = rank_cpus(p)
    return env


def rank_cpus(p: Placement) -> str:
    """``GPUSD_RANK_CPUS``: each GPU's local CPUs as its host's daemon claimed them, in the order of
    ``GPUSD_RANK_GPUS``: ``node-1=0-3/4-7;node-2=?`` (``?``: unknown).  Each rank's wrapper binds
    itself to its GPU's list, intersected there with the CPUs it may use."""
    return ";".join(f"{h.ssh_host}=" + "/".join(_cpus_of(h, i) for i in range(h.slots)) for h in p.hosts)


def _cpus_of(h: HostSlot, i: int) -> str:
    return (h.local_cpus[i] if h.local_cpus else None) or "?"


def host_cpus(h: HostSlot) -> str | None:
    """The union of the CPUs local to a host's GPUs (a CPU list), None when one GPU's are unknown."""

    if not h.local_cpus or any(c is None for c in h.local_cpus):
        return None
    return format_cpulist(frozenset().union(*(parse_cpulist(c) for c in h.local_cpus if c is not None)))


def bound(cmds: Sequence[HostCommand], python: str | None = "python3") -> list[HostCommand]:
    """``launch --bind-cpus`` for engines that start their own ranks on each host (torchrun, DeepSpeed,
    a plain command): each host's command runs under ``python3 -m gpusd.engines.rank_gpu --bind-cpus
    LIST --for GPUS --``, which binds it to the union of its GPUs' local CPUs that it may use there
    and execs it; the ranks it starts inherit that."""
    out = []
    for c in cmds:
        gpus = ",".join(str(g) for g in c.slot.gpus)
        wrapper = rank_wrapper(python)[:-1] + ["--bind-cpus", host_cpus(c.slot) or "?", "--for", gpus, "--"]
        out.append(replace(c, argv=wrapper + list(c.argv)))
    return out


RANK_MODULE = "gpusd.engines.rank_gpu"

# The Python of each rank's wrapper when none is named (gpusd launch without --python): this
# machine's own interpreter where the same path exists on the host and imports gpusd (a venv on a
# shared home, an identical image), else the one of the ``gpusd`` command on the host's PATH (its
# #! line); otherwise a message that says what was tried, and exit 127.  $1: this machine's path.
# A path from the launching machine names whatever is at that path on the host: it is run only when
# it, the file it resolves to, and every directory above either belong to root or the user and no
# one else may write them (a sticky directory such as /tmp excepted): another user of the host could
# otherwise have made /tmp/venv/bin/python3 first, and the job would run it as the user.
_OURS = (
    'gpusd_ours() { me=$(id -u); for p in "$1" "$(readlink -f -- "$1" 2>/dev/null)"; do '
    '[ -n "$p" ] || return 1; while :; do '
    's=$(stat -L -c "%u %a" -- "$p" 2>/dev/null) || return 1; u=${s%% *}; m=${s#* }; '
    '[ "$u" = 0 ] || [ "$u" = "$me" ] || return 1; '
    'if [ $((0$m & 022)) -ne 0 ] && { [ ! -d "$p" ] || [ $((0$m & 01000)) -eq 0 ]; }; then return 1; fi; '
    '[ "$p" = / ] && break; p=$(dirname -- "$p"); done; done; }; '
)
def safe_path_check() -> str:
    """sh that defines ``gpusd_ours PATH`` (:data:`_OURS`): whether a path may be run as the user."""
    return _OURS


def find_python(module: str, here: str | None = None, probe_here: bool = True) -> str:
    """sh that sets ``gpusd_py`` to the Python on the host that runs ``module`` (``-m``), or to nothing:
    this machine's interpreter (``here``, default ``sys.executable``) where the same path exists there,
    is safe (:data:`_OURS`) and imports it (unless ``probe_here`` is false: then only the next), else
    the interpreter of the ``gpusd`` command on the host's PATH (its #! line).  ``$gpusd_py`` is used
    unquoted (a #! line may carry an argument)."""
    if here is None:
        here = sys.executable
    first = (f'if [ -x "$gpusd_here" ] && gpusd_ours "$gpusd_here" && "$gpusd_here" -c "import {module}" 2>/dev/null; '
             "then gpusd_py=$gpusd_here; else " if probe_here else "")
    return ("gpusd_py=; gpusd_here=" + shlex.quote(here) + "; " + _OURS + first +
            "gpusd_g=$(command -v gpusd 2>/dev/null); gpusd_sb=; "
            'if [ -n "$gpusd_g" ]; then gpusd_sb=$(sed -n "1s/^#! *//p" "$gpusd_g" 2>/dev/null); fi; '
            f'if [ -n "$gpusd_sb" ] && $gpusd_sb -c "import {module}" 2>/dev/null; then gpusd_py=$gpusd_sb; fi'
            + ("; fi" if probe_here else ""))


def python_module(module: str, python: str | None = "python3", here: str | None = None,
                  what: str = "gpusd launch") -> list[str]:
    """``PYTHON -m MODULE`` on a host (arguments follow); with ``python`` None, a shell that finds the
    interpreter there (:func:`find_python`; ``here``: this machine's, default ``sys.executable``), or
    says what it tried and exits 127."""
    if python is not None:
        return [python, "-m", module]
    if here is None:
        here = sys.executable
    script = (find_python(module, here) + '; if [ -n "$gpusd_py" ]; then exec $gpusd_py -m ' + module + ' "$@"; fi; '
              f'echo "{what}: no Python with gpusd on $(hostname): tried $gpusd_here (the path on the launching'
              " machine: missing here, without gpusd, or where another user could have put it) and the gpusd on"
              ' PATH (${gpusd_g:-not found}${gpusd_sb:+, #!$gpusd_sb}); install gpusd there or give'
              f' {what} --python PATH" >&2; exit 127')
    return ["sh", "-c", script, "gpusd-" + module.rpartition(".")[2]]


def rank_wrapper(python: str | None = "python3", here: str | None = None) -> list[str]:
    """What runs before each rank's command: ``python3 -m gpusd.engines.rank_gpu --``; with
    ``python`` None, a shell that finds the interpreter on the host (:func:`python_module`)."""
    return [*python_module(RANK_MODULE, python, here), "--"]


def mpirun_argv(p: Placement, hostfile: str, args: Sequence[str], python: str | None = "python3",
                extra: Sequence[str] = (), bind_cpus: bool = False) -> list[str]:
    """``mpirun --hostfile HF -np N --map-by slot -x ... python3 -m gpusd.engines.rank_gpu -- ARGS``.
    ``--map-by slot`` fills the hosts in hostfile order, which the wrapper checks.  ``bind_cpus``:
    ``--bind-to none`` (Open MPI would bind each rank to a core or socket first, and the wrapper can only
    narrow what a rank may use) and each rank's wrapper binds it to its GPU's local CPUs."""
    argv = ["mpirun", "--hostfile", hostfile, "-np", str(p.total_gpus), "--map-by", "slot",
            *(["--bind-to", "none"] if bind_cpus else []), *extra]
    for name in mpi_env(p, bind_cpus):
        argv += ["-x", name]
    return argv + rank_wrapper(python) + list(args)


def horovod_hosts(p: Placement) -> str:
    return ",".join(f"{h.ssh_host}:{h.slots}" for h in p.hosts)


def horovod_discovery_lines(p: Placement) -> str:
    """What ``--host-discovery-script`` prints: one ``host:slots`` line per host."""
    return "".join(f"{h.ssh_host}:{h.slots}\n" for h in p.hosts)


def horovod_discovery_script(source: Sequence[str]) -> str:
    """A script for ``horovodrun --host-discovery-script``: runs ``source`` (a command printing
    ``host:slots`` lines of what gpusd holds now, e.g. ``gpusd hostfile --format horovod-discovery
    --placement FILE``) each time Horovod asks."""
    return "#!/bin/sh\n# made by gpusd: the hosts and slots gpusd holds for this job, one host:slots a line\nexec " + \
        " ".join(shlex.quote(a) for a in source) + "\n"


def horovodrun_argv(p: Placement, args: Sequence[str], python: str | None = "python3") -> list[str]:
    return ["horovodrun", "-np", str(p.total_gpus), "-H", horovod_hosts(p), *rank_wrapper(python), *args]


# -- torchrun -------------------------------------------------------------------------------------------
def torchrun_argv(p: Placement, slot: HostSlot, args: Sequence[str], port: int = RDZV_PORT,
                  extra: Sequence[str] = ()) -> list[str]:
    """The head hosts the c10d store (``--rdzv-conf=is_host=1``; torch would otherwise guess it from
    what the machine's own name resolves to), ``--local-addr`` is the host's placement address for the
    same reason, and ``--tee=3`` prefixes each process's lines with its local rank."""
    is_host = 1 if slot == p.head else 0
    return ["torchrun", f"--nnodes={len(p.hosts)}", f"--nproc-per-node={slot.slots}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={_hostport(p.head.address, port)}", f"--rdzv-id={p.job_id}",
            f"--rdzv-conf=is_host={is_host}", f"--local-addr={slot.address}", "--tee=3", *extra, *args]


def torchrun_commands(p: Placement, args: Sequence[str], port: int = RDZV_PORT,
                      extra: Sequence[str] = ()) -> list[HostCommand]:
    return [HostCommand(h, i, torchrun_argv(p, h, args, port, extra), h.cuda_env(), iface_env=(GLOO_IFNAME,),
                        unset=h.cleared())
            for i, h in enumerate(p.hosts)]


# -- Ray ------------------------------------------------------------------------------------------------
def ray_address(p: Placement, port: int = RAY_PORT) -> str:
    return _hostport(p.head.address, port)


def ray_commands(p: Placement, port: int = RAY_PORT, ray: str = "ray", extra: Sequence[str] = (),
                 worker_extra: Sequence[str] | None = None) -> list[HostCommand]:
    """``ray start --head`` on the head, ``ray start --address=HEAD:PORT`` on the others, each with
    ``--num-gpus`` and the GPUs of the placement there made visible as Ray reads them: NVIDIA
    ``CUDA_VISIBLE_DEVICES``, AMD ``HIP_VISIBLE_DEVICES`` (Ray raises when ``ROCR_VISIBLE_DEVICES`` is
    set: it is unset), Intel ``ZE_AFFINITY_MASK``.  ``extra``: more arguments for the head's (and,
    with ``worker_extra`` None, the workers'); ``worker_extra``: the workers'.  Every node gets
    ``--node-ip-address``, the host's placement address (what its daemon signed), so Ray does not
    look for its own address by reaching out to a public one."""
    out = []
    for i, h in enumerate(p.hosts):
        if i == 0:
            argv = [ray, "start", "--head", f"--port={port}", f"--node-ip-address={h.address}"]
        else:
            argv = [ray, "start", f"--address={ray_address(p, port)}", f"--node-ip-address={h.address}"]
        more = extra if i == 0 or worker_extra is None else worker_extra
        argv += [f"--num-gpus={h.slots}", "--disable-usage-stats", *more]
        out.append(HostCommand(h, i, argv, h.visible_env("ray"), unset=h.cleared("ray")))
    return out


def ray_stop_commands(p: Placement, ray: str = "ray") -> list[HostCommand]:
    return [HostCommand(h, i, [ray, "stop", "--force"], {}) for i, h in enumerate(p.hosts)]


# -- gpusd hostfile --------------------------------------------------------------------------------------
FORMATS = ("deepspeed", "mpi", "horovod", "horovod-discovery", "torchrun", "ray", "json")


def hostfile_text(fmt: str, p: Placement, program: Sequence[str], port: int | None = None,
                  discovery: Sequence[str] | None = None) -> str:
    """What ``gpusd hostfile --format FMT`` writes for placement ``p``: ``program`` stands for the
    training program in command lines, ``port`` for torchrun's rendezvous or Ray's head port (default
    theirs), ``discovery`` (given with ``--output``) is the command Horovod's discovery script runs."""
    if fmt == "json":
        return json.dumps(json_view(p), indent=2) + "\n"
    if fmt == "deepspeed":
        return deepspeed_hostfile(p)
    if fmt == "mpi":
        return mpi_hostfile(p)
    if fmt == "horovod":
        return horovod_discovery_script(discovery) if discovery is not None else horovod_hosts(p) + "\n"
    if fmt == "horovod-discovery":
        return horovod_discovery_lines(p)
    if fmt == "torchrun":
        cmds = torchrun_commands(p, program, port=port or RDZV_PORT)
        return "".join(f"{c.slot.hostname}: {c.shell()}\n" for c in cmds)
    return "".join(f"{c.slot.hostname}: {c.shell()}\n" for c in ray_commands(p, port=port or RAY_PORT))


def hostfile_usage(fmt: str, p: Placement, path: str, program: Sequence[str], port: int | None = None) -> list[str]:
    """How to use what ``gpusd hostfile --format FMT --output PATH`` wrote: comment lines, then the
    engine's command line (none for the formats read by something else)."""
    notes = []
    if fmt == "deepspeed":
        line = deepspeed_argv(p, path, program, master_port=port or DS_MASTER_PORT)
        notes.append(f"# every node needs {deepspeed_env_file(p).strip()} (NVML's GPU order): put it in .deepspeed_env")
    elif fmt == "mpi":
        notes.append("# every rank needs: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in mpi_env(p).items()))
        line = ["env", *[f"{k}={v}" for k, v in mpi_env(p).items()], *mpirun_argv(p, path, program)]
    elif fmt == "horovod":
        line = ["env", f"{RANK_GPUS_VAR}={rank_gpus(p)}", "horovodrun", "-np", str(p.total_gpus),
                "--host-discovery-script", str(Path(path).resolve()), *rank_wrapper(), *program]
    else:
        return []
    return [*notes, " ".join(shlex.quote(w) for w in line)]


# -- generic --------------------------------------------------------------------------------------------
def plain_commands(p: Placement, args: Sequence[str]) -> list[HostCommand]:
    """``gpusd launch command``: the same command on every host, with that host's GPUs visible."""
    return [HostCommand(h, i, list(args), {**h.cuda_env(), "GPUSD_NODE_RANK": str(i),
                                           "GPUSD_NNODES": str(len(p.hosts)), "GPUSD_HEAD": p.head.address},
                        unset=h.cleared())
            for i, h in enumerate(p.hosts)]


def json_view(p: Placement) -> dict[str, Any]:
    """The placement plus, per host, the environment that makes its GPUs visible."""
    d = p.to_dict()
    d["head"] = p.head.address
    d["total_gpus"] = p.total_gpus
    for h, out in zip(p.hosts, d["hosts"]):
        out["env"] = h.cuda_env()
    return d


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
