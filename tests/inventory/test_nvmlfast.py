"""gpusd.inventory.nvmlfast against nvidia-ml-py, its reference, on the fake libnvidia-ml.so.1: each function
calls the same NVML symbols with structures of the same layout, and answers (or fails) as the library's
function of the same name does; whole snapshots read through either are the same."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import pytest

from fakenvml import FakeMig, FakeProcess, make_gpus, nvlink_pairs
from gpusd.inventory import nvmlfast
from gpusd.inventory.nvml import NvmlBackend, bindings

pynvml = pytest.importorskip("pynvml")

GiB = 2**30


PAIRS = [("c_nvmlMemory_t", "c_nvmlMemory_t"), ("c_nvmlUtilization_t", "c_nvmlUtilization_t"),
         ("nvmlPciInfo_t", "nvmlPciInfo_t"), ("c_nvmlProcessInfo_v3_t", "c_nvmlProcessInfo_v3_t"),
         ("c_nvmlValue_t", "c_nvmlValue_t"), ("c_nvmlSample_t", "c_nvmlSample_t")]


def _layout(cls: Any) -> Any:
    return ctypes.sizeof(cls), ctypes.alignment(cls), [
        (name, getattr(cls, name).offset, getattr(cls, name).size) for name, _ in cls._fields_]


def _different_layouts() -> list[str]:
    return [ours for ours, theirs in PAIRS if _layout(getattr(nvmlfast, ours)) != _layout(getattr(pynvml, theirs))]


def test_the_structures_have_nvidia_ml_py_layouts() -> None:
    assert _different_layouts() == []
    assert nvmlfast.NVML_GPU_UTILIZATION_SAMPLES == pynvml.NVML_GPU_UTILIZATION_SAMPLES
    assert nvmlfast.NVML_P2P_CAPS_INDEX_NVLINK == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
    assert nvmlfast.NVML_VALUE_NOT_AVAILABLE_ULONGLONG == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value


def _state(fake: Any) -> None:
    """Four GPUs that make every function of nvmlfast answer something, or fail in a known way."""
    gpus = make_gpus(4, memory_used=12 * GiB, util_gpu=35, util_memory=10, temperature=50, power_usage=180_000,
                     numa_node=0, cpu_affinity="0-3,8", pcie_switch=1)
    gpus[0].processes = [FakeProcess(os.getpid(), 4 * GiB), FakeProcess(999_999_9, GiB)]
    gpus[0].graphics_processes = [FakeProcess(os.getpid(), GiB), FakeProcess(31337, 2 * GiB)]
    gpus[0].fan = 40
    gpus[1].mig_mode = 1
    gpus[1].migs = [FakeMig("3g.40gb", "MIG-11111111-2222-3333-4444-555555555555", 40 * GiB, 5 * GiB, 1, 0),
                    FakeMig("1g.10gb", "MIG-66666666-7777-8888-9999-000000000000", 10 * GiB, 0, 2, 0)]
    gpus[1].processes = [FakeProcess(os.getpid(), 5 * GiB, 1, 0)]
    gpus[2].util_samples = [0, 50, 100, 20]
    gpus[2].errors = {"nvmlDeviceGetTemperature": 999, "nvmlDeviceGetPowerUsage": 3}
    gpus[3].errors = {"*": 15}  # lost
    gpus[3].numa_node = 1
    nvlink_pairs(gpus, [(0, 1)], links=4)
    fake.write(gpus)


def _plain(value: Any) -> Any:
    """An answer as data: a structure's fields, a process's attributes, bytes decoded, lists kept."""
    if isinstance(value, (ctypes.c_void_p, ctypes._Pointer)):  # a device handle: each binding has its own type
        return "handle" if value else None
    if isinstance(value, (ctypes.Structure, ctypes.Union)):
        return {name: _plain(getattr(value, name)) for name, _ in value._fields_}
    if isinstance(value, ctypes.Array):
        return [_plain(v) for v in value]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode()
    if hasattr(value, "pid") and hasattr(value, "usedGpuMemory"):  # a process list's entry
        return {k: getattr(value, k) for k in ("pid", "usedGpuMemory", "gpuInstanceId", "computeInstanceId")}
    return value


def _answer(module: Any, name: str, *args: Any) -> Any:
    try:
        return ("ok", _plain(getattr(module, name)(*args)))
    except module.NVMLError as exc:
        return ("error", exc.value, str(exc))


@pytest.fixture
def both(fake_nvml_inprocess: Any) -> Any:
    if _different_layouts():  # a call would write past a structure: fail here rather than crash
        pytest.fail(f"structures differ from nvidia-ml-py's: {_different_layouts()}")
    _state(fake_nvml_inprocess)
    pynvml.nvmlInit()
    nvmlfast.nvmlInit()
    yield fake_nvml_inprocess
    nvmlfast.nvmlShutdown()
    pynvml.nvmlShutdown()


def _calls(module: Any) -> list[tuple[str, tuple[Any, ...]]]:
    """Every function nvmlfast has, with the arguments NvmlBackend passes, over the fake's GPUs."""
    out: list[tuple[str, tuple[Any, ...]]] = [
        ("nvmlSystemGetDriverVersion", ()), ("nvmlSystemGetNVMLVersion", ()), ("nvmlSystemGetCudaDriverVersion", ()),
        ("nvmlDeviceGetCount", ()), ("nvmlDeviceGetHandleByIndex", (9,))]
    handles = [module.nvmlDeviceGetHandleByIndex(i) for i in range(module.nvmlDeviceGetCount())]
    for i, h in enumerate(handles):
        out += [(name, (h,)) for name in (
            "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetPciInfo", "nvmlDeviceGetNumaNodeId",
            "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetFanSpeed", "nvmlDeviceGetComputeMode",
            "nvmlDeviceGetMigMode", "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
            "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId")]
        out += [("nvmlDeviceGetTemperature", (h, 0)), ("nvmlDeviceGetCpuAffinity", (h, 16)),
                ("nvmlDeviceGetSamples", (h, module.NVML_GPU_UTILIZATION_SAMPLES, 0)),
                ("nvmlDeviceGetNvLinkState", (h, 0)), ("nvmlDeviceGetNvLinkState", (h, 30)),
                ("nvmlDeviceGetNvLinkRemotePciInfo", (h, 0)), ("nvmlDeviceGetNvLinkRemotePciInfo", (h, 5))]
        out += [("nvmlDeviceGetTopologyNearestGpus", (h, level)) for level in (0, 10, 20, 30, 40)]
        for other in handles:
            out += [("nvmlDeviceGetTopologyCommonAncestor", (h, other)),
                    ("nvmlDeviceGetP2PStatus", (h, other, module.NVML_P2P_CAPS_INDEX_NVLINK))]
        for k in range(3):
            try:
                mig = module.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except module.NVMLError as exc:
                out.append(("nvmlDeviceGetMigDeviceHandleByIndex", (h, k)))
                assert exc.value in (2, 3, 6, 15), (i, k)
                continue
            out.append(("nvmlDeviceGetMigDeviceHandleByIndex", (h, k)))
            out += [(name, (mig,)) for name in ("nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo",
                                                "nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId")]
    return out


