// gpusd dashboard: history charts (uPlot, vendored in web/vendor with its licence), usage per user for
// readers on the daemon's own machine, and the idle-lease marks.  Reads GET api/v1/history/series (public; other daemons'
// too, sent with Access-Control-Allow-Origin), api/v1/history/usage (this daemon; per-user rows only
// when the daemon says the reader may see them) and api/v1/history/idle.  Everything from the network
// is bounded and typed before use, and shown through textContent only.
"use strict";

(function () {
  const dash = window.gpusdDashboard;
  if (!dash || typeof uPlot === "undefined") return;
  const RANGES = [["1h", 3600], ["6h", 21600], ["24h", 86400], ["7d", 604800], ["30d", 2592000]];
  const NAME_MAX = 128;
  const $ = (id) => document.getElementById(id);
  const hist = { range: "1h", key: null, chart: null, loadedAt: 0, timer: null, usage: null, idle: new Set() };
  dash.idle = hist.idle;            // read by app.js when it draws a GPU row
  window.gpusdHistory = hist;       // for tests

  function str(v, max) { return typeof v === "string" ? v.slice(0, max) : null; }
  function nums(a, n) { return (Array.isArray(a) ? a.slice(0, n) : []).map((v) => typeof v === "number" && Number.isFinite(v) ? v : null); }
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function headers() {  // no credential: a page holds no secret (docs/security.md)
    return { "Accept": "application/json" };
  }
  function sameOrigin(url) { try { return new URL(url, location.href).host === location.host; } catch (e) { return false; } }
  function apiBase(host) {  // "" for the daemon that served the page, else the other daemon's root
    if (!host || !host.url || sameOrigin(host.url)) return "";
    return host.url.replace(/\/+$/, "").replace(/\/api\/v1$/, "") + "/";
  }
  async function getJSON(url, opts) {
    const r = await fetch(url, Object.assign({ cache: "no-store" }, opts || {}));
    if (!r.ok) throw new Error("HTTP " + r.status);
    const text = await r.text();
    if (text.length > 8 * 1024 * 1024) throw new Error("answer too large");
    return JSON.parse(text);
  }

  // ---------------------------------------------------------------- the GPU and range pickers
  function gpuChoices() {
    const out = [];
    for (const h of [...dash.hosts.values()].sort((a, b) => String(a.hostname).localeCompare(String(b.hostname)))) {
      for (const g of (h.snapshot && h.snapshot.gpus) || []) {
        out.push({ key: h.node_id + "|" + g.uuid, host: h, gpu: g, label: `${h.hostname} #${g.index} ${(g.name || "").replace(/^NVIDIA /, "")}` });
      }
    }
    return out;
  }
  function fillPicker() {
    const sel = $("hist-gpu");
    const choices = gpuChoices();
    const want = choices.map((c) => c.key).join("\n");
    if (sel.dataset.keys !== want) {
      sel.replaceChildren(...choices.map((c) => { const o = el("option", "", c.label.slice(0, NAME_MAX)); o.value = c.key; return o; }));
      sel.dataset.keys = want;
    }
    if (!hist.key && choices.length) hist.key = choices[0].key;
    if (hist.key) sel.value = hist.key;
    return choices;
  }
  function select(key) {
    if (key === hist.key) return;
    hist.key = key;
    $("hist-gpu").value = key;
    load();
  }

  // ---------------------------------------------------------------- the chart
  function draw(data) {
    const box = $("hist-chart");
    const t = nums(data.t, 5000), util = nums(data.util, 5000), mem = nums(data.mem, 5000);
    const total = typeof data.memory_total === "number" && data.memory_total > 0 ? data.memory_total : null;
    const memPct = mem.map((m) => m === null || !total ? null : Math.round(1000 * m / total) / 10);
    const width = Math.max(320, box.clientWidth || 800);
    // the period asked for, from the answer: a new daemon's one point in a 7-day chart sits at its
    // end, not in the middle of an axis uPlot made up around it (Feb 2027 to Aug 2029)
    const from = typeof data.from === "number" && Number.isFinite(data.from) ? data.from : null;
    const to = typeof data.to === "number" && Number.isFinite(data.to) ? data.to : null;
    const x = from !== null && to !== null && from < to ? { time: true, range: [from, to] } : { time: true };
    const opts = {
      width, height: 220,
      scales: { x, y: { range: [0, 100] } },
      series: [{}, { label: "utilisation %", stroke: "#4aa3ff", fill: "rgba(74,163,255,.15)", width: 1.5 },
        { label: "memory %", stroke: "#b083f0", width: 1.5 }],
      axes: [{ stroke: "#7d8a99", grid: { stroke: "#26303b" } }, { stroke: "#7d8a99", grid: { stroke: "#26303b" } }],
      legend: { live: true },
    };
    if (hist.chart) { hist.chart.destroy(); hist.chart = null; }
    box.replaceChildren();
    $("hist-empty").hidden = t.length > 0;
    if (!t.length) return;
    hist.chart = new uPlot(opts, [t, util, memPct], box);
  }
  async function load() {
    const choice = fillPicker().find((c) => c.key === hist.key);
    if (!choice) return;
    const url = apiBase(choice.host) + "api/v1/history/series?gpu=" + encodeURIComponent(choice.gpu.uuid) +
      "&range=" + encodeURIComponent(hist.range);
    $("hist-status").textContent = "loading…";
    try {
      const data = await getJSON(url);
      if (choice.key !== hist.key) return;  // the user picked another GPU meanwhile
      draw(data);
      hist.loadedAt = Date.now();
      $("hist-status").textContent = `${str(data.tier, 16) || ""} · every ${Math.round(data.step || 0)} s`;
    } catch (e) {
      $("hist-status").textContent = "no history: " + String(e.message || e).slice(0, 120);
      draw({ t: [] });
    }
    loadUsage();
  }

  // ---------------------------------------------------------------- usage per user (private readers)
  async function loadUsage() {
    const secs = (RANGES.find((r) => r[0] === hist.range) || RANGES[0])[1];
    try {
      const u = await getJSON("api/v1/history/usage?since=" + secs + "s", { headers: headers() });
      hist.usage = u;
      drawUsage(u);
    } catch (e) { $("usage-body").replaceChildren(); $("usage-note").textContent = "no usage history on this daemon"; }
  }
  function drawUsage(u) {
    const rows = new Map();
    for (const x of Array.isArray(u.users) ? u.users.slice(0, 4096) : []) {
      if (!x || typeof x !== "object") continue;
      const name = u.private === true ? (str(x.user, NAME_MAX) || "(unknown)") : "all users";
      const r = rows.get(name) || { used: 0, held: 0, idle: 0 };
      const s = typeof x.seconds === "number" ? x.seconds : 0, i = typeof x.idle_s === "number" ? x.idle_s : 0;
      if (x.kind === "use") r.used += s; else if (x.kind === "hold") { r.held += s; r.idle += i; }
      rows.set(name, r);
    }
    const body = $("usage-body");
    body.replaceChildren();
    for (const [name, r] of [...rows].sort((a, b) => (b[1].used + b[1].held) - (a[1].used + a[1].held))) {
      const tr = el("tr", "user-row");
      tr.appendChild(el("td", "", name));
      for (const v of [r.used, r.held, r.idle]) tr.appendChild(el("td", "num", (v / 3600).toFixed(2)));
      body.appendChild(tr);
    }
    $("usage-note").textContent = u.private === true ? "GPU-hours on this host, per user (private: shown to readers on the daemon's own machine)"
      : "GPU-hours on this host, all users together; per-user figures are shown on the daemon's own machine";
  }

  // ---------------------------------------------------------------- idle marks
  async function loadIdle() {
    const next = new Set();
    for (const h of [...dash.hosts.values()]) {
      if (!h.alive) continue;
      try {
        const base = apiBase(h);  // another daemon answers a cross-origin reader with the public part only
        const d = await getJSON(base + "api/v1/history/idle", base ? {} : { headers: headers() });
        for (const l of Array.isArray(d.idle) ? d.idle.slice(0, 256) : []) {
          for (const g of Array.isArray(l && l.gpus) ? l.gpus.slice(0, 64) : []) {
            const uuid = str(g, NAME_MAX);
            if (uuid) next.add(h.node_id + "|" + uuid);
          }
        }
      } catch (e) { /* a daemon without history */ }
    }
    const changed = next.size !== hist.idle.size || [...next].some((k) => !hist.idle.has(k));
    hist.idle.clear();
    for (const k of next) hist.idle.add(k);
    if (changed && dash.redraw) dash.redraw();
  }

  // ---------------------------------------------------------------- start
  const bar = $("hist-ranges");
  for (const [name] of RANGES) {
    const b = el("button", name === hist.range ? "on" : "", name);
    b.type = "button";
    b.dataset.range = name;
    b.addEventListener("click", () => {
      hist.range = name;
      for (const x of bar.children) x.classList.toggle("on", x.dataset.range === name);
      load();
    });
    bar.appendChild(b);
  }
  $("hist-gpu").addEventListener("change", (e) => select(e.target.value));
  $("hosts").addEventListener("click", (e) => {
    const tr = e.target.closest && e.target.closest("tr.gpu");
    const card = tr && tr.closest("[data-node]");
    if (tr && card) select(card.dataset.node + "|" + tr.dataset.uuid);
  });
  window.addEventListener("resize", () => { if (hist.chart) hist.chart.setSize({ width: Math.max(320, $("hist-chart").clientWidth), height: 220 }); });
  setInterval(() => {
    fillPicker();
    if (!hist.chart && hist.key && Date.now() - hist.loadedAt > 3000) load();
    else if (Date.now() - hist.loadedAt > (hist.range === "1h" ? 10000 : 60000)) load();
  }, 1000);
  setInterval(loadIdle, 15000);
  setTimeout(loadIdle, 1500);
})();
