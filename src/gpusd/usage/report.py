"""A usage report over one or many daemons' answers (``GET /api/v1/history/usage``).

:func:`build` merges the per-host answers and groups them ``by`` user, host, GPU or model: GPU-hours
used (a process ran; a GPU shared by several users' processes is split between them), GPU-hours held
(a lease or reservation was held), idle-held hours (held while the GPU was under 5 %), mean
utilisation and energy.  Pure arithmetic on JSON-ready dicts; rendering is in ``gpusd.views.report``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import GpusdError
from ..model import display_name
from .db import IDLE_UTIL

BY = ("user", "host", "gpu", "model")
UNKNOWN_USER = "(unknown)"


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else 0.0


def _text(v: Any, limit: int = 256) -> str | None:
    return v[:limit] if isinstance(v, str) else None


def _display_model(name: str | None) -> str:
    return display_name(name) if name else "?"


def build(answers: Iterable[Mapping[str, Any]], by: str = "user") -> dict[str, Any]:
    """The report of ``answers`` (one per host) grouped ``by`` one of :data:`BY`.  Raises
    :class:`GpusdError` for ``by user`` when an answer withheld per-user figures (not signed with the fleet secret)."""
    if by not in BY:
        raise GpusdError(f"--by must be one of {', '.join(BY)}")
    answers = list(answers)
    rows: dict[str, dict[str, float]] = {}
    gpu_of: dict[tuple[str, str], dict[str, Any]] = {}
    never_used, idle_res, top, hosts, timeline = [], [], [], [], {}
    totals = {"gpus": 0, "observed_h": 0.0, "used_h": 0.0, "held_h": 0.0, "idle_held_h": 0.0, "energy_kwh": 0.0,
              "util_s": 0.0, "util_n": 0.0}
    start = min((_num(a.get("from")) for a in answers), default=0.0)
    end = max((_num(a.get("to")) for a in answers), default=0.0)
    # the part of the period with data (answers of older daemons do not say: None)
    firsts = [_num(a.get("data_from")) for a in answers if _num(a.get("data_from")) > 0]
    lasts = [_num(a.get("data_to")) for a in answers if _num(a.get("data_to")) > 0]
    private = all(a.get("private") is True for a in answers)
    if by == "user" and not private:
        raise GpusdError("per-user figures are private: sign with the fleet secret (--token-file FILE or "
                         "$GPUSD_TOKEN_FILE), or ask --by host, gpu or model")

    def row(key: str) -> dict[str, float]:
        return rows.setdefault(key, {"used_h": 0.0, "held_h": 0.0, "idle_held_h": 0.0, "unleased_h": 0.0,
                                     "outside_h": 0.0, "util_s": 0.0, "util_n": 0.0, "energy_kwh": 0.0,
                                     "observed_h": 0.0})

    for a in answers:
        host = _text(a.get("host")) or _text(a.get("node_id")) or "?"
        hosts.append(host)
        pts = a.get("timeline", {}).get("points") if isinstance(a.get("timeline"), dict) else None
        timeline[host] = [[_num(p[0]), p[1] if isinstance(p[1], (int, float)) else None]
                          for p in (pts if isinstance(pts, list) else [])[:2000]
                          if isinstance(p, list) and len(p) >= 2]
        for g in a.get("gpus") or []:
            if not isinstance(g, dict):
                continue
            uuid = _text(g.get("uuid")) or "?"
            info = {"host": host, "uuid": uuid, "index": g.get("index"), "model": _display_model(_text(g.get("model")))}
            gpu_of[(host, uuid)] = info
            secs = _num(g.get("seconds"))
            if secs <= 0:
                # not seen in this range
                continue
            totals["gpus"] += 1
            totals["observed_h"] += secs / 3600
            totals["energy_kwh"] += _num(g.get("energy_j")) / 3.6e6
            totals["util_s"] += _num(g.get("util_s"))
            totals["util_n"] += _num(g.get("util_n"))
            # never used: no process, no lease, and idle all along (a GPU at 30 % whose processes
            # are out of sight, in a container or another user's, was used)
            util_n = _num(g.get("util_n"))
            mean_util = _num(g.get("util_s")) / util_n if util_n else 0.0
            if _num(g.get("busy_s")) <= 0 and _num(g.get("held_s")) <= 0 and mean_util < IDLE_UTIL:
                never_used.append(info)
            if by != "user":
                r = row(_key(by, info))
                r["util_s"] += _num(g.get("util_s"))
                r["util_n"] += _num(g.get("util_n"))
                r["energy_kwh"] += _num(g.get("energy_j")) / 3.6e6
                r["observed_h"] += secs / 3600
        for u in a.get("users") or []:
            if not isinstance(u, dict):
                continue
            info = gpu_of.get((host, _text(u.get("gpu")) or "?"), {"host": host, "uuid": "?", "index": None,
                                                                   "model": "?"})
            kind = u.get("kind")
            secs, idle = _num(u.get("seconds")), _num(u.get("idle_s"))
            r = row(_key(by, info, _text(u.get("user")) or UNKNOWN_USER))
            if kind == "use":
                r["used_h"] += secs / 3600
                totals["used_h"] += secs / 3600
                if by == "user":
                    r["util_s"] += _num(u.get("util_s"))
                    r["util_n"] += secs
            elif kind == "unleased":
                # used without a gpusd lease (part of "use" too)
                r["unleased_h"] += secs / 3600
            elif kind == "outside":
                # held by leases the lease authority did not grant (part of "hold" too)
                r["outside_h"] += secs / 3600
            elif kind == "hold":
                r["held_h"] += secs / 3600
                r["idle_held_h"] += idle / 3600
                totals["held_h"] += secs / 3600
                totals["idle_held_h"] += idle / 3600
            if by == "user":
                r["energy_kwh"] += _num(u.get("energy_j")) / 3.6e6
        for j in a.get("jobs") or []:
            if isinstance(j, dict):
                top.append(_job(host, j))
        for j in a.get("idle_reservations") or []:
            if isinstance(j, dict):
                idle_res.append(_job(host, j))
    out_rows: list[dict[str, Any]] = []
    for key, r in rows.items():
        out_rows.append({by: key, "gpu_hours_used": round(r["used_h"], 4), "gpu_hours_held": round(r["held_h"], 4),
                         "idle_held_hours": round(r["idle_held_h"], 4),
                         "gpu_hours_unleased": round(r["unleased_h"], 4),
                         "gpu_hours_outside_authority": round(r["outside_h"], 4),
                         "mean_util": round(r["util_s"] / r["util_n"], 1) if r["util_n"] else None,
                         "energy_kwh": round(r["energy_kwh"], 4)})
    out_rows.sort(key=lambda r: (-r["gpu_hours_used"] - r["gpu_hours_held"], str(r[by])))
    top.sort(key=lambda j: -j["gpu_hours"])
    return {
        "from": start, "to": end, "data_from": min(firsts) if firsts else None,
        "data_to": max(lasts) if lasts else None, "by": by, "hosts": sorted(hosts), "private": private,
        "rows": out_rows,
        "totals": {"gpus": totals["gpus"], "gpu_hours_observed": round(totals["observed_h"], 4),
                   "gpu_hours_used": round(totals["used_h"], 4), "gpu_hours_held": round(totals["held_h"], 4),
                   "idle_held_hours": round(totals["idle_held_h"], 4),
                   "mean_util": round(totals["util_s"] / totals["util_n"], 1) if totals["util_n"] else None,
                   "energy_kwh": round(totals["energy_kwh"], 4)},
        "never_used": never_used, "idle_reservations": idle_res, "top_jobs": top[:20], "timeline": timeline,
    }


def _key(by: str, gpu: Mapping[str, Any], user: str | None = None) -> str:
    if by == "user":
        return user or UNKNOWN_USER
    if by == "host":
        return str(gpu["host"])
    if by == "model":
        return str(gpu["model"])
    return f"{gpu['host']} #{gpu['index']}"


def _job(host: str, j: Mapping[str, Any]) -> dict[str, Any]:
    gpu_s = _num(j.get("gpu_s"))
    gpus = [g[:64] for g in (j.get("gpus") or [])[:64] if isinstance(g, str)] if isinstance(j.get("gpus"), list) else []
    return {"host": host, "kind": _text(j.get("kind"), 16), "user": _text(j.get("user")),
            "command": _text(j.get("command"), 512), "gpus": gpus, "start": _num(j.get("start")),
            "end": _num(j.get("ended")) or None, "last": _num(j.get("last")),
            "gpu_hours": round(gpu_s / 3600, 4), "idle_hours": round(_num(j.get("idle_s")) / 3600, 4),
            "mean_util": round(_num(j.get("util_s")) / gpu_s, 1) if gpu_s else None,
            "energy_kwh": round(_num(j.get("energy_j")) / 3.6e6, 4),
            "peak_mem": int(_num(j.get("peak_mem"))) or None, "released": _num(j.get("released")) or None}
