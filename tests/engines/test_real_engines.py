"""The real engines on a namespace LAN with an sshd per host (tests/netns.py, tests/sshd.py): torchrun's
all-reduce over gloo on 2 hosts x 2 ranks, and a Ray cluster whose GPU tasks stay within the placement.

Namespaces share the file system, so every "host" has the same Python environment (torch, ray) and the
same files: that is what lets one machine play a cluster.  Marked ``engines`` (torch and ray are the
engines test extra); skipped, saying why, where they or root are missing."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from netns import Lan, Node, lan, netns_ok  # noqa: F401
from sshd import SshFleet, sshd_ok  # noqa: F401

pytestmark = [pytest.mark.engines, pytest.mark.timeout(300)]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
BIN = str(Path(sys.executable).parent)


def _need(module: str) -> None:
    """Skip unless ``module`` is installed, without importing it here (DeepSpeed's import initialises
    NVML in the importing process; torch's loads CUDA libraries): the engines run in subprocesses."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (the engines extra)")


def _placement(tmp_path: Path, hosts: list[tuple[str, Node, list[int]]], job: str) -> Path:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"job_id": job, "hosts": [
        {"hostname": name, "address": node.ip, "ssh_target": name, "gpus": gpus} for name, node, gpus in hosts]}))
    return path


@pytest.fixture
def cluster(lan: Lan, sshd_ok: None, tmp_path: Path):  # type: ignore[no-untyped-def]
    h1, h2 = lan.add_node("h1"), lan.add_node("h2")
    with SshFleet(lan, [(h1, "node-1"), (h2, "node-2")], workdir=tmp_path / "ssh") as fleet:
        yield lan, fleet, h1, h2


