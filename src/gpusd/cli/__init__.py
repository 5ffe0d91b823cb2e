"""The ``gpusd`` command line.

Only argparse is imported at start-up; each command imports what it needs when it runs, so
``gpusd --help`` and the quick commands stay fast.  Exit codes are listed in docs/cli.md; the CLI
maps library exceptions to them (:mod:`gpusd.cli.exits`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from .._version import __version__
from ..errors import SIMULATE_EXAMPLE, BackendUnavailable, GpusdError
from .exits import EXIT_USAGE, exit_code_for
from .trust import add_token_flags

TYPE_CHECKING = False  # typing is not imported at run time: start-up time (issue 24)
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Callable, NoReturn, Sequence

PROGS = ("gpusd", "gpisd")  # the program's names (gpisd: the seed name)


def prog() -> str:
    """The name the program was run under: ``gpisd`` or ``gpusd`` (``python -m gpusd``: gpusd).  A
    daemon started in the background is told its parent's name through ``$GPUSD_PROG``."""
    name = os.path.basename(sys.argv[0] or "")
    if name in PROGS:
        return name
    env = os.environ.get("GPUSD_PROG", "")
    return env if env in PROGS else "gpusd"


# command -> "module:function" run with the parsed arguments
_COMMANDS: dict[str, str] = {}


class _Parser(argparse.ArgumentParser):
    # A value such as -1h or -5m is a (wrong) value, not an unknown flag: without this, argparse says
    # "expected one argument" for --since -1h and the duration parser never gets to say what is wrong.
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._negative_number_matcher = re.compile(r"^-\d+(\.\d*)?[a-zA-Z]*$|^-\.\d+[a-zA-Z]*$")

    def error(self, message: str) -> NoReturn:  # one line, documented exit code, no usage block
        message = message.replace(", 'fleet-job'", "")  # the unlisted command is no choice to offer
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\nsee {self.prog} --help\n")


class _Skipped:
    """Stands in for the parser of a command that is not being run: its options are not built,
    which keeps start-up fast (argparse costs ~0.05 ms per option)."""

    def __getattr__(self, name: str) -> Callable[..., "_Skipped"]:
        return lambda *a, **kw: self


_only: str | None = None  # the command being run, when known before parsing


def _command(sub: "argparse._SubParsersAction[_Parser]", name: str, target: str, help: str | None,
             **kw: Any) -> argparse.ArgumentParser:
    """A subcommand (``help`` None: one that is not listed, such as ``fleet-job``)."""
    if _skipped(sub, name):  # another top-level command than the one being run: not even listed
        return _Skipped()  # type: ignore[return-value]
    p: argparse.ArgumentParser = (sub.add_parser(name, help=help, description=help, **kw) if help is not None
                                  else sub.add_parser(name, **kw))
    p.set_defaults(_target=target)
    return p


def _skipped(sub: Any, name: str) -> bool:
    """Is ``name`` a top-level command other than the one being run?  Its parser is then not built at
    all (each costs ~0.15 ms, and its help strings a gettext look-up each): only ``gpusd --help``, or a
    word that names no command, builds them all, so the help and the "invalid choice" error list every
    command."""
    return _only is not None and name != _only and getattr(sub, "dest", None) == "command"


def _command_in(argv: Sequence[str]) -> str | None:
    """The command named in argv (the first word that is not a top-level option)."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg
    return None


def _seconds(text: str) -> float:
    """A duration flag (seconds, or 90s, 15m, 2h: :func:`gpusd.units.parse_duration`), 0 or more."""
    from ..units import parse_duration

    try:
        return parse_duration(text, zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_seconds(text: str) -> float:
    """A period or duration that must be longer than zero."""
    from ..units import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration_text(text: str) -> str:
    """A duration kept as given (``--since 7d``, ``--for 2h``), checked now so that a wrong one is a
    usage error like any other duration's."""
    _positive_seconds(text)
    return text


def _columns(text: str) -> int:
    """A terminal width: a whole number of columns, 20 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 20 <= value <= 10000:
        raise argparse.ArgumentTypeError(f"must be a number of columns from 20 to 10000, not {text!r}")
    return value


def _positive_number(text: str) -> float:
    """A finite number > 0 in the flag's own unit (days, MiB)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number greater than 0, not {text!r}")
    return value


def _simulate_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--simulate", metavar="SPEC", default=None,
                   help="use simulated GPUs, e.g. 4xA100-80GB or a scenario .json file (also $GPUSD_SIMULATE)")


