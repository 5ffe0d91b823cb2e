"""Rebalancing: pure decisions on snapshots and job records; the daemon acts on them (docs/jobs.md).

Opt-in (``gpusd start --rebalance``, or ``--rebalance-policy FILE`` with the fields of :class:`Policy`
as JSON).  On every sample:

* a GPU is *hot* while its utilisation is above ``util_above`` or its temperature above
  ``temp_above``; after it has been hot for ``hot_for`` seconds, one ``--preemptible`` running job on
  it is moved to an *idle* GPU (utilisation at most ``idle_below``, not hot, no lease, no job) when
  there is one: the job checkpoints and restarts there (the job protocol);
* a ``--pausable`` job is paused (SIGSTOP) while its GPU is above ``pause_temp`` and resumed
  (SIGCONT) once it is ``resume_margin`` degrees below;
* a job is moved at most once per ``min_interval`` seconds, so that an oscillating load cannot make
  it thrash; a move that failed is not retried for that job before ``min_interval`` either.

Every decision carries its reason, in words.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..model import HostSnapshot
from .record import JobRecord


@dataclass
class Policy:
    util_above: float = 90.0  # percent
    temp_above: float = 85.0  # degrees C
    # seconds a GPU stays hot before a job is moved off it
    hot_for: float = 30.0
    # percent: a GPU this quiet (and not hot, unleased) is idle
    idle_below: float = 10.0
    # degrees C: --pausable jobs are paused above this
    pause_temp: float = 90.0
    # ... and resumed this many degrees below
    resume_margin: float = 5.0
    # seconds: at most one move per job per period
    min_interval: float = 300.0

    @classmethod
    def from_dict(cls, d: Any) -> Policy:
        if not isinstance(d, dict):
            raise ConfigError("a rebalancing policy is a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown rebalancing policy field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        values: dict[str, float] = {}
        for k, v in d.items():
            if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"rebalancing policy: {k} must be a number >= 0, not {v!r}")
            values[k] = float(v)
        return cls(**values)

    @classmethod
    def load(cls, path: Path | str) -> Policy:
        try:
            raw = Path(path).read_bytes()[:65536]
            return cls.from_dict(json.loads(raw))
        except OSError as exc:
            raise ConfigError(f"cannot read the rebalancing policy {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise ConfigError(f"the rebalancing policy {path} is not JSON: {exc}") from None

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Decision:
    # "move", "pause", "resume"
    action: str
    job: str
    uid: int | None
    gpu: str  # the UUID concerned
    index: int
    reason: str
    # move: the index of the idle GPU that qualified
    to: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "job": self.job, "gpu": self.gpu, "index": self.index, "to": self.to,
                "reason": self.reason}


@dataclass
class Rebalancer:
    policy: Policy = field(default_factory=Policy)
    hot_since: dict[str, float] = field(default_factory=dict)
    last_move: dict[str, float] = field(default_factory=dict)
    # job -> the GPU it was paused for
    paused: dict[str, str] = field(default_factory=dict)

    def decide(self, snap: HostSnapshot, jobs: list[JobRecord], now: float | None = None) -> list[Decision]:
        now = time.monotonic() if now is None else now
        p = self.policy
        out: list[Decision] = []
        owned = {uuid for r in jobs for uuid in r.devices}
        by_uuid = {g.uuid: g for g in snap.gpus}
        why_hot: dict[str, str] = {}
        for g in snap.gpus:
            util, temp = g.utilization_gpu, g.temperature
            if util is not None and util > p.util_above:
                why_hot[g.uuid] = f"utilisation {util:.0f}% > {p.util_above:g}%"
            elif temp is not None and temp > p.temp_above:
                why_hot[g.uuid] = f"temperature {temp:.0f}°C > {p.temp_above:g}°C"
        for uuid in list(self.hot_since):
            if uuid not in why_hot:
                del self.hot_since[uuid]
        for uuid in why_hot:
            self.hot_since.setdefault(uuid, now)
        idle = [g for g in snap.gpus if g.uuid not in why_hot and g.uuid not in owned and not g.leases
                and g.healthy is not False and (g.utilization_gpu is not None and g.utilization_gpu <= p.idle_below)]
        idle.sort(key=lambda g: (g.utilization_gpu or 0.0, g.index))
        for uuid, since in sorted(self.hot_since.items(), key=lambda x: x[1]):
            if now - since < p.hot_for or not idle:
                continue
            g = by_uuid[uuid]
            for r in jobs:
                if uuid not in r.devices or not r.preemptible or r.state != "running":
                    continue
                last = self.last_move.get(r.job)
                if last is not None and now - last < p.min_interval:
                    # rate limit: no thrashing
                    continue
                target = idle.pop(0)
                self.last_move[r.job] = now
                out.append(Decision("move", r.job, r.uid, uuid, g.index, (
                    f"GPU {g.index} {why_hot[uuid]} for {now - since:.1f}s (>= {p.hot_for:g}s) while GPU "
                    f"{target.index} is idle ({target.utilization_gpu or 0:.0f}%): moving job {r.job} there"),
                    to=target.index))
                break
        for r in jobs:
            if not r.pausable:
                continue
            temps = [(by_uuid[u].temperature, by_uuid[u]) for u in r.devices if u in by_uuid]
            hot = [(t, g) for t, g in temps if t is not None and t > p.pause_temp]
            if r.job not in self.paused and hot and r.state == "running":
                t, g = hot[0]
                self.paused[r.job] = g.uuid
                out.append(Decision("pause", r.job, r.uid, g.uuid, g.index,
                                    f"GPU {g.index} temperature {t:.0f}°C > {p.pause_temp:g}°C: pausing job {r.job}"))
            elif r.job in self.paused:
                pg = by_uuid.get(self.paused[r.job])
                pt = pg.temperature if pg is not None else None
                if pg is None or pt is None or pt <= p.pause_temp - p.resume_margin:
                    del self.paused[r.job]
                    out.append(Decision("resume", r.job, r.uid, pg.uuid if pg else "", pg.index if pg else -1,
                                        f"GPU {pg.index if pg else '?'} cooled to "
                                        f"{'?' if pt is None else f'{pt:.0f}'}°C: resuming job {r.job}"))
        live = {r.job for r in jobs}
        for job in [j for j in self.last_move if j not in live]:
            del self.last_move[job]
        for job in [j for j in self.paused if j not in live]:
            del self.paused[job]
        return out
