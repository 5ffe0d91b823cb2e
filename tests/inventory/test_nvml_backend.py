"""The NVML backend against the fake libnvidia-ml.so.1, through both of its bindings: nvidia-ml-py (the
daemon's, and the reference) and gpusd.inventory.nvmlfast (the quick commands')."""

import os
import time

import pytest

from fakenvml import FakeMig, FakeProcess, make_gpus
from gpusd.errors import BackendUnavailable
from gpusd.inventory import nvml
from gpusd.inventory.lost import filled
from gpusd.inventory.nvml import NvmlBackend
from gpusd.record import replace

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


# -- the straight-line reader (NvmlBackend._read_all) against the call-by-call one (_fill) ----

class _Clock:
    """time.time() for the backends' module: the same instant for both backends' readings of a step."""

    def __init__(self) -> None:
        self.t = time.time()

    def time(self) -> float:
        return self.t


def _rig() -> list:
    """GPUs that take every branch of the straight-line reader."""
    gpus = make_gpus(9, memory_used=12 * GiB, util_gpu=35, util_memory=10, temperature=50, power_usage=180_000)
    for g in gpus[1:]:
        g.errors = {"nvmlDeviceGetSamples": 3}  # no sample buffer: the window from the backend's own readings
    gpus[0].processes = [FakeProcess(os.getpid(), 3 * GiB), FakeProcess(999_999_9, GiB)]
    gpus[0].graphics_processes = [FakeProcess(os.getpid(), GiB), FakeProcess(31337, 2 * GiB)]  # one pid in both
    gpus[0].fan = 40
    gpus[1].mig_mode = 1
    gpus[1].migs = [FakeMig("3g.40gb", "MIG-11111111-2222-3333-4444-555555555555", 40 * GiB, 5 * GiB, 1, 0)]
    gpus[1].processes = [FakeProcess(os.getpid(), 5 * GiB, 1, 0)]
    gpus[2].temperature = gpus[2].power_usage = gpus[2].mig_mode = None  # unsupported: None, not asked again
    gpus[2].errors = {"nvmlDeviceGetSamples": 3, "nvmlDeviceGetComputeMode": 3}
    gpus[3].errors = {"nvmlDeviceGetSamples": 3, "nvmlDeviceGetEnforcedPowerLimit": 2}  # one field missing
    gpus[4].errors = {"nvmlDeviceGetSamples": 3, "nvmlDeviceGetTemperature": 999}  # the GPU in trouble
    gpus[5].errors = {"*": 15}  # lost
    gpus[6].errors = {"nvmlDeviceGetSamples": 15}  # lost while its sample buffer is read
    gpus[7].mig_mode = 1
    gpus[7].errors = {"nvmlDeviceGetSamples": 3, "nvmlDeviceGetMaxMigDeviceCount": 15}  # lost in its MIG slices
    gpus[8].util_gpu = gpus[8].util_memory = None  # no utilisation at all
    gpus[8].errors = {"nvmlDeviceGetSamples": 3, "nvmlDeviceGetComputeRunningProcesses": 3,
                      "nvmlDeviceGetGraphicsRunningProcesses": 3}
    return gpus


def _call_by_call(b: NvmlBackend) -> NvmlBackend:
    """``b`` reading each GPU call by call (_fill), the reference the straight-line reader must match."""
    b._read_all = lambda devices: [b._no_handle(dev) if dev.handle is None else filled(b._blank(dev), b._fill, dev)
                                   for dev in devices]
    return b


def _comparable(snap) -> list:
    gpus = []
    for g in snap.gpus:
        if g.index == 0 and g.utilization_window is not None:  # the driver's samples, up to now: a few ms apart
            g = replace(g, utilization_window=round(g.utilization_window))
        gpus.append(g)
    return gpus


@pytest.mark.parametrize("detail", [True, False], ids=["detail", "no-detail"])
def test_the_straight_line_reader_reads_what_the_call_by_call_one_reads(fake_nvml_inprocess, backend, monkeypatch,
                                                                      detail):
    gpus = _rig()
    fake_nvml_inprocess.write(gpus)
    clock = _Clock()
    monkeypatch.setattr(nvml, "time", clock)
    fast, slow, fields_one_by_one = backend(), _call_by_call(backend()), backend()
    fields_one_by_one._unpack_memory = fields_one_by_one._unpack_rates = None  # where the layouts differ
    for step in range(4):
        clock.t += 0.4 if step != 2 else 0.01  # the same slot of the window, or the next one
        if step == 1:
            gpus[3].util_gpu, gpus[1].memory_used = 90, 30 * GiB
            gpus[0].processes = gpus[0].processes[:1]
            fake_nvml_inprocess.write(gpus)
        since = {gpus[4].uuid: clock.t - 0.5} if step == 3 else None
        snaps = [b.snapshot(util_since=since, detail=detail) for b in (fast, slow, fields_one_by_one)]
        assert _comparable(snaps[0]) == _comparable(snaps[1]) == _comparable(snaps[2]), step
    got = {g.index: g for g in snaps[0].gpus}
    unhealthy = [4, 5, 6, 7] if detail else [5, 6, 7]  # without detail, no temperature is read
    assert [i for i, g in got.items() if not g.healthy] == unhealthy
    assert got[3].utilization_gpu is not None and 35 < got[3].utilization_gpu < 90  # the window of own readings
    assert got[3].power_limit is None and got[2].compute_mode is None and got[8].utilization_gpu is None
    assert got[6].memory_total == 80 * GiB and got[6].utilization_gpu is None  # what was read before it failed
    assert got[7].mig_mode is True and got[7].utilization_gpu == 35 and not got[7].mig_instances
    assert [p.pid for p in got[1].processes] == [os.getpid()] and got[1].mig_instances


def test_records_made_positionally_name_the_models_fields_in_order():
    from gpusd.model import GpuInfo, HostSnapshot, ProcessInfo
    from gpusd.record import fields

    for cls, names in ((GpuInfo, nvml._GPU_FIELDS), (HostSnapshot, nvml._HOST_FIELDS),
                       (ProcessInfo, nvml._PROCESS_FIELDS)):
        assert tuple(f.name for f in fields(cls))[:len(names)] == names, cls.__name__


def test_structures_are_read_in_one_call_only_where_their_layout_is_the_expected_one():
    import ctypes

    pynvml = pytest.importorskip("pynvml")
    from gpusd.inventory import nvmlfast

    for module in (pynvml, nvmlfast):
        assert nvml._unpacker(module.c_nvmlMemory_t, "=QQQ", ("total", "free", "used")) is not None
        assert nvml._unpacker(module.c_nvmlUtilization_t, "=II", ("gpu", "memory")) is not None

    class Signed(ctypes.Structure):
        _fields_ = [("gpu", ctypes.c_int), ("memory", ctypes.c_int)]

    class Wide(ctypes.Structure):
        _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_ulonglong)]

    assert nvml._unpacker(pynvml.c_nvmlMemory_t, "=QQQ", ("total", "used", "free")) is None  # another order
    assert nvml._unpacker(pynvml.c_nvmlMemory_v2_t, "=QQQ", ("total", "free", "used")) is None
    assert nvml._unpacker(Signed, "=II", ("gpu", "memory")) is None
    assert nvml._unpacker(Wide, "=II", ("gpu", "memory")) is None
    assert nvml._unpacker(None, "=II", ("gpu", "memory")) is None
