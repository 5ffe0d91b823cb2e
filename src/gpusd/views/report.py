"""Rendering a usage report (:func:`gpusd.usage.report.build`) as a table, CSV, JSON or HTML.

The HTML report is one self-contained file: the figures as tables, and two charts drawn by the
vendored uPlot (inlined, with its licence notice): utilisation over time per host, and usage per
user (or per host, GPU, model).  Its Content-Security-Policy forbids every network request, so a
report mailed to a lab opens the same anywhere.  Every name in it is escaped; the chart data is a
JSON block whose ``<`` ``>`` ``&`` are escaped, so no user name can end the script.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..sanitize import dumps, for_html, for_terminal
from .tables import render_table

FORMATS = ("table", "csv", "json", "html")
COLUMNS = ("gpu_hours_used", "gpu_hours_held", "idle_held_hours", "mean_util", "energy_kwh")
HEADERS = ("GPU-h used", "GPU-h held", "idle-held h", "mean util", "energy kWh")
VENDOR = Path(__file__).resolve().parent.parent / "web" / "vendor"


def render(report: Mapping[str, Any], fmt: str = "table") -> str:
    if fmt == "json":
        return dumps(report, indent=2) + "\n"
    if fmt == "csv":
        return to_csv(report)
    if fmt == "html":
        return to_html(report)
    return to_table(report)


def _when(ts: float | None) -> str:
    return "-" if not ts else time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _fmt(v: Any, column: str = "") -> str:
    """One format per column, whatever the size: hours and kWh with 2 decimals, utilisation in %."""
    if v is None:
        return "-"
    if column == "mean_util" and isinstance(v, (int, float)):
        return f"{v:.0f}%"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def period(r: Mapping[str, Any]) -> str:
    """The period asked for, and the part of it with data when that is shorter (a new daemon)."""
    text = f"{_when(r['from'])} to {_when(r['to'])}"
    first, last = r.get("data_from"), r.get("data_to")
    if first is None and last is None and r.get("totals", {}).get("gpus") == 0:
        return text + " (no data in this period)"
    if isinstance(first, (int, float)) and isinstance(last, (int, float)) and (
            first - r["from"] > 60 or r["to"] - last > 60):
        return text + f" (data from {_when(first)} to {_when(last)})"
    return text


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    return render_table(headers, rows, right=right, max_cell=60)


def to_table(r: Mapping[str, Any]) -> str:
    by = str(r["by"])
    out = [f"gpusd usage report: {period(r)}, {len(r['hosts'])} host(s), "
           f"{r['totals']['gpus']} GPU(s)", ""]
    rows = [[str(row[by])] + [_fmt(row[c], c) for c in COLUMNS] for row in r["rows"]]
    t = r["totals"]
    rows.append(["(all)"] + [_fmt(t[c], c) for c in COLUMNS])
    out.append(_table([by, *HEADERS], rows, right=range(1, 6)))
    unleased = [(str(row[by]), row.get("gpu_hours_unleased") or 0.0) for row in r["rows"]]
    unleased = [(k, v) for k, v in unleased if isinstance(v, (int, float)) and v > 0]
    # GPU time of processes no gpusd lease covered (docs/allocation.md "Unleased processes")
    if unleased:
        out += ["", "Used unleased (GPU processes without a gpusd lease): "
                + ", ".join(f"{for_terminal(k, 60)} {_fmt(v)} GPU-h" for k, v in unleased)]
    outside = [(str(row[by]), row.get("gpu_hours_outside_authority") or 0.0) for row in r["rows"]]
    outside = [(k, v) for k, v in outside if isinstance(v, (int, float)) and v > 0]
    # leases taken in the shared directory while a daemon was the authority (docs/allocation.md)
    if outside:
        out += ["", "Held NOT through the lease authority (leases taken in the shared lock directory): "
                + ", ".join(f"{for_terminal(k, 60)} {_fmt(v)} GPU-h" for k, v in outside)]
    if r["idle_reservations"]:
        out += ["", "Idle reservations and leases (held under 5 % for longer than the idle limit):"]
        out.append(_table(["host", "user", "GPUs", "held since", "held h", "idle h", "released"],
                          [[j["host"], j["user"] or "-", str(len(j["gpus"])), _when(j["start"]),
                            _fmt(round((j["last"] - j["start"]) / 3600 * max(1, len(j["gpus"])), 2)),
                            _fmt(j["idle_hours"]), _when(j["released"]) if j["released"] else "no"]
                           for j in r["idle_reservations"]], right=(2, 4, 5)))
    if r["never_used"]:
        out += ["", "GPUs never used in this period: " + ", ".join(
            f"{g['host']} #{g['index']} ({g['model']})" for g in r["never_used"])]
    if r["top_jobs"]:
        out += ["", "Top jobs:"]
        out.append(_table(["host", "user", "command", "GPUs", "start", "GPU-h", "mean util", "kWh"],
                          [[j["host"], j["user"] or "-", (j["command"] or "-")[:40], str(len(j["gpus"])),
                            _when(j["start"]), _fmt(j["gpu_hours"]), _fmt(j["mean_util"], "mean_util"),
                            _fmt(j["energy_kwh"])]
                           for j in r["top_jobs"][:10]], right=(3, 5, 6, 7)))
    if not r["private"]:
        out += ["", "(per-user figures and job owners are private: sign with the fleet secret, --token-file,"
                    " to see them)"]
    return "\n".join(out) + "\n"


def to_csv(r: Mapping[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    by = str(r["by"])
    w.writerow([by, *COLUMNS])
    for row in r["rows"]:
        # a leading = + - @ would be a formula in a spreadsheet: quote it away
        key = str(row[by])
        w.writerow([("'" + key) if key[:1] in "=+-@" else key, *["" if row[c] is None else row[c] for c in COLUMNS]])
    return buf.getvalue()


def _script_json(data: Any) -> str:
    return dumps(data, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def to_html(r: Mapping[str, Any]) -> str:
    # the one rule for HTML (gpusd.sanitize): no control byte reaches a saved report
    def e(text: str) -> str:
        return for_html(text, 8192)
    by = str(r["by"])
    js = (VENDOR / "uPlot.iife.min.js").read_text()
    css = (VENDOR / "uPlot.min.css").read_text()
    lic = (VENDOR / "uPlot.LICENSE").read_text()

    def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
        head = "".join(f"<th>{e(h)}</th>" for h in headers)
        body = "".join("<tr>" + "".join(f"<td>{e(_fmt(c) if not isinstance(c, str) else c)}</td>" for c in row)
                       + "</tr>" for row in rows)
        return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'

    t = r["totals"]
    main_rows = [[str(row[by])] + [_fmt(row[c], c) for c in COLUMNS] for row in r["rows"]]
    main_rows.append(["(all)"] + [_fmt(t[c], c) for c in COLUMNS])
    parts = [
        f"<h1>GPU usage {e(period(r).replace(' to ', ' – ', 1))}</h1>",
        f"<p class=meta>{len(r['hosts'])} host(s): {e(', '.join(r['hosts']))} · {t['gpus']} GPUs · "
        f"{_fmt(t['gpu_hours_observed'])} GPU-hours observed · generated {e(_when(time.time()))} by gpusd</p>",
        '<h2>Utilisation over time</h2><div id="timeline" class="chart"></div>',
        f'<h2>Usage by {e(by)}</h2><div id="usage" class="chart"></div>',
        table([by, *HEADERS], main_rows, "main"),
    ]
    if r["idle_reservations"]:
        parts.append("<h2>Idle reservations and leases</h2>")
        parts.append(table(["host", "user", "GPUs", "held since", "idle hours", "released"],
                           [[j["host"], j["user"] or "-", len(j["gpus"]), _when(j["start"]), j["idle_hours"],
                             _when(j["released"]) if j["released"] else "no"] for j in r["idle_reservations"]],
                           "idle"))
    if r["never_used"]:
        parts.append("<h2>GPUs never used</h2><ul>" + "".join(
            f"<li>{e(str(g['host']))} #{e(str(g['index']))} {e(str(g['model']))}</li>" for g in r["never_used"])
            + "</ul>")
    if r["top_jobs"]:
        parts.append("<h2>Top jobs</h2>")
        parts.append(table(["host", "user", "command", "GPUs", "start", "end", "GPU-hours", "mean util", "kWh"],
                           [[j["host"], j["user"] or "-", (j["command"] or "-")[:80], len(j["gpus"]),
                             _when(j["start"]), _when(j["end"]), j["gpu_hours"], _fmt(j["mean_util"], "mean_util"),
                             j["energy_kwh"]]
                            for j in r["top_jobs"]], "jobs"))
    if not r["private"]:
        parts.append("<p class=meta>Per-user figures and job owners are private: this report was made without "
                     "the fleet secret.</p>")
    chart_data = {"by": by, "rows": r["rows"], "timeline": r["timeline"], "from": r["from"], "to": r["to"]}
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; \
style-src 'unsafe-inline'; img-src data:">
<title>GPU usage report</title>
<style>{css}
body{{font:14px system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}}
table{{border-collapse:collapse;margin:1em 0}} td,th{{border-bottom:1px solid #ddd;padding:3px 10px;text-align:right}}
td:first-child,th:first-child{{text-align:left}} .meta{{color:#666}} .chart{{margin:1em 0}}
</style></head><body>
{"".join(parts)}
<script type="application/json" id="report-data">{_script_json(chart_data)}</script>
<script>/* uPlot 1.6.32, MIT licence:
{lic.replace("*/", "* /")}*/
{js}</script>
<script>{(VENDOR.parent / 'report.js').read_text()}</script>
</body></html>
"""
