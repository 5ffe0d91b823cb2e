"""The cost of the daemon's telemetry reads (DCGM's counters, issue 25): one NvmlBackend snapshot of 8
fake GPUs without and with ``telemetry`` (clocks, reserved memory, energy, PCIe replays, encoder/decoder,
remapped rows, field values, XID events), p50 of 1000 calls, alternating twice.

    python bench/bench_telemetry.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    from fakenvml import FakeProcess, build_fake_nvml, make_gpus, preload, write_state

    preload(build_fake_nvml())
    state = Path(tempfile.mkdtemp(prefix="gpusd-bench-tel-")) / "state"
    os.environ["GPUSD_FAKE_NVML_STATE"] = str(state)
    write_state(state, make_gpus(8, energy=10**9, pcie_replay=0, remapped_rows=(0, 0, 0, 0), memory_temperature=50,
                                 processes=[FakeProcess(os.getpid(), 2**30)]))
    from gpusd.inventory.nvml import NvmlBackend

    print("one snapshot of 8 fake GPUs, p50 of 1000")
    for telemetry in (False, True, False, True):
        b = NvmlBackend(telemetry=telemetry)
        b.snapshot()
        times = []
        for _ in range(1000):
            t = time.perf_counter()
            b.snapshot()
            times.append(time.perf_counter() - t)
        b.close()
        print(f"telemetry={telemetry!s:5}  {statistics.median(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
