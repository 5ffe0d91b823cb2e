"""A multi-GPU job on a host with GPUs of several vendors gets GPUs of one vendor (its framework speaks
one runtime), unless it asks for ``--vendor any``."""
import os

import pytest

import tests_paths
from conftest import gpusd_cli
from gpusd.alloc.select import Constraints, explain
from gpusd.errors import NoGpuAvailable
from gpusd.model import GpuInfo, HostSnapshot


def _host(*specs: tuple[str, float]) -> HostSnapshot:
    gpus = [GpuInfo(index=i, uuid=f"GPU-{i:04d}", vendor=v, utilization_gpu=u, memory_total=100, memory_used=0)
            for i, (v, u) in enumerate(specs)]
    return HostSnapshot(hostname="mixed", node_id="n", timestamp=0.0, gpus=gpus)


def test_two_gpus_on_a_mixed_host_are_of_one_vendor() -> None:
    # the two least-loaded GPUs are of two vendors; the best one-vendor pair is the AMD one
    snap = _host(("nvidia", 0.0), ("nvidia", 80.0), ("amd", 5.0), ("amd", 10.0))
    pick = explain(snap, Constraints.build(count=2))
    assert {c.gpu.vendor for c in pick.chosen} == {"amd"}
    assert "one vendor" in pick.reason
    mixed = explain(snap, Constraints.build(count=2, vendor="any"))
    assert {c.gpu.vendor for c in mixed.chosen} == {"nvidia", "amd"}


def test_no_vendor_with_enough_gpus_says_how_to_mix() -> None:
    snap = _host(("nvidia", 0.0), ("amd", 0.0))
    with pytest.raises(NoGpuAvailable, match="of one vendor.*--vendor any"):
        explain(snap, Constraints.build(count=2))
    assert len(explain(snap, Constraints.build(count=2, vendor="any")).chosen) == 2


def test_run_on_a_mixed_simulated_host_sets_one_vendors_variable() -> None:
    env = {**os.environ, "PYTHONPATH": str(tests_paths.SRC)}
    # without GPU 0, the least-loaded pair by index would be an A100 and an MI300X
    r = gpusd_cli(["run", "-n", "2", "--exclude", "0", "--simulate", "2xA100-80GB,2xMI300X", "--", "env"], env=env)
    assert r.returncode == 0, r.stderr
    seen = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    cuda, rocr = seen.get("CUDA_VISIBLE_DEVICES"), seen.get("ROCR_VISIBLE_DEVICES")
    assert (cuda is None) != (rocr is None), (cuda, rocr)  # one vendor's variable, not both
    assert len((cuda or rocr or "").split(",")) == 2
