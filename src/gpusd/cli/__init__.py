"""The ``gpusd`` command line.

Only argparse is imported at start-up; each command imports what it needs when it runs, so
``gpusd --help`` and the quick commands stay fast.  Each command's module registers its own parser
(``register(sub, name)``; :data:`GROUPS` says which module, in the groups ``--help`` lists), and only
the module of the command being run is imported to build it.  The flags several commands share are
defined once, in :mod:`gpusd.cli.options`, which also turns arguments into the library's typed values.
Exit codes are listed in docs/cli.md; the CLI maps library exceptions to them (:mod:`gpusd.cli.exits`).
"""

# Imports inside functions: start-up (quick commands import this module).
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from .._version import __version__
from ..errors import EXIT_USAGE, SIMULATE_EXAMPLE, BackendUnavailable, GpusdError
from .exits import exit_code_for

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Callable, NoReturn, Sequence

# the program's names (gpisd: the seed name)
PROGS = ("gpusd", "gpisd")


def prog() -> str:
    """The name the program was run under: ``gpisd`` or ``gpusd`` (``python -m gpusd``: gpusd).  A
    daemon started in the background is told its parent's name through ``$GPUSD_PROG``."""
    name = os.path.basename(sys.argv[0] or "")
    if name in PROGS:
        return name
    env = os.environ.get("GPUSD_PROG", "")
    return env if env in PROGS else "gpusd"


