"""Every vendor in one fleet: the vendor in the model and on the wire, the visibility
variables per vendor (docs/inventory.md "Vendors"), ``--vendor``, mixed simulated hosts, and what
``gpusd launch``/``ray up`` give an AMD host, checked with Ray's own accelerator code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tests_paths
from conftest import gpusd_cli
from gpusd.engines.generate import plain_commands, ray_commands
from gpusd.engines.placement import Placement, PlacementError
from gpusd.inventory.simulated import SimulatedBackend
from gpusd.inventory.vendors import Visible, job_environ, rank_entry, rank_entry_env, visible_env
from gpusd.model import GpuInfo, HostSnapshot

MIXED = "2xA100-80GB,2xMI300X,1xMAX1550"
GiB = 1024**3


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tests_paths.SRC), **extra}


def test_a_mixed_simulated_host_lists_every_vendor_with_its_own_numbers() -> None:
    snap = SimulatedBackend(MIXED).snapshot()
    assert [g.vendor for g in snap.gpus] == ["nvidia", "nvidia", "amd", "amd", "intel"]
    assert [g.index for g in snap.gpus] == [0, 1, 2, 3, 4]  # unique on the host
    assert [g.device_index for g in snap.gpus] == [0, 1, 0, 1, 0]  # what each runtime counts
    mi300 = snap.gpus[2]
    assert mi300.name == "AMD Instinct MI300X" and mi300.memory_total == 192 * GiB
    assert (mi300.compute_partition, mi300.memory_partition) == ("SPX", "NPS1")
    assert mi300.uuid.startswith("GPU-") and len(mi300.uuid) == 20  # ROCm's form: GPU-<16 hex digits>
    pvc = snap.gpus[4]
    assert pvc.memory_total == 128 * GiB and pvc.subdevices == 2
    assert SimulatedBackend("2xMI250X").snapshot().gpus[0].memory_total == 64 * GiB  # one GCD


def test_the_cli_lists_both_vendors_of_a_mixed_host() -> None:
    r = gpusd_cli(["devices", "--json", "--simulate", "2xA100-80GB,2xMI300X"], env=_env())
    assert r.returncode == 0, r.stderr
    gpus = json.loads(r.stdout)["gpus"]
    assert [(g["vendor"], g["memory_total"] // GiB) for g in gpus] == [
        ("nvidia", 80), ("nvidia", 80), ("amd", 192), ("amd", 192)]
    table = gpusd_cli(["devices", "--simulate", "2xA100-80GB,2xMI300X"], env=_env()).stdout
    assert "MI300X [amd]" in table and "A100-SXM4-80GB  " in table


def test_old_wire_data_without_a_vendor_decodes_as_nvidia() -> None:
    old = {"hostname": "h", "node_id": "n", "timestamp": 1.0, "gpus": [{"index": 0, "uuid": "GPU-1"}]}
    snap = HostSnapshot.from_dict(old)
    assert snap.gpus[0].vendor == "nvidia" and snap.gpus[0].device_index == 0
    new = SimulatedBackend("1xMI300X").snapshot()
    assert HostSnapshot.from_json(new.to_json()).gpus[0].vendor == "amd"


def test_each_vendor_gets_its_own_variables_and_never_cuda_visible_devices_for_amd_or_intel() -> None:
    assert visible_env([Visible("nvidia", 1), Visible("nvidia", 3)]) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1,3"}
    amd = visible_env([Visible("amd", 1, "GPU-0123456789abcdef")])
    assert amd == {"ROCR_VISIBLE_DEVICES": "GPU-0123456789abcdef"}
    intel = visible_env([Visible("intel", 2)])
    assert intel["ZE_AFFINITY_MASK"] == "2" and intel["ZE_FLAT_DEVICE_HIERARCHY"] == "COMPOSITE"
    assert intel["ONEAPI_DEVICE_SELECTOR"] == "level_zero:*"  # never an index the mask renumbered
    assert "CUDA_VISIBLE_DEVICES" not in amd and "CUDA_VISIBLE_DEVICES" not in intel
    # an inherited HIP_VISIBLE_DEVICES (or CUDA_...) would count again after ROCR's mask: removed
    env = job_environ({"HIP_VISIBLE_DEVICES": "3", "CUDA_VISIBLE_DEVICES": "3", "PATH": "/bin"},
                      [Visible("amd", 0, "GPU-0123456789abcdef")])
    assert env == {"ROCR_VISIBLE_DEVICES": "GPU-0123456789abcdef", "PATH": "/bin"}


def test_vendor_amd_picks_an_amd_gpu_and_run_sets_rocr_only() -> None:
    r = gpusd_cli(["run", "-n", "1", "--vendor", "amd", "--simulate", "2xA100-80GB,2xMI300X", "--", "env"],
                  env=_env(HIP_VISIBLE_DEVICES="1"))
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    amd = [g for g in SimulatedBackend("2xA100-80GB,2xMI300X").snapshot().gpus if g.vendor == "amd"]
    assert env["ROCR_VISIBLE_DEVICES"] in {g.uuid for g in amd}
    assert "CUDA_VISIBLE_DEVICES" not in env and "HIP_VISIBLE_DEVICES" not in env


def test_vendor_intel_env_and_a_vendor_that_is_not_there() -> None:
    r = gpusd_cli(["env", "-n", "1", "--vendor", "intel", "--simulate", MIXED], env=_env())
    assert r.returncode == 0, r.stderr
    assert "export ZE_AFFINITY_MASK=0" in r.stdout and "CUDA_VISIBLE_DEVICES" not in r.stdout
    r = gpusd_cli(["select", "--vendor", "amd", "--simulate", "2xA100-80GB"], env=_env())
    assert r.returncode != 0 and "not amd (--vendor)" in r.stderr
    r = gpusd_cli(["select", "--vendor", "matrox", "--simulate", "2xA100-80GB"], env=_env())
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_select_apply_and_set_cuda_visible_devices_follow_the_vendor(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpusd

    monkeypatch.setenv("GPUSD_SIMULATE", "1xA100-80GB,1xMI300X")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    with gpusd.select(1, vendor="amd") as sel:
        sel.apply()
        assert os.environ["ROCR_VISIBLE_DEVICES"] == sel.gpus[0].uuid
        assert "HIP_VISIBLE_DEVICES" not in os.environ and "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES")
    gpusd.set_cuda_visible_devices([1])  # gpusd's index 1 is the MI300X
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and os.environ["ROCR_VISIBLE_DEVICES"].startswith("GPU-")
    gpusd.set_cuda_visible_devices([0])  # the A100
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_gpu_optimizer_sets_the_vendors_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_optimizer import GpuOptimizer

    assert GpuOptimizer(simulate="1xMAX1550").set_visible(1) == [0]  # the simulation given, not in the env
    assert os.environ["ZE_AFFINITY_MASK"] == "0" and "CUDA_VISIBLE_DEVICES" not in os.environ


AMD_PLACEMENT = {"job_id": "amd-1", "hosts": [
    {"hostname": "mi300-a", "address": "127.0.0.1", "gpus": [0, 2], "vendor": "amd",
     "uuids": ["GPU-00000000000000a0", "GPU-00000000000000a2"]}]}


def test_a_placement_carries_the_vendor_and_launch_sets_rocr() -> None:
    p = Placement.from_dict(AMD_PLACEMENT)
    assert Placement.from_dict(p.to_dict()).head.vendor == "amd"
    (cmd,) = plain_commands(p, ["env"])
    assert cmd.env["ROCR_VISIBLE_DEVICES"] == "GPU-00000000000000a0,GPU-00000000000000a2"
    assert "CUDA_VISIBLE_DEVICES" not in cmd.env and "HIP_VISIBLE_DEVICES" in cmd.unset
    with pytest.raises(PlacementError, match="vendor"):
        Placement.from_dict({"hosts": [{"hostname": "x", "gpus": [0], "vendor": "3dfx"}]})


def test_gpusd_launch_on_an_amd_host_runs_with_rocr(tmp_path) -> None:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(AMD_PLACEMENT))
    r = subprocess.run([sys.executable, "-m", "gpusd", "launch", "--placement", str(path), "--grace", "2",
                        "command", "--", "sh", "-c", 'echo "R=$ROCR_VISIBLE_DEVICES H=${HIP_VISIBLE_DEVICES-unset} '
                        'C=${CUDA_VISIBLE_DEVICES-unset}"'],
                       capture_output=True, text=True, env=_env(HIP_VISIBLE_DEVICES="1"), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[mi300-a#0] R=GPU-00000000000000a0,GPU-00000000000000a2 H=unset C=unset"


RAY_CHECK = """
import json, os, sys
env = json.loads(sys.argv[1])
for name in env.pop("__unset__"):
    os.environ.pop(name, None)
