"""How many NVML calls each path makes, counted by the fake NVML (deterministic: no timing).

On a driver a call costs tens of microseconds and a topology query or process list far more
(tests/fakenvml/README.md, "Cost and counting"), so the number of calls is what a pick costs there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fakenvml import COUNTS_ENV, FakeNvml, call_counts, make_gpus

GiB = 2**30

# What one pick may ask the driver per GPU, once the process knows its GPUs: the memory, the
# utilisation samples, the compute and the graphics processes.
PICK_CALLS_PER_GPU = 4


def _counting(fake: FakeNvml, tmp_path: Path) -> tuple[dict[str, str], Path]:
    counts = tmp_path / "nvml-counts"
    counts.mkdir()
    env = fake.env()
    env[COUNTS_ENV] = str(counts)
    return env, counts


def test_the_fake_counts_each_call_per_process(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    fake_nvml.write(make_gpus(3))
    env, counts = _counting(fake_nvml, tmp_path)
    code = ("import ctypes; lib = ctypes.CDLL('libnvidia-ml.so.1'); n = ctypes.c_uint()\n"
            "assert lib.nvmlInit_v2() == 0\n"
            "for _ in range({k}): assert lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) == 0\n"
            "import os; print(os.getpid())")
    pids = [int(subprocess.run([sys.executable, "-c", code.format(k=k)], env=env, capture_output=True, text=True,
                               check=True, timeout=60).stdout) for k in (5, 2)]
    assert call_counts(counts, pids[0]) == {"nvmlInitWithFlags": 1, "nvmlDeviceGetCount_v2": 5}
    assert call_counts(counts, pids[1]) == {"nvmlInitWithFlags": 1, "nvmlDeviceGetCount_v2": 2}
    assert call_counts(counts)["nvmlDeviceGetCount_v2"] == 7


@pytest.mark.parametrize("n", [8, 16])
def test_a_pick_asks_the_driver_at_most_four_calls_per_gpu(fake_nvml_inprocess: FakeNvml, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """``gpusd.select()`` in a process that picked before: the static facts are known, and a pick asks
    only what changes by itself; what it weighs is still read (a new process on a GPU is seen)."""
    import gpusd
    from fakenvml import FakeProcess

    gpus = make_gpus(n, memory_used=GiB)
    fake_nvml_inprocess.write(gpus)
    counts = tmp_path / "counts"
    counts.mkdir()
    monkeypatch.setenv(COUNTS_ENV, str(counts))
    gpusd.select().release()  # the first pick reads the GPUs' static facts
    before = call_counts(counts)
    for _ in range(3):
        gpusd.select().release()
    after = call_counts(counts)
    made = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    assert sum(made.values()) <= 3 * PICK_CALLS_PER_GPU * n, made
    assert made["nvmlDeviceGetMemoryInfo"] == 3 * n
    # what the pick weighs is read at every pick: a process that starts on GPU 0 moves the pick
    first = gpusd.select()
    first.release()
    gpus[first.indices[0]].processes = [FakeProcess(os.getpid(), 60 * GiB)]
    gpus[first.indices[0]].memory_used = 70 * GiB
    fake_nvml_inprocess.write(gpus)
    again = gpusd.select()
    again.release()
    assert again.indices != first.indices
