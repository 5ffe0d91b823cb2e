"""A fake ``libamd_smi.so`` built from C, for the real ``amdsmi`` Python package (AMD's ctypes
bindings from PyPI) as ``tests/fakenvml`` is for NVML.

``amdsmi_wrapper.py`` looks up every C function it wraps when it is imported (184 in amdsmi 7.0.2):
the stubs for those ``fake_amd_smi.c`` does not implement are generated here from the installed
package's own wrapper (never typed by hand), so a newer ``amdsmi`` that wraps more functions still
loads.  The stubs answer ``AMDSMI_STATUS_NOT_SUPPORTED``.

Where the package is: importable already, or installed with ``pip install --target`` in
``$GPUSD_VENDOR_PKGS`` (default ``/opt/gpusd-vendor-pkgs``; ``.ci/run`` puts it there).  It is kept out
of site-packages on purpose: with ``amdsmi`` importable and no ROCm, ``import ray`` fails (Ray 2.60's
AMD detection imports ``amdsmi``, whose import raises KeyError without ``libamd_smi.so``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fake_amd_smi.c"
STATE_ENV = "GPUSD_FAKE_AMDSMI_STATE"
VENDOR_PKGS = os.environ.get("GPUSD_VENDOR_PKGS", "/opt/gpusd-vendor-pkgs")
MiB = 1024**2


class FakeAmdSmiUnavailable(RuntimeError):
    """No C compiler, or the amdsmi package is not installed: the tests that need it skip."""


def package_dir(name: str) -> tuple[Path, str | None]:
    """(directory of package ``name``, the sys.path entry to add for it or None when importable)."""
    spec = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
    if spec is not None and spec.origin:
        return Path(spec.origin).parent, None
    candidate = Path(VENDOR_PKGS) / name / "__init__.py"
    if candidate.is_file():
        return candidate.parent, VENDOR_PKGS
    raise FakeAmdSmiUnavailable(f"the {name} package is not installed (pip install --target {VENDOR_PKGS} {name})")


def wrapped_functions(wrapper: Path) -> list[str]:
    """Every C function amdsmi_wrapper.py looks up in libamd_smi.so."""
    return sorted(set(re.findall(r"_libraries\['libamd_smi\.so'\]\.(\w+)", wrapper.read_text())))


def build() -> Path:
    """Compile the fake (with the generated stubs); the directory to give as ``ROCM_PATH``."""
    pkg, _ = package_dir("amdsmi")
    source = SOURCE.read_text()
    implemented = set(re.findall(r"^EXPORT \w+ (\w+)\(", source, re.M))
    names = wrapped_functions(pkg / "amdsmi_wrapper.py")
    if len(names) < 50:
        raise RuntimeError(f"found only {len(names)} functions in {pkg / 'amdsmi_wrapper.py'}: not amdsmi's wrapper?")
    stubs = "".join(f"__attribute__((visibility(\"default\"))) int {n}(void) {{ return 2; }}\n"
                    for n in names if n not in implemented)
    cc = os.environ.get("CC") or "cc"
    digest = hashlib.sha256((source + stubs + cc).encode()).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"gpusd-fake-amdsmi-{os.getuid()}" / digest
    lib = root / "lib" / "libamd_smi.so"
    if lib.is_file():
        return root
    (root / "lib").mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}.{os.urandom(4).hex()}"
    stub_c = root / f"stubs.{tag}.c"
    stub_c.write_text(stubs)
    tmp = root / "lib" / f".libamd_smi.{tag}.tmp"
    try:
        proc = subprocess.run([cc, "-O1", "-shared", "-fPIC", "-pthread", "-o", str(tmp), str(SOURCE), str(stub_c)],
                              capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise FakeAmdSmiUnavailable(f"no C compiler ({cc}) to build the fake libamd_smi.so") from None
    finally:
        stub_c.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the fake libamd_smi.so failed:\n{proc.stderr}")
    os.replace(tmp, lib)
    return root


@dataclass
class AmdProcess:
    pid: int
    vram: int  # bytes
    name: str = "python3"


@dataclass
class AmdGpu:
    name: str = "AMD Instinct MI300X"
    serial: str = "1a2b3c4d5e6f7081"  # the unique id: ROCm's UUID is GPU-<serial>
    bdf: str = "0000:0c:00.0"
    vram_total: int = 196592 * MiB
    vram_used: int = 0
    gfx: int = 0  # percent
    umc: int = 0
    temp: int = 40  # edge (missing=["temp_edge"]: no edge sensor, as on an MI300X)
    hotspot: int = 48  # junction
    memtemp: int = 44  # VRAM/HBM
    driver: str = "6.8.5"
    board: str = "102-G30211-00"  # board_info.model_number: what AMD's exporter writes as card_model
    energy: int = 7_000_000_000  # µJ since the driver loaded
    power: int = 150  # W
    limit: int = 750
    cpart: str = "SPX"
    mpart: str = "NPS1"
    ecc_ce: int = 0  # ECC totals: correctable, uncorrectable, deferred
    ecc_ue: int = 0
    ecc_de: int = 0
    pcie_max_speed: int = 32000  # MT/s (Gen5)
    pcie_speed: int = 32000
    pcie_width: int = 16
    pcie_bw: int = 1200  # Mb/s
    pcie_replay: int = 0  # counters since the driver loaded; -1: amdsmi's N/A
    pcie_recovery: int = 0
    pcie_rollover: int = 0
    pcie_nak_sent: int = 0
    pcie_nak_rcvd: int = 0
    xcc_busy: list[int] = field(default_factory=list)  # GFX busy of each XCC now, percent (MI300X: 8)
    lost: int = 0  # an amdsmi status every query answers (e.g. 6: DRM error)
    missing: list[str] = field(default_factory=list)  # asic, vram, activity, temp, power, processes, cpart...
    processes: list[AmdProcess] = field(default_factory=list)

    def lines(self) -> list[str]:
        rec = (f"gpu|name={self.name}|serial={self.serial}|bdf={self.bdf}|vram_total={self.vram_total // MiB}"
               f"|vram_used={self.vram_used // MiB}|gfx={self.gfx}|umc={self.umc}|temp={self.temp}|power={self.power}"
               f"|limit={self.limit}|cpart={self.cpart}|mpart={self.mpart}|lost={self.lost}"
               f"|missing={','.join(self.missing)}|hotspot={self.hotspot}|memtemp={self.memtemp}|driver={self.driver}"
               f"|board={self.board}|energy={self.energy}|ecc_ce={self.ecc_ce}|ecc_ue={self.ecc_ue}"
               f"|ecc_de={self.ecc_de}|pcie_max_speed={self.pcie_max_speed}|pcie_speed={self.pcie_speed}"
               f"|pcie_width={self.pcie_width}|pcie_bw={self.pcie_bw}|pcie_replay={self.pcie_replay}"
               f"|pcie_recovery={self.pcie_recovery}|pcie_rollover={self.pcie_rollover}"
               f"|pcie_nak_sent={self.pcie_nak_sent}|pcie_nak_rcvd={self.pcie_nak_rcvd}"
               f"|xcc_busy={','.join(map(str, self.xcc_busy))}")
        return [rec] + [f"proc|pid={p.pid}|mem={p.vram}|vram={p.vram}|name={p.name}" for p in self.processes]


class FakeAmdSmi:
    """The fake's state file and the environment a gpusd subprocess needs to read it."""

    def __init__(self, root: Path, state: Path) -> None:
        self.root, self.state_path = root, state
        _, self.pkg_path = package_dir("amdsmi")

    def write(self, gpus: list[AmdGpu], init_status: int = 0) -> None:
        lines = [f"init|{init_status}"] + [line for g in gpus for line in g.lines()]
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.state_path)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        env.update({"ROCM_PATH": str(self.root), STATE_ENV: str(self.state_path), "GPUSD_BACKENDS": "amd"})
        paths = [p for p in (env.get("PYTHONPATH"), self.pkg_path) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        return env