os.environ.update(env)
from ray._private.accelerators.amd_gpu import AMDGPUAcceleratorManager as M
print(M.get_visible_accelerator_ids_env_var(), ",".join(M.get_current_process_visible_accelerator_ids()))
"""


def _ray_sees(env: dict[str, str], unset: tuple[str, ...],
              inherited: dict[str, str]) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("ray._private.accelerators.amd_gpu", reason="ray is not installed")
    return subprocess.run([sys.executable, "-c", RAY_CHECK, json.dumps({**env, "__unset__": list(unset)})],
                          capture_output=True, text=True, env=_env(**inherited), timeout=120)


def test_ray_up_on_an_amd_host_sets_what_rays_own_accelerator_code_reads() -> None:
    (cmd,) = ray_commands(Placement.from_dict(AMD_PLACEMENT))
    assert "--num-gpus=2" in cmd.argv
    assert cmd.env == {"HIP_VISIBLE_DEVICES": "0,2"} and "ROCR_VISIBLE_DEVICES" in cmd.unset
    # a shell of that host where ROCR_VISIBLE_DEVICES is set (as gpusd run would set it)
    inherited = {"ROCR_VISIBLE_DEVICES": "GPU-00000000000000a0"}
    r = _ray_sees(cmd.env, cmd.unset, inherited)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["HIP_VISIBLE_DEVICES", "0,2"]
    # what the unset prevents: Ray refuses to start beside ROCR_VISIBLE_DEVICES
    r = _ray_sees({}, (), inherited)
    assert r.returncode != 0 and "ROCR_VISIBLE_DEVICES" in r.stderr


def test_ray_up_on_an_intel_host_sets_the_affinity_mask_ray_reads() -> None:
    pytest.importorskip("ray._private.accelerators.intel_gpu", reason="ray is not installed")
    p = Placement.from_dict({"hosts": [{"hostname": "pvc", "gpus": [1], "vendor": "intel"}]})
    (cmd,) = ray_commands(p)
    code = ("import os, json, sys; os.environ.update(json.loads(sys.argv[1])); "
            "from ray._private.accelerators.intel_gpu import IntelGPUAcceleratorManager as M; "
            "print(M.get_visible_accelerator_ids_env_var(), M.get_current_process_visible_accelerator_ids())")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(cmd.env)], capture_output=True, text=True,
                       env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split(None, 1) == ["ZE_AFFINITY_MASK", "['1']\n"]
    assert "ONEAPI_DEVICE_SELECTOR" in cmd.unset


def test_is_free_and_ranking_are_the_same_for_every_vendor() -> None:
    from gpusd.alloc.select import Constraints, choose

    def gpu(i: int, vendor: str, util: float) -> GpuInfo:
        return GpuInfo(index=i, uuid=f"GPU-{i}", vendor=vendor, memory_total=GiB, memory_used=0, memory_free=GiB,
                       utilization_gpu=util)

    snap = HostSnapshot("h", "n", 0.0, [gpu(0, "nvidia", 50), gpu(1, "amd", 1), gpu(2, "intel", 20)])
    assert [g.is_free for g in snap.gpus] == [False, True, False]
    # one job may mix vendors only when it asks (by default a job gets GPUs of one vendor)
    assert [c.gpu.vendor for c in choose(snap, Constraints.build(count=3, vendor="any"))] == ["amd", "intel", "nvidia"]


def test_metrics_carry_amd_exporter_names_for_amd_gpus_and_dcgm_names_for_nvidia_only() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from gpusd.daemon.metrics import render_snapshots

    snap = SimulatedBackend("1xA100-80GB,1xMI300X", host="mixed-1").snapshot()
    text = render_snapshots([snap], dcgm=True).decode()
    series = [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]
    amd = snap.gpus[1]
    gfx = [(labels, v) for name, labels, v in series if name == "gpu_gfx_activity"]
    assert len(gfx) == 1 and gfx[0][1] == amd.utilization_gpu
    labels = gfx[0][0]
    assert (labels["gpu_id"], labels["gpu_uuid"], labels["hostname"], labels["card_model"]) == (
        "0", amd.uuid, "mixed-1", "102-G30211-00")  # the board's part number, which AMD's dashboards match
    assert labels["gpu_compute_partition_type"] == "spx" and labels["gpu_memory_partition_type"] == "nps1"
    # an MI300X has no edge sensor: its hotspot is gpu_junction_temperature, and no gpu_edge_temperature
    assert [v for name, _, v in series if name == "gpu_junction_temperature"] == [amd.temperature]
    assert not [v for name, _, v in series if name == "gpu_edge_temperature"]
    assert [v for name, _, v in series if name == "gpu_health"] == [1.0]
    vram = [v for name, _, v in series if name == "gpu_total_vram"]
    assert vram == [192 * 1024]  # MB, as the exporter counts
    dcgm = [labels["UUID"] for name, labels, _ in series if name == "DCGM_FI_DEV_GPU_UTIL"]
    assert dcgm == [snap.gpus[0].uuid]  # the NVIDIA GPU only
    info = {labels["uuid"]: labels["vendor"] for name, labels, _ in series if name == "gpusd_gpu_info"}
    assert info == {snap.gpus[0].uuid: "nvidia", amd.uuid: "amd"}
    nvidia_only = render_snapshots([SimulatedBackend("1xA100-80GB").snapshot()], dcgm=True).decode()
    assert "gpu_gfx_activity" not in nvidia_only


def test_mpi_ranks_on_an_amd_host_get_rocr_from_the_rank_wrapper() -> None:
    from gpusd.engines.generate import rank_gpus

    p = Placement.from_dict({"hosts": [{"hostname": "a100", "gpus": [3]}, AMD_PLACEMENT["hosts"][0]]})
    text = rank_gpus(p)
    assert text == "a100=3;mi300-a=amd:GPU-00000000000000a0,amd:GPU-00000000000000a2"
    code = 'import os; print(os.environ.get("ROCR_VISIBLE_DEVICES"), os.environ.get("HIP_VISIBLE_DEVICES", "-"))'
    r = subprocess.run([sys.executable, "-m", "gpusd.engines.rank_gpu", "--", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=60,
                       env=_env(GPUSD_RANK_GPUS=text, OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_LOCAL_RANK="1",
                                HIP_VISIBLE_DEVICES="0"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["GPU-00000000000000a2", "-"]


def test_a_reservation_on_an_amd_host_becomes_an_amd_placement() -> None:
    from gpusd.pool.client import HostLease, Reservation

    devices = [{"index": 2, "uuid": "GPU-00000000000000a0", "vendor": "amd", "vendor_index": 0}]
    lease = HostLease("0123456789abcdef", "mi300-a", "node", "https://x", None, devices, {}, 60.0, 0.0,
                      ["198.18.0.5"])
    slot = Reservation([lease], key=None).to_placement().head  # type: ignore[arg-type]
    assert (slot.vendor, slot.gpus, slot.address) == ("amd", (0,), "198.18.0.5")
    assert slot.visible_env() == {"ROCR_VISIBLE_DEVICES": "GPU-00000000000000a0"}
    old = [{"index": 1, "uuid": "GPU-1"}]  # a 0.2 daemon's answer: NVIDIA, by index
    lease = HostLease("0123456789abcdef", "n", "node", "https://x", None, old, {}, 60.0, 0.0, [])
    assert Reservation([lease], key=None).to_placement().head.cuda_env()["CUDA_VISIBLE_DEVICES"] == "1"  # type: ignore[arg-type]


def test_a_hostile_vendor_from_the_network_is_shown_sanitised_and_never_placed() -> None:
    from gpusd.cli.table import gpu_rows

    snap = HostSnapshot.from_dict({"hostname": "h", "node_id": "n", "timestamp": 1.0, "gpus": [
        {"index": 0, "uuid": "GPU-1", "name": "X", "vendor": "\x1b]0;owned\x07amd"}]})
    cell = gpu_rows(snap)[0][1]
    assert "\x1b" not in cell and "\x07" not in cell
    with pytest.raises(PlacementError):
        Placement.from_dict({"hosts": [{"hostname": "h", "gpus": [0], "vendor": snap.gpus[0].vendor}]})


def test_the_lease_protocol_carries_the_vendor_and_refuses_an_unknown_one() -> None:
    from gpusd.alloc.authority import request
    from gpusd.alloc.select import Constraints
    from gpusd.daemon.leasereq import request as parse_request
    from gpusd.errors import ConfigError

    line = json.dumps({**request(Constraints.build(vendor="amd")), "wait": False, "timeout": None}).encode()
    kwargs = parse_request(line)
    assert kwargs["vendor"] == "amd"
    for k in ("wait", "timeout", "command", "visible"):
        kwargs.pop(k)
    assert Constraints.build(**kwargs).vendor == "amd"
    assert "vendor" not in request(Constraints.build())  # an older daemon sees the request it knows
    bad = parse_request(line.replace(b'"amd"', b'"3dfx"'))
    with pytest.raises(ConfigError, match="--vendor"):
        Constraints.build(**{k: v for k, v in bad.items() if k not in ("wait", "timeout", "command", "visible")})


def test_a_job_on_an_amd_gpu_gets_rocr_and_its_job_file_says_so(tmp_path) -> None:
    code = ("import json, os; d = json.load(open(os.environ['GPUSD_JOB_FILE'])); "
            "print(os.environ.get('ROCR_VISIBLE_DEVICES'), os.environ.get('CUDA_VISIBLE_DEVICES', '-'), "
            "d['cuda_visible_devices'], d['env'].get('ROCR_VISIBLE_DEVICES'))")
    r = gpusd_cli(["run", "-n", "1", "--vendor", "amd", "--simulate", "1xA100-80GB,1xMI300X", "--",
                   sys.executable, "-c", code], env=_env())
    assert r.returncode == 0, r.stderr
    uuid = SimulatedBackend("1xA100-80GB,1xMI300X").snapshot().gpus[1].uuid
    assert r.stdout.split() == [uuid, "-", uuid, uuid]


def test_gpusd_ray_up_on_an_amd_host_starts_ray_with_what_rays_amd_code_reads(tmp_path) -> None:
    pytest.importorskip("ray._private.accelerators.amd_gpu", reason="ray is not installed")
    out = tmp_path / "seen.txt"
    fake_ray = tmp_path / "ray"  # stands in for `ray start`: asks Ray's own AMD code what it sees
    fake_ray.write_text(f"#!{sys.executable}\n" + f"""