def _selection_flags(p: argparse.ArgumentParser) -> None:
    if isinstance(p, _Skipped):
        return  # not the command being run: do not even import the constraint definitions
    from ..alloc.select import add_constraint_flags  # the one definition of the constraints

    g = p.add_argument_group("constraints")
    add_constraint_flags(g)
    g.add_argument("--no-lease", dest="lease", action="store_false", help="select only; take no lease")
    g.add_argument("--wait", action="store_true",
                   help="queue (by priority, then first come, first served) until GPUs qualify")
    g.add_argument("--timeout", type=_seconds, metavar="S", help="with --wait: give up after S seconds (exit 5)")
    g.add_argument("--uuid", action="store_true", help="emit UUIDs instead of indices in CUDA_VISIBLE_DEVICES")
    _simulate_flag(p)


def _fleet_flags(p: argparse.ArgumentParser, run: bool = False) -> None:
    """Where fleet commands look (docs/pool.md)."""
    if isinstance(p, _Skipped):
        return
    from .trust import add_token_flags

    g = p.add_argument_group("fleet")
    if run:
        g.add_argument("--fleet", action="store_true",
                       help="run on the best verified host of the fleet, over SSH (docs/pool.md)")
        g.add_argument("--ssh-option", action="append", metavar="OPT", default=[],
                       help="with --fleet: an ssh -o option (repeatable); $GPUSD_SSH_CONFIG: an ssh -F file")
    if run or p.prog.split()[-1] == "reserve":
        g.add_argument("--host", metavar="GLOB", help="only hosts whose name matches")
        g.add_argument("--model", metavar="GLOB", help="only GPUs whose name matches (glob or substring)")
        g.add_argument("--ttl", type=_positive_seconds, default=30.0, metavar="S",
                       help="the lease ends S seconds after its last renewal (default 30)")
    g.add_argument("--session", default="default", help="hosts of this session (default: default)")
    g.add_argument("--interface", "-i", action="append", metavar="IF", dest="interfaces",
                   help="browse on this interface (default all, or $GPUSD_INTERFACES)")
    g.add_argument("--peer", action="append", metavar="HOST[:PORT]", dest="peers",
                   help="also hosts beyond this link (repeatable; default $GPUSD_PEERS; docs/daemon.md)")
    g.add_argument("--peers-file", metavar="FILE", help="peers, one HOST[:PORT] per line (default $GPUSD_PEERS_FILE)")
    g.add_argument("--dns-sd-domain", metavar="DOMAIN",
                   help="also browse this wide-area DNS-SD domain (default $GPUSD_DNS_SD_DOMAIN)")
    g.add_argument("--dns-server", metavar="IP", help="with --dns-sd-domain: ask this DNS server")
    add_token_flags(g, "needed: remote leases are signed requests")  # type: ignore[arg-type]


