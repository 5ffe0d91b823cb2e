"""What a daemon serves from its history: usage over a time range, one GPU's series.

Both answers are plain JSON-ready dicts (docs/history.md, HTTP).  Per-user rows and job owners are
private: :func:`usage` leaves them out (``users`` empty, job ``user``/``command`` null) unless
``private`` is true; the per-GPU aggregates are for everyone.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from .db import COARSE, FINE, HOURLY, STEP, Retention

RANGES = {"1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400}
# points per series: enough for a chart as wide as a screen
MAX_POINTS = 720
TOP_JOBS = 20


def _inside(tier: int, lo: float, hi: float, start: float) -> str:
    """The SQL factor of a bucket's sums inside [start, hi): a bucket that began before ``start``
    counts for its share after it (--since 90s is 90 s, not 90 s plus the rest of the first 10-s
    bucket); one that ends after ``hi`` for its seconds up to ``hi`` (all of them when it is the
    bucket being filled now).  Only numbers computed here go into the text."""
    step = STEP[tier]
    factor = "1.0"
    if lo < start:
        factor = f"(CASE WHEN ts<{int(lo) + step} THEN {float(lo + step - start) / step!r} ELSE 1.0 END)"
    if hi % step:
        end = repr(float(hi))
        factor += f"*(CASE WHEN ts+{step}>{end} THEN min(1.0, ({end}-ts)/max(seconds, 0.001)) ELSE 1.0 END)"
    return factor


def tier_for(start: float, now: float, keep: Retention) -> int:
    """The fine tier when it still covers ``start``, else the coarse one."""
    return FINE if start >= now - keep.fine_keep + STEP[FINE] else COARSE


def spans(start: float, end: float, now: float, keep: Retention) -> list[tuple[int, int, float]]:
    """Where to read [start, end) from: (tier, from, to) pieces.  Recent ranges from the fine tier;
    older ones as whole hours from the hourly tier and the partial hours at the edges from the
    5-minute tier (a 30-day report reads 720 rows per GPU instead of 8640)."""
    tier = tier_for(start, now, keep)
    if tier == FINE:
        return [(FINE, int(start // STEP[FINE] * STEP[FINE]), end)]
    lo = int(start // STEP[COARSE] * STEP[COARSE])
    h1 = -(-lo // STEP[HOURLY]) * STEP[HOURLY]
    h2 = int(end // STEP[HOURLY] * STEP[HOURLY])
    if h2 - h1 < 2 * STEP[HOURLY]:
        return [(COARSE, lo, end)]
    return [(COARSE, lo, h1), (HOURLY, h1, h2), (COARSE, h2, end)]


def latest(conn: sqlite3.Connection) -> float | None:
    row = conn.execute("SELECT max(ts) FROM series WHERE tier=?", (FINE,)).fetchone()
    return None if row[0] is None else float(row[0]) + STEP[FINE]


def series(conn: sqlite3.Connection, gpu: str, seconds: float, now: float, keep: Retention) -> dict[str, Any]:
    """One GPU (UUID or index) over the last ``seconds``: utilisation (%), memory (bytes, the bucket's
    mean and peak), power (W), temperature (°C), at most :data:`MAX_POINTS` points."""
    row = conn.execute("SELECT id, uuid, idx, model, mem_total FROM gpus WHERE uuid=? OR CAST(idx AS TEXT)=? "
                       "ORDER BY last DESC LIMIT 1", (gpu, gpu)).fetchone()
    if row is None:
        raise KeyError(gpu)
    gid, uuid, idx, model, mem_total = row
    start = now - seconds
    tier = tier_for(start, now, keep)
    if tier == COARSE and seconds / MAX_POINTS >= STEP[HOURLY]:
        tier = HOURLY
    step = max(STEP[tier], int(-(-seconds // MAX_POINTS) // STEP[tier] * STEP[tier]) or STEP[tier])
    out: dict[str, list[Any]] = {"t": [], "util": [], "mem": [], "mem_max": [], "power": [], "temp": []}
    q = ("SELECT (ts/?)*? AS b, sum(util_s), sum(util_n), sum(mem_s), max(mem_max), sum(power_s), sum(seconds), "
         "max(temp_max) FROM series WHERE tier=? AND gpu=? AND ts>=? AND ts<? GROUP BY b ORDER BY b")
    for b, util_s, util_n, mem_s, mem_max, power_s, secs, temp in conn.execute(
            q, (step, step, tier, gid, int(start // step * step), now)):
        out["t"].append(b)
        out["util"].append(round(util_s / util_n, 1) if util_n else None)
        out["mem"].append(int(mem_s / secs) if secs else None)
        out["mem_max"].append(mem_max)
        out["power"].append(round(power_s / secs, 1) if secs else None)
        out["temp"].append(temp if temp is not None and temp > -999 else None)
    return {"gpu": uuid, "index": idx, "model": model, "memory_total": mem_total, "from": start, "to": now,
            "step": step, "tier": _TIER_NAMES[tier], **out}


_TIER_NAMES = {FINE: "fine", COARSE: "coarse", HOURLY: "hourly"}


def usage(conn: sqlite3.Connection, start: float, end: float, now: float, keep: Retention, private: bool,
          idle_after: float = 900.0, host: str | None = None, node_id: str | None = None) -> dict[str, Any]:
    """Usage between ``start`` and ``end``: per GPU, per user (private), top jobs, idle reservations,
    and the host's mean utilisation over time (for charts)."""
    pieces = spans(start, end, now, keep)
    gpus: dict[int, dict[str, Any]] = {}
    for gid, uuid, idx, model, mem_total, ghost in conn.execute(
            "SELECT id, uuid, idx, model, mem_total, host FROM gpus"):
        gpus[gid] = {"uuid": uuid, "index": idx, "model": model, "memory_total": mem_total, "host": ghost,
                     "seconds": 0.0, "util_s": 0.0, "util_n": 0.0, "energy_j": 0.0, "busy_s": 0.0, "held_s": 0.0}
    per_user: dict[tuple[int, str, str], list[float]] = {}
    # the first and last bucket with data: the period the figures cover
    seen: list[float] = []
    for tier, lo, hi in pieces:
        part = _inside(tier, lo, hi, start)
        first, last = conn.execute("SELECT min(ts), max(ts) FROM series WHERE tier=? AND ts>=? AND ts<? AND seconds>0",
                                   (tier, lo, hi)).fetchone()
        if first is not None:
            seen += [max(start, float(first)), min(end, float(last) + STEP[tier])]
        for gid, secs, util_s, util_n, power_s, busy_s, held_s in conn.execute(
                f"SELECT gpu, sum(seconds*{part}), sum(util_s*{part}), sum(util_n*{part}), sum(power_s*{part}), "
                f"sum(busy_s*{part}), sum(held_s*{part}) "
                "FROM series WHERE tier=? AND ts>=? AND ts<? GROUP BY gpu", (tier, lo, hi)):
            g = gpus.get(gid)
            if g is not None:
                for k, v in (("seconds", secs), ("util_s", util_s), ("util_n", util_n), ("energy_j", power_s),
                             ("busy_s", busy_s), ("held_s", held_s)):
                    g[k] += v
        for gid, kind, user, secs, util_s, energy, idle_s in conn.execute(
                f"SELECT gpu, kind, user, sum(seconds*{part}), sum(util_s*{part}), sum(energy_j*{part}), "
                f"sum(idle_s*{part}) FROM usage WHERE tier=? AND ts>=? AND ts<? GROUP BY gpu, kind, user",
                (tier, lo, hi)):
            acc = per_user.setdefault((gid, kind, user if private else ""), [0.0, 0.0, 0.0, 0.0])
            for i, v in enumerate((secs, util_s, energy, idle_s)):
                acc[i] += v
    # without the right to see them, one row per GPU and kind, no names (aggregates are for everyone)
    users = [{"gpu": gpus[gid]["uuid"], "kind": kind, "user": (user or None) if private else None,
              "seconds": a[0], "util_s": a[1], "energy_j": a[2], "idle_s": a[3]}
             for (gid, kind, user), a in per_user.items() if gid in gpus]
    jobs = []
    for (kind, uid, user, command, gl, jstart, last, ended, gpu_s, util_s, energy, idle_s, peak, flagged,
         released, timed_out) in conn.execute(
            "SELECT kind, uid, user, command, gpus, start, last, ended, gpu_s, util_s, energy_j, idle_s, peak_mem, "
            "idle_flagged, released, timed_out FROM jobs WHERE start<? AND last>=? ORDER BY gpu_s DESC LIMIT ?",
            (end, start, 10 * TOP_JOBS)):
        idle = kind == "lease" and (flagged is not None or idle_s >= idle_after)
        jobs.append({"kind": kind, "uid": uid if private else None, "user": user if private else None,
                     "command": command if private else None, "gpus": json.loads(gl), "start": jstart,
                     "last": last, "ended": ended, "gpu_s": gpu_s, "util_s": util_s, "energy_j": energy,
                     "idle_s": idle_s, "peak_mem": peak, "idle": idle, "released": released, "timed_out": timed_out})
    idle_jobs = [j for j in jobs if j["idle"]]
    top = sorted((j for j in jobs if j["kind"] in ("process", "unleased")), key=lambda j: -j["gpu_s"])[:TOP_JOBS]
    # the host's utilisation over time: at most MAX_POINTS points, from the coarsest tier that fits
    span = max(1.0, end - start)
    tier = max((t for t, _, _ in pieces if STEP[t] <= max(STEP[FINE], span / MAX_POINTS)),
               default=pieces[0][0])
    tier = FINE if pieces[0][0] == FINE else tier
    step = max(STEP[tier], int(-(-span // MAX_POINTS) // STEP[tier] * STEP[tier]) or STEP[tier])
    lo = int(start // step * step)
    timeline = [[b, round(u / n, 1) if n else None, round(busy / secs * 100, 1) if secs else None]
                for b, u, n, busy, secs in conn.execute(
                    "SELECT (ts/?)*? AS b, sum(util_s), sum(util_n), sum(busy_s), sum(seconds) FROM series "
                    "WHERE tier=? AND ts>=? AND ts<? GROUP BY b ORDER BY b", (step, step, tier, lo, end))]
    return {"host": host, "node_id": node_id, "from": start, "to": end, "tier": _TIER_NAMES[pieces[0][0]],
            "data_from": min(seen) if seen else None, "data_to": max(seen) if seen else None,
            "private": private, "idle_after": idle_after, "gpus": list(gpus.values()), "users": users,
            "jobs": top, "idle_reservations": idle_jobs,
            "timed_out": [j for j in jobs if j["timed_out"] is not None],
            "timeline": {"step": step, "points": timeline}}