import os, sys
from ray._private.accelerators.amd_gpu import AMDGPUAcceleratorManager as M
try:
    seen = M.get_visible_accelerator_ids_env_var() + " " + ",".join(M.get_current_process_visible_accelerator_ids())
except RuntimeError as exc:
    seen = "refused: " + str(exc)
rocr = "ROCR=" + os.environ.get("ROCR_VISIBLE_DEVICES", "unset")  # would mask before HIP's indices count
open({str(out)!r}, "w").write(seen + " " + rocr + " " + " ".join(a for a in sys.argv[1:] if a.startswith("--num")))
""")
    fake_ray.chmod(0o755)
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(AMD_PLACEMENT))
    r = subprocess.run([sys.executable, "-m", "gpusd", "ray", "up", "--placement", str(path), "--ray", str(fake_ray),
                        "--state-dir", str(tmp_path / "state")],
                       capture_output=True, text=True, timeout=120,
                       env=_env(ROCR_VISIBLE_DEVICES="GPU-00000000000000a0"))  # as inside `gpusd run` on AMD
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "HIP_VISIBLE_DEVICES 0,2 ROCR=unset --num-gpus=2"


@pytest.mark.parametrize("vendor, device, entry, variables, inherited", [
    ("nvidia", "3", "3", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3"}, set()),
    ("nvidia", "MIG-1234-abcd", "MIG-1234-abcd",
     {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "MIG-1234-abcd"}, set()),
    ("amd", "GPU-00000000000000a2", "amd:GPU-00000000000000a2", {"ROCR_VISIBLE_DEVICES": "GPU-00000000000000a2"},
     {"HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"}),
    ("intel", "1", "intel:1", {"ZE_AFFINITY_MASK": "1", "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE",
                               "ONEAPI_DEVICE_SELECTOR": "level_zero:*"}, set()),
])
def test_a_ranks_entry_names_its_vendor_and_gets_that_vendors_variables(
        vendor: str, device: str, entry: str, variables: dict[str, str], inherited: set[str]) -> None:
    assert rank_entry(vendor, device) == entry
    assert rank_entry_env(entry) == (variables, inherited)


@pytest.mark.parametrize("entry", ["", "-oops", "GPU-a b", "\u00b2", "amd:", "cuda:0", "amd:../x"])
def test_a_ranks_entry_that_names_no_gpu_is_refused(entry: str) -> None:
    with pytest.raises(ValueError):
        rank_entry_env(entry)
