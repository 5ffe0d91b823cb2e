"""The gpusd modules some commands besides the quick ones (tests/quickpath.py) may import: what each
command is checked against, and what a module must be in to say that its imports inside functions are for
that command's start-up (``start-up (gpusd COMMAND imports this module)``, docs/architecture.md, "Imports
inside functions").  A module added here is a cost every run of the command pays: add it only where one
needs it.

* ``list``: ``gpusd list`` answered by the host's daemon's fleet view (tests/discovery/test_list_fast.py);
* ``top``: ``gpusd top --local --once`` (tests/views/test_top.py);
* ``stop``: ``gpusd stop`` where no daemon runs (tests/cli/test_cli_daemon.py);
* ``report``: ``gpusd report`` of a history database (tests/usage/test_report_output.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Run the command as `python -m gpusd` would, then report sys.modules on stderr (stdout is the command's).
PROBE = """
import sys
from gpusd.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
sys.stderr.write("\\nMODULES " + " ".join(sorted(sys.modules)) + " RC " + str(rc) + "\\n")
"""


def command_modules(args: list[str], env: dict[str, str]) -> tuple[str, set[str]]:
    """The exit status of ``gpusd ARGS`` run in a fresh interpreter, and the modules it imported."""
    env = dict(env, PYTHONPATH=os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, timeout=60)
    line = next((ln for ln in r.stderr.splitlines() if ln.startswith("MODULES ")), None)
    assert line is not None, r.stderr
    names, _, rc = line[len("MODULES "):].rpartition(" RC ")
    return rc, set(names.split())


def gpusd_of(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] == "gpusd"}


LIST = frozenset({
    "gpusd", "gpusd._version", "gpusd.cli", "gpusd.cli.discover", "gpusd.cli.exits", "gpusd.cli.options",
    "gpusd.cli.table", "gpusd.cli.trust", "gpusd.discovery", "gpusd.discovery.fleetsource",
    "gpusd.discovery.fleetview", "gpusd.discovery.source", "gpusd.discovery.types", "gpusd.errors", "gpusd.identity",
    "gpusd.localdaemon", "gpusd.model", "gpusd.record", "gpusd.sanitize", "gpusd.units", "gpusd.views",
    "gpusd.views.tables", "gpusd.wire", "gpusd.wire.aio", "gpusd.wire.fleet", "gpusd.wire.http", "gpusd.wire.mdns",
    "gpusd.wire.txt",
})

TOP = frozenset({
    "gpusd", "gpusd._version", "gpusd.alloc", "gpusd.alloc.handle", "gpusd.alloc.inotify", "gpusd.alloc.leases",
    "gpusd.alloc.leaseview", "gpusd.alloc.lockdir", "gpusd.alloc.policy", "gpusd.alloc.priority", "gpusd.cli",
    "gpusd.cli.exits", "gpusd.cli.monitor", "gpusd.cli.options", "gpusd.cli.trust", "gpusd.errors", "gpusd.identity",
    "gpusd.inventory", "gpusd.inventory.simulated", "gpusd.inventory.vendors", "gpusd.jobs", "gpusd.jobs.containers",
    "gpusd.model", "gpusd.record", "gpusd.sanitize", "gpusd.thresholds", "gpusd.topology", "gpusd.units",
    "gpusd.views", "gpusd.views.sources", "gpusd.views.spark", "gpusd.views.tables", "gpusd.views.top", "gpusd.wire",
    "gpusd.wire.aio", "gpusd.wire.fleet", "gpusd.wire.http",
})

STOP = frozenset({
    "gpusd", "gpusd._version", "gpusd.alloc", "gpusd.alloc.lockdir", "gpusd.cli", "gpusd.cli.daemon",
    "gpusd.cli.exits", "gpusd.cli.options", "gpusd.daemon", "gpusd.daemon.process", "gpusd.errors", "gpusd.identity",
    "gpusd.localdaemon", "gpusd.record", "gpusd.sanitize", "gpusd.wire", "gpusd.wire.aio",
})

REPORT = frozenset({
    "gpusd", "gpusd._version", "gpusd.cli", "gpusd.cli.exits", "gpusd.cli.options", "gpusd.cli.report",
    "gpusd.cli.trust", "gpusd.discovery", "gpusd.discovery.fleetview", "gpusd.discovery.source",
    "gpusd.discovery.types", "gpusd.errors", "gpusd.identity", "gpusd.model", "gpusd.record", "gpusd.sanitize",
    "gpusd.units", "gpusd.usage", "gpusd.usage.db", "gpusd.usage.query", "gpusd.usage.report", "gpusd.views",
    "gpusd.views.report",
    "gpusd.views.sources", "gpusd.views.tables", "gpusd.views.top", "gpusd.wire", "gpusd.wire.aio",
    "gpusd.wire.fleet", "gpusd.wire.http", "gpusd.wire.txt",
})

# the command a reason names: its module set
PATHS = {"list": LIST, "top": TOP, "stop": STOP, "report": REPORT}
