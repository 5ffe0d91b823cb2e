"""The NVML backend against the fake libnvidia-ml.so.1, through both of its bindings: nvidia-ml-py (the
daemon's, and the reference) and gpusd.inventory.nvmlfast (the quick commands')."""

import os
import time

import pytest

from fakenvml import FakeMig, FakeProcess, make_gpus
from gpusd.errors import BackendUnavailable
from gpusd.inventory.nvml import NvmlBackend

GiB = 2**30


@pytest.fixture(params=["nvidia-ml-py", "auto"], ids=["nvidia-ml-py", "nvmlfast"])
def backend(fake_nvml_inprocess, monkeypatch, request):
    monkeypatch.setenv("GPUSD_NVML_BINDINGS", request.param)
    created = []

    def make(**kw):
        b = NvmlBackend(**kw)
        created.append(b)
        return b

    yield make
    for b in created:
        b.close()


def test_snapshot_reports_the_state_file(fake_nvml_inprocess, backend):
    gpus = make_gpus(3, memory_used=10 * GiB, util_gpu=40, util_memory=12, temperature=55,
                     power_usage=250_000, power_limit=400_000)
    gpus[2].name = "NVIDIA H100 80GB HBM3"
    fake_nvml_inprocess.write(gpus)
    snap = backend().snapshot()
    assert [g.index for g in snap.gpus] == [0, 1, 2]
    assert [g.uuid for g in snap.gpus] == [g.uuid for g in gpus]
    assert snap.gpus[2].name == "NVIDIA H100 80GB HBM3"
    g = snap.gpus[0]
    assert (g.memory_total, g.memory_used, g.memory_free) == (80 * GiB, 10 * GiB, 70 * GiB)
    assert g.utilization_gpu == 40 and g.utilization_memory == 12
    assert g.temperature == 55 and g.power_draw == 250.0 and g.power_limit == 400.0
    assert g.pci_bus_id == gpus[0].pci_bus_id
    assert g.compute_mode == "default" and g.healthy
    assert snap.driver_version == "550.54.15" and snap.cuda_version == "12.4"
    assert snap.backend == "nvml" and not snap.simulated


def test_unsupported_queries_give_none(fake_nvml_inprocess, backend):
    fake_nvml_inprocess.write(make_gpus(1, fan=None, power_usage=None, temperature=None, mig_mode=None))
    g = backend().snapshot().gpus[0]
    assert g.fan_speed is None and g.power_draw is None and g.temperature is None and g.mig_mode is None
    assert g.healthy and g.memory_total == 80 * GiB


def test_lost_gpu_is_unhealthy_and_the_others_still_report(fake_nvml_inprocess, backend):
    gpus = make_gpus(3, util_gpu=20)
    b = backend()
    fake_nvml_inprocess.write(gpus)
    assert all(g.healthy for g in b.snapshot().gpus)
    gpus[1].errors = {"*": 15}  # NVML_ERROR_GPU_IS_LOST mid-run, on a cached handle
    fake_nvml_inprocess.write(gpus)
    snap = b.snapshot()
    assert [g.healthy for g in snap.gpus] == [True, False, True]
    assert "lost" in (snap.gpus[1].error or "").lower()
    assert snap.gpus[0].utilization_gpu == 20 and snap.gpus[2].memory_total == 80 * GiB


def test_one_failing_query_does_not_fail_the_gpu(fake_nvml_inprocess, backend):
    gpus = make_gpus(1, temperature=50)
    gpus[0].errors = {"nvmlDeviceGetTemperature": 999}  # unknown error on the temperature query
    fake_nvml_inprocess.write(gpus)
    g = backend().snapshot().gpus[0]
    assert g.healthy is False  # NVML_ERROR_UNKNOWN means the GPU is in trouble
    gpus[0].errors = {"nvmlDeviceGetTemperature": 2}  # invalid argument: just that field
    fake_nvml_inprocess.write(gpus)
    g = backend().snapshot().gpus[0]
    assert g.healthy and g.temperature is None and g.memory_total == 80 * GiB


def test_state_changes_are_seen_with_cached_handles(fake_nvml_inprocess, backend):
    gpus = make_gpus(2, memory_used=GiB)
    fake_nvml_inprocess.write(gpus)
    b = backend()
    assert b.snapshot().gpus[1].memory_used == GiB
    gpus[1].memory_used = 30 * GiB
    fake_nvml_inprocess.write(gpus)
    assert b.snapshot().gpus[1].memory_used == 30 * GiB


