"""NVML through ctypes for the quick commands: the calls a snapshot without telemetry makes, without
importing nvidia-ml-py (its import costs a one-shot command ~10 ms, more than all of gpusd's
own modules on that path: ~200 ctypes structures and exception classes, and ``ctypes.util``, which
imports ``subprocess``).

nvidia-ml-py stays gpusd's NVML binding and the reference: the daemon reads telemetry through it, and
``GPUSD_NVML_BINDINGS=nvidia-ml-py`` makes every backend use it.  This module answers the names
:class:`gpusd.inventory.nvml.NvmlBackend` calls when it reads no telemetry, as nvidia-ml-py answers
them: each function calls the NVML symbol that nvidia-ml-py's function of the same name calls, with
the same structures, returns the same values (a structure's numbers, a decoded string, a process's
``usedGpuMemory`` None where NVML cannot tell), and raises :class:`NVMLError` with the same ``value``
and message.  ``tests/inventory/test_nvmlfast.py`` checks it against nvidia-ml-py: the symbols each
function calls, the structures' layouts, each function's answers on the fake NVML (failures
included), and whole snapshots read both ways.
"""

from __future__ import annotations

# a lock alone: importing threading costs a one-shot command ~1.5 ms
import _thread
import ctypes
from ctypes import (
    Structure,
    Union,
    byref,
    c_char,
    c_double,
    c_int,
    c_longlong,
    c_uint,
    c_ulong,
    c_ulonglong,
    c_ushort,
    c_void_p,
    create_string_buffer,
)

# typing is not imported at run time: start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

# found by its soname, as nvidia-ml-py finds it (after load_library's path)
LIBRARY = "libnvidia-ml.so.1"

# Return codes and constants (nvml.h; nvidia-ml-py's names and values).
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_GPU_UTILIZATION_SAMPLES = 1
NVML_P2P_CAPS_INDEX_NVLINK = 2
# a process's memory where NVML cannot tell
NVML_VALUE_NOT_AVAILABLE_ULONGLONG = 0xFFFFFFFFFFFFFFFF
# a process list's entries asked for in one call (a GPU seldom runs more)
_PROCESSES_BUFFER = 32
# samples asked for in one call (a driver keeps about 20 s of 1/6 s samples: 120)
_SAMPLES_BUFFER = 128

# Buffer sizes (nvml.h).
# NVML_DEVICE_UUID_V2_BUFFER_SIZE
_UUID_SIZE = 96
# NVML_DEVICE_NAME_V2_BUFFER_SIZE
_NAME_SIZE = 96
# NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE, NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE
_VERSION_SIZE = 80

# nvidia-ml-py's words for the codes it knows (NVMLError._errcode_to_string); any other code is
# described by the library's nvmlErrorString, as there.
_MESSAGES = {
    1: "Uninitialized", 2: "Invalid Argument", 3: "Not Supported", 4: "Insufficient Permissions",
    5: "Already Initialized", 6: "Not Found", 7: "Insufficient Size", 8: "Insufficient External Power",
    9: "Driver Not Loaded", 10: "Timeout", 11: "Interrupt Request Issue", 12: "NVML Shared Library Not Found",
    13: "Function Not Found", 14: "Corrupted infoROM", 15: "GPU is lost", 16: "GPU requires restart",
    17: "The operating system has blocked the request.", 18: "RM has detected an NVML/RM version mismatch.",
    20: "Insufficient Memory", 999: "Unknown Error",
}


