// The charts of gpusd's HTML usage report (gpusd.views.report inlines this file and uPlot).
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const W = Math.min(1060, document.body.clientWidth || 1000);
  const colors = ["#2b6cb0", "#c05621", "#2f855a", "#6b46c1", "#b7791f", "#c53030", "#2c7a7b", "#97266d"];
  // utilisation over time: one line per host, on the union of their timestamps
  const hosts = Object.keys(data.timeline);
  const xs = [...new Set(hosts.flatMap((h) => data.timeline[h].map((p) => p[0])))].sort((a, b) => a - b);
  const at = new Map(xs.map((x, i) => [x, i]));
  const ys = hosts.map((h) => { const y = new Array(xs.length).fill(null); for (const p of data.timeline[h]) y[at.get(p[0])] = p[1]; return y; });
  window.reportCharts = [];
  if (xs.length) {
    // the period of the report, not only the part with data
    const x = typeof data.from === "number" && typeof data.to === "number" && data.from < data.to
      ? { time: true, range: [data.from, data.to] } : { time: true };
    window.reportCharts.push(new uPlot({ width: W, height: 260, scales: { x, y: { range: [0, 100] } },
      series: [{}].concat(hosts.map((h, i) => ({ label: h, stroke: colors[i % colors.length], width: 1.5, spanGaps: false }))),
      axes: [{}, { label: "utilisation %" }] }, [xs].concat(ys), document.getElementById("timeline")));
  }
  // usage per key: bars of GPU-hours used, held, idle-held
  const rows = data.rows;
  if (rows.length) {
    const idx = rows.map((r, i) => i);
    const mk = (label, color, off) => ({ label, stroke: color, fill: color, width: 0,
      paths: uPlot.paths.bars({ size: [0.25, 40], align: off }), points: { show: false },
      value: (u, v) => v === null ? "-" : v.toFixed(2) });
    window.reportCharts.push(new uPlot({ width: W, height: 260,
      scales: { x: { time: false, range: [-0.5, rows.length - 0.5] }, y: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] } },  // minutes of use: not lost under a 0-1 axis
      series: [{ label: data.by, value: (u, v) => v === null ? "" : String(rows[Math.round(v)] ? rows[Math.round(v)][data.by] : "") },
        mk("GPU-hours used", "#2b6cb0", -1), mk("GPU-hours held", "#b7791f", 0),
        mk("idle-held hours", "#c53030", 1)],
      axes: [{ values: (u, vals) => vals.map((v) => Number.isInteger(v) && rows[v] ? String(rows[v][data.by]).slice(0, 24) : ""),
               splits: () => idx }, { label: "GPU-hours" }] },
      [idx, rows.map((r) => r.gpu_hours_used), rows.map((r) => r.gpu_hours_held), rows.map((r) => r.idle_held_hours)],
      document.getElementById("usage")));
  }
})();
