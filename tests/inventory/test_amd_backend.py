"""The AMD backend on the fake libamd_smi.so (tests/fakeamdsmi), through AMD's real ``amdsmi`` package:
what ``gpusd devices --json`` lists, what ``gpusd run`` sets, and how lost GPUs, missing fields and
library errors come out (as for NVML: a flagged GPU or a one-line error)."""

from __future__ import annotations

import json
import os

import tests_paths
from conftest import gpusd_cli
from fakeamdsmi import AmdGpu, AmdProcess, MiB, package_dir, wrapped_functions

GiB = 1024**3


def _env(fake, **extra: str) -> dict[str, str]:
    base = {**os.environ, "PYTHONPATH": str(tests_paths.SRC), **extra}
    return fake.env(base)


def _two() -> list[AmdGpu]:
    return [AmdGpu(gfx=63, umc=20, vram_used=40 * 1024 * MiB, temp=51, power=420,
                   processes=[AmdProcess(os.getpid(), 30 * GiB)]),
            AmdGpu(serial="00000000000000b1", bdf="0000:1c:00.0", name="AMD Instinct MI250X", vram_total=65536 * MiB,
                   cpart="", mpart="")]


def test_the_fake_exports_every_function_the_real_package_looks_up(fake_amdsmi) -> None:
    import ctypes

    names = wrapped_functions(package_dir("amdsmi")[0] / "amdsmi_wrapper.py")
    assert len(names) > 150  # 184 in amdsmi 7.0.2
    lib = ctypes.CDLL(str(fake_amdsmi.root / "lib" / "libamd_smi.so"))
    assert [n for n in names if not hasattr(lib, n)] == []
    lib.fake_amdsmi_sizeof.restype = ctypes.c_size_t
    assert lib.fake_amdsmi_sizeof(b"amdsmi_proc_info_t") == 704  # the layout of amdsmi_wrapper.py
    # every struct the fake fills is as large as the package's ctypes one (the C side also asserts offsets)
    wrapper = _wrapper(fake_amdsmi, STRUCTS)
    assert {n: lib.fake_amdsmi_sizeof(n.encode()) for n in STRUCTS} == wrapper


# the structs the fake fills, by amdsmi_wrapper.py's names
STRUCTS = ("amdsmi_asic_info_t", "amdsmi_vram_usage_t", "amdsmi_engine_usage_t", "amdsmi_power_info_t",
           "amdsmi_proc_info_t", "amdsmi_driver_info_t", "amdsmi_board_info_t", "amdsmi_clk_info_t",
           "amdsmi_error_count_t", "amdsmi_pcie_info_t", "amdsmi_gpu_metrics_t", "amdsmi_gpu_xcp_metrics_t")