def test_every_function_answers_as_nvidia_ml_py(both: Any) -> None:
    ours, theirs = _calls(nvmlfast), _calls(pynvml)
    assert [name for name, _ in ours] == [name for name, _ in theirs]
    assert {name for name, _ in ours} | {"nvmlInit", "nvmlShutdown", "nvmlErrorString"} == set(nvmlfast.FUNCTIONS)
    kinds = set()
    for (name, args), (_, their_args) in zip(ours, theirs):
        mine, ref = _answer(nvmlfast, name, *args), _answer(pynvml, name, *their_args)
        if name == "nvmlDeviceGetSamples" and mine[0] == "ok":  # the samples: their values, not their times
            mine = (mine[0], mine[1][0], [s["sampleValue"]["uiVal"] for s in mine[1][1]])
            ref = (ref[0], ref[1][0], [s["sampleValue"]["uiVal"] for s in ref[1][1]])
        assert mine == ref, (name, args)
        kinds.add((name, mine[0]))
    # the state made each kind of answer happen (so the comparison compared something)
    for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMigDeviceHandleByIndex",
                 "nvmlDeviceGetNvLinkRemotePciInfo", "nvmlDeviceGetSamples", "nvmlDeviceGetTemperature"):
        assert {(name, "ok"), (name, "error")} <= kinds, name


