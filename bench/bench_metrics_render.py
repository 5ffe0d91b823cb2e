"""What one /metrics scrape costs to render: an 8-GPU snapshot with every reading the DCGM-named series
use, rendered by the daemon's registry (gpusd names, DCGM names, process metrics), p50 of 300.

    python bench/bench_metrics_render.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    from daemon_helpers import make_snapshot
    from gpusd.daemon.metrics import make_registry, render

    snap = make_snapshot(8, hostname="h", util=30.0, used=2**30)
    readings = dict(clock_sm=1410, clock_memory=1593, memory_temperature=50, memory_reserved=2**29, energy=10**9,
                    pcie_replays=0, utilization_encoder=0, utilization_decoder=0, nvlink_bytes=0,
                    remapped_rows_correctable=0, remapped_rows_uncorrectable=0, row_remap_failure=False,
                    xid_last=0, xid_errors=0)
    for g in snap.gpus:
        g.pci_bus_id, g.power_draw = f"00000000:{7 + g.index:02X}:00.0", 100.0
        for attr, value in readings.items():
            if hasattr(g, attr):  # also runs on a gpusd without these readings (the "before" figure)
                setattr(g, attr, value)
    for dcgm in (False, True):
        registry = make_registry(lambda: [snap], dcgm=dcgm)
        times = []
        for _ in range(300):
            t = time.perf_counter()
            text = render(registry)
            times.append(time.perf_counter() - t)
        print(f"dcgm={dcgm!s:5}  {len(text):6d} bytes  {statistics.median(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
