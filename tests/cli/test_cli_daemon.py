"""`gpusd start` twice, and `gpusd scan`/`list` when nothing (or nothing matching) is found: one
simulated daemon on 127.0.0.1 in its own session, the commands run as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from commandpaths import STOP, command_modules, gpusd_of
from daemon_helpers import unique_session

NO_DAEMON = 6
ALREADY_RUNNING = 7


def gpusd(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpusd", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A running daemon: its environment, session, host name and state directory."""
    state = tmp_path_factory.mktemp("state")
    # its own lock directory and lease socket (module-scoped: made before the per-test ones): one lease
    # authority per lock directory, and the machine's may be taken (a daemon beside the tests)
    env = dict(os.environ, GPUSD_STATE_DIR=str(state), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1",
               GPUSD_LOCK_DIR=str(state / "locks"), GPUSD_LEASE_SOCKET=str(state / "lease.sock"))
    for var in ("GPUSD_SIMULATE", "GPUSD_HOSTNAME", "GPUSD_TOKEN"):
        env.pop(var, None)
    session = unique_session("cli")
    r = gpusd("start", "--simulate", "1xT4", "--interface", "127.0.0.1", "--port", "0", "--session", session,
              "--hostname", "cli-host", env=env)
    assert r.returncode == 0, r.stderr
    try:
        yield {"env": env, "session": session, "state": state, "pid": int((state / "gpusd.pid").read_text())}
    finally:
        gpusd("stop", "--force", env=env)


# -- nothing found: exit 6, and the right reason --------------------------------------------------------
@pytest.mark.parametrize("command", [["scan", "--browse", "0.5"], ["list", "--browse", "0.5"],
                                     ["scan", "--browse", "0.5", "--json"], ["list", "--browse", "0.5", "--json"]])
def test_nothing_found_exits_6(command: list[str], daemon: dict[str, Any]) -> None:
    r = gpusd(*command, "--session", unique_session("nobody"), env=daemon["env"])
    assert r.returncode == NO_DAEMON, (r.stdout, r.stderr)
    if "--json" in command:
        assert json.loads(r.stdout) == []
    else:
        assert r.stderr.startswith("gpusd: no gpusd hosts"), r.stderr


@pytest.mark.parametrize("command", [["scan", "--browse", "3"], ["list"]])
def test_host_filter_that_removes_every_host_says_so(command: list[str], daemon: dict[str, Any]) -> None:
    r = gpusd(*command, "--session", daemon["session"], "--host", "other-*", env=daemon["env"])
    assert r.returncode == NO_DAEMON, (r.stdout, r.stderr)
    assert r.stderr.startswith("gpusd: 1 gpusd host(s) found, but none matched --host 'other-*'"), r.stderr
    assert "is a daemon running" not in r.stderr
    r = gpusd(*command, "--session", daemon["session"], "--host", "CLI-*", env=daemon["env"])
    assert r.returncode == 0 and "cli-host" in r.stdout, r.stderr


# -- a second start ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [[], ["--foreground"]])
def test_second_start_with_the_same_options_says_already_running(mode: list[str], daemon: dict[str, Any]) -> None:
    for extra in ([], ["--simulate", "1xT4", "--session", daemon["session"], "--port", "0",
                       "--interface", "127.0.0.1"]):
        r = gpusd("start", *mode, *extra, env=daemon["env"], timeout=30)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert r.stdout.startswith("gpusd: already running") and f"pid {daemon['pid']}" in r.stdout
        assert "http://127.0.0.1:" in r.stdout and daemon["session"] in r.stdout
    assert int((daemon["state"] / "gpusd.pid").read_text()) == daemon["pid"]


