"""Frameworks that scale natively follow a grow and a shrink (docs/jobs.md, "Frameworks that scale
natively"), with the real frameworks on the fake NVML, CPU only:

* torchrun under ``gpusd run --on-change restart``: its workers are started again with one process
  per GPU (``--nproc-per-node=$GPUSD_GPU_COUNT``) and form a gloo group of the new size;
* elastic Horovod's discovery (its own ``HostDiscoveryScript``) runs the documented discovery
  script, ``python -m gpusd.job --horovod-discovery``, and sees the slots follow the job;
* a Ray node (``ray start --num-gpus $GPUSD_GPU_COUNT --block``) under ``--on-change restart``:
  ``ray.cluster_resources()["GPU"]`` follows the job.  In a network namespace (tests/netns.py), so
  Ray's ports and addresses are its own.

Marked ``engines``; each test skips, saying why, where its framework (or root, for the namespace) is
missing.  The frameworks run in subprocesses only (importing them here would load CUDA or NVML)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import gpusd_cli
from fakenvml import make_gpus
from jobs_helpers import GPUSD, job_env, jobs_json
from netns import Lan, lan, netns_ok  # noqa: F401
from waiting import wait_until_sync

pytestmark = [pytest.mark.engines, pytest.mark.timeout(300)]
BIN = str(Path(sys.executable).parent)


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (the engines extra)")


def _end(p: subprocess.Popen[str], env: dict[str, str]) -> None:
    """Stop the job at once, its command's process group included (the framework's processes)."""
    if p.poll() is None:
        try:
            for rec in jobs_json(env):
                if rec.get("pid") == p.pid and rec.get("child"):
                    os.killpg(int(rec["child"]), signal.SIGKILL)  # --on-change restart: its own group
        except (AssertionError, OSError, ValueError):
            pass
        p.kill()
        p.wait()


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


# -- torchrun ---------------------------------------------------------------------------------------------------
WORKER = r'''
import json, os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)  # a working group of this size
with open(os.environ["OUT"], "a") as f:
    f.write(json.dumps({"rank": dist.get_rank(), "world": int(os.environ["WORLD_SIZE"]), "sum": t.item(),
                        "cuda_visible_devices": os.environ["CUDA_VISIBLE_DEVICES"],
                        "restarts": int(os.environ["GPUSD_RESTART_COUNT"])}) + "\n")
while not os.path.exists(os.environ["STOP"]):
    time.sleep(0.2)
dist.destroy_process_group()
'''


def test_torchrun_follows_grow_and_shrink_with_on_change_restart(fake_nvml, cli_env, tmp_path: Path) -> None:
    _need("torch")
    fake_nvml.write(make_gpus(2))
    worker, out, stop = tmp_path / "worker.py", tmp_path / "out", tmp_path / "stop"
    worker.write_text(WORKER)
    env = job_env(cli_env, OUT=str(out), STOP=str(stop), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                  PATH=f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    p = subprocess.Popen([*GPUSD, "run", "-n", "1", "--on-change", "restart", "--grace", "30", "--", "sh", "-c",
                          f'exec torchrun --standalone --nproc-per-node="$GPUSD_GPU_COUNT" {worker}'],
                         env=env, text=True)

    def generation(restarts: int, world: int) -> list[dict[str, object]]:
        got = [x for x in _lines(out) if x["restarts"] == restarts]
        return got if len(got) == world else []

    try:
        first = wait_until_sync(lambda: generation(0, 1), timeout=120, what="torchrun's first worker")
        assert first == [{"rank": 0, "world": 1, "sum": 1.0, "cuda_visible_devices": "0", "restarts": 0}]
        job = str(jobs_json(env)[0]["job"])
        r = gpusd_cli(["grow", job, "+1"], env=env)
        assert r.returncode == 0, r.stderr
        grown = wait_until_sync(lambda: generation(1, 2), timeout=120, what="two workers after the grow")
        assert sorted(x["rank"] for x in grown) == [0, 1]  # type: ignore[type-var]
        assert all(x["world"] == 2 and x["sum"] == 3.0 and x["cuda_visible_devices"] == "0,1" for x in grown)
        r = gpusd_cli(["shrink", job, "-1"], env=env)
        assert r.returncode == 0, r.stderr
        shrunk = wait_until_sync(lambda: generation(2, 1), timeout=120, what="one worker after the shrink")
        assert shrunk[0]["world"] == 1 and shrunk[0]["cuda_visible_devices"] == "0"
        stop.touch()
        assert p.wait(timeout=60) == 0  # torchrun's own exit status when its workers finish
    finally:
        _end(p, env)


# -- elastic Horovod's discovery ---------------------------------------------------------------------------------
DISCOVER = '#!/bin/sh\nexec python3 -m gpusd.job --horovod-discovery\n'  # docs/jobs.md, as printed there
POLL = r'''
import json, os, sys, time
from horovod.runner.elastic.discovery import HostDiscoveryScript
if __name__ == "__main__":  # Horovod runs the script through a spawned multiprocessing helper
    found, last = HostDiscoveryScript(sys.argv[1], slots=1), None
    while not os.path.exists(os.environ["STOP"]):
        now = found.find_available_hosts_and_slots()   # what horovodrun's elastic driver polls
        if now != last:
            with open(os.environ["OUT"], "a") as f:
                f.write(json.dumps(now) + "\n")
            last = now
        time.sleep(0.2)
'''


def test_horovod_discovery_follows_grow_and_shrink(fake_nvml, cli_env, tmp_path: Path) -> None:
    """Horovod's own discovery code, run where horovodrun runs (in the job, with ``--on-change file``:
    horovodrun has no handler for the notify signal), reads the slots from the documented script."""
    spec = importlib.util.find_spec("horovod")  # not imported here: only its location
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    if not any((Path(d) / "runner" / "elastic" / "discovery.py").exists() for d in places):
        pytest.skip("horovod with its elastic runner is not installed (pip install horovod)")
    fake_nvml.write(make_gpus(3))
    script, poll, out, stop = tmp_path / "discover.sh", tmp_path / "poll.py", tmp_path / "out", tmp_path / "stop"
    script.write_text(DISCOVER)
    script.chmod(0o755)
    poll.write_text(POLL)
    env = job_env(cli_env, OUT=str(out), STOP=str(stop), PATH=f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    p = subprocess.Popen([*GPUSD, "run", "-n", "1", "--on-change", "file", "--", sys.executable, str(poll),
                          str(script)], env=env, text=True)
    host = socket.gethostname()
    try:
        wait_until_sync(lambda: _lines(out), timeout=120, what="Horovod's first discovery")
        assert _lines(out) == [{host: 1}]
        job = str(jobs_json(env)[0]["job"])
        assert gpusd_cli(["grow", job, "+2"], env=env).returncode == 0
        wait_until_sync(lambda: len(_lines(out)) == 2, timeout=60, what="the discovery after the grow")
        assert gpusd_cli(["shrink", job, "-1"], env=env).returncode == 0
        wait_until_sync(lambda: len(_lines(out)) == 3, timeout=60, what="the discovery after the shrink")
        assert _lines(out) == [{host: 1}, {host: 3}, {host: 2}]
        stop.touch()
        assert p.wait(timeout=60) == 0
        assert jobs_json(env) == []
    finally:
        _end(p, env)


# -- Ray ---------------------------------------------------------------------------------------------------------
RAY_GPUS = r'''
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print("RESULT", ray.cluster_resources().get("GPU"), flush=True)
'''


def test_ray_node_follows_grow_and_shrink_with_on_change_restart(lan: Lan, fake_nvml, tmp_path: Path) -> None:
    _need("ray")
    fake_nvml.write(make_gpus(2))
    node = lan.add_node("h1")
    temp = Path(tempfile.mkdtemp(prefix="gr", dir="/tmp"))  # short: Ray's socket paths live under it
    env = job_env(fake_nvml.env(lan.base_env(node)), PATH=f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                  RAY_USAGE_STATS_ENABLED="0")
    address = f"{node.ip}:6379"
    ray_start = (f'exec ray start --head --node-ip-address={node.ip} --port=6379 --include-dashboard=false '
                 f'--num-cpus=1 --num-gpus="$GPUSD_GPU_COUNT" --temp-dir={temp} --disable-usage-stats --block')
    # --grace 5: ray start drains up to 30 s on SIGTERM; SIGKILL to its group ends the rest
    p = lan.popen(node, [*GPUSD, "run", "-n", "1", "--on-change", "restart", "--grace", "5", "--", "sh", "-c",
                         ray_start], env=env, text=True)

    def gpus() -> float | None:
        try:
            r = lan.run(node, [sys.executable, "-c", RAY_GPUS, address], env=env, timeout=90)
        except subprocess.TimeoutExpired:  # the head is restarting
            return None
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        return float(line[0].split()[1]) if line and line[0].split()[1] != "None" else None

    try:
        assert wait_until_sync(lambda: gpus() == 1.0, timeout=120, step=1, what="the Ray node with 1 GPU")
        job = str(jobs_json(env)[0]["job"])
        assert gpusd_cli(["grow", job, "+1"], env=env).returncode == 0
        assert wait_until_sync(lambda: gpus() == 2.0, timeout=120, step=1, what="the Ray node with 2 GPUs")
        assert gpusd_cli(["shrink", job, "-1"], env=env).returncode == 0
        assert wait_until_sync(lambda: gpus() == 1.0, timeout=120, step=1, what="the Ray node with 1 GPU again")
        assert jobs_json(env)[0]["restarts"] == 2
    finally:
        _end(p, env)
        import shutil

        shutil.rmtree(temp, ignore_errors=True)
