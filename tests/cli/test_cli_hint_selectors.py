"""Issue 18, item 5: every hint gpusd prints names the options that select what it acted on, so that
following it acts on the same thing: a second daemon started with ``--state-dir B`` is stopped by its
hint, not the first daemon."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from daemon_helpers import unique_session


def gpusd(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpusd", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def follow(hint: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a hint as a user pastes it."""
    words = shlex.split(hint)
    assert words[0] == "gpusd", hint
    return gpusd(*words[1:], env=env)


def _hint(out: str, after: str) -> str:
    return out.split(after, 1)[1].strip().splitlines()[0].rstrip(".)")


def _running(state: Path, env: dict[str, str]) -> bool:
    return gpusd("status", "--state-dir", str(state), env=env).returncode == 0


def test_the_hints_of_a_second_daemon_with_its_own_state_dir_act_on_it(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    env = dict(os.environ, GPUSD_STATE_DIR=str(a), GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")
    for var in ("GPUSD_SIMULATE", "GPUSD_HOSTNAME", "GPUSD_TOKEN"):
        env.pop(var, None)
    common = ["--simulate", "1xT4", "--interface", "127.0.0.1", "--port", "0", "--hostname", "hint-host"]
    r = gpusd("start", *common, "--session", unique_session("hint-a"), env=env)
    assert r.returncode == 0, r.stderr
    # B is not a lease authority: A is the one of this lock directory (a second would be refused)
    env_b = dict(env, GPUSD_LEASE_SOCKET="off")
    try:
        r = gpusd("start", *common, "--session", unique_session("hint-b"), "--state-dir", str(b), env=env_b)
        assert r.returncode == 0, r.stderr
        hint = _hint(r.stdout, "stop with: ")
        assert hint == shlex.join(["gpusd", "stop", "--state-dir", str(b.resolve())])
        # a start against B with other options is refused, and its hint names B as well
        r = gpusd("start", "--simulate", "2xT4", "--state-dir", str(b), env=env_b)
        assert r.returncode == 7 and f"Stop it first ({hint})" in r.stderr, r.stderr
        assert follow(hint, env_b).returncode == 0
        assert not _running(b, env) and _running(a, env)  # B stopped, the first daemon untouched
    finally:
        gpusd("stop", "--force", "--state-dir", str(b), env=env_b)
        gpusd("stop", "--force", env=env)


def test_the_stop_hint_is_plain_for_the_default_state_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gpusd.daemon.process import stop_command

    monkeypatch.delenv("GPUSD_STATE_DIR")
    assert stop_command(Path("/var/lib/gpusd")) == "gpusd stop"
    assert stop_command(Path("/var/lib/gpusd"), force=True) == "gpusd stop --force"
    monkeypatch.setenv("GPUSD_STATE_DIR", str(tmp_path / "my state"))
    assert shlex.split(stop_command(tmp_path / "my state")) == ["gpusd", "stop", "--state-dir",
                                                                 str(tmp_path / "my state")]


def test_the_release_hint_names_the_secret_and_where_reserve_looked(tmp_path: Path) -> None:
    from gpusd.cli import build_parser
    from gpusd.cli.pool import release_command

    args = build_parser("reserve").parse_args(
        ["reserve", "--token-file", "k.key", "--session", "lab", "--peer", "198.18.2.2:4780", "-i", "eth1"])
    words = shlex.split(release_command(args, "abcdef123456"))
    assert words[:3] == ["gpusd", "release", "abcdef123456"]
    assert words[3:] == ["--token-file", str(Path("k.key").resolve()), "--session", "lab", "--interface", "eth1",
                         "--peer", "198.18.2.2:4780"]
    assert build_parser("release").parse_args(words[1:]).peers == ["198.18.2.2:4780"]  # release takes them all


def test_nothing_found_in_a_session_hints_a_start_in_that_session() -> None:
    session = unique_session("nobody")
    env = dict(os.environ, GPUSD_INTERFACES="127.0.0.1", GPUSD_MDNS_FAST="1")
    r = gpusd("list", "--browse", "0.5", "--session", session, env=env)
    assert r.returncode == 6 and f"(gpusd start --session {session})" in r.stderr, r.stderr
