"""Shared helpers for the benchmarks: the fake NVML from the test tree, timing and statistics."""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from fakenvml import (  # noqa: E402
    FakeGPU,
    FakeProcess,
    build_fake_nvml,
    make_gpus,
    preload,
    write_state,
)

__all__ = ["FakeGPU", "FakeProcess", "make_gpus", "write_state", "FakeEnv", "p50", "pct", "start_ready", "stop",
           "timeit_each", "whole_process"]


class FakeEnv:
    """A fake NVML (built from tests/fakenvml) with a state file in a temporary directory."""

    def __init__(self, gpus: Sequence[FakeGPU]) -> None:
        self.libdir = build_fake_nvml()
        self.tmp = Path(tempfile.mkdtemp(prefix="gpusd-bench-"))
        atexit.register(shutil.rmtree, self.tmp, ignore_errors=True)
        self.state = self.tmp / "state.txt"
        write_state(self.state, gpus)
        self.env = dict(os.environ)
        self.env["LD_LIBRARY_PATH"] = f"{self.libdir}:{self.env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
        self.env["GPUSD_FAKE_NVML_STATE"] = str(self.state)
        self.env["GPUSD_LOCK_DIR"] = str(self.tmp / "locks")
        self.env["GPUSD_STATE_DIR"] = str(self.tmp / "state")
        self.env["GPUSD_LEASE_SOCKET"] = str(self.tmp / "lease.sock")  # never the machine's daemon
        self.env.pop("CUDA_VISIBLE_DEVICES", None)

    def write(self, gpus: Sequence[FakeGPU]) -> None:
        write_state(self.state, gpus)

    def activate_in_process(self) -> None:
        preload(self.libdir)
        for key in ("GPUSD_FAKE_NVML_STATE", "GPUSD_LOCK_DIR", "GPUSD_STATE_DIR", "GPUSD_LEASE_SOCKET"):
            os.environ[key] = self.env[key]


def pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def p50(values: Sequence[float]) -> float:
    return statistics.median(values)


def timeit_each(fn: Callable[[], object], n: int, warmup: int = 20) -> list[float]:
    """Seconds per call, n calls (after warm-up)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def whole_process(cmd: Sequence[str], env: dict[str, str], n: int
                  ) -> tuple[list[float], subprocess.CompletedProcess[bytes]]:
    """Wall-clock seconds of n runs of cmd (after one warm-up run)."""
    last = subprocess.run(cmd, env=env, capture_output=True)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        last = subprocess.run(cmd, env=env, capture_output=True)
        out.append(time.perf_counter() - t)
    return out, last


def start_ready(cmd: Sequence[str], env: dict[str, str], log: Path | None = None,
                what: str = "the daemon") -> tuple[subprocess.Popen[bytes], str]:
    """Start ``cmd`` (a ``gpusd start --foreground``) with ``--ready-fd`` appended, its output to ``log``
    (None: nowhere); (the process, its ready line) once it said it is ready.  A process that ends
    without saying so is reaped and the bench stops with the log's end."""
    r, w = os.pipe()
    out = open(log, "ab") if log is not None else None
    try:
        proc = subprocess.Popen([*cmd, "--ready-fd", str(w)], env=env, stdout=out or subprocess.DEVNULL,
                                stderr=out or subprocess.DEVNULL, pass_fds=(w,), stdin=subprocess.DEVNULL)
    finally:
        os.close(w)
        if out is not None:
            out.close()
    with os.fdopen(r) as f:
        line = f.readline()
    if not line:
        stop(proc)
        tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
        raise SystemExit(f"{what} did not start; log:\n{tail}")
    return proc, line


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 15 s; reaped."""
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
