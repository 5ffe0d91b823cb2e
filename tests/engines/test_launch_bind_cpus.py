"""``gpusd launch --bind-cpus`` (issue 22, item 3; docs/engines.md "CPU binding"): a daemon on fake NVML
whose GPUs have different local CPUs (``cpu_affinity``), and ``gpusd launch -n ...`` from the same
namespace (its hosts are this machine: no ssh).  Each rank (mpirun: gpusd's per-rank wrapper) or each
host's command (a plain command: the per-host launcher, whose ranks inherit it) reads its
``Cpus_allowed_list`` from /proc/self/status: exactly the CPUs local to its GPUs.  Placement files
carry the claim too (``local_cpus``); a claim that is not a CPU list is refused.  Skipped without root
or ``ip netns`` (the daemon's mDNS stays in the namespace)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import tests_paths
from fakenvml import make_gpus
from lan_helpers import secret_file
from netns import Lan, lan, netns_ok  # noqa: F401

pytestmark = pytest.mark.timeout(240)
SRC = str(tests_paths.SRC)
PROBE = 'echo "GPU $CUDA_VISIBLE_DEVICES CPUS $(grep Cpus_allowed_list /proc/self/status | cut -f2)"'
ROOT_MPI = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _two_cpus() -> list[int]:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two usable CPUs to tell a binding from none")
    return mine[:2]


def _seen(out: str) -> dict[str, str]:
    """GPU (CUDA_VISIBLE_DEVICES) -> the CPUs its rank was allowed, from the probes' lines."""
    found = {}
    for line in out.splitlines():
        if "GPU " in line and " CPUS " in line:
            gpu, cpus = line.split("GPU ", 1)[1].split(" CPUS ")
            found[gpu.strip()] = cpus.strip()
    return found


@pytest.fixture
def host(lan: Lan, tmp_path: Path):  # type: ignore[no-untyped-def]  # noqa: F811
    """One daemon (named as this machine, so that mpirun runs its ranks here) with 2 fake GPUs: GPU 0
    local to the second CPU, GPU 1 to the first; and a client environment in its namespace."""
    a, b = _two_cpus()
    gpus = make_gpus(2)
    gpus[0].cpu_affinity, gpus[1].cpu_affinity = str(b), str(a)
    key = secret_file(tmp_path / "fleet.key", secrets.token_hex(32))
    h = lan.add_gpu_host(socket.gethostname(), gpus, fast=True, args=["--token-file", str(key)],
                         extra_env={"GPUSD_LEASE_SOCKET": str(lan.workdir / "h-lease.sock")})
    h.start()
    (tmp_path / "client-state").mkdir()
    env = lan.base_env(h.node, GPUSD_MDNS_FAST="1", GPUSD_STATE_DIR=str(tmp_path / "client-state"),
                       GPUSD_TOKEN_FILE=str(key), **ROOT_MPI)
    yield lan, h, env, {"0": str(b), "1": str(a)}


def test_mpirun_binds_each_rank_to_its_gpus_local_cpus(host) -> None:  # type: ignore[no-untyped-def]
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (Debian: apt-get install openmpi-bin)")
    lan, h, env, local = host
    r = lan.gpusd(h.node, ["launch", "-n", "2", "--bind-cpus", "--python", sys.executable, "mpirun", "--",
                           "sh", "-c", PROBE], env=env, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _seen(r.stdout) == local, r.stdout + r.stderr
    # what it did, per host and per rank
    assert f"each rank on the CPUs local to its GPU (GPU 0: {local['0']}, GPU 1: {local['1']})" in r.stderr
    assert r.stderr.count("--bind-cpus: rank ") == 2 and "bound to CPUs" in r.stderr
    # without the flag, Open MPI's own binding or none: never gpusd's
    r = lan.gpusd(h.node, ["launch", "-n", "2", "--python", sys.executable, "mpirun", "--", "sh", "-c", PROBE],
                  env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--bind-cpus" not in r.stderr


def test_a_per_host_command_is_bound_to_its_gpus_local_cpus(host) -> None:  # type: ignore[no-untyped-def]
    lan, h, env, local = host
    for gpu in ("0", "1"):  # -n 1 --include: each GPU in turn
        r = lan.gpusd(h.node, ["launch", "-n", "1", "--include", gpu, "--bind-cpus", "command", "--",
                               "sh", "-c", PROBE], env=env, timeout=120)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert _seen(r.stdout) == {gpu: local[gpu]}, r.stdout + r.stderr
        assert f"command and its ranks on CPUs {local[gpu]} (local to GPU(s) {gpu})" in r.stderr
    r = lan.gpusd(h.node, ["launch", "-n", "2", "--bind-cpus", "command", "--", "sh", "-c", PROBE],
                  env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    from gpusd.topology import format_cpulist

    assert _seen(r.stdout) == {"0,1": format_cpulist(int(c) for c in local.values())}, r.stdout  # the union


def _placement(tmp_path: Path, local_cpus: object) -> Path:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"job_id": "bind-1", "hosts": [
        {"hostname": "a", "address": "127.0.0.1", "gpus": [1], "local_cpus": local_cpus}]}))
    return path