# Every top-level command (as _build_parser adds them): a word of argv that is one of these builds that
# command's parser alone; any other builds the whole parser.
COMMANDS = ("devices", "select", "env", "run", "jobs", "grow", "shrink", "leases", "fleet-job", "reserve",
            "release", "reservations", "start", "stop", "status", "scan", "list", "list_devices", "watch",
            "demo", "top", "report", "export", "hostfile", "launch", "ray", "slurm")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only`` (a command of :data:`COMMANDS`), the parser of that command alone."""
    global _only
    _only = only if only in COMMANDS else None
    try:
        return _build_parser()
    finally:
        _only = None


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog(),
        description="GPU service discovery and allocation: see every GPU on the LAN, and give each job "
        "the least-loaded GPUs without races.",
        epilog="Exit codes: 0 ok, 1 error, 2 bad usage, 3 no NVML/driver, 4 no GPU qualifies, 5 --wait timed out, "
        "6 no daemon / no host found, 7 start: a daemon runs with other options. See docs/cli.md.",
    )
    parser.add_argument("--version", action="version", version=f"gpusd {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = _command(sub, "devices", "gpusd.cli.devices:run", "show this machine's GPUs")
    p.add_argument("--json", action="store_true", help="print the host snapshot as JSON")
    p.add_argument("--topology", action="store_true",
                   help="print how the GPUs connect, as nvidia-smi topo -m does (NV#, PIX, PXB, PHB, NODE, SYS)")
    p.add_argument("--no-processes", dest="processes", action="store_false", help="skip process lists")
    _simulate_flag(p)

    p = _command(sub, "select", "gpusd.cli.alloc:select",
                 "pick the least-loaded GPUs that satisfy constraints; takes no lease (gpusd run does)")
    _selection_flags(p)
    p.add_argument("--json", action="store_true", help="print the selection as JSON: devices, env and explain")
    p.add_argument("--explain", action="store_true",
                   help="also say why these GPUs: the least-loaded set, the links, the tolerance (docs/allocation.md)")
    p.set_defaults(lease=False)

    p = _command(sub, "env", "gpusd.cli.alloc:env",
                 "print shell lines setting CUDA_VISIBLE_DEVICES: eval \"$(gpusd env -n 2)\"")
    _selection_flags(p)
    p.set_defaults(lease=False)

    p = _command(sub, "run", "gpusd.cli.alloc:run_command",
                 "run a command on leased GPUs: gpusd run -n 2 -- python train.py")
    _selection_flags(p)
    _fleet_flags(p, run=True)
    if not isinstance(p, _Skipped):
        from .jobs import add_run_flags

        add_run_flags(p)
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")

    p = _command(sub, "jobs", "gpusd.cli.jobs:jobs", "list the jobs gpusd run started on this machine")
    p.add_argument("--all", action="store_true", help="every user's jobs (default: yours)")
    p.add_argument("--json", action="store_true")

    told = ("The job file ($GPUSD_JOB_FILE) is rewritten, then the job is told as its --on-change says. With the "
            "default (signal) only a command that catches the notify signal (SIGUSR1 unless --notify-signal) is "
            "sent it; an unaware command (sleep, a script without a handler) is not signalled, keeps running on "
            "the GPUs it started with and sees the change only in the job file. The output says how it was told.")
    p = _command(sub, "grow", "gpusd.cli.jobs:grow", "give a running job more GPUs: gpusd grow JOB +2", epilog=told)
    p.add_argument("job", help="the job id (a unique prefix is enough)")
    p.add_argument("count", nargs="?", default="+1", help="+N more GPUs (default +1)")
    p.add_argument("--wait", action="store_true", help="wait (in the queue) until they qualify")
    p.add_argument("--timeout", type=_seconds, metavar="S", help="with --wait: give up after S seconds")

    p = _command(sub, "shrink", "gpusd.cli.jobs:shrink", "take GPUs back from a running job: gpusd shrink JOB -1",
                 epilog=told)
    p.add_argument("job", help="the job id (a unique prefix is enough)")
    p.add_argument("count", nargs="?", default=None, help="-N GPUs fewer (default -1)")
    p.add_argument("--release", metavar="GPU", help="give back this GPU (index or UUID)")

    p = _command(sub, "leases", "gpusd.cli.alloc:leases", "list the GPU leases held on this machine")
    p.add_argument("--json", action="store_true")

    # what gpusd run --fleet runs on the chosen host, over ssh (docs/jobs.md, "Fleet runs"): not listed
    p = _command(sub, "fleet-job", "gpusd.cli.pool:fleet_job", None)
    p.add_argument("--job", required=True, help="the job id the asking machine chose")
    p.add_argument("--from", dest="asker", default=None, help="the machine that asked (informational)")
    p.add_argument("--lease", default=None, help="the lease this host's daemon holds for the job")
    p.add_argument("--devices", required=True, help="the leased GPUs: a JSON list of {index, uuid, label}")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")

    # --- the fleet pool (docs/pool.md) ---
    p = _command(sub, "reserve", "gpusd.cli.pool:reserve",
                 "hold the least-loaded GPUs of any verified host for an interactive session")
    if not isinstance(p, _Skipped):
        from ..alloc.select import add_constraint_flags

        g = p.add_argument_group("constraints")
        add_constraint_flags(g)
        g.add_argument("--wait", action="store_true", help="wait (woken by the fleet's events) until GPUs qualify")
        g.add_argument("--timeout", type=_seconds, metavar="S", help="with --wait: give up after S seconds (exit 5)")
    _fleet_flags(p)
    p.add_argument("--per-host", type=int, metavar="N", help="N GPUs on each of -n/N hosts (default: all on one)")
    p.add_argument("--for", dest="duration", metavar="DURATION", default="2h", type=_duration_text,
                   help="hold them this long at most (90s, 30m, 2h; default 2h), renewed in the background")
    p.add_argument("--note", metavar="TEXT", help="a note shown with the lease (private, like a command line)")
    p.add_argument("--json", action="store_true", help="print the reservation as JSON")

    p = _command(sub, "release", "gpusd.cli.pool:release", "end a reservation: gpusd release ID")
    p.add_argument("lease_id", metavar="ID", help="the reservation's lease id (gpusd reservations)")
    _fleet_flags(p)

    p = _command(sub, "reservations", "gpusd.cli.pool:reservations",
                 "the GPUs reserved on the fleet's hosts (yours, or --all)")
    p.add_argument("--all", action="store_true", help="every holder's, not only yours")
    p.add_argument("--json", action="store_true")
    _fleet_flags(p)

    # --- discovery & daemon commands ---
    def interface_flag(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--interface", "-i", action="append", metavar="IF", dest="interfaces",
                       help=f"{what} on this interface (name or IPv4 address; repeatable; default all, "
                       "or $GPUSD_INTERFACES)")

    def state_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument("--state-dir", metavar="DIR",
                       help="the daemon's state directory: pid file, log, node id (default $GPUSD_STATE_DIR, "
                       "/var/lib/gpusd for root, else ~/.local/state/gpusd)")

    def beyond_flags(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("hosts beyond this link (docs/daemon.md, \"Beyond one link\")")
        g.add_argument("--peer", action="append", metavar="HOST[:PORT]", dest="peers",
                       help="also follow the daemon at HOST (name or IPv4; port 4780 by default; repeatable; "
                       "default $GPUSD_PEERS, comma-separated)")
        g.add_argument("--peers-file", metavar="FILE",
                       help="peers, one HOST[:PORT] per line, # comments; re-read when it changes "
                       "(default $GPUSD_PEERS_FILE)")
        g.add_argument("--dns-sd-domain", metavar="DOMAIN",
                       help="browse _gpusd._tcp.DOMAIN in unicast DNS (wide-area DNS-SD, RFC 6763 §11; "
                       "default $GPUSD_DNS_SD_DOMAIN)")
        g.add_argument("--dns-server", metavar="IP", help="ask this DNS server (default: the system resolver)")

    def client_flags(p: argparse.ArgumentParser) -> None:
        beyond_flags(p)
        interface_flag(p, "browse")
        p.add_argument("--session", default="default", help="only hosts of this session (default: default)")
        p.add_argument("--all-sessions", action="store_true", help="hosts of every session")
        p.add_argument("--host", metavar="NAME", help="only hosts with this name (glob allowed)")
        add_token_flags(p, "sign requests, see process owners and commands of verified hosts")

    def device_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", metavar="TEXT", help="only GPUs whose model contains TEXT, or matches a glob "
                       "(A100*) as the tables show it or in full (NVIDIA A100*); case-insensitive")
        p.add_argument("--min-free", metavar="MEM", help="only GPUs with at least this much free memory (20GiB)")

    p = _command(sub, "start", "gpusd.cli.daemon:start",
                 "start the daemon: sample this machine's GPUs, serve them over HTTP, announce them on the LAN")
    p.add_argument("--foreground", action="store_true", help="run in the foreground (systemd, containers)")
    interface_flag(p, "announce and serve")
    p.add_argument("--port", type=int, default=4780, help="HTTP port (default 4780; 0: any free port)")
    p.add_argument("--session", default="default", help="cluster name; clients see their session only")
    p.add_argument("--interval", type=_positive_seconds, default=1.0, metavar="S",
                   help="seconds between samples (default 1)")
    p.add_argument("--history", type=_seconds, default=300.0, metavar="S", help="seconds of history kept (default 300)")
    p.add_argument("--hostname", help="host name to announce (default: this machine's, or $GPUSD_HOSTNAME)")
    state_flag(p)
    p.add_argument("--gpusd-compat", action="store_true",
                   help="also announce hwsd's _gpu-sd._tcp and _net-sd._tcp records (for GPU-SD/Equalizer clients)")
    add_token_flags(p, "trust on: private fields and writes for signed requests, HTTPS with a pinned certificate")
    p.add_argument("--tls-port", type=int, default=None, metavar="N",
                   help="with a fleet secret: the HTTPS port (default: --port + 1; 0: any free port)")
    p.add_argument("--threshold", action="append", metavar="RULE",
                   help='alert rule, e.g. "temperature>85", "utilization>90 for 60s", "lost" (repeatable)')
    p.add_argument("--thresholds", action="append", metavar="FILE", help="alert rules from a JSON file")
    p.add_argument("--fleet", choices=("auto", "on", "off"), default="auto",
                   help="the /api/v1/fleet view: started on first use (auto), always, or never")
    beyond_flags(p)
    p.add_argument("--txt-interval", type=_seconds, default=6.0, metavar="S",
                   help="minimum seconds between TXT record updates (default 6: RFC 6762 allows 10 a minute)")
    p.add_argument("--timeout", type=_positive_seconds, default=30.0, metavar="S",
                   help="how long to wait for a background daemon to come up (default 30)")
    p.add_argument("--log-file", metavar="FILE", default=None,
                   help="with --foreground: log to FILE, rotated at 10 MiB (3 kept) while running "
                   "(default: stderr; a background daemon logs to gpusd.log in its state directory)")
    p.add_argument("--dcgm-metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="/metrics also serves NVIDIA DCGM exporter names (DCGM_FI_DEV_GPU_UTIL...) for Grafana "
                   "dashboards made for it (default: on)")
    p.add_argument("--user-metrics", action="store_true",
                   help="/metrics also serves GPU-seconds used and held per user, to readers that may see "
                   "private data (this machine, signed requests); docs/monitoring.md, Privacy")
    h = p.add_argument_group("usage history (docs/history.md)")
    h.add_argument("--no-record", dest="record", action="store_false", help="record no usage history")
    h.add_argument("--retention", type=_positive_number, default=365.0, metavar="DAYS",
                   help="days of 5-minute history and job records kept (default 365)")
    h.add_argument("--history-size", type=_positive_number, default=1024.0, metavar="MIB",
                   help="size bound of the history database in MiB (default 1024)")
    h.add_argument("--idle-after", type=_positive_seconds, default=900.0, metavar="S",
                   help="mark a lease idle after S seconds under 5 %% utilisation (default 900)")
    h.add_argument("--idle-release", action="store_true",
                   help="release idle reservations after a notice and --idle-grace (never a running job's lease)")
    h.add_argument("--idle-grace", type=_seconds, default=900.0, metavar="S",
                   help="seconds between the release notice and the release (default 900)")
    r = p.add_argument_group("rebalancing of gpusd jobs (docs/jobs.md)")
    r.add_argument("--rebalance", action="store_true",
                   help="move --preemptible jobs off GPUs that stay hot while another GPU is idle, and pause "
                   "--pausable jobs while their GPU is too hot (default policy)")
    r.add_argument("--rebalance-policy", metavar="FILE",
                   help="rebalance with the thresholds of this JSON file (implies --rebalance)")
    sl = p.add_argument_group("Slurm (docs/slurm.md)")
    sl.add_argument("--slurm", action="store_true",
                    help="join Slurm as a dynamic node (slurmd -Z, configless) with this host's GPUs; Slurm then "
                    "allocates them: local and remote gpusd leases are refused, Slurm jobs' leases recorded")
    sl.add_argument("--slurm-controller", metavar="HOST[:PORT]",
                    help="with --slurm: slurmctld's address (default: the daemon announcing --slurmctld)")
    sl.add_argument("--slurmctld", metavar="[HOST:]PORT", nargs="?", const="6817", default=None,
                    help="announce that slurmctld runs on this host (its port, default 6817)")
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    _simulate_flag(p)

    p = _command(sub, "stop", "gpusd.cli.daemon:stop", "stop the daemon (its host disappears from clients at once)")
    state_flag(p)
    p.add_argument("--timeout", type=_seconds, default=10.0, metavar="S", help="how long to wait (default 10)")
    p.add_argument("--force", action="store_true", help="SIGKILL the daemon if it does not stop in time")

    p = _command(sub, "status", "gpusd.cli.daemon:status", "is the daemon running, and what does it serve")
    state_flag(p)
    p.add_argument("--json", action="store_true")

    p = _command(sub, "scan", "gpusd.cli.discover:scan", "list the hosts announced on the LAN (mDNS)")
    client_flags(p)
    p.add_argument("--timeout", type=_seconds, default=2.0, metavar="S", help="seconds to browse (default 2)")
    p.add_argument("--json", action="store_true")

    for name in ("list", "list_devices"):
        p = _command(sub, name, "gpusd.cli.discover:list_devices",
                     "every GPU on the LAN with its live load" if name == "list"
                     else "every GPU on the LAN (alias of list)")
        client_flags(p)
        device_flags(p)
        p.add_argument("--timeout", type=_seconds, default=3.0, metavar="S",
                       help="at most this long to wait for hosts to answer (default 3)")
        p.add_argument("--json", action="store_true")

    p = _command(sub, "watch", "gpusd.cli.discover:watch", "print discovery events as they happen, one per line")
    client_flags(p)
    device_flags(p)
    p.add_argument("--duration", type=_positive_seconds, default=None, metavar="S", help="stop after S seconds")
    p.add_argument("--liveness", type=_positive_seconds, default=10.0, metavar="S",
                   help="report a silent host removed after S seconds (default 10)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")

    p = _command(sub, "demo", "gpusd.cli.daemon:demo",
                 "start three daemons with simulated GPUs on 127.0.0.1, discover them and show them live")
    p.add_argument("--duration", type=_positive_seconds, default=10.0, metavar="S", help="seconds to show (default 10)")
    p.add_argument("--once", action="store_true", help="print the table once, then stop")
    p.add_argument("--hosts", type=int, default=3, help="number of simulated hosts (1-8, default 3)")
    # --- end of discovery & daemon commands ---

    # --- monitoring commands ---
    p = _command(sub, "top", "gpusd.cli.monitor:top",
                 "live view of every GPU on the LAN (or --local): utilisation, memory, leases, processes")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--local", action="store_true", help="this machine only, read directly (no daemon)")
    src.add_argument("--url", metavar="URL", help="read the fleet from this daemon, e.g. http://gpu-node-1:4780")
    _simulate_flag(p)
    p.add_argument("--interface", "-i", action="append", metavar="IF", dest="interfaces",
                   help="browse on this interface (name or IPv4 address; repeatable; "
                        "default all, or $GPUSD_INTERFACES)")
    p.add_argument("--session", default="default", help="cluster name to show (default: default)")
    p.add_argument("--all-sessions", action="store_true", help="show hosts of every session")
    p.add_argument("--once", action="store_true", help="print one frame and exit (also when stdout is not a terminal)")
    p.add_argument("--interval", type=_positive_seconds, default=1.0, metavar="S",
                   help="refresh every S seconds (default 1)")
    p.add_argument("--wait", type=_seconds, default=2.0, metavar="S",
                   help="seconds to browse the LAN before the first frame (default 2)")
    p.add_argument("--sort", choices=("host", "util", "memory", "temp", "power", "free"), default="host",
                   help="sort GPUs (and hosts) by this key; key s cycles (default host)")
    p.add_argument("--reverse", action="store_true", help="reverse the sort order")
    p.add_argument("--filter", metavar="TEXT",
                   help="show only GPUs matching TEXT (host, model, UUID, user...; a term with * is a glob: A100*)")
    p.add_argument("--width", type=_columns, metavar="N", help="with --once: render for N columns (20 or more)")
    p.add_argument("--threshold", action="append", metavar="RULE",
                   help='mark GPUs breaking RULE, e.g. "temperature>85", "utilization>90 for 60s" (repeatable)')
    p.add_argument("--thresholds", action="append", metavar="FILE", help="threshold rules from a JSON file")
    add_token_flags(p, "sign requests, see process owners and commands of verified hosts")
    beyond_flags(p)
    p.add_argument("--history", default="1h", metavar="RANGE", type=_duration_text,
                   help="the sparklines' window, from the daemons' history: 1h (default), 6h, 24h, 7d, 30d")

    p = _command(sub, "report", "gpusd.cli.report:report",
                 "usage report: GPU-hours used and held, idle reservations, utilisation, energy, top jobs")
    when = p.add_argument_group("period")
    when.add_argument("--since", default="7d", metavar="DURATION", type=_duration_text,
                      help="the last DURATION (default 7d; 12h, 30d...)")
    when.add_argument("--from", dest="from_", metavar="TIME", help="start (2026-11-01, 2026-11-01T08:00, epoch s)")
    when.add_argument("--to", metavar="TIME", help="end (default now)")
    p.add_argument("--by", choices=("user", "host", "gpu", "model"), default="user",
                   help="group by (default user; per-user figures need the token)")
    p.add_argument("--format", choices=("table", "csv", "json", "html"), default="table",
                   help="output format (html: one self-contained file with charts)")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE (default: standard output)")
    srcs = p.add_mutually_exclusive_group()
    srcs.add_argument("--db", metavar="FILE", help="read this history database (default: the state directory's)")
    srcs.add_argument("--fleet", action="store_true",
                      help="every host of the fleet, as the daemon at --url (default this machine's) sees it")
    p.add_argument("--url", action="append", metavar="URL",
                   help="ask this daemon (repeatable; with --fleet: the daemon whose fleet to ask)")
    p.add_argument("--state-dir", metavar="DIR", help="the local daemon's state directory")
    p.add_argument("--idle-after", type=_positive_seconds, default=900.0, metavar="S",
                   help="with --db: flag leases held idle this long in all (default 900)")
    add_token_flags(p, "sign requests: per-user figures and job owners from daemons that prove they hold it")

    p = (_Skipped() if _skipped(sub, "export") else  # type: ignore[assignment]
         sub.add_parser("export", help="export the fleet for other tools",
                        description="export the fleet for other tools"))
    esub = p.add_subparsers(dest="export_format", metavar="FORMAT", parser_class=_Parser, required=True)
    p = _command(esub, "prometheus-sd", "gpusd.cli.monitor:export_prometheus_sd",
                 "write a Prometheus file_sd target list of the gpusd daemons discovered")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE atomically (default: standard output)")
    p.add_argument("--url", metavar="URL", help="ask this daemon for the fleet instead of browsing the LAN")
    p.add_argument("--interface", "-i", action="append", metavar="IF", dest="interfaces",
                   help="browse on this interface (name or IPv4 address; repeatable; "
                        "default all, or $GPUSD_INTERFACES)")
    p.add_argument("--session", default="default", help="cluster name (default: default)")
    p.add_argument("--all-sessions", action="store_true", help="daemons of every session")
    p.add_argument("--wait", type=_seconds, default=3.0, metavar="S", help="seconds to browse the LAN (default 3)")
    p.add_argument("--watch", action="store_true", help="keep running; rewrite FILE when daemons come and go")
    p.add_argument("--interval", type=_positive_seconds, default=10.0, metavar="S",
                   help="with --watch: check every S seconds")
    add_token_flags(p, "with --url: sign the request")
    p = _command(esub, "dns-sd-zone", "gpusd.cli.discover:export_dns_sd_zone",
                 "print zone-file records (PTR, SRV, TXT, A) publishing the hosts found under _gpusd._tcp.DOMAIN")
    p.add_argument("--domain", required=True, help="the wide-area DNS-SD domain, e.g. lab.example")
    p.add_argument("--ttl", type=int, default=300, help="TTL of the records in seconds (default 300)")
    p.add_argument("--timeout", type=_seconds, default=3.0, metavar="S", help="seconds to browse (default 3)")
    client_flags(p)
    # --- end of monitoring commands ---

    # --- Slurm (docs/slurm.md) ---
    p = (_Skipped() if _skipped(sub, "slurm") else  # type: ignore[assignment]
         sub.add_parser("slurm", help="Slurm from the fleet: slurm.conf and gres.conf lines, prolog/epilog leases",
                        description="Slurm from the fleet: slurm.conf and gres.conf lines, prolog/epilog leases"))
    ssub = p.add_subparsers(dest="slurm_command", metavar="conf|prolog|epilog", parser_class=_Parser, required=True)
    p = _command(ssub, "conf", "gpusd.cli.slurm:conf",
                 "print slurm.conf NodeName lines (or, with --gres, gres.conf lines) for every verified host")
    p.add_argument("--gres", action="store_true", help="print gres.conf lines instead of slurm.conf's")
    p.add_argument("--check", metavar="FILE",
                   help="compare FILE's NodeName lines with the fleet: hosts added, gone, changed (exit 1 if any)")
    p.add_argument("--local", action="store_true", help="this machine only (no fleet, no secret needed)")
    p.add_argument("--wait", type=_seconds, default=3.0, metavar="S", help="seconds to browse the LAN (default 3)")
    _simulate_flag(p)
    _fleet_flags(p)
    for name, what in (("prolog", "Slurm's Prolog: record the job's GPUs as a lease held by the Slurm job"),
                       ("epilog", "Slurm's Epilog: end the lease of the Slurm job")):
        p = _command(ssub, name, f"gpusd.cli.slurm:{name}", what)
        p.add_argument("--job", metavar="ID", help="the Slurm job id (default $SLURM_JOB_ID)")
        p.add_argument("--timeout", type=_positive_seconds, default=10.0, metavar="S",
                       help="give up asking the daemon after S seconds (default 10)")
    # --- end of Slurm ---

    # --- distributed engine commands (docs/engines.md) ---
    # their options come from cli/engines.py, imported only when one of them runs (start-up time)
    ecli: Any = _Skipped()
    if _only in (None, "hostfile", "launch", "ray"):
        ecli = importlib.import_module("gpusd.cli.engines")

    p = _command(sub, "hostfile", "gpusd.cli.engines:hostfile",
                 "write what a distributed engine reads (DeepSpeed/MPI hostfile, Horovod -H, torchrun lines, JSON)")
    ecli.add_placement_flags(p, hold="2h")
    p.add_argument("--format", "-f", choices=ecli.FORMATS, default="json", help="what to write (default json)")
    p.add_argument("--held", metavar="FILE", help=argparse.SUPPRESS)  # Horovod's discovery script
    p.add_argument("--output", metavar="FILE", help="write to FILE and print the engine's command line using it")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="-- PROGRAM ...",
                   help="with -n: a command to run here while the GPUs are held (released at its end); "
                   "also the training program of the command lines shown")

    p = _command(sub, "launch", "gpusd.cli.engines:launch",
                 "start a distributed engine on every host of the job over SSH: "
                 "gpusd launch -n 8 --per-host 4 torchrun -- train.py")
    ecli.add_placement_flags(p)
    ecli.add_ssh_flags(p)
    p.add_argument("--env", "-x", action="append", default=[], metavar="NAME[=VALUE]",
                   help="also set NAME on every host (its value here, or VALUE; repeatable)")
    p.add_argument("--chdir", metavar="DIR", help="working directory on every host (default: the current one)")
    p.add_argument("--no-chdir", action="store_true", help="stay in the login directory on remote hosts")
    p.add_argument("--port", type=int, default=None,
                   help="torchrun's rendezvous port (default 29400) or DeepSpeed's master port (default 29500)")
    p.add_argument("--python", default=None, help="the Python that runs gpusd's per-rank wrapper (mpirun, "
                   "horovodrun; default: this machine's interpreter where the same path exists on the host, "
                   "else the one of the gpusd command on the host's PATH)")
    p.add_argument("--bind-cpus", action="store_true",
                   help="bind to the CPUs local to the GPUs, on each host (intersected there with the CPUs the "
                   "command may use): each rank to its GPU's (mpirun, horovodrun), the per-host launcher and "
                   "so its ranks to its GPUs' (torchrun, deepspeed, command); says what it did per host")
    p.add_argument("engine", choices=ecli.ENGINES, metavar="ENGINE",
                   help="torchrun, deepspeed, mpirun, horovodrun or command (the same command on every host)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="-- PROGRAM ...", help="the program and its arguments")

    p = (_Skipped() if _skipped(sub, "ray") else  # type: ignore[assignment]
         sub.add_parser("ray", help="a Ray cluster on gpusd's GPUs: ray up / ray down",
                        description="a Ray cluster on gpusd's GPUs: ray up / ray down"))
    rsub = p.add_subparsers(dest="ray_command", metavar="up|down", parser_class=_Parser, required=True)
    for name, target, what in (("up", "ray_up", "start a Ray head on the first host and workers on the others, "
                                "each limited to its GPUs; prints the address"),
                               ("down", "ray_down", "stop Ray on every host of a cluster gpusd started; release it")):
        p = _command(rsub, name, f"gpusd.cli.engines:{target}", what)
        ecli.add_placement_flags(p, with_count=name == "up", hold="24h")
        ecli.add_ssh_flags(p)
        p.add_argument("--ray", default="ray", metavar="PATH", help="the ray command on the hosts (default ray)")
        p.add_argument("--port", type=int, default=6379, help="the head's port (default 6379)")
        p.add_argument("--state-dir", metavar="DIR", help="where gpusd remembers the cluster (default: gpusd's "
                       "state directory)")
        p.add_argument("--python", default=None, metavar="PATH",
                       help="the Python with gpusd on the hosts, which runs each node's guard (default python3, "
                       "here gpusd's own; ray down: the one ray up used)")
        if name == "down":
            p.add_argument("cluster", nargs="?", metavar="ID", help="the cluster to stop (ray up prints its id; "
                           "needed when there are several)")
            p.add_argument("--all", action="store_true", help="stop every cluster gpusd started here")
        if name == "up":
            p.add_argument("ray_args", nargs=argparse.REMAINDER, metavar="-- RAY_START_ARGS",
                           help="more arguments for every `ray start` (e.g. -- --object-store-memory=1e9)")
    # --- end of distributed engine commands ---

    return parser


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command that ``args`` were parsed for (``gpusd export prometheus-sd``)."""
    while parser._subparsers is not None:
        action = next((a for a in parser._subparsers._group_actions
                       if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, action.dest, None) if action is not None else None
        if action is None or chosen not in action.choices:
            break
        parser = action.choices[chosen]
    return parser


def _setup_logging(verbose: int) -> None:
    if verbose or os.environ.get("GPUSD_LOG_LEVEL"):
        import logging

        from ..sanitize import log_formatter  # log lines quote what peers sent

        level = os.environ.get("GPUSD_LOG_LEVEL") or ("DEBUG" if verbose > 1 else "INFO")
        handler = logging.StreamHandler()
        handler.setFormatter(log_formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.basicConfig(level=level, handlers=[handler])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _command_in(argv) == "env":  # eval "$(gpusd env ...)" fails closed (docs/cli.md)
        from .alloc import env_failing_closed

        return env_failing_closed(lambda: _main(argv))
    return _main(argv)


def _main(argv: list[str]) -> int:
    parser = build_parser(_command_in(argv))
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the (sub)command's parser, so the usage shown is the command's own
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    args._argv = argv  # for commands that must know which flags were given (gpusd start)
    if not getattr(args, "_target", None):
        parser.print_help()
        return EXIT_USAGE
    _setup_logging(args.verbose)
    module, _, func = args._target.partition(":")
    fn: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), func)
    try:
        return int(fn(args) or 0)
    except BackendUnavailable as exc:
        if exc.hint:  # name the command that was run: gpisd start --simulate ...
            words = [w for w in (args.command, getattr(args, "export_format", None)) if w]
            if getattr(args, "local", False):
                words.append("--local")  # gpusd top --local: --simulate needs it
            words.append(SIMULATE_EXAMPLE)
            if args.command == "run":
                words.append("-- CMD ...")
            print(f"gpusd: {exc.reason}; to try it without a GPU: {prog()} {' '.join(words)}", file=sys.stderr)
        else:
            print(f"gpusd: {exc}", file=sys.stderr)
        return exit_code_for(exc)
    except GpusdError as exc:
        # messages may quote what a peer sent
        from ..sanitize import for_terminal

        print(f"gpusd: {for_terminal(exc, 2000)}", file=sys.stderr)
        return exit_code_for(exc)
    except KeyboardInterrupt:
        print("gpusd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into head & co.: not an error worth a traceback.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0


def entry() -> None:
    sys.exit(main())