def test_every_function_calls_the_symbols_nvidia_ml_py_calls(both: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    called: dict[str, list[str]] = {"ours": [], "theirs": []}
    real_ours, real_theirs = nvmlfast._fn, pynvml._nvmlGetFunctionPointer

    def ours(name: str) -> Any:
        called["ours"].append(name)
        return real_ours(name)

    def theirs(name: str) -> Any:
        called["theirs"].append(name)
        return real_theirs(name)

    monkeypatch.setattr(nvmlfast, "_fn", ours)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", theirs)
    for module in (nvmlfast, pynvml):
        for name, args in _calls(module):
            _answer(module, name, *args)
        _answer(module, "nvmlErrorString", 15)
    assert called["ours"] == called["theirs"] and len(called["ours"]) > 150
    nvmlfast.nvmlShutdown(), pynvml.nvmlShutdown()
    nvmlfast.nvmlInit(), pynvml.nvmlInit()
    assert called["ours"][-2:] == called["theirs"][-2:] == ["nvmlShutdown", "nvmlInitWithFlags"]


def test_errors_say_what_nvidia_ml_py_says(both: Any) -> None:
    codes = sorted({getattr(pynvml, n) for n in dir(pynvml) if n.startswith("NVML_ERROR_")} | {77, 1000})
    for code in codes:
        assert str(nvmlfast.NVMLError(code)) == str(pynvml.NVMLError(code)), code
        assert nvmlfast.NVMLError(code).value == code


def test_snapshots_read_either_way_are_the_same(both: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    snaps = []
    for choice in ("nvidia-ml-py", "auto"):
        monkeypatch.setenv("GPUSD_NVML_BINDINGS", choice)
        b = NvmlBackend()
        assert b._nv is (pynvml if choice == "nvidia-ml-py" else nvmlfast)
        try:
            for detail in (True, False):
                d = b.snapshot(detail=detail).to_dict()
                d.pop("timestamp")
                for g in d["gpus"]:  # the driver's samples, averaged up to now: now differs by a few ms
                    g["utilization_window"] = round(g["utilization_window"] or 0)
                snaps.append(d)
        finally:
            b.close()
    assert snaps[0] == snaps[2] and snaps[1] == snaps[3]
    gpus = snaps[0]["gpus"]
    assert gpus[0]["processes"] and gpus[1]["mig_instances"] and gpus[0]["topology"] and not gpus[3]["healthy"]


def test_telemetry_and_the_setting_choose_nvidia_ml_py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUSD_NVML_BINDINGS", raising=False)
    assert bindings() is nvmlfast and bindings(telemetry=True) is pynvml
    monkeypatch.setenv("GPUSD_NVML_BINDINGS", "nvidia-ml-py")
    assert bindings() is pynvml
    monkeypatch.setenv("GPUSD_NVML_BINDINGS", "fastest")
    from gpusd.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="GPUSD_NVML_BINDINGS"):
        bindings()


@pytest.mark.parametrize("lacking", [("_v3",), ("_v3", "_v2")], ids=["no _v3 (R470)", "no _v3, no _v2"])
def test_a_driver_without_the_newest_process_functions_still_lists_processes(
        both: Any, monkeypatch: pytest.MonkeyPatch, lacking: tuple[str, ...]) -> None:
    """Drivers before R510 have no ``*RunningProcesses_v3`` (nvidia-ml-py asks it alone): the process lists
    come from the older functions, through either binding, not as "unsupported" (an empty list: a busy GPU
    taken for a free one)."""
    def expected() -> list[list[tuple[int, Any]]]:
        b = NvmlBackend()
        try:
            return [[(p.pid, p.used_memory) for p in g.processes] for g in b.snapshot().gpus]
        finally:
            b.close()

    monkeypatch.setenv("GPUSD_NVML_BINDINGS", "auto")
    want = expected()
    assert any(want)
    real_ours, real_theirs = nvmlfast._fn, pynvml._nvmlGetFunctionPointer

    def missing(name: str) -> bool:
        return "RunningProcesses" in name and name.endswith(lacking)

    def ours(name: str) -> Any:
        if missing(name):
            raise nvmlfast.NVMLError(nvmlfast.NVML_ERROR_FUNCTION_NOT_FOUND)
        return real_ours(name)

    def theirs(name: str) -> Any:
        if missing(name):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return real_theirs(name)

    monkeypatch.setattr(nvmlfast, "_process_version", {})  # (what this process's driver had: found again)
    monkeypatch.setattr(nvmlfast, "_fn", ours)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", theirs)
    assert expected() == want  # nvmlfast: down to _v2, or the unversioned functions
    if lacking == ("_v3",):  # nvidia-ml-py has no unversioned function left to ask
        monkeypatch.setenv("GPUSD_NVML_BINDINGS", "nvidia-ml-py")
        assert expected() == want
