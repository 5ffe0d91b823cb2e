"""A fake Level Zero loader (``libze_loader.so.1``) built from C, for the real ``pyzes`` bindings.

What is real: ``pyzes`` (Intel's ctypes layer from PyPI) and every Sysman call gpusd makes through
it, with the structure layouts pyzes declares.  What is faked: the loader and the GPU driver behind
it (``fake_ze_loader.c`` answers the zes* calls from a state file).  ``pyzes`` hard-codes the
loader's path, ``/usr/lib/x86_64-linux-gnu/libze_loader.so.1``: gpusd's ``$GPUSD_ZE_LIBRARY`` (which
real installations with a loader elsewhere use as well) points it at the fake.  ``pyzes`` comes from
``$GPUSD_VENDOR_PKGS`` as ``amdsmi`` does (tests/fakeamdsmi).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fakeamdsmi import FakeAmdSmiUnavailable, package_dir

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fake_ze_loader.c"
STATE_ENV = "GPUSD_FAKE_ZE_STATE"
GiB = 1024**3


def build() -> Path:
    """Compile the fake loader; its path."""
    package_dir("pyzes")  # skip early when the bindings are not there
    source = SOURCE.read_text()
    cc = os.environ.get("CC") or "cc"
    digest = hashlib.sha256((source + cc).encode()).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"gpusd-fake-ze-{os.getuid()}" / digest
    lib = root / "libze_loader.so.1"
    if lib.is_file():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".libze_loader.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        proc = subprocess.run([cc, "-O1", "-shared", "-fPIC", "-pthread", "-Wl,-soname,libze_loader.so.1",
                               "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise FakeAmdSmiUnavailable(f"no C compiler ({cc}) to build the fake Level Zero loader") from None
    if proc.returncode != 0:
        raise RuntimeError(f"building the fake Level Zero loader failed:\n{proc.stderr}")
    os.replace(tmp, lib)
    return lib


@dataclass
class ZeProcess:
    pid: int
    mem: int


@dataclass
class ZeGpu:
    name: str = "Intel(R) Data Center GPU Max 1550"
    uuid: str = "86800bd5000000000000290000000000"  # 16 bytes in hex
    bdf: str = "0000:29:00.0"
    mem_total: int = 128 * GiB
    mem_used: int = 0
    util: int = 0
    temp: int = 40
    power: int = 200
    limit: int = 600
    subdevices: int = 2
    lost: int = 0  # a ze_result_t every query answers (0x70000001: device lost)
    missing: list[str] = field(default_factory=list)
    processes: list[ZeProcess] = field(default_factory=list)

    def lines(self) -> list[str]:
        rec = (f"gpu|name={self.name}|uuid={self.uuid}|bdf={self.bdf}|mem_total={self.mem_total}"
               f"|mem_used={self.mem_used}|util={self.util}|temp={self.temp}|power={self.power}|limit={self.limit}"
               f"|subdevices={self.subdevices}|lost={self.lost}|missing={','.join(self.missing)}")
        return [rec] + [f"proc|pid={p.pid}|mem={p.mem}" for p in self.processes]


class FakeZe:
    def __init__(self, lib: Path, state: Path) -> None:
        self.lib, self.state_path = lib, state
        _, self.pkg_path = package_dir("pyzes")

    def write(self, gpus: list[ZeGpu], init_result: int = 0) -> None:
        lines = [f"init|{init_result}"] + [line for g in gpus for line in g.lines()]
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.state_path)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        env.update({"GPUSD_ZE_LIBRARY": str(self.lib), STATE_ENV: str(self.state_path), "GPUSD_BACKENDS": "intel"})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), self.pkg_path) if p)
        return env
