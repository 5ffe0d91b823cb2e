"""Topology as a user meets it: ``gpusd devices --topology`` in nvidia-smi's notation and
``gpusd env -n 2`` / ``select`` choosing NVLink pairs, on the fake NVML, in subprocesses."""

from __future__ import annotations

import json
import re

import pytest

from conftest import gpusd_cli
from fakenvml import make_gpus, nvlink_pairs


def _env(cli_env, tmp_path):
    return dict(cli_env, GPUSD_LEASE_SOCKET="off")


def test_devices_topology_is_nvidia_smi_topo_m(fake_nvml, cli_env):
    gpus = make_gpus(6)
    layout = [  # (numa node, host bridge, pcie switch, cpus)
        (0, 0, 0, "0"), (0, 0, 0, "0"), (0, 0, 1, "0"), (1, 1, 2, "1"), (1, 1, 2, "1"), (1, 2, 3, "0-1")]
    for g, (numa, bridge, switch, cpus) in zip(gpus, layout):
        g.numa_node, g.host_bridge, g.pcie_switch, g.cpu_affinity = numa, bridge, switch, cpus
    nvlink_pairs(gpus, [(0, 1)], links=4)
    # two switches below one bridge: PXB (PCIe is a tree: GPU 0, on GPU 1's switch, meets GPU 2 there too)
    gpus[0].topology = gpus[1].topology = {2: 20}
    fake_nvml.write(gpus)
    r = gpusd_cli(["devices", "--topology"], env=cli_env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["GPU0", "GPU1", "GPU2", "GPU3", "GPU4", "GPU5", "CPU", "Affinity", "NUMA",
                                "Affinity", "GPU", "NUMA", "ID"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:7]}
    assert rows["GPU0"] == ["X", "NV4", "PXB", "SYS", "SYS", "SYS", "0", "0", "N/A"]
    assert rows["GPU1"] == ["NV4", "X", "PXB", "SYS", "SYS", "SYS", "0", "0", "N/A"]
    assert rows["GPU3"] == ["SYS", "SYS", "SYS", "X", "PIX", "NODE", "1", "1", "N/A"]
    assert rows["GPU4"][5] == "NODE" and rows["GPU5"][6:8] == ["0-1", "1"]
    # the matrix is symmetric, as nvidia-smi's
    names = [f"GPU{i}" for i in range(6)]
    assert all(rows[a][j] == rows[b][i] for i, a in enumerate(names) for j, b in enumerate(names))
    legend = r.stdout[r.stdout.index("Legend:"):]
    for word in ("X    = Self", "SYS ", "NODE", "PHB ", "PXB ", "PIX ", "NV#  = Connection traversing a bonded set"):
        assert word in legend


def test_devices_topology_without_topology_says_na(fake_nvml, cli_env):
    fake_nvml.write(make_gpus(2))
    r = gpusd_cli(["devices", "--topology"], env=cli_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].split() == ["GPU0", "X", "N/A", "N/A", "N/A", "N/A"]


def _pairs(fake_nvml, utils):
    """Four GPUs, NVLink pairs (0,1) and (2,3), one NUMA node; utilisation per GPU."""
    gpus = make_gpus(4)
    for i, (g, u) in enumerate(zip(gpus, utils)):
        g.numa_node, g.pcie_switch, g.util_gpu = 0, i // 2, u
    nvlink_pairs(gpus, [(0, 1), (2, 3)], links=4)
    fake_nvml.write(gpus)


def _visible(r) -> str:
    assert r.returncode == 0, r.stderr
    m = re.search(r"CUDA_VISIBLE_DEVICES=(\S+)", r.stdout)
    assert m, r.stdout
    return m.group(1).strip("'")


def test_env_picks_the_idle_nvlink_pair_over_the_two_idlest_split_gpus(fake_nvml, cli_env, tmp_path):
    """The issue's "done when": the two idlest GPUs (0 and 2) sit in different pairs, but the pair
    (2, 3) is idle within the tolerance: that pair.  When GPU 3 is busy (60 %): the idle split GPUs.
    --topology nvlink never splits; --topology any is the load order."""
    env = _env(cli_env, tmp_path)
    _pairs(fake_nvml, [1, 30, 3, 5])
    assert _visible(gpusd_cli(["env", "-n", "2"], env=env)) == "2,3"
    assert _visible(gpusd_cli(["env", "-n", "2", "--topology", "any"], env=env)) == "0,2"
    _pairs(fake_nvml, [1, 30, 3, 60])
    assert _visible(gpusd_cli(["env", "-n", "2"], env=env)) == "0,2"
    assert _visible(gpusd_cli(["env", "-n", "2", "--topology", "nvlink"], env=env)) == "0,1"


