"""The shipped systemd unit works as shipped, and a daemon says what it serves (issue 39, row 10): its
start line names every port (HTTP and HTTPS) and whether it is the lease authority, and why not; so do
``gpusd status`` and ``GET /api/v1/host``."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.request import urlopen

import pytest

from daemon_helpers import unique_session

DOCS = Path(__file__).resolve().parents[2] / "docs"


def gpusd(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpusd", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = dict(os.environ, GPUSD_STATE_DIR=str(tmp_path / "state"), GPUSD_INTERFACES="127.0.0.1",
             GPUSD_MDNS_FAST="1")
    for var in ("GPUSD_TOKEN", "GPUSD_TOKEN_FILE", "GPUSD_SIMULATE", "GPUSD_HOSTNAME"):
        e.pop(var, None)
    return e


def test_the_shipped_unit_is_the_one_print_unit_writes_and_has_a_runtime_directory() -> None:
    """ProtectSystem=strict without RuntimeDirectory= left /run/gpusd impossible to make: the daemon
    started, but was silently not the lease authority."""
    from gpusd.daemon.process import unit_text

    shipped = (DOCS / "gpusd.service").read_text()
    assert shipped == unit_text()
    lines = shipped.splitlines()
    assert "RuntimeDirectory=gpusd" in lines and "ProtectSystem=strict" in lines


def test_print_unit_fills_in_this_install_and_systemd_accepts_it(env: dict[str, str], tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is missing (Debian package: systemd)")
    r = gpusd("start", "--print-unit", "--session", "lab 1", "--interface", "127.0.0.1", env=env)
    assert r.returncode == 0, r.stderr
    [exec_start] = [line for line in r.stdout.splitlines() if line.startswith("ExecStart=")]
    assert exec_start == (f"ExecStart={sys.executable} -m gpusd start --foreground --session \"lab 1\" "
                          "--interface 127.0.0.1")
    assert not (tmp_path / "state" / "gpusd.pid").exists()  # nothing started
    unit = tmp_path / "gpusd.service"
    unit.write_text(r.stdout)
    v = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=120)
    assert v.returncode == 0 and v.stderr.strip() == "", v.stderr
    # the shipped one, its ExecStart pointed at this install, too (its default path may not exist here)
    shipped = tmp_path / "shipped" / "gpusd.service"
    shipped.parent.mkdir()
    shipped.write_text((DOCS / "gpusd.service").read_text().replace(
        "/usr/local/bin/gpusd start", f"{sys.executable} -m gpusd start"))
    v = subprocess.run([analyze, "verify", str(shipped)], capture_output=True, text=True, timeout=120)
    assert v.returncode == 0 and v.stderr.strip() == "", v.stderr


def test_a_daemon_that_is_not_the_lease_authority_says_so_and_names_every_port(
        env: dict[str, str], tmp_path: Path) -> None:
    key = tmp_path / "fleet.key"
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    # a socket directory that cannot be made (as under ProtectSystem=strict without RuntimeDirectory=)
    env = dict(env, GPUSD_LEASE_SOCKET="/proc/gpusd-cannot-be-made/lease.sock")
    r = gpusd("start", "--simulate", "1xT4", "--interface", "127.0.0.1", "--port", "0", "--session",
              unique_session("unit"), "--token-file", str(key), env=env)
    assert r.returncode == 0, r.stderr
    try:
        line = r.stdout.splitlines()[0]
        info = json.loads((tmp_path / "state" / "gpusd.json").read_text())
        port, tls_port = info["port"], info["tls_port"]
        assert f"http://127.0.0.1:{port}/api/v1" in line and f"https://127.0.0.1:{tls_port}/api/v1" in line, line
        assert "NOT the lease authority (cannot serve /proc/gpusd-cannot-be-made/lease.sock" in line, line
        s = gpusd("status", env=env)
        assert "NOT the lease authority: cannot serve /proc/gpusd-cannot-be-made/lease.sock" in s.stdout, s.stdout
        assert f"https://127.0.0.1:{tls_port}/api/v1" in s.stdout
        with urlopen(f"http://127.0.0.1:{port}/api/v1/host", timeout=10) as resp:
            host = json.loads(resp.read())
        assert host["lease_authority"]["serving"] is False
        assert "/proc/gpusd-cannot-be-made" in host["lease_authority"]["why"]
        # a second daemon on the HTTPS port: the error names that port, not "port N / None"
        other = dict(env, GPUSD_STATE_DIR=str(tmp_path / "state2"))
        r2 = gpusd("start", "--foreground", "--simulate", "1xT4", "--interface", "127.0.0.1", "--port", "0",
                   "--tls-port", str(tls_port), "--session", unique_session("unit2"), "--token-file", str(key),
                   env=other, timeout=60)
        assert r2.returncode != 0 and f"HTTPS on 127.0.0.1 port {tls_port}" in r2.stderr, r2.stderr
        assert "None" not in r2.stderr.splitlines()[-1]
    finally:
        gpusd("stop", "--force", env=env)
