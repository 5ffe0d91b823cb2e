"""What the quick commands import (issue 24, start-up): `devices`, `select`, `env` and `run` run on the fake
NVML in a fresh interpreter without site (`python -S`: this machine's .pth files import typing and more
before gpusd starts), and the modules they leave in ``sys.modules`` are checked.  A command imports what it
runs: no event loop, no network stack, no signing, no rich, no database; and no ``typing`` (annotations are
strings), no ``logging`` where nothing is logged.  ``devices --json``, ``select`` and ``env`` also make their
records without ``dataclasses`` (and so without ``inspect``, ``ast``, ``dis``: gpusd.record) and read NVML
through gpusd.inventory.nvmlfast, without nvidia-ml-py (``pynvml``, and its ``ctypes.util`` and
``subprocess``); asking the host's daemon, ``select`` and ``env`` load no NVML binding at all.  An
assertion on the set of modules, never on time."""

from __future__ import annotations

import os
import site
import subprocess
import sys

import pytest

from commandpaths import PROBE, SRC
from fakenvml import make_gpus
from quickpath import QUICK

# Never on the path of a quick command: what the daemon, discovery, trust, views and history use.
HEAVY = ("aiohttp", "zeroconf", "rich", "cryptography", "http_message_signatures", "prometheus_client",
         "sqlite3", "asyncio", "ssl", "http", "email", "psutil")
# What annotations and lazy logging keep out.
LIGHT = ("typing", "logging")
# What gpusd's records and its own NVML calls keep out of devices --json, select and env (not of the table of
# `devices`, which rich renders, nor yet of `run`, whose queue and job records are dataclasses).
RECORDS_AND_NVML = ("dataclasses", "inspect", "ast", "dis", "tokenize", "pynvml", "ctypes.util", "subprocess")


def _modules(args: list[str], env: dict[str, str]) -> set[str]:
    env = dict(env, PYTHONPATH=os.pathsep.join([str(SRC), *site.getsitepackages(), site.getusersitepackages()]))
    r = subprocess.run([sys.executable, "-S", "-c", PROBE, *args], env=env, capture_output=True, text=True,
                       timeout=60)
    line = next((ln for ln in r.stderr.splitlines() if ln.startswith("MODULES ")), None)
    assert line is not None, r.stderr
    names, _, rc = line[len("MODULES "):].rpartition(" RC ")
    assert rc == "0", r.stderr
    return set(names.split())


@pytest.mark.parametrize("args", [
    ["devices", "--json"],
    ["devices"],
    ["select", "-n", "1"],
    ["env", "-n", "1"],
    ["run", "-n", "1", "--", "true"],
], ids=lambda a: " ".join(a))
def test_a_quick_command_imports_only_what_it_runs(fake_nvml, cli_env, args) -> None:
    fake_nvml.write(make_gpus(4, errors={"nvmlDeviceGetSamples": 3}))
    mods = _modules(args, cli_env)
    assert "gpusd.inventory.nvml" in mods  # it did read the GPUs
    assert "gpusd.inventory.nvmlfast" in mods or "pynvml" in mods
    if args[0] in ("select", "env") or "--json" in args:
        assert sorted(m for m in RECORDS_AND_NVML if m in mods) == [], f"{args[0]} imported them"
    # argparse's formatters find the terminal's width without shutil (bz2, lzma, zlib: ~2.5 ms); the NVML
    # backend's locks are _thread's, its XID thread (the daemon's) imports threading when it starts
    assert "shutil" not in mods and "tempfile" not in mods  # (run's job directory: gpusd.jobs.child.private_dir)
    if args[0] == "devices":
        assert "threading" not in mods
    # the table commands render through rich, gpusd's one table renderer; --json does not
    heavy = tuple(h for h in HEAVY if not (h == "rich" and "--json" not in args and args[0] == "devices"))
    loaded = sorted(m for m in mods if m.split(".")[0] in heavy)
    assert loaded == [], f"{args[0]} imported {loaded}"
    if "rich" not in heavy:  # rich itself imports typing
        assert [m for m in LIGHT if m in mods and m != "typing"] == []
    else:
        assert [m for m in LIGHT if m in mods] == []
    # only the command's own module of the CLI, not the others'
    others = {"gpusd.cli.discover", "gpusd.cli.daemon", "gpusd.cli.monitor", "gpusd.cli.pool", "gpusd.cli.engines",
              "gpusd.cli.report", "gpusd.daemon", "gpusd.discovery", "gpusd.views", "gpusd.usage", "gpusd.web"}
    if "rich" not in heavy:  # the one table renderer's package, and nothing else of it
        others -= {"gpusd.views"}
        assert sorted(m for m in mods if m.startswith("gpusd.views.")) == ["gpusd.views.tables"]
    assert sorted(mods & others) == []
    # gpusd's modules: those tests/quickpath.py pins, no more (a new one there is a cost every quick command may pay)
    assert sorted(m for m in mods if m.split(".")[0] == "gpusd" and m not in QUICK) == []


