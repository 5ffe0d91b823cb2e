"""Issue 18, item 3: on a host whose daemon serves simulated GPUs (no driver here), every local allocation
path asks the daemon, as ``gpusd run`` does: ``select``, ``env``, ``run --wait``, ``run --no-lease``,
``gpusd.select(lease=False)`` and the seed API (docs/allocation.md, "The daemon as lease authority")."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from authority_helpers import ServerThread
from conftest import gpusd_cli
from waiting import wait_until_sync

NO_DRIVER = {"GPUSD_NVML_LIBRARY": "/nonexistent/libnvidia-ml.so.1"}  # whatever this machine has


@pytest.fixture
def sim_daemon(tmp_path):
    scenario = tmp_path / "idle.json"  # three idle GPUs: the choice is by index, as for any tie
    scenario.write_text(json.dumps({"gpus": [{"model": "A100-80GB", "util": 0, "memory_used": 0}] * 3}))
    server = ServerThread(simulate=str(scenario))
    yield server
    server.stop()


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **NO_DRIVER, **extra}


def _ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "driver" not in r.stderr, r.stderr
    return r.stdout


def test_without_a_daemon_there_is_no_driver_here():
    """The baseline the tests below rely on: without the daemon, these clients have no GPU to see."""
    r = gpusd_cli(["select"], env=_env())
    assert r.returncode == 3 and "NVML library" in r.stderr, r.stderr


def test_select_and_env_ask_the_daemon(sim_daemon):
    assert _ok(gpusd_cli(["select"], env=_env())).strip() == "0"
    out = json.loads(_ok(gpusd_cli(["select", "-n", "2", "--json"], env=_env())))
    assert [d["index"] for d in out["devices"]] == [0, 1] and out["devices"][0]["name"].endswith("A100-SXM4-80GB")
    script = f'eval "$({sys.executable} -m gpusd env -n 2)"; echo "$? $CUDA_VISIBLE_DEVICES"'
    r = subprocess.run(["bash", "-c", script], env=_env(), capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "0 0,1", r.stderr
    r = gpusd_cli(["select", "-n", "5"], env=_env())  # the daemon's refusal, with its exit code
    assert r.returncode == 4 and "need 5" in r.stderr and "driver" not in r.stderr


def test_the_daemons_choice_honours_leases(sim_daemon, tmp_path):
    stop = tmp_path / "stop"
    held = subprocess.Popen([sys.executable, "-m", "gpusd", "run", "--", "sh", "-c",
                             f"while [ ! -e {stop} ]; do sleep 0.1; done"], env=_env())
    try:
        wait_until_sync(lambda: json.loads(_ok(gpusd_cli(["leases", "--json"], env=_env())))["leases"], timeout=30)
        assert _ok(gpusd_cli(["select"], env=_env())).strip() == "1"
        stop.touch()
        assert held.wait(timeout=30) == 0
    finally:
        if held.poll() is None:
            held.kill()
            held.wait()


def test_run_wait_and_run_no_lease_ask_the_daemon(sim_daemon):
    for flags in (["--wait", "--timeout", "30"], ["--no-lease"], ["--wait", "--priority", "high"]):
        out = _ok(gpusd_cli(["run", "-n", "2", *flags, "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"], env=_env()))
        assert out.strip() == "0,1", flags


def test_the_seed_api_and_gpusd_select_without_a_lease_ask_the_daemon(sim_daemon):
    code = ("from gpu_optimizer import GpuOptimizer; import gpusd\n"
            "print(GpuOptimizer().get_min_load_gpu(), GpuOptimizer().get_min_load_gpus(2))\n"
            "print(gpusd.select(1, lease=False).indices)\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert _ok(r).split("\n")[:2] == ["0 [0, 1]", "[0]"]


def test_a_daemon_that_does_not_know_choose_leaves_the_choice_here(fake_nvml, cli_env, tmp_path):
    """An older daemon answers ``choose`` with a usage error: the client chooses itself (here: the fake NVML)."""
    from fakenvml import make_gpus

    fake_nvml.write(make_gpus(2))
    path = Path(cli_env["GPUSD_LEASE_SOCKET"])
    path.parent.mkdir(parents=True, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    asked: list[dict[str, object]] = []

    def old_daemon() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                asked.append(json.loads(conn.makefile().readline()))
                conn.sendall(b'{"ok": false, "error": "usage", "message": "unknown request (expected '
                             b'{\\"op\\": \\"lease\\", ...})"}\n')

    t = threading.Thread(target=old_daemon, daemon=True)
    t.start()
    try:
        r = gpusd_cli(["select", "-n", "2"], env=cli_env)
        assert r.returncode == 0 and r.stdout.strip() == "0,1", r.stderr
        assert [a["op"] for a in asked] == ["choose"]
    finally:
        listener.close()


def test_a_preemptible_job_leases_the_daemons_gpus_in_the_lock_directory_and_grows(sim_daemon, tmp_path):
    """A --preemptible job takes its lease in the lock directory (its supervisor must hold the locks to
    move it): without a driver here, it reads the GPUs from the daemon ({"op": "snapshot"})."""
    out, stop = tmp_path / "out", tmp_path / "stop"
    job = subprocess.Popen([sys.executable, "-m", "gpusd", "run", "--preemptible", "--", "sh", "-c",
                            f'echo "$CUDA_VISIBLE_DEVICES" > {out}; while [ ! -e {stop} ]; do sleep 0.1; done'],
                           env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_until_sync(lambda: out.exists() and out.read_text().strip(), timeout=30, what="the job to start")
        assert out.read_text().strip() == "0"
        [rec] = json.loads(_ok(gpusd_cli(["jobs", "--json"], env=_env())))["jobs"]
        assert "the command does not catch" in _ok(gpusd_cli(["grow", rec["job"]], env=_env()))
        held = json.loads(_ok(gpusd_cli(["leases", "--json"], env=_env())))["leases"]
        assert len(held) == 2 and {le["job"] for le in held} == {rec["job"]}
        assert _ok(gpusd_cli(["select"], env=_env())).strip() == "2"  # the daemon sees them leased
        stop.touch()
        assert job.wait(timeout=30) == 0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.stderr is not None and "driver" not in job.stderr.read()


def test_the_daemons_snapshot_names_no_process_owner(tmp_path):
    """The lease socket is open to every local user: the snapshot it gives carries what selection reads
    (pids, memory), not who runs what."""
    from gpusd.alloc.authority import DaemonInventory

    scenario = tmp_path / "busy.json"
    scenario.write_text(json.dumps({"gpus": [{"model": "A100-80GB", "processes": [
        {"pid": 4242, "user": "alice", "command": "python secret-project.py", "memory": "10GiB"}]}]}))
    server = ServerThread(simulate=str(scenario))
    try:
        snap = DaemonInventory().snapshot()
    finally:
        server.stop()
    [gpu] = snap.gpus
    assert [(p.pid, p.used_memory, p.user, p.command) for p in gpu.processes] == [(4242, 10 * 2**30, None, None)]


def test_select_explain_says_why_when_the_daemon_chose(sim_daemon):
    """``gpusd select --explain`` (and ``--json``'s ``explain``) beside a daemon: the daemon's choice comes
    with its reasons. It printed the GPUs and silently nothing else (``explain: null``)."""
    out = _ok(gpusd_cli(["select", "-n", "2", "--explain"], env=_env())).splitlines()
    assert out[0] == "0,1" and out[1].startswith("chose GPU(s) 0, 1 (--topology auto): "), out
    got = json.loads(_ok(gpusd_cli(["select", "-n", "2", "--json"], env=_env())))
    assert got["explain"] is not None and got["explain"]["chosen"] == ["0", "1"], got