def _wrapper(fake, names: tuple[str, ...]) -> dict[str, int]:
    """sizeof() of the ctypes structs of the installed amdsmi_wrapper.py, read in a subprocess (its import
    needs the library, and would keep amdsmi loaded in the test process)."""
    import subprocess
    import sys

    script = ("import ctypes, json, sys\n"
              "from amdsmi import amdsmi_wrapper as w\n"
              "print(json.dumps({n: ctypes.sizeof(getattr(w, n)) for n in sys.argv[1:]}))\n")
    r = subprocess.run([sys.executable, "-c", script, *names], env=_env(fake), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_devices_json_lists_amd_gpus_with_vendor_memory_utilisation_and_processes(fake_amdsmi) -> None:
    fake_amdsmi.write(_two())
    r = gpusd_cli(["devices", "--json"], env=_env(fake_amdsmi))
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert snap["backend"] == "amdsmi"
    a, b = snap["gpus"]
    assert (a["vendor"], a["name"], a["uuid"], a["pci_bus_id"]) == (
        "amd", "AMD Instinct MI300X", "GPU-1a2b3c4d5e6f7081", "0000:0C:00.0")
    assert a["memory_total"] == 196592 * MiB and a["memory_used"] == 40 * GiB
    assert a["utilization_gpu"] == 63 and a["utilization_memory"] == 20
    assert (a["temperature"], a["power_draw"], a["power_limit"]) == (51, 420, 750)
    assert (a["compute_partition"], a["memory_partition"]) == ("SPX", "NPS1")
    assert [(p["pid"], p["used_memory"]) for p in a["processes"]] == [(os.getpid(), 30 * GiB)]
    assert a["processes"][0]["user"]  # resolved on the host, as for NVML
    assert b["name"] == "AMD Instinct MI250X" and b["memory_total"] == 64 * GiB and b["compute_partition"] is None
    assert a["free"] is False and b["free"] is True
    table = gpusd_cli(["devices"], env=_env(fake_amdsmi)).stdout
    assert "MI300X [amd]" in table


def test_run_on_an_amd_host_sets_rocr_visible_devices_and_no_cuda_variable(fake_amdsmi) -> None:
    fake_amdsmi.write(_two())
    r = gpusd_cli(["run", "-n", "1", "--", "env"], env=_env(fake_amdsmi))
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert env["ROCR_VISIBLE_DEVICES"] == "GPU-00000000000000b1"  # the idle one
    assert "CUDA_VISIBLE_DEVICES" not in env and "HIP_VISIBLE_DEVICES" not in env
    # an inherited HIP_VISIBLE_DEVICES limits the choice, as an inherited CUDA_VISIBLE_DEVICES does
    r = gpusd_cli(["run", "-n", "1", "--", "env"], env=_env(fake_amdsmi, HIP_VISIBLE_DEVICES="0"))
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert env["ROCR_VISIBLE_DEVICES"] == "GPU-1a2b3c4d5e6f7081" and "HIP_VISIBLE_DEVICES" not in env
    r = gpusd_cli(["env", "-n", "1", "--vendor", "amd"], env=_env(fake_amdsmi))
    assert r.returncode == 0, r.stderr
    assert "export ROCR_VISIBLE_DEVICES=GPU-00000000000000b1" in r.stdout
    assert "unset CUDA_VISIBLE_DEVICES" in r.stdout and "export CUDA" not in r.stdout


def test_a_lost_gpu_is_flagged_and_the_other_still_read(fake_amdsmi) -> None:
    gpus = _two()
    gpus[0].lost = 6  # AMDSMI_STATUS_DRM_ERROR on every query
    fake_amdsmi.write(gpus)
    r = gpusd_cli(["devices", "--json"], env=_env(fake_amdsmi))
    assert r.returncode == 0, r.stderr
    a, b = json.loads(r.stdout)["gpus"]
    assert a["healthy"] is False and "DRM error" in a["error"]
    assert b["healthy"] is True and b["memory_total"] == 64 * GiB
    r = gpusd_cli(["run", "-n", "2", "--", "true"], env=_env(fake_amdsmi))
    assert r.returncode != 0 and "unhealthy" in r.stderr and "Traceback" not in r.stderr


def test_missing_fields_stay_unknown(fake_amdsmi) -> None:
    gpus = _two()
    gpus[0].missing = ["temp", "power", "processes", "cpart", "mpart"]
    fake_amdsmi.write(gpus)
    r = gpusd_cli(["devices", "--json"], env=_env(fake_amdsmi))
    assert r.returncode == 0, r.stderr
    a = json.loads(r.stdout)["gpus"][0]
    assert a["healthy"] is True and a["temperature"] is None and a["power_draw"] is None
    assert a["compute_partition"] is None and a["processes"] == [] and a["memory_total"] == 196592 * MiB
    gpus[0].missing = ["activity"]  # no utilisation: gpusd cannot tell it is free
    fake_amdsmi.write(gpus)
    a = json.loads(gpusd_cli(["devices", "--json"], env=_env(fake_amdsmi)).stdout)["gpus"][0]
    assert a["utilization_gpu"] is None and a["free"] is False


def test_library_errors_are_one_line(fake_amdsmi, tmp_path) -> None:
    fake_amdsmi.write(_two(), init_status=34)  # AMDSMI_STATUS_DRIVER_NOT_LOADED
    r = gpusd_cli(["devices"], env=_env(fake_amdsmi))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("gpusd: the amdgpu driver is not loaded")
    r = gpusd_cli(["devices", "--json"], env={**_env(fake_amdsmi), "ROCM_PATH": str(tmp_path)})
    assert r.returncode != 0 and r.stdout == "" and "Traceback" not in r.stderr  # amdsmi's own print is kept off
    assert "no ROCm library libamd_smi.so" in r.stderr
    r = gpusd_cli(["devices"], env={**_env(fake_amdsmi), "PYTHONPATH": str(tests_paths.SRC)})
    assert r.returncode != 0 and "the amdsmi package is not installed" in r.stderr


def test_a_host_with_nvidia_and_amd_gpus_is_one_host(fake_amdsmi, fake_nvml) -> None:
    from fakenvml import make_gpus

    fake_nvml.write(make_gpus(2))
    fake_amdsmi.write(_two())
    env = {**fake_nvml.env(_env(fake_amdsmi)), "GPUSD_BACKENDS": "nvidia,amd"}
    r = gpusd_cli(["devices", "--json"], env=env)
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert snap["backend"] == "nvml+amdsmi"
    assert [(g["index"], g["vendor"], g["vendor_index"]) for g in snap["gpus"]] == [
        (0, "nvidia", None), (1, "nvidia", None), (2, "amd", 0), (3, "amd", 1)]
    r = gpusd_cli(["run", "-n", "1", "--vendor", "amd", "--include", "3", "--", "env"], env=env)
    assert r.returncode == 0, r.stderr
    assert "ROCR_VISIBLE_DEVICES=GPU-00000000000000b1" in r.stdout.splitlines()
    assert not any(line.startswith("CUDA_VISIBLE_DEVICES=") for line in r.stdout.splitlines())
    r = gpusd_cli(["run", "-n", "1", "--vendor", "nvidia", "--", "env"], env=env)
    assert r.returncode == 0, r.stderr
    assert not any(line.startswith("ROCR_VISIBLE_DEVICES=") for line in r.stdout.splitlines())
    assert any(line.startswith("CUDA_VISIBLE_DEVICES=") for line in r.stdout.splitlines())


def test_by_default_every_vendor_that_opens_is_read_and_one_that_fails_is_skipped(fake_amdsmi, fake_nvml) -> None:
    from fakenvml import make_gpus

    fake_nvml.write(make_gpus(1))
    fake_amdsmi.write(_two())
    env = fake_nvml.env(_env(fake_amdsmi))
    env.pop("GPUSD_BACKENDS")
    snap = json.loads(gpusd_cli(["devices", "--json"], env=env).stdout)
    assert [g["vendor"] for g in snap["gpus"]] == ["nvidia", "amd", "amd"]
    fake_amdsmi.write(_two(), init_status=34)  # the amdgpu driver not loaded: the NVIDIA GPU alone
    r = gpusd_cli(["devices", "--json"], env=env)
    assert r.returncode == 0, r.stderr
    assert [g["vendor"] for g in json.loads(r.stdout)["gpus"]] == ["nvidia"]
    r = gpusd_cli(["devices"], env={**env, "GPUSD_BACKENDS": "nvidia,amd"})  # named: it must work
    assert r.returncode != 0 and "amdgpu driver is not loaded" in r.stderr


def test_the_daemons_backend_on_a_mixed_host_reads_nvml_telemetry_and_serves_dcgm_names_for_nvidia_only(
        fake_amdsmi, fake_nvml) -> None:
    """open_backend(telemetry=True) (what the daemon opens) goes through the combined backend and still
    asks NVML for DCGM's readings; a one-shot open_backend() does not; the DCGM names cover the NVIDIA
    GPUs and AMD's exporter names the AMD ones."""
    import subprocess
    import sys

    from fakenvml import make_gpus

    fake_nvml.write(make_gpus(2, clock_sm=1395, energy=5_000_000, pcie_replay=3))
    fake_amdsmi.write(_two())
    env = {**fake_nvml.env(_env(fake_amdsmi)), "GPUSD_BACKENDS": "nvidia,amd"}
    env.pop("GPUSD_SIMULATE", None)
    script = (
        "import json, sys\n"
        "from gpusd.inventory import open_backend\n"
        "from gpusd.daemon.metrics import render_snapshots\n"
        "with open_backend(telemetry=sys.argv[1] == '1') as b:\n"
        "    snap = b.snapshot()\n"
        "print(json.dumps({'snap': snap.to_dict(), 'metrics': render_snapshots([snap], dcgm=True).decode()}))\n")
    out = {}
    for telemetry in ("1", "0"):
        r = subprocess.run([sys.executable, "-c", script, telemetry], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        out[telemetry] = json.loads(r.stdout)
    snap = out["1"]["snap"]
    assert snap["backend"] == "nvml+amdsmi"
    nvidia = [g["uuid"] for g in snap["gpus"] if g["vendor"] == "nvidia"]
    amd = [g["uuid"] for g in snap["gpus"] if g["vendor"] == "amd"]
    assert len(nvidia) == 2 and len(amd) == 2
    # NVML's DCGM readings for NVIDIA; amdsmi's clocks and PCIe replay counter for AMD
    assert [(g.get("clock_sm"), g.get("pcie_replays")) for g in snap["gpus"]] == [(1395, 3)] * 2 + [(2100, 0)] * 2
    assert all("clock_sm" not in g and "energy" not in g for g in out["0"]["snap"]["gpus"])  # one-shot: none

    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(out["1"]["metrics"])}
    for name in ("DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_GPU_UTIL"):
        assert sorted(s.labels["UUID"] for s in fams[name].samples) == sorted(nvidia), name
    assert sorted(s.labels["gpu_uuid"] for s in fams["gpu_gfx_activity"].samples) == sorted(amd)
    assert sorted(s.labels["gpu_uuid"] for s in fams["pcie_replay_count"].samples) == sorted(amd)  # AMD's name


def test_what_amd_smi_and_amds_exporter_show_for_an_mi300x(fake_amdsmi) -> None:
    """Driver version, each temperature sensor under its own name only where it exists (an MI300X has no
    edge sensor), health, energy in µJ, clocks, and card_model as the board's part number: what AMD's
    device-metrics-exporter serves and its dashboards match."""
    import subprocess
    import sys

    from gpusd.daemon.metrics import render_snapshots
    from gpusd.model import HostSnapshot

    gpus = _two()
    gpus[0].missing = ["temp_edge"]
    gpus[0].hotspot, gpus[0].memtemp, gpus[0].energy = 61, 55, 9_000_000_000
    fake_amdsmi.write(gpus)
    script = ("import json\n"
              "from gpusd.inventory import open_backend\n"
              "with open_backend(telemetry=True) as b:\n"  # what the daemon opens
              "    print(json.dumps(b.snapshot().to_dict()))\n")
    r = subprocess.run([sys.executable, "-c", script], env=_env(fake_amdsmi), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["driver_version"] == "6.8.5"
    a, b = d["gpus"]
    assert "edge_temperature" not in a and a["junction_temperature"] == 61 and a["memory_temperature"] == 55
    assert a["temperature"] == 61  # gpusd's own reading: the hotspot where there is no edge sensor
    assert b["edge_temperature"] == 40 and b["junction_temperature"] == 48
    assert a["energy"] == 9_000_000 and a["board_model"] == "102-G30211-00"  # mJ, gpusd's unit
    assert (a["clock_sm"], a["clock_memory"]) == (2100, 1300)
    text = render_snapshots([HostSnapshot.from_dict(d)], dcgm=True).decode()

    def series(name: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(name + "{")]

    edge, junction = series("gpu_edge_temperature"), series("gpu_junction_temperature")
    assert len(edge) == 1 and 'gpu_uuid="GPU-00000000000000b1"' in edge[0]  # only the GPU with the sensor
    assert len(junction) == 2 and any('gpu_uuid="GPU-1a2b3c4d5e6f7081"' in s and s.endswith(" 61.0") for s in junction)
    assert len(series("gpu_memory_temperature")) == 2 and len(series("gpu_health")) == 2
    energy = next(s for s in series("gpu_energy_consumed") if "GPU-1a2b3c4d5e6f7081" in s)
    assert float(energy.rsplit(" ", 1)[1]) == 9e9  # µJ, as AMD's exporter
    assert 'card_model="102-G30211-00"' in energy and 'driver_version="6.8.5"' in energy
    clocks = series("gpu_clock")
    assert any('clock_type="SYSTEM"' in c and c.endswith(" 2100.0") for c in clocks)
    assert any('clock_type="MEMORY"' in c for c in clocks)


def test_ecc_pcie_and_xcc_busy_as_amds_exporter_serves_them(fake_amdsmi) -> None:
    """The daemon's AMD telemetry beyond gpusd's own fields: the ECC totals
    (amdsmi_get_gpu_total_ecc_count), the PCIe link (amdsmi_get_pcie_info: MT/s served as GT/s, Mb/s,
    counters) and the GFX busy of each XCC (the metrics table's xcp_stats.gfx_busy_inst), under AMD's
    exporter's names, types and labels; a reading amdsmi does not give (N/A, NOT_SUPPORTED, a partitioned
    GPU's XCCs) is left out, and a one-shot reader asks for none of it."""
    import subprocess
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    from gpusd.daemon.metrics import AMD_LABELS, render_snapshots
    from gpusd.model import HostSnapshot

    gpus = _two()
    a = gpus[0]
    a.ecc_ce, a.ecc_ue, a.ecc_de = 12, 1, 3
    a.pcie_max_speed, a.pcie_speed, a.pcie_bw = 32000, 16000, 25_600
    a.pcie_replay, a.pcie_recovery, a.pcie_rollover, a.pcie_nak_sent, a.pcie_nak_rcvd = 7, 2, -1, 4, 5
    a.xcc_busy = [61, 62, 63, 64, 65, 66, 67, 68]
    gpus[1].missing = ["ecc", "pcie", "gpu_metrics"]  # an older board: none of it
    gpus.append(AmdGpu(serial="00000000000000c1", bdf="0000:2c:00.0", cpart="CPX", xcc_busy=[90]))
    fake_amdsmi.write(gpus)
    script = ("import json, sys\n"
              "from gpusd.inventory import open_backend\n"
              "with open_backend(telemetry=sys.argv[1] == '1') as b:\n"
              "    print(json.dumps(b.snapshot().to_dict()))\n")
    out = {}
    for telemetry in ("1", "0"):
        r = subprocess.run([sys.executable, "-c", script, telemetry], env=_env(fake_amdsmi), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        out[telemetry] = json.loads(r.stdout)
    d = out["1"]
    mi300, old, cpx = d["gpus"]
    assert all(g["healthy"] for g in d["gpus"])
    assert (mi300["ecc_correctable"], mi300["ecc_uncorrectable"], mi300["ecc_deferred"]) == (12, 1, 3)
    assert (mi300["pcie_max_speed"], mi300["pcie_speed"], mi300["pcie_bandwidth"]) == (32.0, 16.0, 25_600)
    assert (mi300["pcie_replays"], mi300["pcie_recoveries"], mi300["pcie_nak_sent"], mi300["pcie_nak_received"]) == (
        7, 2, 4, 5)
    assert "pcie_replay_rollovers" not in mi300  # amdsmi's N/A: left out, never 0
    assert mi300["gfx_busy_xcc"] == [61, 62, 63, 64, 65, 66, 67, 68]
    assert not [k for k in old if k.startswith(("ecc_", "pcie_", "gfx_busy"))]
    assert "gfx_busy_xcc" not in cpx and cpx["ecc_correctable"] == 0  # which XCP is this partition's: unknown
    assert not [k for g in out["0"]["gpus"] for k in g if k.startswith(("ecc_", "pcie_", "gfx_busy"))]

    text = render_snapshots([HostSnapshot.from_dict(d)], dcgm=True).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    uuid = "GPU-1a2b3c4d5e6f7081"

    def value(name: str, **labels: str) -> float | None:
        found = [s.value for s in fams[name].samples if s.labels["gpu_uuid"] == uuid
                 and all(s.labels.get(k) == v for k, v in labels.items())] if name in fams else []
        assert len(found) <= 1, name
        return found[0] if found else None

    expected = {"gpu_ecc_correct_total": 12, "gpu_ecc_uncorrect_total": 1, "gpu_ecc_deferred_total": 3,
                "pcie_max_speed": 32, "pcie_speed": 16, "pcie_bandwidth": 25_600, "pcie_replay_count": 7,
                "pcie_recovery_count": 2, "pcie_nack_sent_count": 4, "pcie_nack_received_count": 5}
    assert {name: value(name) for name in expected} == expected
    assert value("pcie_replay_rollover_count") is None
    for name in expected:
        assert fams[name].type == "gauge", name  # gauges in AMD's exporter, "_total" or not
        assert sorted(s.labels["gpu_uuid"] for s in fams[name].samples) == sorted([uuid, cpx["uuid"]]), name
        assert set(fams[name].samples[0].labels) == set(AMD_LABELS), name
    busy = fams["gpu_gfx_busy_instantaneous"]
    assert busy.type == "gauge" and set(busy.samples[0].labels) == {"xcc_index", *AMD_LABELS}
    assert [(s.labels["xcc_index"], s.value) for s in busy.samples] == [(str(i), 61.0 + i) for i in range(8)]
    assert "# TYPE gpu_ecc_correct_total gauge" in text  # the exporter's name as is: not a counter's "_total"
