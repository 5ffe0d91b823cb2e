"""`gpusd doctor` as an administrator runs it: each check's finding, a fix for each failure, exit 0 only
when every check passes or does not apply. Multicast is tried on 127.0.0.1 alone (and with a TTL of 0,
which the kernel never transmits)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import gpusd_cli
from daemon_helpers import unique_session
from fakenvml import make_gpus


def _doctor(env: dict[str, str], *extra: str) -> tuple[int, dict[str, dict[str, object]]]:
    r = gpusd_cli(["doctor", "--json", "--interface", "127.0.0.1", *extra], env=env)
    assert r.returncode in (0, 1), r.stderr
    d = json.loads(r.stdout)
    assert d["ok"] is (r.returncode == 0)
    return r.returncode, {c["check"]: c for c in d["checks"]}


def _env(cli_env: dict[str, str], tmp: Path) -> dict[str, str]:
    env = dict(cli_env, GPUSD_STATE_DIR=str(tmp / "state"), GPUSD_LOCK_DIR=str(tmp / "locks"),
               GPUSD_LEASE_SOCKET="off", GPUSD_INTERFACES="127.0.0.1")
    for var in ("GPUSD_SIMULATE", "GPUSD_TOKEN", "GPUSD_TOKEN_FILE"):
        env.pop(var, None)
    return env


def test_without_a_daemon_it_fails_and_says_what_to_do(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(2))
    rc, checks = _doctor(_env(cli_env, tmp_path))
    assert rc == 1
    assert checks["gpu-libraries"]["status"] == "ok" and "driver 550.54.15" in checks["gpu-libraries"]["found"]
    assert checks["daemon"]["status"] == "fail" and "gpusd start" in checks["daemon"]["fix"]
    assert checks["lock-dir"]["status"] == "ok"
    assert checks["multicast"]["status"] == "ok" and "127.0.0.1 ok" in checks["multicast"]["found"]
    assert checks["secret"]["status"] == "skip"
    r = gpusd_cli(["doctor", "--interface", "127.0.0.1"], env=_env(cli_env, tmp_path))
    assert r.returncode == 1 and "FAIL  daemon" in r.stdout and "-> start it" in r.stdout


def test_a_readable_secret_and_an_open_lock_directory_fail(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(1))
    secret = tmp_path / "fleet.key"
    secret.write_text("s" * 40 + "\n")
    secret.chmod(0o644)
    locks = tmp_path / "locks"
    locks.mkdir()
    locks.chmod(0o777)  # world-writable without the sticky bit: others could replace lock files
    env = _env(cli_env, tmp_path)
    _, checks = _doctor(env, "--token-file", str(secret))
    assert checks["secret"]["status"] == "fail" and f"chmod 600 {secret}" in checks["secret"]["fix"]
    assert checks["lock-dir"]["status"] == "fail" and "chmod 1777" in checks["lock-dir"]["fix"]
    secret.chmod(0o600)
    locks.chmod(0o1777)
    _, checks = _doctor(env, "--token-file", str(secret))
    assert checks["secret"]["status"] == "ok" and checks["lock-dir"]["status"] == "ok"


def test_no_gpu_library_is_a_failure_with_the_ways_out(cli_env, tmp_path):
    env = _env(cli_env, tmp_path)
    env["GPUSD_NVML_LIBRARY"] = str(tmp_path / "nothing-here.so")
    env.pop("LD_LIBRARY_PATH", None)
    env.pop("LD_PRELOAD", None)
    _, checks = _doctor(env)
    if checks["gpu-libraries"]["status"] == "ok":
        pytest.skip("a GPU library loads on this machine")
    assert checks["gpu-libraries"]["status"] == "fail" and "--simulate" in checks["gpu-libraries"]["fix"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the lease authority is a root daemon")
def test_a_root_daemon_as_lease_authority_passes_every_check(fake_nvml, cli_env, tmp_path):
    fake_nvml.write(make_gpus(2))
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    env = _env(cli_env, tmp_path)
    env["GPUSD_LEASE_SOCKET"] = str(run / "lease.sock")
    env["GPUSD_MDNS_FAST"] = "1"
    secret = tmp_path / "fleet.key"
    secret.write_text("s" * 40 + "\n")
    secret.chmod(0o600)
    start = subprocess.run([sys.executable, "-m", "gpusd", "start", "--interface", "127.0.0.1", "--port", "0",
                            "--session", unique_session("doctor"), "--hostname", "doctor-host"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert start.returncode == 0, start.stderr
    try:
        rc, checks = _doctor(env, "--token-file", str(secret))
        assert checks["daemon"]["status"] == "ok" and "lease authority" in checks["daemon"]["found"]
        assert checks["lease-socket"]["status"] == "ok"
        assert rc == 0, {k: (c["status"], c["found"]) for k, c in checks.items()}
    finally:
        subprocess.run([sys.executable, "-m", "gpusd", "stop"], env=env, capture_output=True, timeout=60)
