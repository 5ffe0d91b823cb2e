"""The fake libnvidia-ml.so.1 (tests/fakenvml), exercised through the real nvidia-ml-py bindings,
nvitop and gpustat."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from fakenvml import (
    LIB_NAME,
    STATE_ENV,
    FakeGPU,
    FakeMig,
    FakeNvml,
    FakeProcess,
    build_fake_nvml,
    fake_bus_id,
    fake_uuid,
    make_gpus,
    render_state,
)

pynvml = pytest.importorskip("pynvml")

GiB = 2**30
TESTS_DIR = Path(__file__).resolve().parent
NO_ID = 0xFFFFFFFF


def run_py(fake: FakeNvml, code: str, *, timeout: float = 60, extra_env: dict[str, str] | None = None) -> Any:
    """Run ``code`` in a fresh interpreter on the fake library; return the JSON it prints last."""
    env = fake.env()
    env["PYTHONPATH"] = str(TESTS_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextmanager
def nvml() -> Iterator[None]:
    pynvml.nvmlInit()
    try:
        yield
    finally:
        pynvml.nvmlShutdown()


# --------------------------------------------------------------------------------------------
# build and layout
# --------------------------------------------------------------------------------------------


def test_build_is_cached_and_exports_nvml(fake_nvml_libdir: Path, tmp_path: Path) -> None:
    assert (fake_nvml_libdir / LIB_NAME).is_file()
    assert build_fake_nvml() == fake_nvml_libdir  # cache hit
    lib = tmp_path / "lib"
    assert build_fake_nvml(lib) == lib and (lib / LIB_NAME).is_file()
    mtime = (lib / LIB_NAME).stat().st_mtime_ns
    assert build_fake_nvml(lib) == lib and (lib / LIB_NAME).stat().st_mtime_ns == mtime
    assert (lib / LIB_NAME).read_bytes()[:4] == b"\x7fELF"
    # Never dlopen a second copy in this process: pynvml's CDLL("libnvidia-ml.so.1") would match
    # whichever object with that soname was loaded first.  The cached build is the preloaded one.
    so = ctypes.CDLL(str(fake_nvml_libdir / LIB_NAME))
    for name in ("nvmlInit_v2", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetSamples",
                 "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetMigDeviceHandleByIndex"):
        assert hasattr(so, name)
    assert not hasattr(so, "nvmlDeviceGetConfComputeMemSizeInfo")  # keeps nvitop on the v3 struct
    so.nvmlErrorString.restype = ctypes.c_char_p
    assert so.nvmlErrorString(15) == b"GPU is lost"
    assert so.nvmlErrorString(999) == b"Unknown Error"
    assert so.nvmlDeviceGetCount_v2(ctypes.byref(ctypes.c_uint())) == 1  # uninitialised


def test_struct_layouts_match_pynvml(fake_nvml_libdir: Path) -> None:
    so = ctypes.CDLL(str(fake_nvml_libdir / LIB_NAME))
    so.fake_nvml_sizeof.restype = ctypes.c_ulong
    so.fake_nvml_offsetof.restype = ctypes.c_ulong

    class c_nvmlProcessInfo_v1_t(ctypes.Structure):  # nvitop's layout for the unversioned calls
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

    structs = {name: getattr(pynvml, name) for name in (
        "nvmlPciInfo_t", "nvmlPciInfo_v2_t", "nvmlPciInfoExt_v1_t", "c_nvmlMemory_t", "c_nvmlMemory_v2_t",
        "c_nvmlBAR1Memory_t", "c_nvmlProcessInfo_v2_t", "c_nvmlUtilization_t", "c_nvmlValue_t",
        "c_nvmlSample_t", "c_nvmlFieldValue_t", "c_nvmlTemperature_v1_t",
        "c_nvmlProcessUtilizationSample_t")}
    structs["c_nvmlProcessInfo_v1_t"] = c_nvmlProcessInfo_v1_t
    for name, cls in structs.items():
        assert so.fake_nvml_sizeof(name.encode()) == ctypes.sizeof(cls), name
    for dotted in ("nvmlPciInfo_t.busId", "nvmlPciInfo_t.pciSubSystemId", "nvmlPciInfo_v2_t.pciSubSystemId",
                   "nvmlPciInfoExt_v1_t.busId", "c_nvmlMemory_v2_t.total", "c_nvmlMemory_v2_t.used",
                   "c_nvmlProcessInfo_v2_t.usedGpuMemory", "c_nvmlProcessInfo_v2_t.gpuInstanceId",
                   "c_nvmlProcessInfo_v2_t.computeInstanceId", "c_nvmlSample_t.sampleValue",
                   "c_nvmlFieldValue_t.timestamp", "c_nvmlFieldValue_t.nvmlReturn", "c_nvmlFieldValue_t.value",
                   "c_nvmlTemperature_v1_t.temperature", "c_nvmlProcessUtilizationSample_t.timeStamp",
                   "c_nvmlProcessUtilizationSample_t.decUtil"):
        struct, field = dotted.split(".")
        assert so.fake_nvml_offsetof(dotted.encode()) == getattr(structs[struct], field).offset, dotted
    assert pynvml.nvmlMemory_v2 == 0x02000028 and pynvml.nvmlTemperature_v1 == 0x100000C


def test_make_gpus_and_render_state() -> None:
    gpus = make_gpus(64)
    assert len({g.uuid for g in gpus}) == 64
    assert all(g.uuid.startswith("GPU-") and [len(p) for p in g.uuid[4:].split("-")] == [8, 4, 4, 4, 12]
               for g in gpus)
    assert [g.pci_bus_id for g in gpus] == sorted(g.pci_bus_id for g in gpus)
    assert make_gpus(2)[1].uuid == fake_uuid(1) and gpus[2].pci_bus_id == fake_bus_id(2)
    text = render_state([FakeGPU(fan=None, util_gpu=None)], init_error=9)
    assert "init_error 9" in text and "\nfan " not in text and "util_gpu" not in text
    assert f"uuid {fake_uuid(0)}" in text  # AUTO
    with pytest.raises(ValueError):
        make_gpus(65)
    with pytest.raises(ValueError):
        render_state([FakeGPU(name="bad # name")])


# --------------------------------------------------------------------------------------------
# pynvml in a subprocess
# --------------------------------------------------------------------------------------------


def test_pynvml_subprocess_sees_the_state_file(fake_nvml: FakeNvml) -> None:
    gpus = make_gpus(3, memory_used=5 * GiB, memory_reserved=GiB // 2, util_gpu=40, util_memory=12)
    gpus[1].name = "NVIDIA H100 80GB HBM3"
    gpus[1].memory_total = 81559 * 2**20
    fake_nvml.write(gpus, driver_version="535.104.05", cuda_version=12020)
    out = run_py(fake_nvml, """
        import json, pynvml as N
        N.nvmlInit()
        res = {"driver": N.nvmlSystemGetDriverVersion(), "cuda": N.nvmlSystemGetCudaDriverVersion(),
               "cuda2": N.nvmlSystemGetCudaDriverVersion_v2(), "nvml": N.nvmlSystemGetNVMLVersion(), "gpus": []}
        for i in range(N.nvmlDeviceGetCount()):
            h = N.nvmlDeviceGetHandleByIndex(i)
            m1, m2 = N.nvmlDeviceGetMemoryInfo(h), N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
            pci = N.nvmlDeviceGetPciInfo(h)
            u = N.nvmlDeviceGetUtilizationRates(h)
            res["gpus"].append({
                "index": N.nvmlDeviceGetIndex(h), "name": N.nvmlDeviceGetName(h), "uuid": N.nvmlDeviceGetUUID(h),
                "serial": N.nvmlDeviceGetSerial(h), "minor": N.nvmlDeviceGetMinorNumber(h),
                "busId": pci.busId, "busIdLegacy": pci.busIdLegacy, "bus": pci.bus,
                "pciDeviceId": pci.pciDeviceId,
                "v1": [m1.total, m1.free, m1.used], "v2": [m2.total, m2.reserved, m2.free, m2.used],
                "util": [u.gpu, u.memory], "arch": N.nvmlDeviceGetArchitecture(h),
                "cc": list(N.nvmlDeviceGetCudaComputeCapability(h)),
                "by_uuid": N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(N.nvmlDeviceGetUUID(h))),
                "by_pci": N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByPciBusId(pci.busIdLegacy)),
            })
        try:
            N.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
        except N.NVMLError_NotFound:
            res["not_found"] = True
        try:
            N.nvmlDeviceGetHandleByIndex(3)
        except N.NVMLError_InvalidArgument:
            res["bad_index"] = True
        N.nvmlShutdown()
        print(json.dumps(res))
    """)
    assert out["driver"] == "535.104.05" and out["cuda"] == out["cuda2"] == 12020
    assert out["nvml"] == "12.535.104.05"
    assert out["not_found"] and out["bad_index"]
    assert [g["name"] for g in out["gpus"]] == ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3",
                                                "NVIDIA A100-SXM4-80GB"]
    for i, (g, want) in enumerate(zip(out["gpus"], gpus)):
        assert g["index"] == g["by_uuid"] == g["by_pci"] == g["minor"] == i
        assert g["uuid"] == want.uuid and g["busId"] == want.pci_bus_id
        assert g["busIdLegacy"] == want.pci_bus_id[4:] and g["bus"] == 7 + 3 * i
        assert g["serial"] == str(1320000000000 + i) and g["pciDeviceId"] == 0x20B210DE
        total = want.memory_total
        free = total - 5 * GiB - GiB // 2
        assert g["v2"] == [total, GiB // 2, free, 5 * GiB]
        assert g["v1"] == [total, free, total - free]
        assert g["util"] == [40, 12] and g["arch"] == 7 and g["cc"] == [8, 0]


def test_init_refcount_and_init_errors(fake_nvml: FakeNvml) -> None:
    # a fresh process: nothing loaded yet, so the first-load rules apply
    fake_nvml.write_text("device\nmemory_total not-a-number\n")
    out = run_py(fake_nvml, f"""
        import json, os, pynvml as N
        from fakenvml import make_gpus, write_state, write_state_text
        state = os.environ["{STATE_ENV}"]
        res = {{}}
        def code(fn, *a):
            try:
                fn(*a)
                return 0
            except N.NVMLError as e:
                return e.value
        os.environ["{STATE_ENV}"] = state + ".missing"
        res["missing"] = code(N.nvmlInit)
        os.environ["{STATE_ENV}"] = state
        res["malformed_first"] = code(N.nvmlInit)
        res["before_init"] = code(N.nvmlDeviceGetCount)
        write_state(state, make_gpus(2), init_error=9)
        res["init_error"] = code(N.nvmlInit)
        write_state(state, make_gpus(2))
        N.nvmlInit(); N.nvmlInit()
        N.nvmlShutdown()
        res["after_one_shutdown"] = N.nvmlDeviceGetCount()
        N.nvmlShutdown()
        res["after_two_shutdowns"] = code(N.nvmlDeviceGetCount)
        res["extra_shutdown"] = code(N.nvmlShutdown)
        N.nvmlInit()
        write_state_text(state, "device\\ncuda_cc 8\\n")  # malformed later: previous state stays
        res["malformed_later"] = N.nvmlDeviceGetCount()
        res["reinit"] = code(N.nvmlInit)
        del os.environ["{STATE_ENV}"]                    # unset later: previous state stays
        res["unset_later"] = N.nvmlDeviceGetCount()
        print(json.dumps(res))
    """)
    assert out == {"missing": 9, "malformed_first": 999, "before_init": 1, "init_error": 9,
                   "after_one_shutdown": 2, "after_two_shutdowns": 1, "extra_shutdown": 1,
                   "malformed_later": 2, "reinit": 0, "unset_later": 2}


def test_concurrent_readers_and_writer(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(make_gpus(4))
    out = run_py(fake_nvml, """
        import json, os, threading, time, pynvml as N
        from fakenvml import make_gpus, write_state
        state = os.environ["GPUSD_FAKE_NVML_STATE"]
        N.nvmlInit()
        handles = [N.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
        stop = time.monotonic() + 0.7
        errors, calls = [], [0]
        def reader():
            while time.monotonic() < stop:
                for h in handles:
                    try:
                        N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
                        N.nvmlDeviceGetComputeRunningProcesses(h)
                        N.nvmlDeviceGetName(h)
                        calls[0] += 3
                    except N.NVMLError_GpuIsLost:
                        pass
                    except Exception as e:
                        errors.append(repr(e))
        threads = [threading.Thread(target=reader) for _ in range(4)]
        for t in threads: t.start()
        i = 0
        while time.monotonic() < stop:
            i += 1
            write_state(state, make_gpus(1 + i % 4, memory_used=i))
        for t in threads: t.join()
        print(json.dumps({"errors": errors[:5], "calls": calls[0], "writes": i}))
    """)
    assert out["errors"] == [] and out["calls"] > 100 and out["writes"] > 10


# --------------------------------------------------------------------------------------------
# pynvml in this process (preloaded library)
# --------------------------------------------------------------------------------------------


def test_preload_is_found_by_soname(fake_nvml_inprocess: FakeNvml) -> None:
    fake_nvml_inprocess.write(make_gpus(2))
    with nvml():
        assert pynvml.nvmlDeviceGetCount() == 2
        assert hasattr(pynvml.nvmlLib, "fake_nvml_sizeof")  # pynvml's CDLL("libnvidia-ml.so.1") is the fake
    maps = Path("/proc/self/maps").read_text()
    loaded = {line.split()[-1] for line in maps.splitlines() if LIB_NAME in line}
    assert loaded == {str(fake_nvml_inprocess.lib_path.resolve())}


def test_state_change_seen_through_a_cached_handle(fake_nvml_inprocess: FakeNvml) -> None:
    gpus = make_gpus(2, memory_used=GiB)
    fake_nvml_inprocess.write(gpus)
    with nvml():
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        assert pynvml.nvmlDeviceGetMemoryInfo(h0).used == GiB
        gpus[0].memory_used = 7 * GiB
        gpus[0].name = "NVIDIA A100-SXM4-40GB"
        fake_nvml_inprocess.write(gpus)
        assert pynvml.nvmlDeviceGetMemoryInfo(h0, version=pynvml.nvmlMemory_v2).used == 7 * GiB
        assert pynvml.nvmlDeviceGetName(h0) == "NVIDIA A100-SXM4-40GB"
        fake_nvml_inprocess.write(gpus[:1])  # GPU 1 vanishes
        assert pynvml.nvmlDeviceGetCount() == 1
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetName(h1)
        assert pynvml.nvmlDeviceGetName(h0) == "NVIDIA A100-SXM4-40GB"
        fake_nvml_inprocess.write(gpus)  # and comes back: the old handle works again
        assert pynvml.nvmlDeviceGetUUID(h1) == gpus[1].uuid


def test_rapid_same_size_rewrites_are_all_seen(fake_nvml_inprocess: FakeNvml) -> None:
    gpus = make_gpus(1)
    fake_nvml_inprocess.write(gpus)
    with nvml():
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for used in range(1000, 1040):  # same file size every time, written within one mtime tick
            gpus[0].memory_used = used
            fake_nvml_inprocess.write(gpus)
            assert pynvml.nvmlDeviceGetMemoryInfo(h).used == used
        time.sleep(0.06)  # past the racy window: plain stat() comparison from now on
        gpus[0].memory_used = 2000
        fake_nvml_inprocess.write(gpus)
        assert pynvml.nvmlDeviceGetMemoryInfo(h).used == 2000


def test_env_var_is_read_at_each_check(fake_nvml_inprocess: FakeNvml, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml_inprocess.write(make_gpus(2))
    other = tmp_path / "other-state"
    other.write_text(render_state(make_gpus(5)))
    with nvml():
        assert pynvml.nvmlDeviceGetCount() == 2
        monkeypatch.setenv(STATE_ENV, str(other))
        assert pynvml.nvmlDeviceGetCount() == 5


def test_injected_errors(fake_nvml_inprocess: FakeNvml) -> None:
    gpus = make_gpus(3, fan=40)
    gpus[1].errors = {"*": 15}
    gpus[2].errors = {"nvmlDeviceGetTemperature": 3, "nvmlDeviceGetMemoryInfo": 999}
    fake_nvml_inprocess.write(gpus)
    with nvml():
        h0, h1, h2 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(3))
        for fn in (pynvml.nvmlDeviceGetName, pynvml.nvmlDeviceGetUUID, pynvml.nvmlDeviceGetMemoryInfo,
                   pynvml.nvmlDeviceGetUtilizationRates, pynvml.nvmlDeviceGetComputeRunningProcesses):
            with pytest.raises(pynvml.NVMLError_GpuIsLost) as exc:
                fn(h1)
        assert str(exc.value) == "GPU is lost"
        assert pynvml.nvmlDeviceGetName(h0) == gpus[0].name and pynvml.nvmlDeviceGetFanSpeed(h0) == 40
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetTemperature(h2, pynvml.NVML_TEMPERATURE_GPU)
        with pytest.raises(pynvml.NVMLError_Unknown):  # family: covers nvmlDeviceGetMemoryInfo_v2 too
            pynvml.nvmlDeviceGetMemoryInfo(h2, version=pynvml.nvmlMemory_v2)
        assert pynvml.nvmlDeviceGetFanSpeed(h2) == 40
        assert pynvml.nvmlDeviceGetTemperature(h0, pynvml.NVML_TEMPERATURE_GPU) == 35
        gpus[1].errors = {}
        fake_nvml_inprocess.write(gpus)
        assert pynvml.nvmlDeviceGetName(h1) == gpus[1].name


def test_omitted_fields_are_not_supported(fake_nvml_inprocess: FakeNvml) -> None:
    fake_nvml_inprocess.write(make_gpus(1, fan=None, power_usage=None, util_gpu=None, util_memory=None,
                                        temperature=None, mig_mode=None) +
                              make_gpus(1, fan=55, power_usage=123_000, temperature=61, mig_mode=0))
    with nvml():
        h, full = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        for call in (lambda d: pynvml.nvmlDeviceGetFanSpeed(d), lambda d: pynvml.nvmlDeviceGetNumFans(d),
                     lambda d: pynvml.nvmlDeviceGetPowerUsage(d), lambda d: pynvml.nvmlDeviceGetUtilizationRates(d),
                     lambda d: pynvml.nvmlDeviceGetTemperature(d, 0), lambda d: pynvml.nvmlDeviceGetMigMode(d),
                     lambda d: pynvml.nvmlDeviceGetSamples(d, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)):
            with pytest.raises(pynvml.NVMLError_NotSupported):
                call(h)
        assert pynvml.nvmlDeviceGetFanSpeed(full) == 55 and pynvml.nvmlDeviceGetFanSpeed_v2(full, 0) == 55
        assert pynvml.nvmlDeviceGetPowerUsage(full) == 123_000
        assert pynvml.nvmlDeviceGetEnforcedPowerLimit(full) == 400_000
        assert pynvml.nvmlDeviceGetPowerManagementLimit(full) == 400_000
        assert pynvml.nvmlDeviceGetTemperature(full, 0) == 61
        assert pynvml.nvmlDeviceGetMigMode(full) == [0, 0]
        assert pynvml.nvmlDeviceGetClockInfo(full, pynvml.NVML_CLOCK_SM) == 1410
        assert pynvml.nvmlDeviceGetMaxClockInfo(full, pynvml.NVML_CLOCK_MEM) == 1593
        assert pynvml.nvmlDeviceGetPerformanceState(full) == 0
        assert pynvml.nvmlDeviceGetPersistenceMode(full) == 1
        assert pynvml.nvmlDeviceGetComputeMode(full) == 0
        assert pynvml.nvmlDeviceGetDisplayActive(full) == 0 and pynvml.nvmlDeviceGetDisplayMode(full) == 0
        assert pynvml.nvmlDeviceGetEncoderUtilization(full)[0] == 0


def test_processes(fake_nvml_inprocess: FakeNvml) -> None:
    gpus = make_gpus(2)
    gpus[0].processes = [FakeProcess(os.getpid(), 3 * GiB)] + [FakeProcess(10_000 + i, i * 2**20) for i in range(99)]
    gpus[0].graphics_processes = [FakeProcess(555, 1000)]
    fake_nvml_inprocess.write(gpus)
    with nvml():
        h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h0)
        assert [(p.pid, p.usedGpuMemory) for p in procs] == [(p.pid, p.used_memory) for p in gpus[0].processes]
        assert {(p.gpuInstanceId, p.computeInstanceId) for p in procs} == {(NO_ID, NO_ID)}
        g = pynvml.nvmlDeviceGetGraphicsRunningProcesses(h0)
        assert [(p.pid, p.usedGpuMemory) for p in g] == [(555, 1000)]
        assert pynvml.nvmlDeviceGetComputeRunningProcesses(h1) == []
        assert pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3(h0) == []
        # the raw two-call protocol
        fn = pynvml.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3
        count = ctypes.c_uint(5)
        buf = (pynvml.c_nvmlProcessInfo_v3_t * 5)()
        assert fn(h0, ctypes.byref(count), buf) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE and count.value == 100
        count = ctypes.c_uint(0)
        assert fn(h1, ctypes.byref(count), None) == pynvml.NVML_SUCCESS and count.value == 0
        # the unversioned (v1) call writes 16-byte {pid, usedGpuMemory} entries
        fn1 = pynvml.nvmlLib.nvmlDeviceGetComputeRunningProcesses

        class V1(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

        count = ctypes.c_uint(100)
        buf1 = (V1 * 100)()
        assert fn1(h0, ctypes.byref(count), buf1) == 0 and count.value == 100
        assert (buf1[1].pid, buf1[1].usedGpuMemory) == (10_000, 0)
        assert (buf1[99].pid, buf1[99].usedGpuMemory) == (10_098, 98 * 2**20)


def test_mig_devices(fake_nvml_inprocess: FakeNvml) -> None:
    gpus = make_gpus(2, mig_mode=0)
    a, b = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "MIG-11111111-2222-3333-4444-555555555555"
    gpus[0].mig_mode = 1
    gpus[0].migs = [FakeMig("1g.10gb", a, 10 * GiB, GiB, gpu_instance_id=7, compute_instance_id=0),
                    FakeMig("3g.40gb", b, 40 * GiB, 0, gpu_instance_id=2, compute_instance_id=0)]
    gpus[0].processes = [FakeProcess(100, GiB, 7, 0), FakeProcess(200, 5 * GiB, 2, 0)]
    fake_nvml_inprocess.write(gpus)
    with nvml():
        h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        assert pynvml.nvmlDeviceGetMigMode(h0) == [1, 1] and pynvml.nvmlDeviceGetMigMode(h1) == [0, 0]
        assert pynvml.nvmlDeviceGetMaxMigDeviceCount(h0) == 7
        assert not pynvml.nvmlDeviceIsMigDeviceHandle(h0).value
        m0 = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h0, 0)
        m1 = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h0, 1)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h0, 2)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h1, 0)
        assert pynvml.nvmlDeviceIsMigDeviceHandle(m0).value == 1
        assert pynvml.nvmlDeviceGetName(m0) == "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
        assert pynvml.nvmlDeviceGetUUID(m1) == b
        mem = pynvml.nvmlDeviceGetMemoryInfo(m0)
        assert (mem.total, mem.used, mem.free) == (10 * GiB, GiB, 9 * GiB)
        assert pynvml.nvmlDeviceGetMemoryInfo(m1, version=pynvml.nvmlMemory_v2).total == 40 * GiB
        assert (pynvml.nvmlDeviceGetGpuInstanceId(m0), pynvml.nvmlDeviceGetComputeInstanceId(m0)) == (7, 0)
        assert pynvml.nvmlDeviceGetGpuInstanceId(m1) == 2
        parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m1)
        assert pynvml.nvmlDeviceGetIndex(parent) == 0
        assert ctypes.cast(parent, ctypes.c_void_p).value == ctypes.cast(h0, ctypes.c_void_p).value
        assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(gpus[0].uuid)) == 0
        by_uuid = pynvml.nvmlDeviceGetHandleByUUID(a)
        assert ctypes.cast(by_uuid, ctypes.c_void_p).value == ctypes.cast(m0, ctypes.c_void_p).value
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetUtilizationRates(m0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetGpuInstanceId(h0)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h0)
        # processes: the parent lists all, each MIG device its own
        all_procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h0)
        assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in all_procs] == [(100, 7, 0), (200, 2, 0)]
        assert [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(m1)] == [(200, 5 * GiB)]
        # MIG disabled: its handles are gone
        gpus[0].mig_mode = 0
        fake_nvml_inprocess.write(gpus)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetName(m0)


def test_samples(fake_nvml_inprocess: FakeNvml) -> None:
    gpus = make_gpus(2, util_gpu=33, util_memory=11)
    gpus[0].util_samples = [10, 20, 30, 40]
    fake_nvml_inprocess.write(gpus)
    with nvml():
        h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        before = time.time_ns() // 1000
        vtype, samples = pynvml.nvmlDeviceGetSamples(h0, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
        assert vtype == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        assert [s.sampleValue.uiVal for s in samples] == [10, 20, 30, 40]
        stamps = [s.timeStamp for s in samples]
        assert [b - a for a, b in zip(stamps, stamps[1:])] == [166667] * 3
        assert before - 166667 <= stamps[-1] <= time.time_ns() // 1000
        _, newer = pynvml.nvmlDeviceGetSamples(h0, pynvml.NVML_GPU_UTILIZATION_SAMPLES, stamps[1])
        assert [s.sampleValue.uiVal for s in newer] == [30, 40]
        with pytest.raises(pynvml.NVMLError_NotFound):  # nothing newer than the last one
            pynvml.nvmlDeviceGetSamples(h0, pynvml.NVML_GPU_UTILIZATION_SAMPLES, stamps[-1])
        _, synth = pynvml.nvmlDeviceGetSamples(h1, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
        assert len(synth) == 12 and {s.sampleValue.uiVal for s in synth} == {33}
        assert synth[-1].timeStamp - synth[0].timeStamp == 11 * 166667
        _, mem = pynvml.nvmlDeviceGetSamples(h0, pynvml.NVML_MEMORY_UTILIZATION_SAMPLES, 0)
        assert {s.sampleValue.uiVal for s in mem} == {11}
        # raw call with too small a buffer
        count, vt = ctypes.c_uint(2), ctypes.c_uint()
        buf = (pynvml.c_nvmlSample_t * 2)()
        rc = pynvml.nvmlLib.nvmlDeviceGetSamples(h0, 1, ctypes.c_ulonglong(0), ctypes.byref(vt),
                                                 ctypes.byref(count), buf)
        assert rc == pynvml.NVML_ERROR_INSUFFICIENT_SIZE and count.value == 4


# --------------------------------------------------------------------------------------------
# third-party tools (subprocesses: nvitop keeps NVML initialised until exit)
# --------------------------------------------------------------------------------------------


def _tool_gpus() -> list[FakeGPU]:
    gpus = make_gpus(3, memory_used=10 * GiB, util_gpu=40, util_memory=12, fan=30, temperature=50,
                     power_usage=150_000)
    gpus[1].name = "NVIDIA H100 80GB HBM3"
    gpus[1].processes = [FakeProcess(os.getpid(), 2 * GiB)]
    gpus[2].mig_mode = 1
    gpus[2].migs = [FakeMig("3g.40gb", "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", 40 * GiB, 3 * GiB, 1, 0)]
    return gpus


needs_nvitop = pytest.mark.skipif(importlib.util.find_spec("nvitop") is None, reason="nvitop is not installed")
needs_gpustat = pytest.mark.skipif(importlib.util.find_spec("gpustat") is None, reason="gpustat is not installed")


@needs_nvitop
def test_nvitop_device_all(fake_nvml: FakeNvml) -> None:
    gpus = _tool_gpus()
    fake_nvml.write(gpus)
    out = run_py(fake_nvml, """
        import json
        from nvitop import Device
        res = []
        for d in Device.all():
            res.append({"name": d.name(), "uuid": d.uuid(), "bus_id": d.bus_id(), "total": d.memory_total(),
                        "used": d.memory_used(), "free": d.memory_free(), "gpu": d.gpu_utilization(),
                        "mem": d.memory_utilization(), "temp": d.temperature(), "power": d.power_usage(),
                        "limit": d.power_limit(), "fan": d.fan_speed(), "compute_mode": d.compute_mode(),
                        "mig_mode": d.mig_mode(), "pids": sorted(d.processes()),
                        "migs": [[m.name(), m.uuid(), m.memory_total(), m.gpu_instance_id()]
                                 for m in d.mig_devices()]})
        print(json.dumps(res))
    """)
    assert [d["name"] for d in out] == [g.name for g in gpus]
    assert [d["uuid"] for d in out] == [g.uuid for g in gpus]
    assert [d["bus_id"] for d in out] == [g.pci_bus_id for g in gpus]
    for d in out:
        assert (d["total"], d["used"], d["free"]) == (80 * GiB, 10 * GiB, 70 * GiB)
        assert (d["gpu"], d["mem"], d["temp"], d["power"], d["limit"], d["fan"]) == (40, 12, 50, 150_000, 400_000, 30)
        assert d["compute_mode"] == "Default"
    assert out[1]["pids"] == [os.getpid()] and out[0]["pids"] == []
    assert [d["mig_mode"] for d in out] == ["N/A", "N/A", "Enabled"]
    assert out[2]["migs"] == [["NVIDIA A100-SXM4-80GB MIG 3g.40gb", "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
                               40 * GiB, 1]]


@needs_nvitop
def test_nvitop_cli(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(_tool_gpus())
    env = fake_nvml.env()
    env.update(TERM="xterm-256color", COLUMNS="160", LINES="50")
    proc = subprocess.run([sys.executable, "-m", "nvitop", "-1"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "ERROR" not in proc.stderr
    assert "Driver Version: 550.54.15" in proc.stdout and "CUDA Driver Version: 12.4" in proc.stdout
    assert proc.stdout.count("A100-SXM4-80GB") == 2 and "H100 80GB HBM3" in proc.stdout
    assert "00000000:0A:00.0" in proc.stdout and "3g.40gb" in proc.stdout


@needs_gpustat
def test_gpustat_new_query(fake_nvml: FakeNvml) -> None:
    gpus = _tool_gpus()
    gpus[0].fan = None
    gpus[2].errors = {"*": 15}
    fake_nvml.write(gpus)
    out = run_py(fake_nvml, """
        import json
        from gpustat import GPUStatCollection
        stats = GPUStatCollection.new_query()
        print(json.dumps({"driver": stats.driver_version, "gpus": [g.jsonify() for g in stats.gpus]},
                         default=str))
    """)
    assert out["driver"] == "550.54.15"
    g0, g1, g2 = out["gpus"]
    assert [g0["uuid"], g1["uuid"]] == [gpus[0].uuid, gpus[1].uuid]
    assert g1["name"] == "NVIDIA H100 80GB HBM3"
    assert (g0["memory.total"], g0["memory.used"]) == (81920, 10240)
    assert (g0["utilization.gpu"], g0["temperature.gpu"], g0["power.draw"], g0["enforced.power.limit"]) == \
        (40, 50, 150, 400)
    assert g0["fan.speed"] is None and g1["fan.speed"] == 30
    assert [p["pid"] for p in g1["processes"]] == [os.getpid()] and g1["processes"][0]["gpu_memory_usage"] == 2048
    assert "lost" in str(g2.get("name", "")).lower()  # gpustat's InvalidGPU for NVML_ERROR_GPU_IS_LOST


@needs_gpustat
def test_gpustat_cli_json(fake_nvml: FakeNvml) -> None:
    gpus = _tool_gpus()
    fake_nvml.write(gpus)
    proc = subprocess.run([sys.executable, "-m", "gpustat", "--json"], env=fake_nvml.env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["driver_version"] == "550.54.15"
    assert [g["uuid"] for g in data["gpus"]] == [g.uuid for g in gpus]
    assert [g["utilization.gpu"] for g in data["gpus"]] == [40, 40, 40]


# -- telemetry: energy, PCIe replays, remapped rows, field values, XID events, GPM ----------------
def test_telemetry_calls_answer_from_the_state(fake_nvml_inprocess: FakeNvml) -> None:
    gpus = make_gpus(2, energy=1000, pcie_replay=4, remapped_rows=(3, 2, 1, 0), memory_temperature=66,
                     power_usage=0)
    gpus[1] = make_gpus(2)[1]  # nothing modelled: NOT_SUPPORTED
    fake_nvml_inprocess.write(gpus)
    with nvml():
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        assert pynvml.nvmlDeviceGetTotalEnergyConsumption(h0) == 1000  # 0 W: does not grow
        assert pynvml.nvmlDeviceGetPcieReplayCounter(h0) == 4
        assert pynvml.nvmlDeviceGetRemappedRows(h0) == (3, 2, 1, 0)
        [v] = pynvml.nvmlDeviceGetFieldValues(h0, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
        assert (v.nvmlReturn, v.value.ullVal) == (0, 66)
        [v] = pynvml.nvmlDeviceGetFieldValues(h1, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
        assert v.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
        for fn in (pynvml.nvmlDeviceGetTotalEnergyConsumption, pynvml.nvmlDeviceGetPcieReplayCounter,
                   pynvml.nvmlDeviceGetRemappedRows):
            with pytest.raises(pynvml.NVMLError) as exc:
                fn(h1)
            assert exc.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
        # a malformed telemetry line makes the file malformed: the previous state stays
        fake_nvml_inprocess.write_text(render_state(gpus).replace("remapped_rows 3 2 1 0", "remapped_rows 3"))
        assert pynvml.nvmlDeviceGetRemappedRows(h0) == (3, 2, 1, 0)


def test_xid_events_are_delivered_once_each_after_registration(fake_nvml_inprocess: FakeNvml) -> None:
    gpus = make_gpus(1, xids=[13])  # an XID from before registration is not an event
    fake_nvml_inprocess.write(gpus)
    with nvml():
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetSupportedEventTypes(h) == pynvml.nvmlEventTypeXidCriticalError
        es = pynvml.nvmlEventSetCreate()
        try:
            pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
            with pytest.raises(pynvml.NVMLError) as exc:
                pynvml.nvmlEventSetWait(es, 30)
            assert exc.value.value == pynvml.NVML_ERROR_TIMEOUT
            gpus[0].xids = [13, 79, 48]
            fake_nvml_inprocess.write(gpus)
            got = [pynvml.nvmlEventSetWait(es, 1000) for _ in range(2)]
            assert [(int(e.eventType), int(e.eventData)) for e in got] == [(8, 79), (8, 48)]
            assert ctypes.cast(got[0].device, ctypes.c_void_p).value == ctypes.cast(h, ctypes.c_void_p).value
            with pytest.raises(pynvml.NVMLError):
                pynvml.nvmlEventSetWait(es, 30)  # each once
        finally:
            pynvml.nvmlEventSetFree(es)
        gpus[0].xid_events = False
        fake_nvml_inprocess.write(gpus)
        es = pynvml.nvmlEventSetCreate()
        try:
            with pytest.raises(pynvml.NVMLError) as exc:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
            assert exc.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
        finally:
            pynvml.nvmlEventSetFree(es)


def test_gpm_metrics_between_two_samples(fake_nvml_inprocess: FakeNvml) -> None:
    gpus = make_gpus(2)
    gpus[0].gpm = {5: 35, 10: 20}
    fake_nvml_inprocess.write(gpus)
    with nvml():
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        assert pynvml.nvmlGpmQueryDeviceSupport(h0).isSupportedDevice == 1
        assert pynvml.nvmlGpmQueryDeviceSupport(h1).isSupportedDevice == 0
        a, b = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
        try:
            pynvml.nvmlGpmSampleGet(h0, a)
            time.sleep(0.01)
            pynvml.nvmlGpmSampleGet(h0, b)
            mg = pynvml.c_nvmlGpmMetricsGet_t()
            mg.version, mg.numMetrics, mg.sample1, mg.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, 3, a, b
            for i, mid in enumerate((5, 10, 1)):
                mg.metrics[i].metricId = mid
            pynvml.nvmlGpmMetricsGet(mg)
            assert [(m.metricId, m.nvmlReturn, m.value) for m in mg.metrics[:3]] == [
                (5, 0, 35.0), (10, 0, 20.0), (1, pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0)]
            mg.sample1, mg.sample2 = b, a  # the second sample must be the later one
            with pytest.raises(pynvml.NVMLError):
                pynvml.nvmlGpmMetricsGet(mg)
            with pytest.raises(pynvml.NVMLError) as exc:
                pynvml.nvmlGpmSampleGet(h1, a)
            assert exc.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
        finally:
            pynvml.nvmlGpmSampleFree(a)
            pynvml.nvmlGpmSampleFree(b)
