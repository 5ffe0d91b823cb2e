"""Driving the usage history with simulated time: a scenario's snapshots at a fixed interval."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpusd.inventory.simulated import SimulatedBackend
from gpusd.usage.recorder import Recorder

SCENARIO = Path(__file__).resolve().parent / "scenarios" / "two_users.json"
# a multiple of the scenario's 6-hour step cycle, so step i covers hour i of the scenario
T0 = 6 * 3600.0 * 83334
HOUR = 3600.0


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def record_scenario(db: Path, hours: float = 6.0, interval: float = 10.0, spec: Path = SCENARIO,
                    t0: float = T0, **kw: Any) -> tuple[SimulatedBackend, Clock]:
    """Record ``hours`` of ``spec`` into ``db`` (one sample every ``interval`` seconds of simulated time
    from ``t0``) through the daemon's recorder and its writer thread."""
    clock = Clock(t0)
    backend = SimulatedBackend(str(spec), node="node-1", clock=clock)
    rec = Recorder(db, interval, **kw)
    try:
        for i in range(int(hours * HOUR / interval) + 1):
            clock.t = t0 + i * interval
            rec.submit(backend.snapshot())
            if i % 500 == 0:
                rec.flush()  # the queue holds 600: keep the writer close behind
        rec.flush()
        assert rec.dropped == 0 and rec.errors == 0
    finally:
        rec.close()
    return backend, clock