@pytest.mark.parametrize("command", ["select", "env"])
def test_asking_the_hosts_daemon_loads_no_nvml_binding(fake_nvml, cli_env, command) -> None:
    """With a daemon serving the lease socket (here its lease authority, on simulated GPUs, in this process),
    ``select`` and ``env`` ask it: no NVML binding, no ctypes, no inventory backend in the command."""
    from authority_helpers import ServerThread

    fake_nvml.write(make_gpus(4, errors={"nvmlDeviceGetSamples": 3}))
    server = ServerThread(simulate="2xA100-80GB")
    try:
        mods = _modules([command, "-n", "1"], cli_env)
    finally:
        server.stop()
    assert "gpusd.alloc.authority" in mods and "socket" in mods  # it asked the daemon
    loaded = sorted(m for m in ("ctypes", "pynvml", "gpusd.inventory.nvml", "gpusd.inventory.nvmlfast",
                                *RECORDS_AND_NVML) if m in mods)
    assert loaded == []


def test_a_lock_directory_without_lease_records_is_looked_at_without_their_parsers(fake_nvml, cli_env) -> None:
    """The lock directory of a machine where gpusd ran, with no lease held: select and env look at it
    (through the lease view) without importing what reads a lease record (json, the lease ids)."""
    from gpusd.alloc.leases import LeaseStore

    fake_nvml.write(make_gpus(2, errors={"nvmlDeviceGetSamples": 3}))
    LeaseStore().ensure()  # cli_env's GPUSD_LOCK_DIR: this test's own
    for command in ("select", "env"):
        mods = _modules([command, "-n", "1"], cli_env)
        assert "gpusd.alloc.leaseview" in mods  # it did look at the directory
        assert sorted(m for m in ("json", "gpusd.ids") if m in mods) == []


def test_select_on_simulated_gpus_does_not_load_nvml(cli_env) -> None:
    mods = _modules(["select", "-n", "1", "--simulate", "2xA100-80GB"], cli_env)
    assert "pynvml" not in mods and "gpusd.inventory.nvml" not in mods and "ctypes" not in mods
    assert sorted(m for m in mods if m.split(".")[0] == "gpusd" and m not in QUICK) == []


def test_help_still_lists_every_command() -> None:
    """The parser of the command alone is built; ``--help`` builds them all."""
    from gpusd.cli import COMMANDS

    r = subprocess.run([sys.executable, "-m", "gpusd", "--help"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(SRC), COLUMNS="200"))
    assert r.returncode == 0
    listed = {ln.split()[0] for ln in r.stdout.splitlines() if ln.startswith("    ") and ln[4:5] != " "}
    assert listed == set(COMMANDS) - {"fleet-job"}  # the unlisted one is not listed
    bad = subprocess.run([sys.executable, "-m", "gpusd", "lsit"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert bad.returncode == 2 and "'devices'" in bad.stderr and "'launch'" in bad.stderr


@pytest.mark.parametrize("columns", ["57", "0", "wide", None])
def test_the_help_is_as_wide_as_shutil_would_make_it(monkeypatch: pytest.MonkeyPatch, columns: str | None) -> None:
    """The formatters find the width without shutil, by its rule: $COLUMNS, else the terminal, else 80."""
    import shutil

    from gpusd.cli import _columns

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert _columns() == shutil.get_terminal_size().columns