def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` finds it ($COLUMNS, else the terminal on
    stdout, else 80), without importing shutil (it imports bz2, lzma and zlib: ~2.5 ms)."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, its width found without shutil: argparse builds one for every argument
    added (to check its metavar), so every command paid shutil's import."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position, _columns() - 2 if width is None else width)


class _Parser(argparse.ArgumentParser):
    # A value such as -1h or -5m is a (wrong) value, not an unknown flag: without this, argparse says
    # "expected one argument" for --since -1h and the duration parser never gets to say what is wrong.
    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kw)
        self._negative_number_matcher = re.compile(r"^-\d+(\.\d*)?[a-zA-Z]*$|^-\.\d+[a-zA-Z]*$")

    # one line, documented exit code, no usage block
    def error(self, message: str) -> NoReturn:
        # the unlisted command is no choice to offer
        message = message.replace(", 'fleet-job'", "")
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\nsee {self.prog} --help\n")


# The commands, grouped under the headings of docs/cli.md (and so listed by ``gpusd --help``): (heading,
# ((command, the module of gpusd.cli that registers its parser), ...)).  Each of those modules has
# ``register(sub, name)``; only the module of the command being run is imported to build its parser
# (start-up time).
GROUPS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("Local GPUs", (("devices", "devices"),)),
    ("Allocation (docs/allocation.md)", (("select", "alloc"), ("env", "alloc"), ("run", "alloc"),
                                         ("leases", "alloc"), ("notify", "notify"), ("adopt", "adopt"))),
    ("The fleet pool (docs/pool.md)", (("reserve", "pool"), ("release", "pool"), ("reservations", "pool"))),
    ("Jobs (docs/jobs.md)", (("jobs", "jobs"), ("grow", "jobs"), ("shrink", "jobs"))),
    ("The daemon and the LAN (docs/daemon.md)", (("start", "daemon"), ("stop", "daemon"), ("status", "daemon"),
                                                 ("scan", "discover"), ("list", "discover"),
                                                 ("list_devices", "discover"), ("watch", "discover"),
                                                 ("demo", "daemon"), ("doctor", "doctor"))),
    ("Slurm (docs/slurm.md)", (("slurm", "slurm"),)),
    ("Watching the fleet (docs/monitoring.md)", (("top", "monitor"), ("export", "monitor"))),
    ("Distributed engines (docs/engines.md)", (("hostfile", "engines"), ("launch", "engines"), ("ray", "engines"))),
    ("Usage history (docs/history.md)", (("report", "report"),)),
)
# not listed: what gpusd run --fleet runs on the chosen host, over ssh (docs/jobs.md, "Fleet runs")
_UNLISTED = (("fleet-job", "pool"),)
_MODULE = {name: module for _, cmds in GROUPS for name, module in cmds}
_MODULE.update(_UNLISTED)

# Every top-level command: a word of argv that is one of these builds that command's parser alone; any
# other builds the whole parser.
COMMANDS = tuple(_MODULE)


class _GroupedHelp(_Formatter):
    """``gpusd --help`` lists the commands in the groups of :data:`GROUPS` (argparse has no groups of
    subcommands: the one subcommand action is written group by group, each group's title where the
    action's own line would be)."""

    def _format_action(self, action: argparse.Action) -> str:
        if not isinstance(action, argparse._SubParsersAction):
            return super()._format_action(action)
        listed = {a.dest: a for a in action._get_subactions()}
        parts = []
        for title, cmds in GROUPS:
            if not any(name in listed for name, _ in cmds):
                continue
            parts.append(f"{' ' * self._current_indent}{title}:\n")
            self._indent()
            for name, _ in cmds:
                if name in listed:
                    parts.append(super()._format_action(listed[name]))
            self._dedent()
        return "".join(parts)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only`` (a command of :data:`COMMANDS`), the parser of that command alone:
    the others are not even listed (each costs ~0.15 ms, and its help strings a gettext look-up each).
    Only ``gpusd --help``, or a word that names no command, builds them all, so the help and the
    "invalid choice" error list every command."""
    parser = _Parser(
        prog=prog(),
        description="GPU service discovery and allocation: see every GPU on the LAN, and give each job "
        "the least-loaded GPUs without races.",
        epilog="Exit codes: 0 ok, 1 error, 2 bad usage, 3 no NVML/driver, 4 no GPU qualifies, 5 --wait timed out, "
        "6 no daemon / no host found, 7 start: a daemon runs with other options. See docs/cli.md.",
        formatter_class=_GroupedHelp,
    )
    parser.add_argument("--version", action="version", version=f"gpusd {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, title="commands")
    for name in ((only,) if only in _MODULE else _MODULE):
        importlib.import_module(f"gpusd.cli.{_MODULE[name]}").register(sub, name)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The command named in argv (the first word that is not a top-level option)."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg
    return None


def wants_start_slot(argv: Sequence[str]) -> bool:
    """Whether ``gpusd ARGV`` is a job that queues here (``run --wait``, not ``--fleet``, ``--no-lease``),
    from the words before ``--``: read before the parser, whose own start-up is what the slot
    (:mod:`gpusd.alloc.startgate`) paces; a command given without ``--`` whose own flags say ``--wait``
    takes a slot for nothing but its start."""
    words = list(argv[:argv.index("--")] if "--" in argv else argv)
    return ("run" in words and "--wait" in words and "--fleet" not in words and "--no-lease" not in words
            and "-h" not in words and "--help" not in words)


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

        # log lines quote what peers sent
        from ..sanitize import log_formatter

        level = os.environ.get("GPUSD_LOG_LEVEL") or ("DEBUG" if verbose > 1 else "INFO")
        handler = logging.StreamHandler()
        handler.setFormatter(log_formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.basicConfig(level=level, handlers=[handler])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from ..wire.aio import own_process

    # this process is gpusd's: aiohttp may be imported without the CA store (gpusd.wire.aio)
    own_process()
    # eval "$(gpusd env ...)" fails closed (docs/cli.md)
    if _command_in(argv) == "env":
        from .alloc import env_failing_closed

        return env_failing_closed(lambda: _main(argv))
    # queued jobs submitted together start up in turn (gpusd.alloc.startgate)
    if _command_in(argv) == "run":
        from ..alloc import startgate as gate

        try:
            if wants_start_slot(argv):
                gate.enter()
            return _main(argv)
        finally:
            gate.leave()
    return _main(argv)


def _main(argv: list[str]) -> int:
    parser = build_parser(_command_in(argv))
    args, extra = parser.parse_known_args(argv)
    # reported by the (sub)command's parser, so the usage shown is the command's own
    if extra:
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    # for commands that must know which flags were given (gpusd start)
    args._argv = argv
    if not getattr(args, "_target", None):
        parser.print_help()
        return EXIT_USAGE
    _setup_logging(args.verbose)
    module, _, func = args._target.partition(":")
    fn: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), func)
    try:
        return int(fn(args) or 0)
    except BackendUnavailable as exc:
        # name the command that was run: gpisd start --simulate ...
        if exc.hint:
            words = [w for w in (args.command, getattr(args, "export_format", None)) if w]
            if getattr(args, "local", False):
                # gpusd top --local: --simulate needs it
                words.append("--local")
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
    except OSError as exc:
        from ..errors import DiskFull

        if not DiskFull.caused(exc):
            raise
        # a write no gpusd code expected to fail: still one line, naming the file where it is known
        where = os.path.dirname(os.fsdecode(exc.filename)) if exc.filename else "a directory gpusd writes"
        err = DiskFull.of(where, exc)
        print(f"gpusd: {err}", file=sys.stderr)
        return exit_code_for(err)


def entry() -> None:
    sys.exit(main())
