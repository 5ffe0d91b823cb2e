"""A fake ``libnvidia-ml.so.1`` for tests and benchmarks.

The C source ``fake_nvml.c`` is compiled on demand with the system C compiler.
The real NVML bindings (nvidia-ml-py's ``pynvml``, nvitop, gpustat) then run
against fake GPUs described by a text state file; see ``README.md``.

Typical use in a subprocess::

    libdir = build_fake_nvml()
    write_state(state, make_gpus(2))
    subprocess.run([...], env=fake_env(libdir, state))

In-process::

    preload(libdir)                        # before pynvml loads the library
    os.environ[STATE_ENV] = str(state)
    pynvml.nvmlInit()
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "AUTO",
    "CACHE_ENV",
    "COST_ENV",
    "COUNTS_ENV",
    "REALISTIC_COST",
    "SLOW_COST_ENV",
    "LIB_NAME",
    "SOURCE",
    "STATE_ENV",
    "FakeGPU",
    "FakeMig",
    "FakeNvml",
    "FakeNvmlBuildError",
    "FakeProcess",
    "build_fake_nvml",
    "call_counts",
    "fake_bus_id",
    "fake_env",
    "fake_uuid",
    "make_gpus",
    "nvlink_pairs",
    "preload",
    "render_state",
    "write_state",
]

SOURCE = Path(__file__).with_name("fake_nvml.c")
LIB_NAME = "libnvidia-ml.so.1"
STATE_ENV = "GPUSD_FAKE_NVML_STATE"
CACHE_ENV = "GPUSD_FAKE_NVML_CACHE"
# The driver's cost (microseconds a call spins, read at every call) and the call counter (a directory:
# one file per process, see call_counts); README.md, "Cost and counting".
COST_ENV = "GPUSD_FAKE_NVML_COST_US"
SLOW_COST_ENV = "GPUSD_FAKE_NVML_SLOW_COST_US"
COUNTS_ENV = "GPUSD_FAKE_NVML_COUNTS"
# A driver's cost as measured on real GPUs (README.md, "Cost and counting", gives the sources):
# about 20 us an ordinary query, and at least 1 ms a topology/NVLink query or process list.
REALISTIC_COST = {COST_ENV: "20", SLOW_COST_ENV: "1000"}

_CFLAGS = ["-O2", "-shared", "-fPIC", "-pthread", f"-Wl,-soname,{LIB_NAME}"]


class FakeNvmlBuildError(RuntimeError):
    """The fake NVML library could not be built (no C compiler, or it failed)."""


class _Auto:
    """Marker: derive the value from the GPU's index (see :func:`render_state`)."""

    _instance: "_Auto | None" = None

    def __new__(cls) -> "_Auto":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "AUTO"


AUTO: Any = _Auto()


# --------------------------------------------------------------------------
# building the library
# --------------------------------------------------------------------------


def _find_compiler() -> list[str]:
    cc = os.environ.get("CC")
    if cc:
        argv = shlex.split(cc)
        if argv and shutil.which(argv[0]):
            return argv
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise FakeNvmlBuildError(
        "cannot build the fake libnvidia-ml.so.1: no C compiler found "
        "(looked for $CC, cc, gcc, clang on PATH)"
    )


def _default_cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"gpusd-fake-nvml-{uid}"


