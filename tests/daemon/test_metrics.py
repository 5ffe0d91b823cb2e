"""Prometheus metrics: what a Prometheus server would parse from /metrics."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gpusd.daemon.metrics import render_snapshots
from gpusd.model import GpuInfo, HostSnapshot, LeaseInfo, MigInstance, ProcessInfo
from gpusd.thresholds import ThresholdEngine, parse_rule

GiB = 2**30


def snapshot() -> HostSnapshot:
    g0 = GpuInfo(index=0, uuid="GPU-aaa", name="NVIDIA A100-SXM4-80GB", memory_total=80 * GiB,
                 memory_used=20 * GiB, memory_free=60 * GiB, utilization_gpu=45.0, utilization_memory=30.0,
                 temperature=61, power_draw=250.5, power_limit=400.0, fan_speed=None, mig_mode=True,
                 processes=[ProcessInfo(pid=1, used_memory=GiB, user="alice", command="python x.py")],
                 leases=[LeaseInfo(lease_id="l", pid=1), LeaseInfo(lease_id="m", pid=2)],
                 mig_instances=[MigInstance(index=0, uuid="MIG-1", profile="3g.40gb", memory_total=40 * GiB,
                                            memory_used=GiB)])
    g1 = GpuInfo(index=1, uuid="GPU-bbb", name="NVIDIA A100-SXM4-80GB", healthy=False, error="GPU is lost")
    return HostSnapshot(hostname="gpu-node-1", node_id="0123456789abcdef", timestamp=1700000000.0,
                        gpus=[g0, g1], driver_version="550.54", cuda_version="12.4")


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(ss: dict[str, list], name: str, uuid: str) -> float:
    [s] = [s for s in ss[name] if s.labels.get("uuid") == uuid]
    return s.value


def test_gpu_metrics_in_base_units_with_standard_labels():
    ss = samples(render_snapshots([snapshot()]).decode())
    assert value(ss, "gpusd_gpu_utilization_ratio", "GPU-aaa") == 0.45
    assert value(ss, "gpusd_gpu_memory_utilization_ratio", "GPU-aaa") == 0.30
    assert value(ss, "gpusd_gpu_memory_used_bytes", "GPU-aaa") == 20 * GiB
    assert value(ss, "gpusd_gpu_memory_total_bytes", "GPU-aaa") == 80 * GiB
    assert value(ss, "gpusd_gpu_memory_free_bytes", "GPU-aaa") == 60 * GiB
    assert value(ss, "gpusd_gpu_temperature_celsius", "GPU-aaa") == 61
    assert value(ss, "gpusd_gpu_power_watts", "GPU-aaa") == 250.5
    assert value(ss, "gpusd_gpu_power_limit_watts", "GPU-aaa") == 400
    assert value(ss, "gpusd_gpu_processes", "GPU-aaa") == 1
    assert value(ss, "gpusd_gpu_leases", "GPU-aaa") == 2
    [util] = [s for s in ss["gpusd_gpu_utilization_ratio"]]
    assert util.labels == {"host": "gpu-node-1", "uuid": "GPU-aaa", "index": "0", "model": "NVIDIA A100-SXM4-80GB"}


def test_health_and_missing_readings():
    ss = samples(render_snapshots([snapshot()]).decode())
    assert value(ss, "gpusd_gpu_healthy", "GPU-aaa") == 1
    assert value(ss, "gpusd_gpu_healthy", "GPU-bbb") == 0
    # a lost GPU has no readings: no series rather than a fake 0
    assert [s for s in ss["gpusd_gpu_temperature_celsius"] if s.labels["uuid"] == "GPU-bbb"] == []
    assert "gpusd_gpu_fan_speed_ratio" not in ss  # no GPU reports a fan


def test_info_metrics():
    ss = samples(render_snapshots([snapshot()]).decode())
    [host] = ss["gpusd_host_info"]
    assert host.value == 1 and host.labels["node_id"] == "0123456789abcdef"
    assert host.labels["driver_version"] == "550.54"
    assert host.labels["simulated"] == "false"
    info = {s.labels["uuid"]: s.labels for s in ss["gpusd_gpu_info"]}
    assert info["GPU-aaa"]["mig_mode"] == "enabled"
    assert ss["gpusd_host_gpus"][0].value == 2
    assert ss["gpusd_host_snapshot_timestamp_seconds"][0].value == 1700000000.0
    [mig] = ss["gpusd_mig_memory_total_bytes"]
    assert mig.labels["mig_uuid"] == "MIG-1" and mig.labels["profile"] == "3g.40gb" and mig.value == 40 * GiB
    assert ss["gpusd_build_info"][0].value == 1


def test_no_private_fields_in_metrics():
    text = render_snapshots([snapshot()]).decode()
    assert "alice" not in text and "python" not in text


def test_threshold_alerts_exported():
    snap = snapshot()
    eng = ThresholdEngine([parse_rule("hot: temperature>60"), parse_rule("lost")])
    eng.update(snap)
    ss = samples(render_snapshots([snap], alerts=eng.active()).decode())
    active = sorted((s.labels["uuid"], s.labels["rule"]) for s in ss["gpusd_threshold_active"])
    assert active == [("GPU-aaa", "hot"), ("GPU-bbb", "lost")]


def test_empty_until_first_sample():
    ss = samples(render_snapshots([]).decode())
    assert "gpusd_gpu_utilization_ratio" not in ss and ss["gpusd_build_info"]