@pytest.mark.parametrize("mode", [[], ["--foreground"]])
@pytest.mark.parametrize("options, named", [
    (["--port", "4999"], "--port 4999 (running: 0)"),
    (["--simulate", "2xT4"], "--simulate 2xT4 (running: 1xT4)"),
    (["--session", "elsewhere"], "--session elsewhere"),
    (["--gpusd-compat"], "--gpusd-compat (running: without it)"),
    (["--threshold", "lost"], "--threshold lost (running: none)"),
    (["--idle-release"], "--idle-release (running: without it)"),
    (["--no-record"], "--no-record (running: without it)"),
    (["--retention", "30"], "--retention 30 (running: 365)"),
])
def test_second_start_with_other_options_is_refused(mode: list[str], options: list[str], named: str,
                                                    daemon: dict[str, Any]) -> None:
    r = gpusd("start", *mode, *options, env=daemon["env"], timeout=30)
    assert r.returncode == ALREADY_RUNNING, (r.stdout, r.stderr)
    assert named in r.stderr and f"pid {daemon['pid']}" in r.stderr and "gpusd stop" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert int((daemon["state"] / "gpusd.pid").read_text()) == daemon["pid"]  # still the first one


@pytest.mark.parametrize("mode", [[], ["--foreground"]])
@pytest.mark.parametrize("options, named", [
    (["--token-file", "{key}"], "--token-file (running: without a secret: trust is off)"),
    (["--peer", "198.18.0.9:4780"], "--peer 198.18.0.9:4780 (running: default)"),
    (["--tls-port", "4999"], "--tls-port 4999 (running: default)"),
    (["--dns-sd-domain", "lab.example"], "--dns-sd-domain lab.example (running: default)"),
])
def test_second_start_that_would_change_trust_or_ports_is_refused(
        mode: list[str], options: list[str], named: str, daemon: dict[str, Any], tmp_path: Path) -> None:
    """The admin turns trust on with a second start: it said "already running", exit 0, and trust stayed
    off (--token-file, --peer, --tls-port were not among the options compared)."""
    import secrets

    key = tmp_path / "fleet.key"
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    r = gpusd("start", *mode, *[o.format(key=key) for o in options], env=daemon["env"], timeout=30)
    assert r.returncode == ALREADY_RUNNING, (r.stdout, r.stderr)
    assert named in r.stderr and f"pid {daemon['pid']}" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    # a secret from the environment counts as given; the secret itself is never shown
    env = dict(daemon["env"], GPUSD_TOKEN_FILE=str(key))
    r = gpusd("start", *mode, env=env, timeout=30)
    assert r.returncode == ALREADY_RUNNING and "--token-file (running: without a secret" in r.stderr, r.stderr
    assert key.read_text().strip() not in r.stderr
    env = dict(daemon["env"], GPUSD_LEASE_SOCKET=str(tmp_path / "elsewhere.sock"))
    r = gpusd("start", *mode, env=env, timeout=30)
    assert r.returncode == ALREADY_RUNNING and "$GPUSD_LEASE_SOCKET" in r.stderr, r.stderr
    assert int((daemon["state"] / "gpusd.pid").read_text()) == daemon["pid"]  # still the first one


def test_second_start_against_a_daemon_that_recorded_no_options(tmp_path: Path, daemon: dict[str, Any]) -> None:
    """An older daemon's gpusd.json has no options: a start that gives options cannot be checked."""
    from gpusd.cli import build_parser
    from gpusd.cli.daemon import _already_running
    from gpusd.errors import GpusdError
    from gpusd.localdaemon import DaemonStatus

    args = build_parser("start").parse_args(["start", "--port", "0"])
    args._argv = ["start", "--port", "0"]
    st = DaemonStatus(running=True, pid=123, state_dir=tmp_path, info={"urls": ["http://x:1/api/v1"]})
    from gpusd.daemon.config import DaemonConfig

    with pytest.raises(GpusdError, match="not recorded") as exc:
        _already_running(args, DaemonConfig(port=0), st)
    from gpusd.cli.exits import exit_code_for

    assert exit_code_for(exc.value) == ALREADY_RUNNING


def test_stop_where_no_daemon_runs_imports_no_daemon(tmp_path: Path) -> None:
    """``gpusd stop`` where none runs says so (exit 6) with the process manager alone: not the daemon, its
    logs nor the lease authority (tests/commandpaths.py pins its set)."""
    rc, mods = command_modules(["stop"], dict(os.environ, GPUSD_STATE_DIR=str(tmp_path)))
    assert rc == "6" and "gpusd.daemon.process" in mods
    assert sorted(gpusd_of(mods) - STOP) == []