def test_a_placement_files_claim_is_bound_within_the_cpus_allowed_and_a_bad_one_refused(tmp_path: Path) -> None:
    a, b = _two_cpus()
    env = {**os.environ, "PYTHONPATH": SRC}
    argv = [sys.executable, "-m", "gpusd", "launch", "--grace", "2", "--bind-cpus", "command", "--", "sh", "-c",
            PROBE]
    r = subprocess.run(argv[:4] + ["--placement", str(_placement(tmp_path, [str(b)]))] + argv[4:],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _seen(r.stdout) == {"1": str(b)}
    # a claim naming CPUs this command may not use: only those it may; none at all: not bound, said so
    r = subprocess.run(["taskset", "-c", str(a), *argv[:4], "--placement",
                        str(_placement(tmp_path, [f"{a},{b}"])), *argv[4:]],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _seen(r.stdout) == {"1": str(a)}
    r = subprocess.run(["taskset", "-c", str(a), *argv[:4], "--placement", str(_placement(tmp_path, [str(b)])),
                        *argv[4:]], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _seen(r.stdout) == {"1": str(a)} and "may be used here" in r.stderr and "not bound" in r.stderr
    for bad in (["0-99999999"], ["1; reboot"], ["0", "1"], "0"):
        r = subprocess.run(argv[:4] + ["--placement", str(_placement(tmp_path, bad))] + argv[4:],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode != 0 and "Traceback" not in r.stderr and "gpusd" in r.stderr, (bad, r.stderr)


def test_a_hosts_claim_that_is_not_a_cpu_list_is_unknown_in_the_placement() -> None:
    """A lease answer's ``local_cpus`` comes from the network: what does not parse becomes unknown (not
    bound), never a placement error nor a word on the host's command line."""
    from gpusd.pool.client import HostLease, Reservation

    devices = [{"index": 0, "uuid": "GPU-a", "local_cpus": "0-3"},
               {"index": 1, "uuid": "GPU-b", "local_cpus": "1; reboot"},
               {"index": 2, "uuid": "GPU-c", "local_cpus": ["0"]}, {"index": 3, "uuid": "GPU-d"}]
    lease = HostLease("0123456789ab", "node-1", "n1", "http://198.18.0.2:4780", None, devices, {}, 30.0, 0.0,
                      ["198.18.0.2"])
    slot = Reservation([lease], None).to_placement("job-1").head  # type: ignore[arg-type]
    assert slot.local_cpus == ("0-3", None, None, None)


def test_the_rank_wrapper_refuses_a_cpu_map_that_does_not_match_the_gpu_map() -> None:
    env = {**os.environ, "PYTHONPATH": SRC, "GPUSD_RANK_GPUS": "h=0,1", "GPUSD_RANK_CPUS": "h=0",
           "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    r = subprocess.run([sys.executable, "-m", "gpusd.engines.rank_gpu", "--", "true"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2 and "does not match" in r.stderr
    r = subprocess.run([sys.executable, "-m", "gpusd.engines.rank_gpu", "--", "sh", "-c", PROBE],
                       capture_output=True, text=True, env={**env, "GPUSD_RANK_CPUS": "h=?/0"}, timeout=60)
    assert r.returncode == 0 and _seen(r.stdout) == {"1": "0"} and "bound to CPUs 0" in r.stderr


def test_torchruns_ranks_inherit_the_binding_of_their_hosts_launcher(tmp_path: Path) -> None:
    """torchrun starts its ranks itself: gpusd binds the host's torchrun, and each rank it starts runs
    on exactly those CPUs (the GPUs' local CPUs here: one CPU for both)."""
    if shutil.which("torchrun") is None or subprocess.run([sys.executable, "-c", "import torch"]).returncode:
        pytest.skip("torch (torchrun) is not installed")
    _, b = _two_cpus()
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"job_id": "bind-2", "hosts": [
        {"hostname": "a", "address": "127.0.0.1", "gpus": [0, 1], "local_cpus": [str(b), str(b)]}]}))
    r = subprocess.run([sys.executable, "-m", "gpusd", "launch", "--placement", str(path), "--grace", "2",
                        "--bind-cpus", "torchrun", "--", "--no-python", "sh", "-c",
                        'echo "RANK $LOCAL_RANK CPUS $(grep Cpus_allowed_list /proc/self/status | cut -f2)"'],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = sorted(line.split("RANK ", 1)[1] for line in r.stdout.splitlines() if "RANK " in line)
    assert ranks == [f"0 CPUS {b}", f"1 CPUS {b}"], r.stdout
    assert f"torchrun and what it starts: bound to CPUs {b}" in r.stderr
