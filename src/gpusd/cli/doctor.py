"""``gpusd doctor``: check this host's setup, one line per check, what to do for each that fails
(the checks: :mod:`gpusd.doctor`)."""

# Imports inside functions: start-up (a command's own module).
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import EXIT_ERROR

_MARK = {"ok": "ok  ", "fail": "FAIL", "skip": "-   "}


def doctor(args: argparse.Namespace) -> int:
    from ..doctor import FAIL, run_checks
    from ..identity import state_dir
    from ..sanitize import dumps, for_terminal

    state = Path(args.state_dir) if args.state_dir else state_dir()
    from ..wire.mdns import resolve_interfaces

    given = resolve_interfaces(args.interfaces) if args.interfaces else None
    checks = run_checks(state, interfaces=given, token_file=args.token_file)
    failed = [c for c in checks if c.status == FAIL]
    if args.json:
        print(dumps({"ok": not failed, "checks": [c.to_dict() for c in checks]}, indent=1))
    else:
        for c in checks:
            print(f"{_MARK.get(c.status, c.status)}  {c.name:<14} {for_terminal(c.found, 400)}")
            if c.status == FAIL and c.fix:
                print(f"{'':6}{'':14} -> {for_terminal(c.fix, 400)}")
        print(f"{len(checks) - len(failed)} of {len(checks)} checks passed or do not apply; {len(failed)} failed")
    return EXIT_ERROR if failed else 0


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str) -> None:
    """The parser of ``gpusd doctor``."""
    from . import options as o

    o.command(sub, name, "gpusd.cli.doctor:doctor",
              "check this host's setup (GPU libraries, daemon, lease socket, lock directory, multicast, "
              "secret, clock, systemd) and say what to do for each check that fails",
              parents=[o.state_dir(), o.json_output(), o.interface(), o.token("checked: its owner and mode")])
