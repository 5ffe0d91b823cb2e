"""The Intel backend on a fake Level Zero loader (tests/fakeze) through Intel's real ``pyzes``
bindings: ``gpusd devices --json``, ``gpusd run``, lost GPUs, missing fields, library errors."""

from __future__ import annotations

import json
import os

import tests_paths
from conftest import gpusd_cli
from fakeze import GiB, ZeGpu, ZeProcess


def _env(fake, **extra: str) -> dict[str, str]:
    return fake.env({**os.environ, "PYTHONPATH": str(tests_paths.SRC), **extra})


def _two() -> list[ZeGpu]:
    return [ZeGpu(util=40, mem_used=32 * GiB, temp=55, power=380, processes=[ZeProcess(os.getpid(), 30 * GiB)]),
            ZeGpu(uuid="86800bd5000000000000aa0000000000", bdf="0000:aa:00.0")]


def test_devices_json_lists_intel_gpus_with_vendor_memory_utilisation_and_processes(fake_ze) -> None:
    fake_ze.write(_two())
    r = gpusd_cli(["devices", "--json"], env=_env(fake_ze))
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert snap["backend"] == "levelzero"
    a, b = snap["gpus"]
    assert (a["vendor"], a["name"], a["pci_bus_id"]) == (
        "intel", "Intel(R) Data Center GPU Max 1550", "00000000:29:00.0")
    assert a["uuid"] == "GPU-86800bd5-0000-0000-0000-290000000000"
    assert a["memory_total"] == 128 * GiB and a["memory_used"] == 32 * GiB
    assert abs(a["utilization_gpu"] - 40) < 2  # from two readings of the engine counters
    assert a["temperature"] == 55 and abs(a["power_draw"] - 380) < 5 and a["power_limit"] == 600
    assert a["subdevices"] == 2
    assert [(p["pid"], p["used_memory"]) for p in a["processes"]] == [(os.getpid(), 30 * GiB)]
    assert a["free"] is False and b["free"] is True
    assert "Max 1550 [intel]" in gpusd_cli(["devices"], env=_env(fake_ze)).stdout


def test_run_on_an_intel_host_sets_the_affinity_mask_and_no_cuda_variable(fake_ze) -> None:
    fake_ze.write(_two())
    r = gpusd_cli(["run", "-n", "1", "--", "env"], env=_env(fake_ze, ONEAPI_DEVICE_SELECTOR="level_zero:1"))
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert env["ZE_AFFINITY_MASK"] == "1" and env["ZE_FLAT_DEVICE_HIERARCHY"] == "COMPOSITE"
    assert env["ONEAPI_DEVICE_SELECTOR"] == "level_zero:*"  # not an index the mask has renumbered
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_a_lost_gpu_is_flagged_and_missing_fields_stay_unknown(fake_ze) -> None:
    gpus = _two()
    gpus[0].lost = 0x70000001  # ZE_RESULT_ERROR_DEVICE_LOST
    gpus[1].missing = ["temp", "power", "processes"]
    fake_ze.write(gpus)
    r = gpusd_cli(["devices", "--json"], env=_env(fake_ze))
    assert r.returncode == 0, r.stderr
    a, b = json.loads(r.stdout)["gpus"]
    assert a["healthy"] is False and "device lost" in a["error"]
    assert b["healthy"] is True and b["temperature"] is None and b["power_draw"] is None
    assert b["memory_total"] == 128 * GiB and b["utilization_gpu"] == 0


def test_library_errors_are_one_line(fake_ze, tmp_path) -> None:
    fake_ze.write(_two(), init_result=0x78000001)
    r = gpusd_cli(["devices"], env=_env(fake_ze))
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert "Level Zero Sysman failed to start" in r.stderr
    r = gpusd_cli(["devices"], env={**_env(fake_ze), "GPUSD_ZE_LIBRARY": str(tmp_path / "nope.so")})
    assert r.returncode != 0 and "no Level Zero loader" in r.stderr and "Traceback" not in r.stderr
