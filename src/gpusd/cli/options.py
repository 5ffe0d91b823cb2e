"""The command line's vocabulary: the value types of its flags, and the flag groups several commands
take, each defined once as an argparse parent parser (docs/cli.md, "Vocabulary": a word means one
thing in every command).  Also the CLI's edge: :func:`constraints` turns parsed arguments into the
library's typed value, so that no module below :mod:`gpusd.cli` sees an argparse namespace.

Each parent is built afresh when a command's parser is (a parent's actions are shared by reference
with the parser that copies them, and ``gpusd start`` rewrites its defaults), and only for the
command being run (start-up time): nothing here imports more than argparse until a
group's function is called.
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import argparse
import sys

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Sequence

    from ..alloc.select import Constraints
    from ..jobs.containers import ContainerRun
    from ..jobs.supervisor import JobSpec

# the release in which the deprecated spellings below go
RELEASE_DROPPED = "0.4"


# -- value types -------------------------------------------------------------------------------------
def seconds(text: str) -> float:
    """A duration flag (seconds, or 90s, 15m, 2h: :func:`gpusd.units.parse_duration`), 0 or more."""
    from ..units import parse_duration

    try:
        return parse_duration(text, zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_seconds(text: str) -> float:
    """A period or duration that must be longer than zero."""
    from ..units import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def grace(text: str) -> float:
    """A grace period (SIGTERM to SIGKILL): a duration from 0 to a day, in the words of every duration."""
    from ..units import parse_duration

    try:
        value = parse_duration(text, zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value >= 86400:
        raise argparse.ArgumentTypeError(f"must be a duration under a day (the grace period), not {text!r}")
    return value


def duration_text(text: str) -> str:
    """A duration kept as given (``--since 7d``, ``--for 2h``), checked now so that a wrong one is a
    usage error like any other duration's."""
    positive_seconds(text)
    return text


def whole_number(text: str, low: int, high: int, message: str) -> int:
    """``text`` as a whole number from ``low`` to ``high``; anything else is the usage error ``message``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(message) from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(message)
    return value


def after_dashes(words: Sequence[str]) -> list[str]:
    """The words ``argparse.REMAINDER`` gathered, less the ``--`` that may stand first (``gpusd run -- CMD``)."""
    return list(words[1:] if words and words[0] == "--" else words)


def columns(text: str) -> int:
    """A terminal width: a whole number of columns, 20 or more."""
    return whole_number(text, 20, 10000, f"must be a number of columns from 20 to 10000, not {text!r}")


def positive_number(text: str) -> float:
    """A finite number > 0 in the flag's own unit (days, MiB)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number greater than 0, not {text!r}")
    return value


# -- commands and renamed flags ------------------------------------------------------------------------
def command(sub: Any, name: str, target: str, help: str | None, parents: Sequence[Flags] = (),
            **kw: Any) -> argparse.ArgumentParser:
    """A (sub)command run by ``target`` ("module:function"); ``help`` None: one that is not listed
    (``fleet-job``).  ``parents``: the shared flag groups it takes."""
    p: argparse.ArgumentParser = (sub.add_parser(name, help=help, description=help, parents=list(parents), **kw)
                                  if help is not None else sub.add_parser(name, parents=list(parents), **kw))
    p.set_defaults(_target=target)
    return p


# the deprecation notes already printed by this process (one line each)
_told: set[str] = set()