class NVMLError(Exception):
    """An NVML call failed: ``value`` is NVML's return code (as :class:`pynvml.NVMLError`'s)."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        text = _MESSAGES.get(self.value)
        if text is None:
            try:
                text = _MESSAGES[self.value] = str(nvmlErrorString(self.value))
            except NVMLError:
                return f"NVML Error with code {self.value}"
        return text


# -- the structures (nvml.h; the layouts of nvidia-ml-py's c_nvml* structures, checked by the tests) --
class c_nvmlMemory_t(Structure):
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]


class c_nvmlUtilization_t(Structure):
    _fields_ = [("gpu", c_uint), ("memory", c_uint)]


class nvmlPciInfo_t(Structure):
    _fields_ = [("busIdLegacy", c_char * 16), ("domain", c_uint), ("bus", c_uint), ("device", c_uint),
                ("pciDeviceId", c_uint), ("pciSubSystemId", c_uint), ("busId", c_char * 32)]


class c_nvmlProcessInfo_v3_t(Structure):
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong), ("gpuInstanceId", c_uint),
                ("computeInstanceId", c_uint)]


# the unversioned functions' (drivers before R510's _v2/_v3)
class c_nvmlProcessInfo_v1_t(Structure):
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong)]


class c_nvmlValue_t(Union):
    _fields_ = [("dVal", c_double), ("uiVal", c_uint), ("ulVal", c_ulong), ("ullVal", c_ulonglong),
                ("sllVal", c_longlong), ("siVal", c_int), ("usVal", c_ushort)]


class c_nvmlSample_t(Structure):
    _fields_ = [("timeStamp", c_ulonglong), ("sampleValue", c_nvmlValue_t)]


class Process:
    """One entry of a process list, as nvidia-ml-py gives it (its ``nvmlFriendlyObject``)."""

    __slots__ = ("computeInstanceId", "gpuInstanceId", "pid", "usedGpuMemory")

    def __init__(self, info: c_nvmlProcessInfo_v3_t | c_nvmlProcessInfo_v1_t) -> None:
        self.pid = info.pid
        used = info.usedGpuMemory
        self.usedGpuMemory = None if used == NVML_VALUE_NOT_AVAILABLE_ULONGLONG else used
        # (a v1 entry has no instance ids)
        self.gpuInstanceId = getattr(info, "gpuInstanceId", None)
        self.computeInstanceId = getattr(info, "computeInstanceId", None)


# -- the library and its functions ----------------------------------------------------------------------
_lib: Any = None
_lock = _thread.allocate_lock()
_functions: dict[str, Any] = {}


def _fn(name: str) -> Any:
    """The library's function ``name`` (looked up once); NVMLError as nvidia-ml-py raises it where the
    library is not loaded or lacks the symbol."""
    fn = _functions.get(name)
    if fn is None:
        with _lock:
            if _lib is None:
                raise NVMLError(NVML_ERROR_UNINITIALIZED)
            try:
                fn = _functions[name] = getattr(_lib, name)
            except AttributeError:
                raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND) from None
    return fn


def _check(ret: int) -> None:
    if ret != NVML_SUCCESS:
        raise NVMLError(ret)


def _load() -> None:
    global _lib
    with _lock:
        if _lib is None:
            try:
                _lib = ctypes.CDLL(LIBRARY)
            except OSError:
                raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND) from None


def nvmlInit() -> None:
    _load()
    _check(_fn("nvmlInitWithFlags")(0))


def nvmlShutdown() -> None:
    _check(_fn("nvmlShutdown")())


def nvmlErrorString(result: int) -> str:
    fn = _fn("nvmlErrorString")
    fn.restype = ctypes.c_char_p
    text = fn(result)
    return text.decode() if isinstance(text, bytes) else str(text)


def _text(symbol: str, size: int, *args: Any) -> str:
    buf = create_string_buffer(size)
    _check(_fn(symbol)(*args, buf, c_uint(size)))
    return buf.value.decode()


def _out(symbol: str, kind: Any, *args: Any) -> Any:
    """The ``kind`` (a ctypes type) that ``symbol`` fills, its last argument, after ``args``."""
    out = kind()
    _check(_fn(symbol)(*args, byref(out)))
    return out


def _uint(symbol: str, *args: Any) -> int:
    return int(_out(symbol, c_uint, *args).value)


def nvmlSystemGetDriverVersion() -> str:
    return _text("nvmlSystemGetDriverVersion", _VERSION_SIZE)


def nvmlSystemGetNVMLVersion() -> str:
    return _text("nvmlSystemGetNVMLVersion", _VERSION_SIZE)


def nvmlSystemGetCudaDriverVersion() -> int:
    return int(_out("nvmlSystemGetCudaDriverVersion", c_int).value)


def nvmlDeviceGetCount() -> int:
    return _uint("nvmlDeviceGetCount_v2")


def nvmlDeviceGetHandleByIndex(index: int) -> c_void_p:
    return _out("nvmlDeviceGetHandleByIndex_v2", c_void_p, c_uint(index))  # type: ignore[no-any-return]


def nvmlDeviceGetUUID(handle: c_void_p) -> str:
    return _text("nvmlDeviceGetUUID", _UUID_SIZE, handle)


def nvmlDeviceGetName(handle: c_void_p) -> str:
    return _text("nvmlDeviceGetName", _NAME_SIZE, handle)


def nvmlDeviceGetPciInfo(handle: c_void_p) -> nvmlPciInfo_t:
    return _out("nvmlDeviceGetPciInfo_v3", nvmlPciInfo_t, handle)  # type: ignore[no-any-return]


def nvmlDeviceGetNumaNodeId(handle: c_void_p) -> int:
    return int(_out("nvmlDeviceGetNumaNodeId", c_int, handle).value)


def nvmlDeviceGetCpuAffinity(handle: c_void_p, cpu_set_size: int) -> Any:
    mask = (c_ulonglong * cpu_set_size)()
    _check(_fn("nvmlDeviceGetCpuAffinity")(handle, cpu_set_size, byref(mask)))
    return mask


def nvmlDeviceGetTopologyCommonAncestor(device1: c_void_p, device2: c_void_p) -> int:
    return _uint("nvmlDeviceGetTopologyCommonAncestor", device1, device2)


def nvmlDeviceGetTopologyNearestGpus(device: c_void_p, level: int) -> list[c_void_p]:
    fn = _fn("nvmlDeviceGetTopologyNearestGpus")
    count = c_uint(0)
    # the number, then the handles (as nvidia-ml-py)
    _check(fn(device, c_uint(level), byref(count), None))
    handles = (c_void_p * count.value)()
    _check(fn(device, c_uint(level), byref(count), handles))
    return [c_void_p(h) for h in handles[0:count.value]]


def nvmlDeviceGetP2PStatus(device1: c_void_p, device2: c_void_p, p2p_index: int) -> int:
    return _uint("nvmlDeviceGetP2PStatus", device1, device2, p2p_index)


def nvmlDeviceGetNvLinkState(device: c_void_p, link: int) -> int:
    return _uint("nvmlDeviceGetNvLinkState", device, link)


def nvmlDeviceGetNvLinkRemotePciInfo(device: c_void_p, link: int) -> nvmlPciInfo_t:
    return _out("nvmlDeviceGetNvLinkRemotePciInfo_v2", nvmlPciInfo_t, device, link)  # type: ignore[no-any-return]


def nvmlDeviceGetMemoryInfo(handle: c_void_p) -> c_nvmlMemory_t:
    return _out("nvmlDeviceGetMemoryInfo", c_nvmlMemory_t, handle)  # type: ignore[no-any-return]


def nvmlDeviceGetUtilizationRates(handle: c_void_p) -> c_nvmlUtilization_t:
    return _out("nvmlDeviceGetUtilizationRates", c_nvmlUtilization_t, handle)  # type: ignore[no-any-return]


def nvmlDeviceGetTemperature(handle: c_void_p, sensor: int) -> int:
    return _uint("nvmlDeviceGetTemperature", handle, c_uint(sensor))


def nvmlDeviceGetPowerUsage(handle: c_void_p) -> int:
    return _uint("nvmlDeviceGetPowerUsage", handle)


def nvmlDeviceGetEnforcedPowerLimit(handle: c_void_p) -> int:
    return _uint("nvmlDeviceGetEnforcedPowerLimit", handle)


def nvmlDeviceGetFanSpeed(handle: c_void_p) -> int:
    return _uint("nvmlDeviceGetFanSpeed", handle)


def nvmlDeviceGetComputeMode(handle: c_void_p) -> int:
    return _uint("nvmlDeviceGetComputeMode", handle)


def nvmlDeviceGetMigMode(device: c_void_p) -> list[int]:
    current, pending = c_uint(), c_uint()
    _check(_fn("nvmlDeviceGetMigMode")(device, byref(current), byref(pending)))
    return [current.value, pending.value]


def nvmlDeviceGetSamples(device: c_void_p, sampling_type: int, since_us: int) -> tuple[int, list[c_nvmlSample_t]]:
    fn = _fn("nvmlDeviceGetSamples")
    kind, since, value_type = c_uint(sampling_type), c_ulonglong(since_us), c_uint()
    # One call where the samples fit a buffer as large as drivers keep (nvidia-ml-py first asks for the
    # number, a second call a pick makes per GPU: a driver call costs tens of microseconds); where they
    # do not, the number, then the samples, as nvidia-ml-py asks.
    count = c_uint(_SAMPLES_BUFFER)
    samples = (c_nvmlSample_t * _SAMPLES_BUFFER)()
    ret = fn(device, kind, since, byref(value_type), byref(count), samples)
    if ret == NVML_ERROR_INSUFFICIENT_SIZE:
        count.value = 0
        # the number of samples
        _check(fn(device, kind, since, byref(value_type), byref(count), None))
        samples = (c_nvmlSample_t * count.value)()
        ret = fn(device, kind, since, byref(value_type), byref(count), samples)
    _check(ret)
    return value_type.value, samples[0:count.value]


# Each process list's functions, newest first: _v3 (R510 and later), _v2 (the same entries, R470), and the
# unversioned one (entries without instance ids).  A driver that lacks one is asked the next (nvidia-ml-py
# asks _v3 only: on an older driver its snapshot fails; a list that cannot be read is never taken for an
# empty one, which would make a busy GPU look free).  The one found is kept per list (one assignment).
_PROCESS_FUNCTIONS: dict[str, tuple[tuple[str, Any], ...]] = {
    kind: ((f"{kind}_v3", c_nvmlProcessInfo_v3_t), (f"{kind}_v2", c_nvmlProcessInfo_v3_t),
           (kind, c_nvmlProcessInfo_v1_t))
    for kind in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")}
# kind -> the index in its versions of the one this driver has
_process_version: dict[str, int] = {}


def _process_lister(kind: str) -> tuple[Any, Any]:
    """The process-list function ``kind`` of this driver (the newest it has) and its entry structure."""
    versions = _PROCESS_FUNCTIONS[kind]
    first = _process_version.get(kind, 0)
    for i in range(first, len(versions)):
        symbol, entry = versions[i]
        try:
            fn = _fn(symbol)
        except NVMLError as exc:
            if exc.value != NVML_ERROR_FUNCTION_NOT_FOUND or i == len(versions) - 1:
                raise
            continue
        if i != first:
            # (one assignment: threads finding it together agree)
            _process_version[kind] = i
        return fn, entry
    raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)  # pragma: no cover - the loop raises or returns


def _processes(kind: str, handle: c_void_p) -> list[Process]:
    fn, entry = _process_lister(kind)
    # One call where the processes fit a buffer of _PROCESSES_BUFFER (nvidia-ml-py first asks for the
    # number: a second call for every GPU with a process); where they do not, room for twice as many
    # as there are, plus some started meanwhile, as nvidia-ml-py leaves.
    count = c_uint(_PROCESSES_BUFFER)
    infos = (entry * _PROCESSES_BUFFER)()
    ret = fn(handle, byref(count), infos)
    if ret == NVML_ERROR_INSUFFICIENT_SIZE:
        count.value = count.value * 2 + 5
        infos = (entry * count.value)()
        ret = fn(handle, byref(count), infos)
    _check(ret)
    return [Process(infos[i]) for i in range(count.value)]


def nvmlDeviceGetComputeRunningProcesses(handle: c_void_p) -> list[Process]:
    return _processes("nvmlDeviceGetComputeRunningProcesses", handle)


def nvmlDeviceGetGraphicsRunningProcesses(handle: c_void_p) -> list[Process]:
    return _processes("nvmlDeviceGetGraphicsRunningProcesses", handle)


def nvmlDeviceGetMaxMigDeviceCount(device: c_void_p) -> int:
    return _uint("nvmlDeviceGetMaxMigDeviceCount", device)


def nvmlDeviceGetMigDeviceHandleByIndex(device: c_void_p, index: int) -> c_void_p:
    return _out("nvmlDeviceGetMigDeviceHandleByIndex", c_void_p, device, c_uint(index))  # type: ignore[no-any-return]


def nvmlDeviceGetGpuInstanceId(device: c_void_p) -> int:
    return _uint("nvmlDeviceGetGpuInstanceId", device)


def nvmlDeviceGetComputeInstanceId(device: c_void_p) -> int:
    return _uint("nvmlDeviceGetComputeInstanceId", device)


# The names NvmlBackend calls without telemetry: tests/inventory/test_nvmlfast.py checks each against
# nvidia-ml-py's function of the same name.
FUNCTIONS = (
    "nvmlInit", "nvmlShutdown", "nvmlErrorString", "nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion",
    "nvmlSystemGetCudaDriverVersion", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID",
    "nvmlDeviceGetName", "nvmlDeviceGetPciInfo", "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetCpuAffinity",
    "nvmlDeviceGetTopologyCommonAncestor", "nvmlDeviceGetTopologyNearestGpus", "nvmlDeviceGetP2PStatus",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkRemotePciInfo", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetFanSpeed", "nvmlDeviceGetComputeMode", "nvmlDeviceGetMigMode", "nvmlDeviceGetSamples",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
)

__all__ = ["NVMLError", *FUNCTIONS]