@pytest.mark.parametrize("utils", [[1, 30, 3, 5], [1, 30, 3, 60], [0, 90, 0, 90], [50, 0, 0, 50], [0, 0, 0, 0]])
def test_topology_nvlink_never_splits_a_pair(fake_nvml, cli_env, tmp_path, utils):
    _pairs(fake_nvml, utils)
    chosen = _visible(gpusd_cli(["env", "-n", "2", "--topology", "nvlink"], env=_env(cli_env, tmp_path)))
    assert chosen in ("0,1", "2,3", "1,0", "3,2")


def test_topology_nvlink_refuses_when_no_pair_qualifies(fake_nvml, cli_env, tmp_path):
    _pairs(fake_nvml, [1, 30, 3, 60])
    r = gpusd_cli(["env", "-n", "2", "--topology", "nvlink", "--exclude", "1,3"], env=_env(cli_env, tmp_path))
    assert r.returncode == 4, r.stdout + r.stderr
    assert "nvlink" in r.stderr.lower() and "Traceback" not in r.stderr
    r = gpusd_cli(["env", "-n", "2", "--topology", "mesh"], env=_env(cli_env, tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_select_explains_its_pick(fake_nvml, cli_env, tmp_path):
    _pairs(fake_nvml, [1, 30, 3, 5])
    env = _env(cli_env, tmp_path)
    r = gpusd_cli(["select", "-n", "2", "--json"], env=env)
    assert r.returncode == 0, r.stderr
    why = json.loads(r.stdout)["explain"]
    assert why["chosen"] == ["2", "3"] and why["least_loaded"] == ["0", "2"] and why["topology"] == "auto"
    assert why["links"] == [{"a": "2", "b": "3", "link": "NV4"}]
    assert why["tolerance"] == {"utilization_points": 10.0, "memory_fraction": 0.1}
    r = gpusd_cli(["select", "-n", "2", "--explain"], env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "2,3" and "better connected" in out[1] and "2-3 NV4" in r.stdout
    assert "least-loaded set: 0, 2" in r.stdout


# -- gpusd run --bind-cpus ------------------------------------------------------------------------------
_SHOW = ("import re; print(re.search(r'Cpus_allowed_list:\\s*(\\S+)', open('/proc/self/status').read()).group(1))")


def _allowed() -> list[int]:
    import os

    return sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("lease", [True, False])
def test_run_bind_cpus_runs_the_command_on_the_gpus_local_cpus(fake_nvml, cli_env, tmp_path, lease):
    """GPU 0's local CPUs are one CPU this test may use (the last one); GPU 1's are every CPU: the
    command of ``run --bind-cpus --include 0`` runs on exactly that CPU, as the kernel says."""
    import sys

    mine = _allowed()
    if len(mine) < 2:
        pytest.skip("needs two usable CPUs to tell a binding from none")
    gpus = make_gpus(2)
    gpus[0].cpu_affinity, gpus[1].cpu_affinity = str(mine[-1]), f"0-{max(mine)}"
    fake_nvml.write(gpus)
    args = ["run", "-n", "1", "--include", "0", "--bind-cpus"] + ([] if lease else ["--no-lease"])
    r = gpusd_cli([*args, "--", sys.executable, "-c", _SHOW], env=_env(cli_env, tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == str(mine[-1])
    assert f"runs on CPUs {mine[-1]}" in r.stderr
    # without the flag the command keeps every CPU it may use
    r = gpusd_cli(["run", "-n", "1", "--include", "0", "--", sys.executable, "-c", _SHOW], env=_env(cli_env, tmp_path))
    assert r.returncode == 0, r.stderr
    from gpusd.topology import format_cpulist, parse_cpulist

    assert format_cpulist(parse_cpulist(r.stdout.split()[-1])) == format_cpulist(mine)


def test_run_bind_cpus_says_so_when_it_cannot_bind(fake_nvml, cli_env, tmp_path):
    import sys

    gpus = make_gpus(1)
    gpus[0].cpu_affinity = "1000"  # a CPU this machine does not have
    fake_nvml.write(gpus)
    r = gpusd_cli(["run", "--bind-cpus", "--", sys.executable, "-c", _SHOW], env=_env(cli_env, tmp_path))
    assert r.returncode == 0, r.stderr
    assert "not bound" in r.stderr and "1000" in r.stderr
    fake_nvml.write(make_gpus(1))  # no CPU affinity at all
    r = gpusd_cli(["run", "--bind-cpus", "--", sys.executable, "-c", _SHOW], env=_env(cli_env, tmp_path))
    assert r.returncode == 0 and "unknown" in r.stderr