class _Deprecated(argparse.Action):
    """The old spelling of a renamed flag: it still works (for one release) and says, once, in one line
    on stderr, what to write instead."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", append: bool = False,
                 **kw: Any) -> None:
        self.new, self.append = new, append
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        note = (f"{parser.prog}: {option_string} is now {self.new}; the old spelling goes in {RELEASE_DROPPED} "
                "(docs/cli.md, \"Vocabulary\")")
        if note not in _told:
            _told.add(note)
            print(note, file=sys.stderr)
        # as the new flag's action="append" does: a new list, not the default's
        if self.append:
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


def deprecated(p: Any, old: str, new: argparse.Action) -> None:
    """Keep ``old`` as a hidden alias of the flag ``new`` (the same dest, type and choices)."""
    p.add_argument(old, action=_Deprecated, new=new.option_strings[0], dest=new.dest, type=new.type,
                   choices=new.choices, metavar=new.metavar, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                   append=isinstance(new, argparse._AppendAction))


# -- the shared flag groups (parent parsers) ---------------------------------------------------------------
class Flags(argparse._ActionsContainer):
    """A parent parser: the flags (and argument groups) that ``parents=`` copies into a command's parser.
    It is argparse's container of actions, not a whole ``ArgumentParser``, whose construction (its
    registries, its groups' translated titles, a formatter built per flag to check its metavar) would cost
    more than the flags it holds (a metavar that does not fit its flag shows when the command's help is
    built: tests/cli/test_cli_vocabulary.py builds every command's)."""

    def __init__(self) -> None:
        super().__init__(description=None, prefix_chars="-", argument_default=None, conflict_handler="error")
        # as ArgumentParser does: no type, the text itself
        self.register("type", None, _same)


def _same(text: str) -> str:
    return text


def _parent() -> Flags:
    return Flags()


def simulate() -> Flags:
    p = _parent()
    p.add_argument("--simulate", metavar="SPEC", default=None,
                   help="use simulated GPUs, e.g. 4xA100-80GB or a scenario .json file (also $GPUSD_SIMULATE)")
    return p


def interface() -> Flags:
    p = _parent()
    p.add_argument("--interface", "-i", action="append", metavar="IF", dest="interfaces",
                   help="the network interface to browse on (start: to announce and serve on): a name or IPv4 "
                   "address; repeatable; default all, or $GPUSD_INTERFACES")
    return p


def session(all_sessions: bool = True) -> Flags:
    """``--session`` (a daemon announces in it; a client sees its hosts only) and ``--all-sessions``."""
    p = _parent()
    p.add_argument("--session", default="default",
                   help="the session (cluster name): a daemon announces in it, clients see its hosts only "
                   "(default: default)")
    if all_sessions:
        p.add_argument("--all-sessions", action="store_true", help="hosts of every session")
    return p


def state_dir() -> Flags:
    p = _parent()
    p.add_argument("--state-dir", metavar="DIR",
                   help="gpusd's state directory: the daemon's pid file, log, node id and history, the Ray "
                   "clusters gpusd started (default $GPUSD_STATE_DIR, /var/lib/gpusd for root, "
                   "else ~/.local/state/gpusd)")
    return p


def beyond() -> Flags:
    """The hosts beyond this link: static peers and wide-area DNS-SD."""
    p = _parent()
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
    g.add_argument("--dns-server", metavar="IP", help="with --dns-sd-domain: ask this DNS server "
                   "(default: the system resolver)")
    return p


def token(what: str) -> Flags:
    """``--token-file`` (and ``--identity``); ``what``: what the secret does for this command."""
    from .trust import add_token_flags

    p = _parent()
    add_token_flags(p, what)
    return p


def fleet(what: str = "needed: remote leases are signed requests") -> list[Flags]:
    """Where fleet commands look (docs/pool.md): the session, the interfaces, the hosts beyond this
    link, the fleet secret."""
    return [session(all_sessions=False), interface(), beyond(), token(what)]


SIGN = "sign requests, see process owners and commands of verified hosts"


def client(model: bool = False) -> list[Flags]:
    """What a discovery client takes (``scan``, ``list``, ``watch``, ``export dns-sd-zone``): the hosts
    beyond this link, the interfaces, the session, ``--host`` (``model``: and ``--model``), the secret."""
    return [beyond(), interface(), session(), host_filter(model), token(SIGN)]


def host_filter(model: bool = True) -> Flags:
    """``--host GLOB`` (and ``--model GLOB``): which hosts and GPUs a command considers."""
    p = _parent()
    p.add_argument("--host", metavar="GLOB", help="only hosts whose name matches GLOB (a name, or a pattern such as "
                   "'node-*')")
    if model:
        p.add_argument("--model", metavar="GLOB", help="only GPUs whose model matches GLOB (a glob such as A100*, as "
                       "the tables show it or in full: NVIDIA A100*; or a substring)")
    return p


def thresholds() -> Flags:
    p = _parent()
    p.add_argument("--threshold", action="append", metavar="RULE",
                   help='a threshold rule, e.g. "temperature>85", "utilization>90 for 60s", "lost": start alerts, '
                   'top marks the GPUs breaking it (repeatable)')
    p.add_argument("--thresholds", action="append", metavar="FILE", help="threshold rules from a JSON file")
    return p


def json_output(what: str | None = None) -> Flags:
    """``--json``: print JSON (``what``: which, e.g. "the host snapshot as JSON") instead of a table."""
    p = _parent()
    p.add_argument("--json", action="store_true", help=None if what is None else f"print {what}")
    return p


def browse(default: float, old: str) -> Flags:
    """``--browse S``: how long a command browses the LAN (mDNS) before it answers; ``old``: the
    spelling it had in this command (``--timeout`` or ``--wait``), kept as a deprecated alias."""
    p = _parent()
    new = p.add_argument("--browse", type=seconds, default=default, metavar="S",
                         help="browse the LAN this long at most before answering (default %(default)g)")
    deprecated(p, old, new)
    return p


def ttl() -> Flags:
    p = _parent()
    p.add_argument("--ttl", type=positive_seconds, default=30.0, metavar="S",
                   help="the lease ends S seconds after its last renewal (default 30)")
    return p


def constraints(title: str = "constraints", wait: bool = True) -> Flags:
    """A flag for every constraint that has one (the fields of :class:`gpusd.alloc.select.Constraints`,
    each stored under its :func:`gpusd.select` keyword with the field's default), and, with ``wait``,
    ``--wait`` and ``--timeout``.  :func:`to_constraints` reads them back."""
    from ..alloc.select import Constraints, keyword_of
    from ..record import fields

    p = _parent()
    g = p.add_argument_group(title)
    for f in fields(Constraints):
        meta = f.metadata
        if not meta.get("flags"):
            continue
        kw: dict[str, Any] = {"dest": keyword_of(f.name), "help": meta["help"]}
        if meta["switch"]:
            kw["action"] = "store_true"
        else:
            kw["default"] = f.default
            for key, arg in (("parse", "type"), ("metavar", "metavar"), ("choices", "choices")):
                if meta.get(key) is not None:
                    kw[arg] = meta[key]
        g.add_argument(*meta["flags"], **kw)
    if wait:
        _wait_flags(g)
    return p


def wait() -> Flags:
    """``--wait`` (a switch: queue until GPUs qualify) and ``--timeout S`` (how long at most)."""
    p = _parent()
    _wait_flags(p)
    return p


def _wait_flags(g: Any) -> None:
    g.add_argument("--wait", action="store_true",
                   help="wait until GPUs qualify: in the queue (by priority, then first come, first served), "
                   "woken by the fleet's events for fleet commands")
    g.add_argument("--timeout", type=seconds, metavar="S", help="with --wait: give up after S seconds (exit 5)")


def to_constraints(args: argparse.Namespace) -> Constraints:
    """The constraints given on a command line parsed with :func:`constraints`: the CLI's edge."""
    from ..alloc.select import Constraints, constraint_keywords

    return Constraints.from_keywords(**{k: getattr(args, k) for k in constraint_keywords() if hasattr(args, k)})


def job_spec(args: argparse.Namespace, cmd: list[str], command: str,
             container: ContainerRun | None = None) -> JobSpec:
    """What ``gpusd run`` was asked, as the one value the library's job runner takes: the CLI's edge."""
    from ..alloc.priority import PRIORITIES
    from ..jobs.supervisor import JobSpec

    return JobSpec(to_constraints(args), tuple(cmd), command, priority=PRIORITIES[args.priority],
                   preemptible=args.preemptible, pausable=args.pausable, notify_signal=args.notify_signal,
                   grace=args.grace, wait=args.wait, timeout=wait_timeout(args), simulate=args.simulate,
                   use_uuid=args.uuid, on_change=args.on_change, bind_cpus=args.bind_cpus, container=container,
                   time_limit=getattr(args, "time", None))


def wait_timeout(args: argparse.Namespace) -> float | None:
    """``--timeout`` (None: wait for ever), refused without ``--wait``."""
    from ..errors import ConfigError

    if args.timeout is not None and not args.wait:
        raise ConfigError("--timeout only makes sense with --wait")
    return args.timeout  # type: ignore[no-any-return]

