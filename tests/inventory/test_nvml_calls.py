"""How many NVML calls each path makes, counted by the fake NVML (deterministic: no timing).

On a driver a call costs tens of microseconds and a topology query or process list far more
(tests/fakenvml/README.md, "Cost and counting"), so the number of calls is what a pick costs there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fakenvml import COUNTS_ENV, FakeNvml, call_counts, make_gpus

GiB = 2**30

# What one pick may ask the driver per GPU, once the process knows its GPUs: the memory, the
# utilisation samples, the compute and the graphics processes.
PICK_CALLS_PER_GPU = 4


def _counting(fake: FakeNvml, tmp_path: Path) -> tuple[dict[str, str], Path]:
    counts = tmp_path / "nvml-counts"
    counts.mkdir()
    env = fake.env()
    env[COUNTS_ENV] = str(counts)
    return env, counts


def test_the_fake_counts_each_call_per_process(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    fake_nvml.write(make_gpus(3))
    env, counts = _counting(fake_nvml, tmp_path)
    code = ("import ctypes; lib = ctypes.CDLL('libnvidia-ml.so.1'); n = ctypes.c_uint()\n"
            "assert lib.nvmlInit_v2() == 0\n"
            "for _ in range({k}): assert lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) == 0\n"
            "import os; print(os.getpid())")
    pids = [int(subprocess.run([sys.executable, "-c", code.format(k=k)], env=env, capture_output=True, text=True,
                               check=True, timeout=60).stdout) for k in (5, 2)]
    assert call_counts(counts, pids[0]) == {"nvmlInitWithFlags": 1, "nvmlDeviceGetCount_v2": 5}
    assert call_counts(counts, pids[1]) == {"nvmlInitWithFlags": 1, "nvmlDeviceGetCount_v2": 2}
    assert call_counts(counts)["nvmlDeviceGetCount_v2"] == 7


@pytest.mark.parametrize("n", [8, 16])
def test_a_pick_asks_the_driver_at_most_four_calls_per_gpu(fake_nvml_inprocess: FakeNvml, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """``gpusd.select()`` in a process that picked before: the static facts are known, and a pick asks
    only what changes by itself; what it weighs is still read (a new process on a GPU is seen)."""
    import gpusd
    from fakenvml import FakeProcess

    gpus = make_gpus(n, memory_used=GiB)
    for g in gpus[::2]:  # a process list with entries is read in one call too
        g.processes = [FakeProcess(4242, GiB), FakeProcess(4243, GiB)]
    fake_nvml_inprocess.write(gpus)
    counts = tmp_path / "counts"
    counts.mkdir()
    monkeypatch.setenv(COUNTS_ENV, str(counts))
    gpusd.select().release()  # the first pick reads the GPUs' static facts
    before = call_counts(counts)
    for _ in range(3):
        gpusd.select().release()
    after = call_counts(counts)
    made = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    assert sum(made.values()) <= 3 * PICK_CALLS_PER_GPU * n, made
    assert made["nvmlDeviceGetMemoryInfo"] == 3 * n
    # the process lists of the GPUs it is about to choose only: GPU 0's (busy: passed over) and GPU 1's
    assert sum(v for k, v in made.items() if "RunningProcesses" in k) == 3 * 2 * 2, made
    # what the pick weighs is read at every pick: a process that starts on GPU 0 moves the pick
    first = gpusd.select()
    first.release()
    gpus[first.indices[0]].processes = [FakeProcess(os.getpid(), 60 * GiB)]
    gpus[first.indices[0]].memory_used = 70 * GiB
    fake_nvml_inprocess.write(gpus)
    again = gpusd.select()
    again.release()
    assert again.indices != first.indices


def _dgx_like(n: int) -> list:
    """``n`` GPUs on two NUMA nodes, four to a host bridge, two to a PCIe switch, NVLink-bridged in pairs."""
    from fakenvml import nvlink_pairs

    gpus = make_gpus(n, memory_used=GiB)
    for i, g in enumerate(gpus):
        g.numa_node, g.host_bridge, g.pcie_switch = i * 2 // n, i // 4, i // 2
    nvlink_pairs(gpus, [(i, i + 1) for i in range(0, n, 2)], links=4)
    return gpus


def _devices_json(fake: FakeNvml, tmp_path: Path, n: int) -> tuple[bytes, int]:
    """What ``gpusd devices --json`` prints at ``n`` GPUs, and the NVML calls it made."""
    fake.write(_dgx_like(n))
    env, counts = _counting(fake, tmp_path / str(n))
    proc = subprocess.Popen([sys.executable, "-m", "gpusd", "devices", "--json"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out, sum(call_counts(counts, proc.pid).values())


def test_devices_json_grows_linearly_with_the_gpus(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    """64 GPUs print at most 10x what 8 print, with at most 10x the NVML calls (a link per GPU pair
    grew both with the square)."""
    (tmp_path / "8").mkdir()
    (tmp_path / "64").mkdir()
    small, small_calls = _devices_json(fake_nvml, tmp_path, 8)
    large, large_calls = _devices_json(fake_nvml, tmp_path, 64)
    assert len(large) <= 10 * len(small), (len(small), len(large))
    assert large_calls <= 10 * small_calls, (small_calls, large_calls)


def test_the_topology_that_travels_says_what_the_pairs_said(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    """``devices --json`` read back: every pair's NVLinks and PCIe level as NVML gives them pair by pair."""
    import ctypes
    import json

    from gpusd.model import GpuInfo
    from gpusd.topology import link_between

    (tmp_path / "8").mkdir()
    out, _ = _devices_json(fake_nvml, tmp_path, 8)
    gpus = [GpuInfo.from_dict(g) for g in json.loads(out)["gpus"]]
    assert all(not g.links and g.topology is not None for g in gpus)
    lib = ctypes.CDLL(str(fake_nvml.lib_path))
    env = {"GPUSD_FAKE_NVML_STATE": str(fake_nvml.state_path)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert lib.nvmlInit_v2() == 0
        handles = []
        for i in range(8):
            h = ctypes.c_void_p()
            assert lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) == 0
            handles.append(h)
        for a in gpus:
            for b in gpus:
                if a.index == b.index:
                    continue
                level = ctypes.c_int()
                assert lib.nvmlDeviceGetTopologyCommonAncestor(handles[a.index], handles[b.index],
                                                               ctypes.byref(level)) == 0
                link = link_between(a, b)
                assert link is not None and link.level == level.value, (a.index, b.index)
                assert link.nvlink == (4 if a.index // 2 == b.index // 2 else 0), (a.index, b.index)
        lib.nvmlShutdown()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cli(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "gpusd", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


@pytest.mark.parametrize("command", [["select"], ["env"], ["select", "-n", "2"]])
def test_a_one_shot_pick_reads_each_static_fact_once(fake_nvml: FakeNvml, tmp_path: Path,
                                                     command: list[str]) -> None:
    """Without a daemon, a one-shot pick reads what it weighs once, and each static fact once; how
    the GPUs connect only where it chooses several (one GPU has no pair to weigh)."""
    n = 8
    fake_nvml.write(_dgx_like(n))
    env, counts = _counting(fake_nvml, tmp_path)
    r, pid = _cli(env, *command)
    assert r.returncode == 0, r.stderr
    made = call_counts(counts, pid)
    topology = {k: v for k, v in made.items() if "Topology" in k or "NvLink" in k or "P2P" in k}
    assert sum(made.values()) - sum(topology.values()) <= 15 * n, made
    if "-n" not in command:
        assert topology == {}, topology
        return
    # the topology: per GPU, each of its NVLinks' state and remote end (18 on H100), and its PCIe groups
    assert made["nvmlDeviceGetNvLinkState"] <= 18 * n and made["nvmlDeviceGetNvLinkRemotePciInfo_v2"] <= 18 * n
    assert made["nvmlDeviceGetTopologyNearestGpus"] <= 2 * 5 * n, made
    for static in ("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetUUID", "nvmlDeviceGetName",
                   "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetCpuAffinity"):
        assert made[static] == n, static
    assert "nvmlDeviceGetTopologyCommonAncestor" not in made  # a call per pair of GPUs


def test_a_one_shot_pick_beside_a_daemon_asks_the_driver_nothing(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    """Where a daemon runs, ``gpusd select`` takes its recent samples: no NVML call in the client."""
    from daemon_helpers import unique_session
    from netns import read_lines

    fake_nvml.write(_dgx_like(8))
    env, counts = _counting(fake_nvml, tmp_path)
    env.update(GPUSD_STATE_DIR=str(tmp_path / "daemon-state"), GPUSD_INTERFACES="127.0.0.1",
               GPUSD_MDNS_FAST="1", GPUSD_HOSTNAME="calls-host")
    r, w = os.pipe()
    with open(tmp_path / "log", "wb") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "gpusd", "start", "--foreground", "--port", "0",
                                   "--session", unique_session("calls"), "--interval", "0.2",
                                   "--ready-fd", str(w)], env=env, pass_fds=(w,), stdout=subprocess.DEVNULL,
                                  stderr=log)
    os.close(w)
    try:
        assert read_lines(r, 1, 60), (tmp_path / "log").read_text()
        client_env = dict(env, GPUSD_STATE_DIR=str(tmp_path / "client-state"))
        got, pid = _cli(client_env, "select")
        assert got.returncode == 0, got.stderr
        assert call_counts(counts, pid) == {}
        assert sum(call_counts(counts, daemon.pid).values()) > 0  # the daemon read the GPUs
    finally:
        os.close(r)
        daemon.terminate()
        daemon.wait(15)
