import json

import pytest

from gpusd.model import GpuInfo, HostSnapshot, LeaseInfo, MigInstance, ProcessInfo


def _snapshot() -> HostSnapshot:
    return HostSnapshot(
        hostname="node-1", node_id="0123456789abcdef", timestamp=1700000000.25,
        driver_version="550.54.15", cuda_version="12.4", nvml_version="12.550.54.15",
        gpus=[
            GpuInfo(index=0, uuid="GPU-a", name="NVIDIA A100-SXM4-80GB", pci_bus_id="00000000:07:00.0",
                    memory_total=80 * 2**30, memory_used=2**30, memory_free=79 * 2**30,
                    utilization_gpu=12.5, utilization_memory=3.0, utilization_window=5.0, temperature=41,
                    power_draw=61.5, power_limit=400.0, fan_speed=None, compute_mode="default", mig_mode=True,
                    mig_instances=[MigInstance(index=0, uuid="MIG-x", profile="3g.40gb", memory_total=40 * 2**30,
                                               memory_used=0, gpu_instance_id=1, compute_instance_id=0)],
                    processes=[ProcessInfo(pid=42, used_memory=2**30, user="alice", command="python train.py",
                                           gpu_instance_id=1, compute_instance_id=0)],
                    leases=[LeaseInfo(lease_id="abc", pid=42, user="alice", started=1.5, memory=2**34,
                                      shared=True, command="python", device="MIG-x")]),
            GpuInfo(index=1, uuid="GPU-b", healthy=False, error="GPU is lost"),
        ],
    )


def test_json_round_trip_is_lossless():
    snap = _snapshot()
    text = snap.to_json()
    again = HostSnapshot.from_json(text)
    assert again == snap
    assert again.to_json() == text


def test_unsupported_fields_are_none_not_zero():
    d = json.loads(_snapshot().to_json())
    lost = d["gpus"][1]
    assert lost["memory_total"] is None and lost["temperature"] is None and lost["healthy"] is False
    assert d["gpus"][0]["fan_speed"] is None


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["gpus"][0].__setitem__("memory_total", "80GB"), "memory_total"),
    (lambda d: d["gpus"][0].__setitem__("index", True), "index"),
    (lambda d: d.__setitem__("node_id", None), "node_id"),
    (lambda d: d.__setitem__("gpus", {"0": {}}), "gpus"),
    (lambda d: d["gpus"][0]["processes"].append("pid 4"), "processes"),
    (lambda d: d.__setitem__("schema", 99), "schema"),
])
def test_from_dict_rejects_bad_input_with_a_named_field(mutate, message):
    d = json.loads(_snapshot().to_json())
    mutate(d)
    with pytest.raises(ValueError, match=message):
        HostSnapshot.from_dict(d)


def test_from_json_rejects_non_json():
    with pytest.raises(ValueError, match="not JSON"):
        HostSnapshot.from_json(b"\xff\xfe garbage")


def test_unknown_fields_are_ignored_for_forward_compatibility():
    d = json.loads(_snapshot().to_json())
    d["future_field"] = 1
    d["gpus"][0]["nvlink"] = [1, 2]
    assert HostSnapshot.from_dict(d).gpus[0].uuid == "GPU-a"
