"""Unified-memory GPUs (DGX Spark GB10, Jetson Thor): NVML answers the memory query "not supported",
and what the GPU can allocate is the host's memory. A fake NVML that refuses memory info stands in."""
import json

import pytest

from conftest import gpusd_cli
from fakenvml import make_gpus
from gpusd.alloc.select import Constraints, candidates
from gpusd.inventory.nvml import NvmlBackend
from gpusd.model import HostSnapshot, LeaseInfo
from gpusd.topology import host_memory

GiB = 2**30


def _unified(n=1):
    gpus = make_gpus(n, util_gpu=3)
    for g in gpus:
        g.name = "NVIDIA GB10"
        g.memory_total = None  # nvmlDeviceGetMemoryInfo: NOT_SUPPORTED
    return gpus


@pytest.mark.parametrize("bindings", ["nvidia-ml-py", "auto"])
def test_memory_is_the_hosts_and_marked_shared(fake_nvml_inprocess, monkeypatch, bindings):
    monkeypatch.setenv("GPUSD_NVML_BINDINGS", bindings)
    fake_nvml_inprocess.write(_unified())
    total, _ = host_memory()
    with NvmlBackend() as b:
        for _ in range(2):  # the first reading learns "not supported"; the second skips the call
            g = b.snapshot().gpus[0]
            assert g.memory_shared is True and g.memory_total == total
            assert g.memory_free is not None and 0 < g.memory_free <= total
            assert g.memory_used == total - g.memory_free


def test_a_gpu_with_memory_of_its_own_is_not_shared(fake_nvml_inprocess):
    fake_nvml_inprocess.write(make_gpus(1))
    with NvmlBackend() as b:
        g = b.snapshot().gpus[0]
    assert g.memory_total == 80 * GiB and not g.memory_shared


def test_select_and_devices_on_a_unified_memory_gpu(fake_nvml, cli_env):
    fake_nvml.write(_unified())
    r = gpusd_cli(["select", "-n", "1", "--min-free", "1GiB", "--no-lease"], env=cli_env)
    assert r.returncode == 0, r.stderr
    r = gpusd_cli(["devices", "--json"], env=cli_env)
    assert r.returncode == 0, r.stderr
    g = json.loads(r.stdout)["gpus"][0]
    assert g["memory_shared"] is True and g["memory_total"] == host_memory()[0]
    table = gpusd_cli(["devices"], env=cli_env).stdout
    row = next(line for line in table.splitlines() if line.startswith("0 "))
    assert "shared" in row


def test_two_reservations_never_add_up_to_more_than_the_host_has():
    """Two unified-memory GPUs share one pool: a job's --memory on one is gone for the other."""
    from gpusd.model import GpuInfo

    gpus = [GpuInfo(index=i, uuid=f"GPU-{i}", memory_total=100 * GiB, memory_used=20 * GiB, memory_free=80 * GiB,
                    utilization_gpu=0.0, memory_shared=True) for i in range(2)]
    snap = HostSnapshot(hostname="spark", node_id="n", timestamp=0.0, gpus=gpus)
    held = [LeaseInfo(lease_id="a" * 12, device="GPU-0", pid=1, user="u", memory=60 * GiB)]
    ok, rejected = candidates(snap, Constraints.build(count=1, min_free="30GiB"), leases=held)
    assert ok == [] and len(rejected) == 2, rejected  # 80 - 60 = 20 GiB left on the host, on either GPU
    ok, _ = candidates(snap, Constraints.build(count=1, min_free="15GiB"), leases=held)
    assert [c.gpu.index for c in ok] == [1]  # GPU 0 is the lease's own
