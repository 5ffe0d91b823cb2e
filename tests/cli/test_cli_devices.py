"""`gpusd devices` as a user runs it: a subprocess on the fake NVML."""

import json
import os
import subprocess
import sys

from conftest import gpusd_cli
from fakenvml import FakeMig, FakeProcess, make_gpus

GiB = 2**30


def test_devices_json_shows_exactly_the_state_file(fake_nvml, cli_env):
    gpus = make_gpus(4, memory_used=2 * GiB, util_gpu=10)
    gpus[1].mig_mode = 1
    gpus[1].migs = [FakeMig("3g.40gb", "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", 40 * GiB, GiB, 1, 0)]
    gpus[2].processes = [FakeProcess(os.getpid(), 5 * GiB), FakeProcess(4_000_000, GiB)]
    gpus[3].errors = {"nvmlDeviceGetMemoryInfo": 15}  # lost in the middle of the query
    fake_nvml.write(gpus)
    r = gpusd_cli(["devices", "--json"], env=cli_env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert [g["uuid"] for g in d["gpus"]] == [g.uuid for g in gpus]
    assert [g["healthy"] for g in d["gpus"]] == [True, True, True, False]
    assert d["gpus"][3]["error"] and "lost" in d["gpus"][3]["error"].lower()
    assert d["gpus"][0]["memory_used"] == 2 * GiB and d["gpus"][0]["utilization_gpu"] == 10
    migs = d["gpus"][1]["mig_instances"]
    assert [(m["uuid"], m["profile"], m["memory_total"]) for m in migs] == [
        ("MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "3g.40gb", 40 * GiB)]
    assert sorted((p["pid"], p["used_memory"]) for p in d["gpus"][2]["processes"]) == sorted(
        [(os.getpid(), 5 * GiB), (4_000_000, GiB)])
    assert d["simulated"] is False and d["backend"] == "nvml"


def test_devices_table_is_readable(fake_nvml, cli_env):
    gpus = make_gpus(2, memory_used=20 * GiB, util_gpu=55, temperature=61)
    gpus[1].errors = {"*": 15}
    fake_nvml.write(gpus)
    r = gpusd_cli(["devices"], env=cli_env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "IDX" in lines[1] and "MEMORY" in lines[1] and "UTIL" in lines[1]
    row0 = next(line for line in lines if line.startswith("0 "))
    assert "A100-SXM4-80GB" in row0 and "NVIDIA" not in row0
    assert "20.0GiB / 80.0GiB" in row0 and "55%" in row0 and "61C" in row0
    row1 = next(line for line in lines if line.startswith("1 "))
    assert "UNHEALTHY" in row1


def test_gpu_lost_before_start_is_listed_unhealthy(fake_nvml, cli_env):
    gpus = make_gpus(3)
    gpus[1].errors = {"*": 15}  # every query fails, its UUID included
    fake_nvml.write(gpus)
    d = json.loads(gpusd_cli(["devices", "--json"], env=cli_env).stdout)
    assert [(g["index"], g["healthy"]) for g in d["gpus"]] == [(0, True), (1, False), (2, True)]
    assert d["gpus"][2]["uuid"] == gpus[2].uuid


def test_no_nvml_library_is_one_clear_line(tmp_path):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(tmp_path)  # nothing there
    r = gpusd_cli(["devices"], env=env)
    assert r.returncode == 3
    assert "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1
    assert "libnvidia-ml.so.1" in r.stderr and "--simulate" in r.stderr


def test_simulated_outputs_say_so():
    r = gpusd_cli(["devices", "--simulate", "2xH100-80GB"])
    assert r.returncode == 0, r.stderr
    assert "SIMULATED" in r.stdout and "H100 80GB HBM3" in r.stdout
    r = gpusd_cli(["devices", "--json", "--simulate", "2xH100-80GB"])
    d = json.loads(r.stdout)
    assert d["simulated"] is True and d["backend"] == "simulated" and len(d["gpus"]) == 2


def test_bad_simulation_spec_is_a_usage_error():
    r = gpusd_cli(["devices", "--simulate", "4xQuantumGPU"])
    assert r.returncode == 2 and "unknown simulated GPU model" in r.stderr and "Traceback" not in r.stderr


def test_wrong_flag_is_a_usage_error():
    r = gpusd_cli(["devices", "--jsonn"])
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr


def test_help_does_not_import_heavy_modules():
    code = ("import sys; from gpusd.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('zeroconf', 'aiohttp', 'rich', 'pynvml', 'psutil', 'prometheus_client')"
            " if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_every_command_has_its_options_when_run():
    from gpusd.cli import build_parser

    full = build_parser()
    for name, sub in full._subparsers._group_actions[0].choices.items():
        only = build_parser(name)._subparsers._group_actions[0].choices[name]
        assert only.format_help() == sub.format_help(), name