def test_gpu_that_vanishes_and_count_change(fake_nvml_inprocess, backend):
    gpus = make_gpus(3)
    fake_nvml_inprocess.write(gpus)
    b = backend()
    assert len(b.snapshot().gpus) == 3
    fake_nvml_inprocess.write(gpus[:2])
    snap = b.snapshot()
    assert [g.uuid for g in snap.gpus] == [g.uuid for g in gpus[:2]]


def test_processes_with_owner_and_command(fake_nvml_inprocess, backend):
    gpus = make_gpus(2)
    gpus[0].processes = [FakeProcess(os.getpid(), 3 * GiB), FakeProcess(999_999_9, GiB)]
    gpus[1].graphics_processes = [FakeProcess(os.getpid(), GiB)]
    fake_nvml_inprocess.write(gpus)
    snap = backend().snapshot()
    procs = {p.pid: p for p in snap.gpus[0].processes}
    me = procs[os.getpid()]
    assert me.used_memory == 3 * GiB and me.type == "compute"
    import getpass

    assert me.user == getpass.getuser() and "python" in (me.command or "")
    ghost = procs[999_999_9]  # a pid this host cannot see (as in a container without host PIDs)
    assert ghost.user is None and ghost.command is None and ghost.used_memory == GiB
    assert [p.type for p in snap.gpus[1].processes] == ["graphics"]


def test_mig_instances(fake_nvml_inprocess, backend):
    gpus = make_gpus(1, mig_mode=1)
    gpus[0].migs = [
        FakeMig("3g.40gb", "MIG-11111111-2222-3333-4444-555555555555", 40 * GiB, 5 * GiB, 1, 0),
        FakeMig("1g.10gb", "MIG-66666666-7777-8888-9999-000000000000", 10 * GiB, 0, 2, 0),
    ]
    gpus[0].processes = [FakeProcess(os.getpid(), 5 * GiB, 1, 0)]
    fake_nvml_inprocess.write(gpus)
    g = backend().snapshot().gpus[0]
    assert g.mig_mode is True
    assert [(m.profile, m.uuid, m.memory_total, m.memory_used, m.gpu_instance_id) for m in g.mig_instances] == [
        ("3g.40gb", "MIG-11111111-2222-3333-4444-555555555555", 40 * GiB, 5 * GiB, 1),
        ("1g.10gb", "MIG-66666666-7777-8888-9999-000000000000", 10 * GiB, 0, 2),
    ]
    assert g.processes[0].gpu_instance_id == 1 and g.processes[0].compute_instance_id == 0


def test_utilisation_is_averaged_over_the_driver_samples(fake_nvml_inprocess, backend):
    fake_nvml_inprocess.write(make_gpus(1, util_gpu=100, util_samples=[0, 0, 0, 100]))
    g = backend(util_window=5.0).snapshot().gpus[0]
    # The instant reading says 100 %, the last samples say mostly idle.
    assert g.utilization_gpu == pytest.approx(25.0, abs=1.0)
    assert g.utilization_window is not None and 0.5 <= g.utilization_window <= 5.0


def test_window_from_own_readings_without_sample_buffer(fake_nvml_inprocess, backend):
    gpus = make_gpus(1, util_gpu=80)
    gpus[0].errors = {"nvmlDeviceGetSamples": 3}
    fake_nvml_inprocess.write(gpus)
    b = backend(util_window=5.0)
    first = b.snapshot().gpus[0]
    assert first.utilization_gpu == 80 and first.utilization_window is None  # a single reading says so
    time.sleep(0.2)
    gpus[0].util_gpu = 0
    fake_nvml_inprocess.write(gpus)
    time.sleep(0.2)
    later = b.snapshot().gpus[0]
    assert 0 < later.utilization_gpu < 80 and later.utilization_window is not None


@pytest.mark.parametrize("bindings", ["nvidia-ml-py", "auto"])
def test_driver_not_loaded_is_a_clear_error(fake_nvml_inprocess, monkeypatch, bindings):
    monkeypatch.setenv("GPUSD_NVML_BINDINGS", bindings)
    fake_nvml_inprocess.write(make_gpus(1), init_error=9)
    with pytest.raises(BackendUnavailable, match="driver is not loaded.*--simulate"):
        NvmlBackend()
