// gpusd dashboard: the fleet as one daemon sees it.
// GET api/v1/fleet once, then follow the server-sent events of api/v1/fleet/events (read with fetch).
// The page holds no secret: process owners and commands are shown where the daemon serves them to
// this browser (opened on the daemon's own machine, under its own name: docs/security.md).  No build step, no dependencies, no network
// access beyond the daemon that served this page.  All text from the network goes through
// textContent, never innerHTML.
//
// Every host's data is hostile (docs/security.md): what arrives is normalised first (strings
// bounded, numbers finite or null, lists bounded; clean() & co.), and each host is drawn on its own
// (a host whose data cannot be shown becomes one "cannot show" card), so one malformed host never
// takes the page down with it.
"use strict";

(function () {
  const HISTORY_SECONDS = 180;     // sparkline window
  const STALE_MS = 6500;           // three missed heartbeats: the stream is dead
  const GONE_KEEP_MS = 120000;     // a vanished host stays greyed out this long
  const LOG_MAX = 200;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const NAME_MAX = 128;            // characters kept of a host or GPU name, UUID, node id
  const TEXT_MAX = 512;            // of a command, an error, an alert message
  const SHOWN_MAX = 64;            // of a name shown in a cell (the whole one is in its tooltip)
  const GPUS_MAX = 256, PROCS_MAX = 64;

  const state = {
    hosts: new Map(),     // node_id -> {node_id, hostname, url, alive, snapshot, goneAt}
    history: new Map(),   // gpu uuid -> [{t, util, mem}]
    alerts: new Map(),    // node|uuid|rule -> threshold data
    lastHeard: 0,
    topoOpen: new Set(),  // node ids whose topology view is open (kept across redraws)
    dirty: false,
    status: "connecting",
  };

  // ------------------------------------------------------------------ helpers
  const $ = (id) => document.getElementById(id);
  // Bounded, typed values from the network: a string (or null), a finite number (or null), a list.
  function str(v, max) {
    if (typeof v === "number" && Number.isFinite(v)) v = String(v);
    if (typeof v !== "string") return null;
    return v.length > max ? v.slice(0, max - 1) + "…" : v;
  }
  function num(v) { return typeof v === "number" && Number.isFinite(v) ? v : null; }
  function obj(v) { return v !== null && typeof v === "object" && !Array.isArray(v) ? v : null; }
  function bounded(v, max) { return Array.isArray(v) ? v.slice(0, max) : []; }
  function clip(v, max) { const t = String(v ?? ""); return t.length > max ? t.slice(0, max - 1) + "…" : t; }
  function cleanProc(p) {
    p = obj(p) || {};
    return Object.assign({}, p, { pid: num(p.pid), used_memory: num(p.used_memory), user: str(p.user, NAME_MAX),
      command: str(p.command, TEXT_MAX), unleased: p.unleased === true, container: str(p.container, 128),
      container_runtime: str(p.container_runtime, 32), container_owner: str(p.container_owner, NAME_MAX) });
  }
  function cleanLease(l) {
    l = obj(l) || {};
    return Object.assign({}, l, { pid: num(l.pid), user: str(l.user, NAME_MAX), shared: l.shared === true,
      expires: num(l.expires), job: str(l.job, 32), outside_authority: l.outside_authority === true,
      over_cap: l.over_cap === true });
  }
  function cleanGpu(g) {  // null: not a GPU at all
    g = obj(g);
    if (!g) return null;
    const out = Object.assign({}, g);
    for (const k of ["memory_total", "memory_used", "memory_free", "utilization_gpu", "utilization_memory",
      "temperature", "power_draw", "power_limit", "fan_speed"]) out[k] = num(g[k]);
    out.index = num(g.index) ?? 0;
    out.uuid = str(g.uuid, NAME_MAX) || "?";
    out.name = str(g.name, NAME_MAX);
    // issue 21: a known vendor or "nvidia" (older daemons send none); never free text on the page
    out.vendor = ["nvidia", "amd", "intel"].includes(g.vendor) ? g.vendor : "nvidia";
    out.error = str(g.error, TEXT_MAX);
    out.healthy = g.healthy !== false;
    out.memory_shared = g.memory_shared === true;  // unified memory: the host's
    out.processes = bounded(g.processes, PROCS_MAX).map(cleanProc);
    out.leases = bounded(g.leases, PROCS_MAX).map(cleanLease);
    out.numa_node = num(g.numa_node);
    out.local_cpus = typeof g.local_cpus === "string" && /^[0-9,-]{1,256}$/.test(g.local_cpus) ? g.local_cpus : null;
    out.links = bounded(g.links, GPUS_MAX).map(cleanLink).filter(Boolean);
    out.topology = cleanTopology(g.topology);
    return out;
  }
  // a GPU's topology in the form that grows with its links (docs/wire-format.md, "Topology v2"); null: none
  function cleanTopology(t) {
    t = obj(t);
    if (!t) return null;
    const ints = (xs, n) => bounded(xs, n).map(num).filter((x) => x !== null);
    return { pcie: ints(t.pcie, 5), nvlink: bounded(t.nvlink, 64).map(cleanLink).filter(Boolean),
             fabric: num(t.fabric), fabric_links: Math.max(0, Math.min(999, num(t.fabric_links) ?? 0)) };
  }
  // how a reaches b (gpusd.topology.link_between): from both topologies, else from the pair links
  const PCIE_LEVELS = [0, 10, 20, 30, 40];
  function linkBetween(a, b) {
    if (a.topology && b.topology) {
      const ta = a.topology, tb = b.topology;
      let level = null;
      if (ta.pcie.length && tb.pcie.length) {
        level = 50;
        for (let k = 0; k < PCIE_LEVELS.length; k++) {
          if (ta.pcie[k] !== undefined && ta.pcie[k] === tb.pcie[k]) { level = PCIE_LEVELS[k]; break; }
        }
      }
      const bond = ta.nvlink.find((x) => x.peer === b.index) || tb.nvlink.find((x) => x.peer === a.index);
      let nvlink = bond ? bond.nvlink : 0;
      if (!nvlink && ta.fabric !== null && ta.fabric === tb.fabric) nvlink = ta.fabric_links;
      return level === null && !nvlink ? null : { peer: b.index, level, nvlink };
    }
    return a.links.find((x) => x.peer === b.index) || b.links.find((x) => x.peer === a.index) || null;
  }
  function cleanLink(l) {  // {peer, level, nvlink} (docs/wire-format.md, "Topology"); null: not a link
    l = obj(l);
    if (!l || num(l.peer) === null) return null;
    return { peer: num(l.peer), level: num(l.level), nvlink: Math.max(0, Math.min(999, num(l.nvlink) ?? 0)) };
  }
  // nvidia-smi topo -m's words (gpusd.topology.label): NV# for # bonded NVLinks, else the PCIe level
  const LEVEL_LABELS = { 0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS" };
  function linkLabel(a, b) {
    const l = linkBetween(a, b);
    if (!l) return "N/A";
    if (l.nvlink > 0) return "NV" + Math.round(l.nvlink);
    return LEVEL_LABELS[l.level] || "N/A";
  }
  function cleanSnapshot(s) {
    s = obj(s);
    if (!s) return null;
    return Object.assign({}, s, {
      hostname: str(s.hostname, NAME_MAX), node_id: str(s.node_id, NAME_MAX), timestamp: num(s.timestamp),
      driver_version: str(s.driver_version, 32), cuda_version: str(s.cuda_version, 32), simulated: s.simulated === true,
      gpus: bounded(s.gpus, GPUS_MAX).map(cleanGpu).filter(Boolean),
      bookings: bounded(s.bookings, 64).map(cleanBooking).filter(Boolean),
    });
  }
  // A booking of the host (gpusd reserve --at): its times, its GPUs, its booker (private: null for
  // a reader who may not see it), whether the daemon holds it now.
  function cleanBooking(b) {
    b = obj(b);
    if (!b || num(b.start) === null || num(b.end) === null || !(b.end > b.start)) return null;
    return { booking_id: str(b.booking_id, 16), start: b.start, end: b.end, user: str(b.user, NAME_MAX),
             indices: bounded(b.indices, GPUS_MAX).filter((i) => Number.isInteger(i)), held: b.held === true };
  }
  // JSON as a daemon may send it: an older or foreign daemon may write NaN or Infinity, which
  // JSON.parse refuses; they are read as null (outside strings only) rather than losing everything.
  function parseJSON(text) {
    try { return JSON.parse(text); } catch (e) {
      return JSON.parse(text.replace(/("(?:[^"\\]|\\.)*")|-?\b(?:NaN|Infinity)\b/g, (m, q) => q || "null"));
    }
  }
  async function readJSON(r) { return parseJSON(await r.text()); }
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmtBytes(n) {
    if (n === null || n === undefined) return "-";
    const g = n / 2 ** 30;
    return (g >= 10 ? g.toFixed(0) : g.toFixed(1)) + " GiB";
  }
  function pct(v) { return v === null || v === undefined ? "-" : Math.round(v) + "%"; }
  function memRatio(g) {
    return g.memory_total && g.memory_used !== null && g.memory_used !== undefined ? g.memory_used / g.memory_total : null;
  }
  function level(p) { return p === null ? "" : p >= 90 ? "bad" : p >= 70 ? "warn" : ""; }
  // gpusd.model.display_name: without "NVIDIA ", then without one brand ("GeForce ", "Tesla ")
  function shortName(n) {
    return (n || "").replace(/^(NVIDIA |AMD |Intel\(R\) )?(GeForce |Tesla |Instinct |Radeon |Data Center GPU )?/, "") || "-";
  }
  function hostKey(d) { d = obj(d) || {}; return str(d.node_id, NAME_MAX) || str(d.hostname, NAME_MAX) || "?"; }
  function now() { return Date.now() / 1000; }
  function headers() {
    return { "Accept": "application/json" };
  }
  function markDirty() {
    if (!state.dirty) { state.dirty = true; requestAnimationFrame(render); }
  }

  // ------------------------------------------------------------------ data
  function record(key, g, t) {  // key: node id | GPU UUID (UUIDs of fakes repeat across hosts)
    let h = state.history.get(key);
    if (!h) { h = []; state.history.set(key, h); }
    const m = memRatio(g);
    const point = { t: t || now(), util: g.utilization_gpu, mem: m === null ? null : 100 * m };
    if (h.length && point.t <= h[h.length - 1].t) h[h.length - 1] = point; else h.push(point);
    const cut = point.t - HISTORY_SECONDS;
    while (h.length > 2 && h[0].t < cut) h.shift();
  }
  function setHost(entry) {
    entry = obj(entry);
    if (!entry) throw new Error("a host entry must be an object");
    const key = hostKey(entry);
    const prev = state.hosts.get(key);
    const snap = cleanSnapshot(entry.snapshot);
    const host = {
      node_id: str(entry.node_id, NAME_MAX) || (snap && snap.node_id) || key,
      hostname: str(entry.hostname, NAME_MAX) || (snap && snap.hostname) || key,
      url: str(entry.url, 2048) || (prev && prev.url) || null,
      alive: entry.alive !== false,
      snapshot: snap || (prev && prev.snapshot) || null,
      goneAt: entry.alive === false ? (prev && prev.goneAt) || Date.now() : null,
    };
    state.hosts.set(key, host);
    if (host.snapshot) for (const g of host.snapshot.gpus || []) record(host.node_id + "|" + g.uuid, g, host.snapshot.timestamp);
    return host;
  }
  function upsertGpu(d, remove) {
    const key = hostKey(d);
    const host = state.hosts.get(key);
    const g = cleanGpu(d.gpu);
    if (!host || !host.snapshot || !g) { scheduleRefetch(); return; }
    const gpus = host.snapshot.gpus || (host.snapshot.gpus = []);
    const i = gpus.findIndex((x) => x.uuid === g.uuid);
    if (remove) { if (i >= 0) gpus.splice(i, 1); }
    else {
      if (i >= 0) gpus[i] = g; else { gpus.push(g); gpus.sort((a, b) => a.index - b.index); }
      record(host.node_id + "|" + g.uuid, g, num(d.ts));
    }
    host.alive = true; host.goneAt = null;
    host.snapshot.timestamp = num(d.ts) || now();
  }
  function thresholdData(d) {
    // The fleet event carries the host's threshold event under "data" (or flat).
    const t = Object.assign({}, d, (d.data && typeof d.data === "object") ? d.data : {});
    const gpu = d.gpu && typeof d.gpu === "object" ? d.gpu : null;
    t.uuid = typeof t.gpu === "string" ? t.gpu : gpu ? gpu.uuid : t.uuid;
    if (t.index === undefined && gpu) t.index = gpu.index;
    return t;
  }
  function onThreshold(d, exceeded) {
    const t = thresholdData(d);
    const key = [hostKey(d), t.uuid, t.rule].join("|");
    if (exceeded) state.alerts.set(key, t); else state.alerts.delete(key);
    log((exceeded ? "exceeded" : "cleared"),
      t.message || `${d.hostname} GPU ${t.index ?? t.uuid}: ${t.rule} ${exceeded ? "exceeded" : "cleared"}`);
  }
  function log(cls, text) {
    const list = $("log");
    const li = el("li", cls, new Date().toLocaleTimeString() + "  " + clip(text, TEXT_MAX));
    list.insertBefore(li, list.firstChild);
    while (list.children.length > LOG_MAX) list.removeChild(list.lastChild);
  }

  function onEvent(name, d) {
    state.lastHeard = Date.now();
    switch (name) {
      case "host_added":
      case "host_updated":
        if (d.snapshot) setHost(d); else scheduleRefetch();
        log("", `host ${str(d.hostname, SHOWN_MAX) || hostKey(d)} added`);
        break;
      case "host_removed": {
        const h = state.hosts.get(hostKey(d));
        if (h) { h.alive = false; h.goneAt = Date.now(); }
        alertsLoaded.delete(hostKey(d));  // its alerts went with it; asked again if it comes back
        for (const k of [...state.alerts.keys()]) if (k.startsWith(hostKey(d) + "|")) state.alerts.delete(k);
        log("exceeded", `host ${str(d.hostname, SHOWN_MAX) || hostKey(d)} gone`);
        break;
      }
      case "device_added":
      case "device_updated":
        upsertGpu(d, false); break;
      case "device_removed":
        upsertGpu(d, true); break;
      case "threshold_exceeded":
        onThreshold(d, true); break;
      case "threshold_cleared":
        onThreshold(d, false); break;
      case "job": {  // a rebalancing decision (docs/jobs.md), with its reason
        const j = (d.data && typeof d.data === "object") ? d.data : {};
        log(j.ok === true ? "" : "exceeded", `${str(d.hostname, SHOWN_MAX) || hostKey(d)}: ${str(j.reason, TEXT_MAX) || "job " +
          str(j.action, 16)}${j.ok === true ? "" : " (failed: " + str(j.result, 200) + ")"}`);
        return;
      }
      case "snapshot":
        if (d.gpus) setHost({ node_id: d.node_id, hostname: d.hostname, snapshot: d });
        break;
      default:
        return;  // heartbeat and unknown events
    }
    markDirty();
  }

  // ------------------------------------------------------------------ network
  let refetchTimer = null;
  function scheduleRefetch() {
    if (refetchTimer === null) refetchTimer = setTimeout(() => { refetchTimer = null; loadFleet().catch(() => {}); }, 300);
  }
  async function loadFleet() {
    const r = await fetch("api/v1/fleet", { headers: headers(), cache: "no-store" });
    if (!r.ok) throw new Error("fleet: HTTP " + r.status);
    const data = obj(await readJSON(r));
    if (!data || !Array.isArray(data.hosts)) throw new Error("fleet: the answer has no hosts list");
    const seen = new Set();
    for (const h of data.hosts) {
      try { seen.add(hostKey(setHost(h))); }  // one malformed host is skipped, not the whole fleet
      catch (e) { console.warn("gpusd: skipped a malformed host", e); }
    }
    loadAlerts(false);
    for (const [k, h] of state.hosts) if (!seen.has(k) && h.alive) { h.alive = false; h.goneAt = Date.now(); }
    state.lastHeard = Date.now();
    markDirty();
  }
  function sameOrigin(url) {
    try { return new URL(url, location.href).host === location.host; } catch (e) { return false; }
  }
  const prefilled = new Set();
  async function loadHistory() {
    // The daemon that served this page keeps a history of its own GPUs: start the sparklines with it.
    for (const h of state.hosts.values()) {
      if (!h.url || !sameOrigin(h.url) || prefilled.has(h.node_id)) continue;
      prefilled.add(h.node_id);
      try {
        const r = await fetch("api/v1/history?seconds=" + HISTORY_SECONDS, { headers: headers(), cache: "no-store" });
        if (!r.ok) return;
        const data = await readJSON(r);
        for (const [uuid, s] of Object.entries(data.gpus || {})) {
          const g = (h.snapshot && h.snapshot.gpus || []).find((x) => x.uuid === uuid);
          const total = g && g.memory_total;
          const pts = (s.t || []).map((t, i) => ({
            t, util: (s.utilization_gpu || [])[i] ?? null,
            mem: total && (s.memory_used || [])[i] !== null && (s.memory_used || [])[i] !== undefined ? 100 * s.memory_used[i] / total : null,
          }));
          const key = h.node_id + "|" + uuid;
          const cur = state.history.get(key) || [];
          const first = cur.length ? cur[0].t : Infinity;
          state.history.set(key, pts.filter((p) => p.t < first).concat(cur));
        }
        markDirty();
      } catch (e) { /* history is a nicety */ }
    }
  }
  function alertsUrl(h) {
    // This daemon's own alerts, or another daemon's (its URL ends in /api/v1; the answer is public and
    // sent with Access-Control-Allow-Origin, so no token and no preflight).
    if (!h.url || sameOrigin(h.url)) return "api/v1/alerts";
    return h.url.replace(/\/+$/, "").replace(/\/api\/v1$/, "") + "/api/v1/alerts";
  }
  const alertsLoaded = new Set();
  async function loadAlerts(force) {
    // Threshold events only tell what changes from now on: ask each daemon what is exceeded already.
    for (const h of [...state.hosts.values()]) {
      if (!h.alive || (!force && alertsLoaded.has(h.node_id))) continue;
      alertsLoaded.add(h.node_id);
      try {
        const r = await fetch(alertsUrl(h), { cache: "no-store" });
        if (!r.ok) continue;
        const data = obj(await readJSON(r)) || {};
        for (const k of [...state.alerts.keys()]) if (k.startsWith(h.node_id + "|")) state.alerts.delete(k);
        for (const a of bounded(data.alerts, 256)) {  // another daemon's answer: as hostile as any
          if (!obj(a)) continue;
          const gpu = str(a.gpu, NAME_MAX), rule = str(a.rule, SHOWN_MAX);
          state.alerts.set([h.node_id, gpu, rule].join("|"), Object.assign({}, a, {
            uuid: gpu, gpu, rule, hostname: str(a.hostname, SHOWN_MAX), message: str(a.message, TEXT_MAX) }));
        }
        markDirty();
      } catch (e) { /* a daemon without the monitor, or unreachable: its events still arrive */ }
    }
  }

  function setStatus(s, title) {
    state.status = s;
    const st = $("status");
    st.className = "status " + s;
    st.textContent = s;
    st.title = title || "";
  }

  let controller = null;
  async function stream() {
    controller = new AbortController();
    const r = await fetch("api/v1/fleet/events", {
      headers: Object.assign(headers(), { "Accept": "text/event-stream" }),
      cache: "no-store", signal: controller.signal,
    });
    if (!r.ok || !r.body) throw new Error("events: HTTP " + r.status);
    setStatus("live");
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "", event = "", data = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        let line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (data.length) {
            try { onEvent(event || "message", obj(parseJSON(data.join("\n"))) || {}); }
            catch (e) { console.warn("gpusd: bad event", event, e); }
          }
          event = ""; data = [];
        } else if (line.startsWith(":")) {
          state.lastHeard = Date.now();
        } else {
          const c = line.indexOf(":");
          const field = c < 0 ? line : line.slice(0, c);
          let v = c < 0 ? "" : line.slice(c + 1);
          if (v.startsWith(" ")) v = v.slice(1);
          if (field === "event") event = v; else if (field === "data") data.push(v);
        }
      }
      if (buf.length > 4 * 1024 * 1024) throw new Error("event too large");
    }
  }

  async function run() {
    let delay = 1000;
    for (;;) {
      try {
        await loadFleet();
        loadAlerts(true);
        loadHistory();
        await stream();
        delay = 1000;
        setStatus("connecting", "stream ended; reconnecting");
      } catch (e) {
        if (e && e.name !== "AbortError") setStatus("down", String(e && e.message || e));
        else setStatus("stale", "no heartbeat; reconnecting");
      }
      await new Promise((res) => setTimeout(res, delay));
      delay = Math.min(10000, delay * 2);
    }
  }

  setInterval(() => {
    if (state.status === "live" && Date.now() - state.lastHeard > STALE_MS && controller) controller.abort();
    let changed = false;
    for (const [k, h] of state.hosts) {
      if (!h.alive && h.goneAt && Date.now() - h.goneAt > GONE_KEEP_MS) { state.hosts.delete(k); changed = true; }
    }
    if (changed) markDirty();
  }, 1000);

  // ------------------------------------------------------------------ drawing
  function sparkline(points, field, cls) {
    const svg = document.createElementNS(SVG_NS, "svg");
    svg.setAttribute("class", "spark");
    svg.setAttribute("viewBox", "0 0 100 22");
    svg.setAttribute("preserveAspectRatio", "none");
    const t1 = now(), t0 = t1 - HISTORY_SECONDS;
    const pts = [];
    for (const p of points || []) {
      const v = p[field];
      if (v === null || v === undefined) continue;
      const x = Math.max(0, (p.t - t0) / HISTORY_SECONDS * 100);
      pts.push([x, 21 - Math.max(0, Math.min(100, v)) / 100 * 20]);
    }
    if (pts.length) {
      pts.push([100, pts[pts.length - 1][1]]);  // hold the last value up to now
      const line = pts.map((p) => p[0].toFixed(1) + "," + p[1].toFixed(1)).join(" ");
      const area = document.createElementNS(SVG_NS, "path");
      area.setAttribute("class", cls);
      area.setAttribute("d", "M" + pts[0][0].toFixed(1) + ",22 L" + line.replace(/ /g, " L") + " L100,22 Z");
      area.setAttribute("stroke", "none");
      const pl = document.createElementNS(SVG_NS, "polyline");
      pl.setAttribute("class", cls);
      pl.setAttribute("fill", "none");
      pl.setAttribute("points", line);
      svg.appendChild(area);
      svg.appendChild(pl);
    }
    const title = document.createElementNS(SVG_NS, "title");
    title.textContent = `${field === "util" ? "utilisation" : "memory"}, last ${HISTORY_SECONDS / 60} min`;
    svg.appendChild(title);
    return svg;
  }
  function metric(p, cls, hist, field, detail) {
    const d = el("div", "metric " + cls);
    const left = el("div", "val");
    left.appendChild(el("span", "num " + cls + "-value " + level(p), pct(p)));
    if (detail) left.appendChild(el("span", "detail", detail));
    d.appendChild(left);
    d.appendChild(sparkline(hist, field, field));
    return d;
  }
  function procsText(g) {
    const parts = (g.processes || []).slice(0, 3).map((p) => {
      const cmd = p.command ? " " + clip(p.command.split(" ")[0].split("/").pop(), 32) : "";
      const box = p.container ? " [" + clip(p.container_runtime || "container", 16) + " " + clip(p.container, 12)
        + (p.container_owner ? " of " + clip(p.container_owner, 32) : "") + "]" : "";
      return clip(p.user || "pid " + p.pid, 32) + cmd + box + (p.unleased ? " unleased (gpusd adopt " + p.pid + ")" : "");
    });
    if ((g.processes || []).length > 3) parts.push("+" + (g.processes.length - 3));
    const until = (l) => l.expires == null ? "" :  // a remote reservation (docs/pool.md): until when
      " until " + new Date(l.expires * 1000).toLocaleTimeString();
    const leases = (g.leases || []).map((l) => "lease " + clip(l.user || "pid " + l.pid, 32) + until(l) +
      (l.job ? " job " + clip(l.job, 16) : "") + (l.outside_authority ? " not through the authority" : "") +
      (l.over_cap ? " OVER CAP" : ""));
    return parts.concat(leases).join(", ") || "-";
  }
  function gpuAlerts(host, uuid) {
    const out = [];
    for (const [k, a] of state.alerts) if (k.startsWith(host.node_id + "|" + uuid + "|")) out.push(clip(a.rule, SHOWN_MAX));
    return out;
  }
  function matches(host, g, terms) {
    if (!terms.length) return true;
    const hay = [host.hostname, host.node_id, g.name, g.uuid, "#" + g.index,
      ...(g.processes || []).map((p) => (p.user || "") + " " + (p.command || "")),
      ...(g.leases || []).map((l) => l.user || ""), g.healthy === false ? "lost" : ""].join(" ").toLowerCase();
    return terms.every((t) => hay.includes(t));
  }
  function desc(x, y) { return x === y ? 0 : x < y ? 1 : -1; }
  function sortValue(g, key) {
    const m = memRatio(g);
    const v = { util: g.utilization_gpu, memory: m, temp: g.temperature, free: g.memory_free }[key];
    return v === null || v === undefined ? -Infinity : v;
  }

  function gpuRow(host, g) {
    const tr = el("tr", "gpu");
    tr.dataset.uuid = g.uuid;
    tr.dataset.index = g.index;
    const alerts = gpuAlerts(host, g.uuid);
    if (g.healthy === false) tr.classList.add("lost");
    if (alerts.length) tr.classList.add("alerting");
    tr.appendChild(el("td", "idx", g.index));
    const name = el("td", "model", clip(shortName(g.name) + (g.vendor !== "nvidia" ? " [" + g.vendor + "]" : ""),
      SHOWN_MAX));
    name.title = (g.name || "") + "\n" + g.uuid;
    tr.appendChild(name);
    if (g.healthy === false) {
      const td = el("td", "", "LOST: " + (g.error || "unhealthy"));
      td.colSpan = 4;
      tr.appendChild(td);
      return tr;
    }
    const hist = state.history.get(host.node_id + "|" + g.uuid);
    const utd = el("td");
    utd.appendChild(metric(g.utilization_gpu ?? null, "util", hist, "util"));
    tr.appendChild(utd);
    const m = memRatio(g);
    const mtd = el("td");
    mtd.appendChild(metric(m === null ? null : 100 * m, "mem", hist, "mem",
      fmtBytes(g.memory_used) + " / " + fmtBytes(g.memory_total) + (g.memory_shared ? " shared" : "")));
    tr.appendChild(mtd);
    const t = g.temperature;
    const tp = el("td", "tp");
    tp.appendChild(el("div", "temp" + (t >= 85 ? " hot" : t >= 75 ? " warm" : ""), t === null || t === undefined ? "-" : t + "°C"));
    const pw = el("div", "power", g.power_draw === null || g.power_draw === undefined ? "-" : Math.round(g.power_draw) + " W");
    if (g.power_limit) pw.title = "limit " + Math.round(g.power_limit) + " W";
    tp.appendChild(pw);
    tr.appendChild(tp);
    const ptd = el("td", "procs");
    ptd.appendChild(el("div", "plist", procsText(g)));
    ptd.title = (g.processes || []).map((p) => `${p.pid} ${p.user || ""} ${p.command || ""}`).join("\n");
    if (alerts.length) ptd.appendChild(el("div", "alert-tag", "⚠ " + alerts.join(", ")));
    if (state.idle && state.idle.has(host.node_id + "|" + g.uuid)) {  // history.js: a lease held idle
      tr.classList.add("idle-held");
      ptd.appendChild(el("div", "idle-tag", "idle lease"));
    }
    tr.appendChild(ptd);
    return tr;
  }

  function hostCard(host, gpus) {
    const card = el("section", "host" + (host.alive ? "" : " gone"));
    card.dataset.node = host.node_id;
    card.dataset.hostname = host.hostname;
    const head = el("div", "head");
    head.appendChild(el("span", "name", clip(host.hostname, SHOWN_MAX)));
    head.title = host.hostname;
    const snap = host.snapshot;
    if (snap) {
      const all = snap.gpus || [];
      head.appendChild(el("span", "meta", `${all.length} GPU${all.length === 1 ? "" : "s"} · driver ${snap.driver_version || "-"} · CUDA ${snap.cuda_version || "-"}`));
      if (snap.simulated) head.appendChild(el("span", "badge sim", "simulated"));
    }
    if (!host.alive) head.appendChild(el("span", "badge gone", "gone"));
    card.appendChild(head);
    const table = el("table", "gpus");
    const hr = el("tr");
    for (const [h, c] of [["#", ""], ["model", ""], ["util", ""], ["memory", ""], ["temp · power", ""], ["processes", "procs-h"]]) hr.appendChild(el("th", c, h));
    const thead = el("thead"); thead.appendChild(hr); table.appendChild(thead);
    const tb = el("tbody");
    for (const g of gpus) {
      try { tb.appendChild(gpuRow(host, g)); }
      catch (e) { console.warn("gpusd: cannot show a GPU of", host.hostname, e); }
    }
    table.appendChild(tb);
    card.appendChild(table);
    if (snap) {
      const tl = bookingTimeline(snap.bookings || []);
      if (tl) card.appendChild(tl);
      const topo = topologyView(host, snap.gpus || []);
      if (topo) card.appendChild(topo);
    }
    return card;
  }

  // The host's bookings over the next 24 hours (docs/pool.md, "Time"): one bar per booking, placed on
  // an axis from now to now + 24 h, with hour marks every 6 hours; none when nothing is booked then.
  const DAY_MS = 24 * 3600 * 1000;
  function hhmm(ms) {
    const d = new Date(ms);
    return String(d.getHours()).padStart(2, "0") + ":" + String(d.getMinutes()).padStart(2, "0");
  }
  function bookingTimeline(bookings) {
    const now = Date.now();
    const ahead = bookings.filter((b) => b.end * 1000 > now && b.start * 1000 < now + DAY_MS)
      .sort((a, b) => a.start - b.start);
    if (!ahead.length) return null;
    const box = el("div", "timeline");
    box.appendChild(el("div", "timeline-title", "bookings, next 24 h"));
    const axis = el("div", "timeline-axis");
    for (let h = 0; h <= 24; h += 6) {
      const tick = el("span", "tick", hhmm(now + h * 3600 * 1000));
      tick.style.left = (h / 24 * 100) + "%";
      axis.appendChild(tick);
    }
    box.appendChild(axis);
    for (const b of ahead) {
      const from = Math.max(0, b.start * 1000 - now), to = Math.min(DAY_MS, b.end * 1000 - now);
      const lane = el("div", "timeline-lane");
      const bar = el("div", "booking" + (b.held ? " held" : ""),
                     `GPU ${b.indices.join(",")} ${hhmm(b.start * 1000)}–${hhmm(b.end * 1000)}` +
                     (b.user ? " " + clip(b.user, 32) : "") + (b.held ? " (held)" : ""));
      bar.style.left = (from / DAY_MS * 100) + "%";
      bar.style.width = Math.max(0.5, (to - from) / DAY_MS * 100) + "%";
      bar.dataset.booking = b.booking_id || "";
      bar.title = `booking ${b.booking_id || "?"}`;
      lane.appendChild(bar);
      box.appendChild(lane);
    }
    return box;
  }

  // The host's GPU matrix as nvidia-smi topo -m prints it (all its GPUs, whatever the filter shows).
  function topologyView(host, all) {
    const gpus = [...all].sort((a, b) => a.index - b.index).slice(0, 64);
    if (!gpus.some((g) => g.links.length || g.topology || g.numa_node !== null || g.local_cpus)) return null;
    const box = el("details", "topology");
    box.open = state.topoOpen.has(host.node_id);
    box.addEventListener("toggle", () => {
      if (box.open) state.topoOpen.add(host.node_id); else state.topoOpen.delete(host.node_id);
    });
    const nv = gpus.some((g) => g.links.some((l) => l.nvlink > 0) ||
      (g.topology && (g.topology.nvlink.length > 0 || g.topology.fabric !== null)));
    box.appendChild(el("summary", "", "topology" + (nv ? " · NVLink" : " · PCIe only")));
    const t = el("table", "topo");
    const hr = el("tr");
    hr.appendChild(el("th", "", ""));
    for (const g of gpus) hr.appendChild(el("th", "", "GPU" + g.index));
    hr.appendChild(el("th", "", "CPU Affinity"));
    hr.appendChild(el("th", "", "NUMA Affinity"));
    t.appendChild(hr);
    for (const a of gpus) {
      const tr = el("tr");
      tr.dataset.index = a.index;
      tr.appendChild(el("th", "", "GPU" + a.index));
      for (const b of gpus) {
        const lbl = a === b ? "X" : linkLabel(a, b);
        tr.appendChild(el("td", lbl.startsWith("NV") ? "nv" : lbl === "SYS" ? "sys" : "", lbl));
      }
      tr.appendChild(el("td", "cpus", a.local_cpus || "N/A"));
      tr.appendChild(el("td", "numa", a.numa_node === null ? "N/A" : String(a.numa_node)));
      t.appendChild(tr);
    }
    box.appendChild(t);
    return box;
  }

  function render() {
    state.dirty = false;
    const terms = $("filter").value.toLowerCase().split(/\s+/).filter(Boolean);
    const key = $("sort").value;
    const hosts = [...state.hosts.values()].sort((a, b) => String(a.hostname).localeCompare(String(b.hostname)) ||
      String(a.node_id).localeCompare(String(b.node_id)));
    const main = $("hosts");
    const frag = document.createDocumentFragment();
    let nHosts = 0, nGpus = 0, free = 0, utilSum = 0, utilN = 0;
    const cards = [];
    for (const h of hosts) {
      let gpus = ((h.snapshot && h.snapshot.gpus) || []).filter((g) => matches(h, g, terms));
      if (terms.length && !gpus.length) continue;
      if (key === "host") gpus.sort((a, b) => a.index - b.index);
      else gpus.sort((a, b) => desc(sortValue(a, key), sortValue(b, key)) || a.index - b.index);
      if (h.alive) {
        nHosts++;
        for (const g of gpus) {
          nGpus++;
          if (g.utilization_gpu !== null && g.utilization_gpu !== undefined) { utilSum += g.utilization_gpu; utilN++; }
          if (g.free === true) free++;  // computed by the daemon (GpuInfo.is_free): one rule everywhere
        }
      }
      cards.push([h, gpus]);
    }
    if (key !== "host") {
      const top = (c) => Math.max(-Infinity, ...c[1].map((g) => sortValue(g, key)));
      cards.sort((a, b) => desc(top(a), top(b)));
    }
    for (const [h, gpus] of cards) {
      try { frag.appendChild(hostCard(h, gpus)); }  // a host that cannot be drawn costs its card, not the page
      catch (e) {
        console.warn("gpusd: cannot show host", h.hostname, e);
        const bad = el("section", "host bad");
        bad.dataset.node = clip(h.node_id, NAME_MAX);
        bad.appendChild(el("div", "head", clip(h.hostname, SHOWN_MAX) + ": cannot show this host's data"));
        frag.appendChild(bad);
      }
    }
    main.replaceChildren(frag);
    $("empty").hidden = cards.length > 0;

    const s = $("summary");
    s.replaceChildren();
    const add = (b, t) => { s.appendChild(el("b", "", b)); s.appendChild(document.createTextNode(t)); };
    add(nHosts, nHosts === 1 ? " host · " : " hosts · ");
    add(nGpus, " GPUs · ");
    add(free, " free");
    if (utilN) { s.appendChild(document.createTextNode(" · mean util ")); add(Math.round(utilSum / utilN) + "%", ""); }

    const list = $("alert-list");
    list.replaceChildren();
    for (const a of state.alerts.values()) {
      list.appendChild(el("li", "", clip(a.message || `${a.hostname} GPU ${a.index ?? a.uuid}: ${a.rule}`, TEXT_MAX)));
    }
    $("alerts").hidden = state.alerts.size === 0;
  }

  // ------------------------------------------------------------------ start
  sessionStorage.removeItem("gpusd-token");  // kept by earlier versions: a secret has no place in a page
  $("filter").addEventListener("input", markDirty);
  $("sort").addEventListener("change", markDirty);
  setInterval(markDirty, 5000);  // sparklines slide even when nothing changes
  state.redraw = markDirty;  // for history.js (idle marks)
  window.gpusdDashboard = state;  // for debugging, tests and history.js
  run();
})();
