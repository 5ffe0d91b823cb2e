import json

import pytest

from conftest import gpusd_cli
from gpusd.errors import ConfigError
from gpusd.inventory.simulated import SimulatedBackend

GiB = 2**30


@pytest.mark.parametrize("spec, names", [
    ("4xA100-80GB", ["NVIDIA A100-SXM4-80GB"] * 4),
    ("2xh100,1xRTX4090", ["NVIDIA H100 80GB HBM3"] * 2 + ["NVIDIA GeForce RTX 4090"]),
    ("T4", ["Tesla T4"]),
])
def test_specs(spec, names):
    snap = SimulatedBackend(spec).snapshot()
    assert [g.name for g in snap.gpus] == names
    assert snap.simulated and snap.backend == "simulated"
    assert len({g.uuid for g in snap.gpus}) == len(names)
    for g in snap.gpus:
        assert 0 <= g.utilization_gpu <= 100 and 0 <= g.memory_used <= g.memory_total
        assert g.memory_free == g.memory_total - g.memory_used


@pytest.mark.parametrize("spec", ["0xA100", "4xB999", "4 x", "100xA100"])
def test_bad_specs(spec):
    with pytest.raises(ConfigError):
        SimulatedBackend(spec)


def test_scenario_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"hostname": "sim-x", "gpus": [
        {"model": "A100-80GB", "util": 30, "memory_used": "20GiB", "temperature": 55},
        {"model": "A100-80GB", "util": {"steps": [7, 7]}, "mig": ["3g.40gb", "1g.10gb"]},
        {"model": "RTX4090",
         "processes": [{"pid": 4242, "memory": "10GiB", "user": "alice", "command": "python t.py"}]},
        {"model": "T4", "lost": True},
    ]}))
    snap = SimulatedBackend(str(path)).snapshot()
    assert snap.hostname == "sim-x"
    g0, g1, g2, g3 = snap.gpus
    assert (g0.utilization_gpu, g0.memory_used, g0.temperature) == (30, 20 * GiB, 55)
    assert g1.mig_mode is True and [m.profile for m in g1.mig_instances] == ["3g.40gb", "1g.10gb"]
    assert g1.mig_instances[0].memory_total == 40 * GiB and g1.mig_instances[0].uuid.startswith("MIG-")
    assert g2.processes[0].user == "alice" and g2.memory_used == 10 * GiB
    assert not g3.healthy and g3.memory_total is None


def test_same_host_same_values_across_instances():
    a, b = SimulatedBackend("3xA100", host="h", node="n"), SimulatedBackend("3xA100", host="h", node="n")
    sa, sb = a.snapshot(), b.snapshot()
    assert [g.uuid for g in sa.gpus] == [g.uuid for g in sb.gpus]
    assert [g.utilization_gpu for g in sa.gpus] == pytest.approx([g.utilization_gpu for g in sb.gpus], abs=1.0)


@pytest.mark.parametrize("content, message", [
    (None, "cannot read scenario"),
    ("{nope", "not valid JSON"),
    ('{"gpus": []}', "non-empty 'gpus'"),
    ('{"gpus": [{"model": "A100", "util": {"min": 1}}]}', "bad gpus[0].util"),
])
def test_bad_scenarios_are_usage_errors(tmp_path, content, message):
    path = tmp_path / "s.json"
    if content is not None:
        path.write_text(content)
    r = gpusd_cli(["devices", "--simulate", str(path)])
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("util", ["NaN", "Infinity", '{"min": 0, "max": -Infinity}', '{"steps": [1, NaN]}'])
def test_non_finite_scenario_values_are_refused(tmp_path, util):
    """Python's JSON reader accepts NaN and Infinity; a scenario must not turn them into readings
    (a NaN on the wire made every dashboard show every host down)."""
    from gpusd.inventory import open_backend

    path = tmp_path / "s.json"
    path.write_text(f'{{"gpus": [{{"model": "A100", "util": {util}}}]}}')
    with pytest.raises(ConfigError, match=r"gpus\[0\]\.util"):
        open_backend(str(path))