def build_fake_nvml(dest_dir: Path | str | None = None) -> Path:
    """Compile ``fake_nvml.c`` and return the directory holding ``libnvidia-ml.so.1``.

    Without ``dest_dir`` the library goes to ``<cache>/<hash of source>/`` where
    ``<cache>`` is ``$GPUSD_FAKE_NVML_CACHE`` or ``<tmp>/gpusd-fake-nvml-<uid>``;
    an up-to-date build is reused.  With ``dest_dir`` it is built into that
    directory (reused when the stamp file says it came from the same source).
    Builds go to a temporary name and are renamed into place, so concurrent
    builds (e.g. pytest-xdist workers) are safe.
    """
    source = SOURCE.read_bytes()
    compiler = _find_compiler()
    digest = hashlib.sha256(
        source + b"\0" + " ".join(compiler + _CFLAGS).encode()
    ).hexdigest()[:20]
    libdir = Path(dest_dir) if dest_dir is not None else _default_cache_root() / digest
    lib = libdir / LIB_NAME
    stamp = libdir / (LIB_NAME + ".sha256")
    try:
        if lib.is_file() and stamp.read_text().strip() == digest:
            return libdir
    except OSError:
        pass

    libdir.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}.{os.urandom(4).hex()}"
    tmp_lib = libdir / f".{LIB_NAME}.{tag}.tmp"
    tmp_stamp = libdir / f".{LIB_NAME}.sha256.{tag}.tmp"
    cmd = [*compiler, *_CFLAGS, "-o", str(tmp_lib), str(SOURCE)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise FakeNvmlBuildError(
                f"building the fake libnvidia-ml.so.1 failed ({shlex.join(cmd)}):\n"
                f"{proc.stdout}{proc.stderr}"
            )
        os.replace(tmp_lib, lib)
        tmp_stamp.write_text(digest + "\n")
        os.replace(tmp_stamp, stamp)
    finally:
        for p in (tmp_lib, tmp_stamp):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
    return libdir


# --------------------------------------------------------------------------
# describing fake GPUs
# --------------------------------------------------------------------------


@dataclass
class FakeProcess:
    """A process line; instance ids ``None`` -> reported as 0xFFFFFFFF (no MIG)."""

    pid: int
    used_memory: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass
class FakeMig:
    """A MIG device.  ``gpu_instance_id=None`` -> its 1-based position on the GPU."""

    profile: str
    uuid: str
    memory_total: int
    memory_used: int = 0
    gpu_instance_id: int | None = None
    compute_instance_id: int = 0


@dataclass
class FakeGPU:
    """One fake GPU.

    A field set to ``None`` omits its line, and the matching NVML call returns
    NVML_ERROR_NOT_SUPPORTED.  ``AUTO`` (uuid, serial, pci_bus_id, minor)
    derives the value from the GPU's index, like :func:`make_gpus`.
    """

    name: str | None = "NVIDIA A100-SXM4-80GB"
    uuid: str | None = AUTO
    serial: str | None = AUTO
    pci_bus_id: str | None = AUTO
    minor: int | None = AUTO
    architecture: int | None = 7  # NVML_DEVICE_ARCH_AMPERE
    cuda_cc: tuple[int, int] | None = (8, 0)
    memory_total: int | None = 80 * 2**30
    memory_used: int = 0
    memory_reserved: int = 0
    bar1_total: int | None = 128 * 2**30
    bar1_used: int = 2 * 2**20
    util_gpu: int | None = 0
    util_memory: int | None = 0
    util_samples: Sequence[int] | None = None
    util_memory_samples: Sequence[int] | None = None
    util_encoder: int | None = 0
    util_decoder: int | None = 0
    temperature: int | None = 35
    power_usage: int | None = 60_000  # mW
    power_limit: int | None = 400_000  # mW
    fan: int | None = None  # data-centre boards have no fan
    pstate: int | None = 0
    compute_mode: int | None = 0
    persistence_mode: int | None = 1
    display_active: int | None = 0
    clock_sm: int | None = 1410
    clock_sm_max: int | None = 1410
    clock_mem: int | None = 1593
    clock_mem_max: int | None = 1593
    pcie_tx: int | None = None  # KB/s
    pcie_rx: int | None = None
    ecc_errors: int | None = None
    mig_mode: int | None = None
    migs: list[FakeMig] = field(default_factory=list)
    processes: list[FakeProcess] = field(default_factory=list)
    graphics_processes: list[FakeProcess] = field(default_factory=list)
    # pid -> (sm, mem) or (sm, mem, enc, dec), for nvmlDeviceGetProcessUtilization
    process_utilization: Mapping[int, Sequence[int]] = field(default_factory=dict)
    # topology (README "Topology"): NUMA node, PCIe switch and host bridge ids, the local CPUs (a
    # Linux CPU list such as "0-3,8"), NVLinks as (remote PCI bus id, number of links), and NVML
    # levels to other GPUs by index that override the level derived from switch/bridge/NUMA node
    numa_node: int | None = None
    pcie_switch: int | None = None
    host_bridge: int | None = None
    cpu_affinity: str | None = None
    nvlinks: list[tuple[str, int]] = field(default_factory=list)
    topology: Mapping[int, int] = field(default_factory=dict)
    # exported function name (or "*") -> nvmlReturn_t code
    errors: Mapping[str, int] = field(default_factory=dict)
    # raw extra lines appended to this device's block
    extra_lines: list[str] = field(default_factory=list)
    # -- telemetry for the DCGM-style series --
    energy: int | None = None  # mJ when the file is loaded; grows at power_usage mW from then
    pcie_replay: int | None = None  # nvmlDeviceGetPcieReplayCounter
    remapped_rows: tuple[int, int, int, int] | None = None  # corr, unc, pending, failure
    memory_temperature: int | None = None  # C, field NVML_FI_DEV_MEMORY_TEMP (82)
    nvlink_raw: Mapping[int, tuple[int, int]] = field(default_factory=dict)  # link -> (tx, rx) KiB
    fields: Mapping[tuple[int, int], int] = field(default_factory=dict)  # (field id, scope) -> value
    xids: Sequence[int] = ()  # every XID so far; a rewrite with more is an event for each new one
    xid_events: bool = True  # False: nvmlDeviceRegisterEvents answers NOT_SUPPORTED
    gpm: Mapping[int, int] = field(default_factory=dict)  # GPM metric id -> value (a Hopper's GPM)


def fake_uuid(index: int, seed: str = "gpusd-fake-gpu", prefix: str = "GPU") -> str:
    """Deterministic ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` for ``index``."""
    h = hashlib.sha1(f"{seed}:{index}".encode()).hexdigest()
    return f"{prefix}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def fake_bus_id(index: int) -> str:
    """PCI bus id for GPU ``index``; increasing with the index (up to 64 GPUs)."""
    return f"00000000:{0x07 + 3 * index:02X}:00.0"


def make_gpus(
    n: int,
    model: str = "NVIDIA A100-SXM4-80GB",
    memory_total: int = 80 * 2**30,
    **kwargs: Any,
) -> list[FakeGPU]:
    """``n`` distinct GPUs (deterministic UUIDs, increasing PCI bus ids).

    Extra keyword arguments are passed to every :class:`FakeGPU`.
    """
    if not 0 <= n <= 64:
        raise ValueError("the fake NVML supports 0..64 GPUs")
    return [
        FakeGPU(
            name=model,
            memory_total=memory_total,
            uuid=fake_uuid(i),
            serial=str(1320000000000 + i),
            pci_bus_id=fake_bus_id(i),
            minor=i,
            **kwargs,
        )
        for i in range(n)
    ]


def nvlink_pairs(gpus: Sequence[FakeGPU], pairs: Iterable[tuple[int, int]], links: int = 4) -> None:
    """Bond ``links`` NVLinks between each pair of GPUs (by position in ``gpus``), both ways."""
    for a, b in pairs:
        for x, y in ((a, b), (b, a)):
            bus = gpus[y].pci_bus_id
            gpus[x].nvlinks.append((fake_bus_id(y) if bus is AUTO or bus is None else str(bus), links))


def _check_str(key: str, value: str) -> str:
    value = str(value)
    if not value or "\n" in value or "#" in value or value != value.strip():
        raise ValueError(f"invalid value for {key!r}: {value!r}")
    return value


NVML_FI_DEV_MEMORY_TEMP = 82
NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX = 140
NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX = 141


def _telemetry_lines(g: FakeGPU) -> list[str]:
    """The state lines of the telemetry fields (energy, PCIe replays, remapped rows, field values, XIDs)."""
    out: list[str] = []
    if g.energy is not None:
        out.append(f"energy {int(g.energy)}")
    if g.pcie_replay is not None:
        out.append(f"pcie_replay {int(g.pcie_replay)}")
    if g.remapped_rows is not None:
        out.append("remapped_rows " + " ".join(str(int(v)) for v in g.remapped_rows))
    fields = dict(g.fields)
    if g.memory_temperature is not None:
        fields[(NVML_FI_DEV_MEMORY_TEMP, 0)] = g.memory_temperature
    for link, (tx, rx) in g.nvlink_raw.items():
        fields[(NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX, link)] = tx
        fields[(NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX, link)] = rx
    if len(fields) > 48:
        raise ValueError("at most 48 field values per GPU")
    for (fid, scope), v in fields.items():
        out.append(f"field {int(fid)} {int(v)} {int(scope)}")
    if len(g.xids) > 64:
        raise ValueError("at most 64 XIDs per GPU")
    out.extend(f"xid {int(x)}" for x in g.xids)
    if not g.xid_events:
        out.append("xid_events 0")
    if len(g.gpm) > 48:
        raise ValueError("at most 48 GPM metrics per GPU")
    out.extend(f"gpm {int(k)} {int(v)}" for k, v in g.gpm.items())
    return out


def render_state(
    gpus: Iterable[FakeGPU],
    driver_version: str | None = "550.54.15",
    cuda_version: int | None = 12040,
    init_error: int | None = None,
    nvml_version: str | None = AUTO,
) -> str:
    """The state-file text for ``gpus`` (see README.md for the format)."""
    out: list[str] = ["# gpusd fake NVML state"]
    if driver_version is not None:
        out.append(f"driver_version {_check_str('driver_version', driver_version)}")
    if nvml_version is AUTO:
        nvml_version = None if driver_version is None else f"12.{driver_version}"
    if nvml_version is not None:
        out.append(f"nvml_version {_check_str('nvml_version', nvml_version)}")
    if cuda_version is not None:
        out.append(f"cuda_version {int(cuda_version)}")
    if init_error is not None:
        out.append(f"init_error {int(init_error)}")

    for index, g in enumerate(gpus):
        if index >= 64:
            raise ValueError("the fake NVML supports at most 64 GPUs")
        out.append("")
        out.append("device")
        auto = {
            "uuid": fake_uuid(index),
            "serial": str(1320000000000 + index),
            "pci_bus_id": fake_bus_id(index),
            "minor": index,
        }

        def val(key: str) -> Any:
            v = getattr(g, key)  # noqa: B023 - used within this iteration only
            return auto[key] if v is AUTO else v  # noqa: B023

        for key in ("name", "uuid", "serial", "pci_bus_id"):
            v = val(key)
            if v is not None:
                out.append(f"{key} {_check_str(key, v)}")
        for key in ("minor", "architecture"):
            v = val(key)
            if v is not None:
                out.append(f"{key} {int(v)}")
        if g.cuda_cc is not None:
            out.append(f"cuda_cc {int(g.cuda_cc[0])} {int(g.cuda_cc[1])}")
        if g.memory_total is not None:
            out.append(f"memory_total {int(g.memory_total)}")
        out.append(f"memory_used {int(g.memory_used)}")
        out.append(f"memory_reserved {int(g.memory_reserved)}")
        if g.bar1_total is not None:
            out.append(f"bar1_total {int(g.bar1_total)}")
            out.append(f"bar1_used {int(g.bar1_used)}")
        for key, attr in (
            ("util_gpu", "util_gpu"),
            ("util_memory", "util_memory"),
            ("util_encoder", "util_encoder"),
            ("util_decoder", "util_decoder"),
            ("temperature", "temperature"),
            ("power_usage", "power_usage"),
            ("power_limit", "power_limit"),
            ("fan", "fan"),
            ("pstate", "pstate"),
            ("compute_mode", "compute_mode"),
            ("persistence_mode", "persistence_mode"),
            ("display_active", "display_active"),
            ("clock_sm", "clock_sm"),
            ("clock_sm_max", "clock_sm_max"),
            ("clock_mem", "clock_mem"),
            ("clock_mem_max", "clock_mem_max"),
            ("pcie_tx", "pcie_tx"),
            ("pcie_rx", "pcie_rx"),
            ("ecc_errors", "ecc_errors"),
            ("mig_mode", "mig_mode"),
        ):
            v = getattr(g, attr)
            if v is not None:
                out.append(f"{key} {int(v)}")
        for key, samples in (
            ("util_samples", g.util_samples),
            ("util_memory_samples", g.util_memory_samples),
        ):
            if samples is not None:
                if not 1 <= len(samples) <= 128:
                    raise ValueError(f"{key}: 1..128 values expected")
                out.append(f"{key} " + " ".join(str(int(s)) for s in samples))
        if len(g.migs) > 16:
            raise ValueError("at most 16 MIG devices per GPU")
        for pos, mig in enumerate(g.migs, start=1):
            gi = pos if mig.gpu_instance_id is None else mig.gpu_instance_id
            out.append(
                f"mig {_check_str('profile', mig.profile)} {_check_str('uuid', mig.uuid)} "
                f"{int(mig.memory_total)} {int(mig.memory_used)} {int(gi)} "
                f"{int(mig.compute_instance_id)}"
            )
        for key, procs in (
            ("process", g.processes),
            ("graphics_process", g.graphics_processes),
        ):
            if len(procs) > 256:
                raise ValueError("at most 256 processes of each kind per GPU")
            for p in procs:
                line = f"{key} {int(p.pid)} {int(p.used_memory)}"
                if p.gpu_instance_id is not None or p.compute_instance_id is not None:
                    gi = 0xFFFFFFFF if p.gpu_instance_id is None else p.gpu_instance_id
                    ci = 0xFFFFFFFF if p.compute_instance_id is None else p.compute_instance_id
                    line += f" {int(gi)} {int(ci)}"
                out.append(line)
        for pid, util in g.process_utilization.items():
            if len(util) not in (2, 4):
                raise ValueError("process_utilization values: (sm, mem) or (sm, mem, enc, dec)")
            out.append(f"process_util {int(pid)} " + " ".join(str(int(u)) for u in util))
        for key in ("numa_node", "pcie_switch", "host_bridge"):
            v = getattr(g, key)
            if v is not None:
                out.append(f"{key} {int(v)}")
        if g.cpu_affinity is not None:
            out.append(f"cpu_affinity {_check_str('cpu_affinity', g.cpu_affinity)}")
        for bus, count in g.nvlinks:
            out.append(f"nvlink {_check_str('nvlink', bus)} {int(count)}")
        for peer, level in g.topology.items():
            out.append(f"topology {int(peer)} {int(level)}")
        out.extend(_telemetry_lines(g))
        for fn, code in g.errors.items():
            out.append(f"error {_check_str('error', fn)} {int(code)}")
        out.extend(g.extra_lines)
    return "\n".join(out) + "\n"


def write_state(
    path: Path | str,
    gpus: Iterable[FakeGPU],
    driver_version: str | None = "550.54.15",
    cuda_version: int | None = 12040,
    init_error: int | None = None,
    nvml_version: str | None = AUTO,
) -> Path:
    """Atomically (temp file in the same directory + ``os.replace``) write a state file.

    The library notices the change at its next call: the replacement has a new
    inode, and a content check covers writes within the same timestamp tick.
    """
    path = Path(path)
    text = render_state(
        gpus,
        driver_version=driver_version,
        cuda_version=cuda_version,
        init_error=init_error,
        nvml_version=nvml_version,
    )
    write_state_text(path, text)
    return path


def write_state_text(path: Path | str, text: str) -> Path:
    """Atomically write raw state-file ``text`` (e.g. a hand-written or broken file)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


# --------------------------------------------------------------------------
# using the library
# --------------------------------------------------------------------------


def fake_env(
    libdir: Path | str,
    state_path: Path | str,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for a subprocess that should load the fake library."""
    env = dict(os.environ if base is None else base)
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = str(libdir) + (os.pathsep + old if old else "")
    env[STATE_ENV] = str(state_path)
    return env


_preloaded: dict[str, ctypes.CDLL] = {}


def preload(libdir: Path | str) -> ctypes.CDLL:
    """Load the fake library into this process with RTLD_GLOBAL.

    Afterwards ``CDLL("libnvidia-ml.so.1")`` (what pynvml does on its first
    ``nvmlInit``) resolves to the already-loaded library by its soname.  Must
    happen before pynvml loads some other libnvidia-ml.so.1 in this process.
    Only one fake library can be active per process: preloading a second,
    different build raises RuntimeError.
    """
    lib = str(Path(libdir, LIB_NAME).resolve())
    if lib in _preloaded:
        return _preloaded[lib]
    if _preloaded:
        raise RuntimeError(
            f"a different fake NVML is already loaded in this process: {next(iter(_preloaded))}"
        )
    handle = ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    _preloaded[lib] = handle
    return handle


class FakeNvml:
    """A built library plus one state file: the object the pytest fixtures hand out."""

    def __init__(self, libdir: Path | str, state_path: Path | str) -> None:
        self.libdir = Path(libdir)
        self.state_path = Path(state_path)

    @property
    def lib_path(self) -> Path:
        return self.libdir / LIB_NAME

    def write(self, gpus: Iterable[FakeGPU], **kwargs: Any) -> Path:
        """:func:`write_state` to this object's state file."""
        return write_state(self.state_path, gpus, **kwargs)

    def write_text(self, text: str) -> Path:
        return write_state_text(self.state_path, text)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """:func:`fake_env` for this library and state file."""
        return fake_env(self.libdir, self.state_path, base)

    def preload(self) -> ctypes.CDLL:
        return preload(self.libdir)


_COUNT_SLOT = 64  # {char name[56]; uint64 count} (fake_nvml.c, COUNT_SLOTS records)


def call_counts(counts_dir: Path | str, pid: int | None = None) -> dict[str, int]:
    """The NVML calls counted under ``counts_dir`` (the ``GPUSD_FAKE_NVML_COUNTS`` directory), by
    function name, summed over every process that loaded the fake there (or only ``pid``'s).  A
    function that another one of the same family forwards to counts under the name of the one that
    does the work (``nvmlInit_v2`` as ``nvmlInitWithFlags``, ``nvmlDeviceGetCount`` as ``..._v2``)."""
    import struct

    out: dict[str, int] = {}
    for path in sorted(Path(counts_dir).iterdir()):
        if not path.name.isdigit() or (pid is not None and int(path.name) != pid):
            continue
        data = path.read_bytes()
        for off in range(0, len(data) - _COUNT_SLOT + 1, _COUNT_SLOT):
            raw, count = struct.unpack_from("=56sQ", data, off)
            name = raw.split(b"\0", 1)[0].decode("ascii", "replace")
            if name:
                out[name] = out.get(name, 0) + count
    return out