def _env(fleet: SshFleet, node: Node) -> dict[str, str]:
    # the engines' commands live next to this Python; the remote login PATH does not have them
    return fleet.env(node, PATH=f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin")


def test_torchrun_all_reduce_on_two_hosts_with_the_placements_gpus(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _need("torch")
    lan, fleet, h1, h2 = cluster
    pl = _placement(tmp_path, [("node-1", h1, [1, 3]), ("node-2", h2, [0, 2])], "allreduce-1")
    r = lan.run(h1, [sys.executable, "-m", "gpusd", "launch", "--placement", str(pl),
                     "--env", "PATH", "--env", "OMP_NUM_THREADS=1",
                     "torchrun", "--", str(SCRIPTS / "allreduce.py")], env=_env(fleet, h1), timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = []
    for line in r.stdout.splitlines():
        if "RESULT " in line:
            prefix, _, payload = line.partition("RESULT ")
            results.append((prefix, json.loads(payload)))
    assert len(results) == 4, r.stdout[-3000:]
    assert sorted(res["rank"] for _, res in results) == [0, 1, 2, 3]
    assert all(res["world"] == 4 and res["sum"] == 10.0 for _, res in results)
    expected = {h1.ip: ("1,3", "[node-1#0]"), h2.ip: ("0,2", "[node-2#1]")}
    for prefix, res in results:
        visible, label = expected[res["address"]]
        assert res["cuda_visible_devices"] == visible and res["cuda_device_order"] == "PCI_BUS_ID"
        assert prefix.startswith(label)  # output prefixed by host and rank
    assert sorted(res["address"] for _, res in results) == sorted([h1.ip, h1.ip, h2.ip, h2.ip])


RAY_PROBE = r'''
import json, subprocess, sys, time
import ray

ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote(num_gpus=1)
def where():
    import os
    time.sleep(3)  # hold the GPU, so that the four tasks run at once on the four GPUs
    ip = subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True).stdout.split()
    return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()], "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "address": ip[3].split("/")[0]}

print("RESULT " + json.dumps({"total_gpus": ray.cluster_resources().get("GPU"),
                              "tasks": ray.get([where.remote() for _ in range(4)])}), flush=True)
'''


def _ray_pids() -> list[int]:
    """Ray's processes on this machine (every namespace shares the pid space)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(k in cmdline for k in ("raylet", "gcs_server", "ray/_private/", "ray::", "default_worker.py")):
            out.append(int(proc.name))
    return out


def test_ray_cluster_from_the_placement(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """gpusd ray up: a head on node-1 and a worker on node-2, each with --num-gpus and the placement's
    CUDA_VISIBLE_DEVICES; a num_gpus=1 task runs on each reserved GPU (Ray's own GPU ids within the
    placement); gpusd ray down leaves no Ray process."""
    _need("ray")
    if _ray_pids():
        pytest.skip("Ray processes already run on this machine: the test would stop them")
    lan, fleet, h1, h2 = cluster
    pl = _placement(tmp_path, [("node-1", h1, [1, 3]), ("node-2", h2, [0, 2])], "ray-1")
    env = _env(fleet, h1)
    state = tmp_path / "state"
    base = ["--placement", str(pl), "--ray", f"{BIN}/ray", "--state-dir", str(state)]
    try:
        r = lan.run(h1, [sys.executable, "-m", "gpusd", "ray", "up", *base, "--",
                         "--object-store-memory=100000000"], env=env, timeout=180)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        address = r.stdout.strip().splitlines()[-1]
        assert address == f"{h1.ip}:6379"
        r = lan.run(h1, [sys.executable, "-c", RAY_PROBE, address], env=env, timeout=120)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        result = json.loads(r.stdout.split("RESULT ", 1)[1])
        assert result["total_gpus"] == 4.0
        reserved = {h1.ip: {"1", "3"}, h2.ip: {"0", "2"}}
        used = set()
        for task in result["tasks"]:
            assert len(task["gpu_ids"]) == 1 and task["gpu_ids"][0] in reserved[task["address"]], task
            assert task["cvd"] == task["gpu_ids"][0]
            used.add((task["address"], task["gpu_ids"][0]))
        assert used == {(a, g) for a, gs in reserved.items() for g in gs}  # one task on each reserved GPU
    finally:
        down = lan.run(h1, [sys.executable, "-m", "gpusd", "ray", "down", *base[2:]], env=env, timeout=120)
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    deadline = time.monotonic() + 20
    while _ray_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ray_pids() == []
    assert not (state / "ray-placement.json").exists()


def test_mpirun_runs_every_rank_on_its_host_and_gpu(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """gpusd launch mpirun: Open MPI (the distribution's) reads gpusd's hostfile, starts its daemons over
    the same ssh (GPUSD_SSH_CONFIG becomes plm_rsh_agent), and the per-rank wrapper gives each rank the
    placement's GPU on its host."""
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (Debian: apt-get install openmpi-bin)")
    lan, fleet, h1, h2 = cluster
    pl = _placement(tmp_path, [("node-1", h1, [1, 3]), ("node-2", h2, [2])], "mpi-1")
    env = _env(fleet, h1)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    probe = ('echo "RANK $OMPI_COMM_WORLD_RANK $OMPI_COMM_WORLD_LOCAL_RANK $CUDA_VISIBLE_DEVICES '
             '$(ip -4 -o addr show eth0 | awk \'{print $4}\')"')
    r = lan.run(h1, [sys.executable, "-m", "gpusd", "launch", "--placement", str(pl),
                     "--python", sys.executable, "--env", "PATH", "--env", "PYTHONPATH",
                     "--env", "OMPI_ALLOW_RUN_AS_ROOT", "--env", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
                     "--env", "OMPI_MCA_btl_tcp_if_include=eth0", "--env", "OMPI_MCA_oob_tcp_if_include=eth0",
                     "mpirun", "--", "sh", "-c", probe], env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = sorted(tuple(line.split("RANK ", 1)[1].split()) for line in r.stdout.splitlines() if "RANK " in line)
    assert ranks == [("0", "0", "1", f"{h1.ip}/16"), ("1", "1", "3", f"{h1.ip}/16"), ("2", "0", "2", f"{h2.ip}/16")]


def test_deepspeed_launcher_gives_each_node_the_included_gpus(cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """gpusd launch deepspeed: DeepSpeed's own launcher runs on each host (--no_ssh --node_rank=I) with
    the hostfile gpusd wrote there, and sets CUDA_VISIBLE_DEVICES per node from --include: the
    placement's GPUs.  (No GPU is used: the script only reports what it was given.)"""
    _need("deepspeed")
    lan, fleet, h1, h2 = cluster
    pl = _placement(tmp_path, [("node-1", h1, [0, 2]), ("node-2", h2, [3])], "ds-1")
    r = lan.run(h1, [sys.executable, "-m", "gpusd", "launch", "--placement", str(pl), "--env", "PATH",
                     "deepspeed", "--", str(SCRIPTS / "report_env.py")], env=_env(fleet, h1), timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = sorted((res["rank"], res["local_rank"], res["world"], res["address"], res["cuda_visible_devices"],
                  res["cuda_device_order"])
                 for res in (json.loads(line.split("RESULT ", 1)[1]) for line in r.stdout.splitlines()
                             if "RESULT " in line))
    assert got == [(0, 0, 3, h1.ip, "0,2", "PCI_BUS_ID"), (1, 1, 3, h1.ip, "0,2", "PCI_BUS_ID"),
                   (2, 0, 3, h2.ip, "3", "PCI_BUS_ID")]
