"use strict";
// Headroom's dashboard: one page, four views chosen by the URL, so every
// view (and a GPU with its time range) has a link a Slack alert can carry:
//   /?show=grid|tiles       fleet overview, live over server-sent events
//   /?node=NAME             one node's devices, whatever the fleet's size
//   /?gpu=UUID&from=&to=    one GPU or MIG instance
//   /?view=processes        memory by user, pod and job; leak suspects
//   /?view=alerts           firing, pending, resolved; acknowledge, silence

const GiB = 1024 ** 3;
const MIN = 60_000;
const RANGES = [["15m", 15 * MIN], ["1h", 60 * MIN], ["6h", 360 * MIN], ["24h", 1440 * MIN], ["7d", 7 * 1440 * MIN], ["30d", 30 * 1440 * MIN], ["90d", 90 * 1440 * MIN], ["1y", 365 * 1440 * MIN]];
const fmtBytes = (b) => b == null ? "—" : (Math.abs(b) >= GiB ? (b / GiB).toFixed(1) + " GiB" : (b / 1024 ** 2).toFixed(0) + " MiB");
const fmtRate = (b) => b == null ? "—" : (b / 1e9).toFixed(2) + " GB/s";
const fmtTime = (ms) => new Date(ms).toLocaleString();
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
// Used fraction decides the level; the text says it too, so colour is never the only signal.
const level = (frac) => frac >= 0.95 ? "crit" : frac >= 0.9 ? "warn" : "ok";
const LEVEL_TEXT = { ok: "OK", warn: "HIGH", crit: "CRITICAL", none: "NO DATA" };

// What the page knows, shared by the views; tests read it through window.__headroom.
// `scope` is what the stream sends: `devices` (every one), `node` (the
// devices of the node the page names) or `nodes` (a fleet too large to
// send device by device: a row per node in `nodeRows`, and the devices at
// risk in `gpus`).
const state = { scope: "devices", nodeRows: new Map(), devicesInFleet: 0, nodes: [], gpus: new Map(), alerts: { pending: 0, firing: 0 }, deviceAlerts: {}, owners: {}, processes: [], processesMatch: null, updates: 0, charts: [], connected: false };
window.__headroom = state;

async function getJson(url, options) {
  const r = await fetch(url, options);
  // Signed out meanwhile (token revoked, cookie expired): offer to sign in again.
  if (r.status === 401 && url !== "/api/v1/session") showSignIn(await r.json().catch(() => ({})));
  if (!r.ok) {
    let message = `HTTP ${r.status}`;
    try { message = (await r.json()).error || message; } catch (_) { /* not JSON */ }
    throw new Error(`${url}: ${message}`);
  }
  return r.json();
}

function setStatus(text) { document.getElementById("status").textContent = text; }

// ---------------------------------------------------------------- live data

let stream = null;
let streamNode = "";
// The fleet's stream, or one node's when the page names one (`/?node=`).
function connectStream() {
  const node = params().get("node") || "";
  if (stream && node === streamNode) return;
  if (stream) stream.close();
  streamNode = node;
  stream = new EventSource(node ? `/api/v1/stream?node=${encodeURIComponent(node)}` : "/api/v1/stream");
  stream.addEventListener("snapshot", (e) => { applyFleet(JSON.parse(e.data), true); });
  stream.addEventListener("update", (e) => { applyFleet(JSON.parse(e.data), false); });
  stream.addEventListener("unavailable", (e) => { setStatus(`figures may be stale: ${e.data}`); });
  stream.onopen = () => { state.connected = true; };
  stream.onerror = () => {
    state.connected = false;
    setStatus("live updates interrupted; reconnecting…");
    // A refusal (503 at the client limit) closes it for good: try again.
    if (stream.readyState === EventSource.CLOSED) {
      stream = null;
      setTimeout(connectStream, 5000);
    }
    // A stream refused for its sign-in does not come back by itself.
    fetch("/api/v1/session").then(async (r) => { if (r.status === 401) showSignIn(await r.json().catch(() => ({}))); }).catch(() => {});
  };
}

// How long after a sample its tile changes, and what a fleet render costs
// (the last few hundred of each), for the benchmark in tests/browser.
state.sampleToScreenMs = [];
state.renderMs = [];
const remember = (list, value) => { list.push(value); if (list.length > 500) list.shift(); };

function applyFleet(msg, snapshot) {
  // A device at risk of a `nodes` message may be sent for a change of its
  // alerts or owners alone: not a sample's way to the screen.
  if (!snapshot && msg.scope !== "nodes") {
    const now = Date.now();
    for (const d of msg.gpus || []) if (d.latest) remember(state.sampleToScreenMs, now - d.latest.timestamp_ms);
  }
  state.scope = msg.scope || "devices";
  if (state.scope === "nodes") {
    if (snapshot) state.nodeRows = new Map();
    for (const r of msg.node_rows || []) state.nodeRows.set(r.node, r);
    for (const name of msg.removed_nodes || []) state.nodeRows.delete(name);
    state.devicesInFleet = msg.devices;
    // The devices at risk that changed, each with its alerts and owners
    // (none when absent), and those no longer at risk.
    if (snapshot) { state.gpus = new Map(); state.deviceAlerts = {}; state.owners = {}; }
    state.nodes = [];
    for (const d of msg.gpus || []) {
      state.gpus.set(d.uuid, d);
      const a = (msg.device_alerts || {})[d.uuid];
      if (a) state.deviceAlerts[d.uuid] = a; else delete state.deviceAlerts[d.uuid];
      const o = (msg.owners || {})[d.uuid];
      if (o && o.length) state.owners[d.uuid] = o; else delete state.owners[d.uuid];
    }
    for (const uuid of msg.removed || []) { state.gpus.delete(uuid); delete state.deviceAlerts[uuid]; delete state.owners[uuid]; }
  } else {
    if (snapshot) { state.gpus = new Map(); state.nodeRows = new Map(); }
    for (const d of msg.gpus || []) state.gpus.set(d.uuid, d);
    for (const uuid of msg.removed || []) state.gpus.delete(uuid);
    if (msg.nodes) state.nodes = msg.nodes;
    if (msg.device_alerts) state.deviceAlerts = msg.device_alerts;
    if (snapshot) state.owners = {};
    for (const [uuid, owners] of Object.entries(msg.owners || {})) {
      if (owners.length) state.owners[uuid] = owners; else delete state.owners[uuid];
    }
  }
  if (msg.alerts) {
    const changed = msg.alerts.pending !== state.alerts.pending || msg.alerts.firing !== state.alerts.firing;
    state.alerts = msg.alerts;
    // The alerts view follows new and resolved alerts without a reload.
    if (changed && currentView === "alerts") renderAlertList(params().get("state") === "resolved" ? "resolved" : "active").catch(() => {});
  }
  state.updates += 1;
  setStatus(`live · updated ${new Date().toLocaleTimeString()}`);
  renderSummary();
  if (currentView === "fleet") {
    scheduleFleetRender();
    // A filtered fleet follows processes that start and end.
    if (ownerFilterSet()) refreshFilterProcesses();
  }
}

function renderSummary() {
  let nodes = state.nodes.length, gpus = 0, migs = 0, low = 0;
  if (state.scope === "nodes") {
    nodes = state.nodeRows.size;
    for (const r of state.nodeRows.values()) { gpus += r.gpus; migs += r.mig_instances; low += r.low; }
  } else {
    for (const d of state.gpus.values()) {
      if (d.kind === "gpu") gpus += 1; else migs += 1;
      if (d.latest && d.latest.headroom_pct < 10) low += 1;
    }
  }
  const where = state.scope === "node"
    ? `<span>node <b>${esc(streamNode)}</b> (<a href="/">whole fleet</a>)</span>`
    : `<span><b>${nodes}</b> nodes</span>`;
  document.getElementById("summary").innerHTML =
    `${where}<span><b>${gpus}</b> GPUs</span><span><b>${migs}</b> MIG instances</span>` +
    `<span><b>${low}</b> below 10 % headroom</span>`;
  const a = state.alerts;
  document.getElementById("alert-count").innerHTML = a.firing || a.pending
    ? `<span class="${a.firing ? "text-crit" : "text-warn"}">(${a.firing} firing, ${a.pending} pending)</span>` : "";
}

// ---------------------------------------------------------------- routing

let currentView = null;
// Bumped on every navigation: a view whose data arrives after the user
// moved on must not draw over the next one.
let routeGen = 0;
const isCurrent = (gen) => gen === routeGen;
function params() { return new URLSearchParams(location.search); }

function navigate(url) {
  history.pushState(null, "", url);
  route();
}

document.addEventListener("click", (e) => {
  const a = e.target.closest("a[href^='/']");
  if (!a || e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return;
  e.preventDefault();
  navigate(a.getAttribute("href"));
});
window.addEventListener("popstate", route);

function route() {
  for (const c of state.charts) c.destroy();
  state.charts = [];
  const p = params();
  currentView = p.get("gpu") ? "gpu" : (p.get("view") || "fleet");
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === currentView);
  const view = document.getElementById("view");
  view.innerHTML = "";
  const gen = ++routeGen;
  const show = { fleet: showFleet, gpu: showGpu, processes: showProcesses, alerts: showAlerts }[currentView] || showFleet;
  show(view, p, gen).catch((err) => { if (isCurrent(gen)) view.innerHTML = `<p class="text-crit">${esc(err.message)}</p>`; });
}

// ---------------------------------------------------------------- fleet

// A fleet view shows tiles while they fit a screen or two, and one small
// cell per device beyond that: 2,000 GPUs on one screen.
const TILES_UP_TO = 64;
const fleetFilter = { node: "", user: "", job: "", pod: "", sort: "name", mode: "auto" };
let fleetRenderPending = false;
let nodeFromUrl = false;

async function showFleet(view, p, gen) {
  document.title = p.get("node") ? `Headroom — ${p.get("node")}` : "Headroom — fleet";
  // `/?show=grid` or `/?show=tiles`: a link that opens the fleet in that view.
  if (["auto", "grid", "tiles"].includes(p.get("show"))) fleetFilter.mode = p.get("show");
  // `/?node=NAME`: that node's devices, streamed alone; leaving it leaves
  // its filter too.
  if (p.get("node")) { fleetFilter.node = p.get("node"); nodeFromUrl = true; }
  else if (nodeFromUrl) { fleetFilter.node = ""; nodeFromUrl = false; }
  connectStream();
  view.innerHTML = `
    <div class="controls">
      <label>show <select id="f-mode"><option value="auto">grid, tiles when few</option><option value="grid">grid of cells</option><option value="tiles">tiles</option></select></label>
      <label>sort <select id="f-sort"><option value="name">node, GPU</option><option value="headroom">headroom, least first</option><option value="used">used, most first</option></select></label>
      <label>node <input id="f-node" placeholder="gpu-node-0"></label>
      <label>user <input id="f-user" placeholder="alice"></label>
      <label>Slurm job <input id="f-job" placeholder="4817263"></label>
      <label>pod <input id="f-pod" placeholder="pod uid"></label>
      <span class="muted" id="f-count"></span>
    </div>
    <div id="job-filter-composition"></div>
    <section id="at-risk" aria-labelledby="at-risk-title"><h2 id="at-risk-title">At risk</h2><div id="at-risk-list"></div></section>
    <div id="fleet"></div>
    <div id="cell-tip" role="tooltip" hidden></div>
    <section id="fleet-history"><h2>Fleet history</h2><div class="ranges" id="history-ranges"></div>
      <div id="chart-fleet-memory" class="chart"></div><div id="chart-fleet-risk" class="chart"></div></section>`;
  for (const key of ["node", "user", "job", "pod", "sort", "mode"]) {
    const el = document.getElementById(`f-${key}`);
    el.value = fleetFilter[key];
    el.addEventListener("input", async () => {
      fleetFilter[key] = el.value.trim();
      // Another node than the page's: back to the whole fleet's stream.
      if (key === "node") nodeFromUrl = false;
      if (key === "node" && params().get("node") && fleetFilter.node !== params().get("node")) {
        const rest = params();
        rest.delete("node");
        history.replaceState(null, "", rest.size ? `/?${rest}` : "/");
        document.title = "Headroom — fleet";
        connectStream();
      }
      // Drawn at once from the processes already read; the matching ones
      // are read again once typing pauses in any of the three fields, and
      // the job's bar when the job changed.
      scheduleFleetRender();
      if (["user", "job", "pod"].includes(key)) {
        if (key === "job") jobTyped = true;
        clearTimeout(filterTyping);
        filterTyping = setTimeout(() => {
          refreshFilterProcesses();
          if (jobTyped) { jobTyped = false; renderJobFilterComposition(gen); }
        }, 250);
      }
    });
  }
  wireGrid(document.getElementById("fleet"));
  if (ownerFilterSet()) await processesForFilters();
  if (!isCurrent(gen)) return;
  scheduleFleetRender();
  renderJobFilterComposition(gen);
  showFleetHistory(gen, 24 * 60 * MIN);
}

// The processes the user, job and pod filters may match: the node's when
// the page follows one (few, matched here), else only those the collector
// finds matching (the fleet's are 200,000 at 100,000 GPUs). Read when a
// filter changes and again once the last answer is 5 s old, one read of a
// URL at a time (a slow store is not piled on); a read overtaken by a
// later one is dropped. True when it read a new list.
const ownerFilterSet = () => Boolean(fleetFilter.user || fleetFilter.job || fleetFilter.pod);
let filterTyping = null;
let jobTyped = false;
let filterRead = { url: null, at: 0 };
let filterReading = null;
let filterReadSeq = 0;
function filterProcessesUrl() {
  if (streamNode) return `/api/v1/processes?node=${encodeURIComponent(streamNode)}`;
  const q = new URLSearchParams();
  if (fleetFilter.user) q.set("user", fleetFilter.user);
  if (fleetFilter.job) q.set("slurm_job_id", fleetFilter.job);
  if (fleetFilter.pod) q.set("pod_uid", fleetFilter.pod);
  return `/api/v1/processes?${q}`;
}
async function processesForFilters() {
  if (!ownerFilterSet()) return false;
  const url = filterProcessesUrl();
  if (filterReading === url || (filterRead.url === url && Date.now() - filterRead.at < 5000)) return false;
  const seq = ++filterReadSeq;
  const match = streamNode ? null : { user: fleetFilter.user, job: fleetFilter.job, pod: fleetFilter.pod };
  filterReading = url;
  try {
    const found = await getJson(url);
    if (seq !== filterReadSeq) return false;
    state.processes = found;
    state.processesMatch = match;
    filterRead = { url, at: Date.now() };
    return true;
  } catch (_) {
    return false; // the fleet still shows; the next update asks again
  } finally {
    if (filterReading === url) filterReading = null;
  }
}
const refreshFilterProcesses = () => processesForFilters().then((read) => { if (read) scheduleFleetRender(); });

// The held processes the user, job and pod filters match, or null when
// none is set. They are matched with the filter they were read for, since
// a read for a wider one may still be on its way (matching it against the
// narrower list would hide devices); on a node's page, whose processes are
// all held, with what is typed now.
function processesMatchingFilters() {
  if (!ownerFilterSet()) return null;
  const { user, job, pod } = state.processesMatch || fleetFilter;
  return state.processes.filter((p) => (!user || p.user.includes(user)) && (!job || p.slurm_job_id.includes(job)) &&
    (!pod || p.pod_uid.includes(pod)));
}

function scheduleFleetRender() {
  if (fleetRenderPending) return;
  fleetRenderPending = true;
  requestAnimationFrame(() => {
    fleetRenderPending = false;
    if (currentView !== "fleet") return;
    const t0 = performance.now();
    renderFleet();
    remember(state.renderMs, performance.now() - t0);
  });
}

// Devices that a process matching the user/job/pod filters runs on (a
// MIG instance's process also selects its GPU).
function devicesMatchingProcesses() {
  const matching = processesMatchingFilters();
  if (!matching) return null;
  const match = new Set();
  for (const p of matching) {
    match.add(p.device_uuid);
    const d = state.gpus.get(p.device_uuid);
    if (d && d.parent_uuid) match.add(d.parent_uuid);
  }
  return match;
}

function tileNumbers(d) {
  const s = d.latest;
  if (!s) return null;
  const total = s.memory_total_bytes;
  const frac = total > 0 ? (s.memory_used_bytes + s.memory_reserved_bytes) / total : 0;
  const peakFrac = total > 0 ? (s.memory_used_max_bytes + s.memory_reserved_bytes) / total : 0;
  return { s, total, frac, peakFrac, lvl: level(Math.max(frac, peakFrac)) };
}

// A device's active alerts (`a`, undefined when none), whether one fires,
// and the level it shows: a firing alert outranks the memory level, so a
// device never says OK under one.
function deviceLevel(d) {
  const a = state.deviceAlerts[d.uuid];
  const firing = Boolean(a && a.rules.length);
  const n = tileNumbers(d);
  const alertLvl = firing ? (a.severity === "critical" ? "crit" : "warn") : null;
  const memLvl = n ? n.lvl : "none";
  const lvl = [memLvl, alertLvl].includes("crit") ? "crit" : [memLvl, alertLvl].includes("warn") ? "warn" : memLvl;
  return { n, a, firing, lvl };
}

// What a device's active alerts say, in words, each with the class that
// colours it: one wording for the cell's label, its tooltip and the at-risk list.
function alertNotes(a) {
  if (!a) return [];
  const notes = [];
  if (a.rules.length) notes.push({ text: `ALERT: ${a.rules.join(", ")}`, cls: a.severity === "critical" ? "text-crit" : "text-warn" });
  if (a.pending.length) notes.push({ text: `pending: ${a.pending.join(", ")}`, cls: "text-warn" });
  if (a.oom_at_ms) notes.push({ text: `OOM forecast in ${untilText(a.oom_at_ms)}`, cls: "forecast" });
  return notes;
}
const noteHtml = (note, tag = "span") => `<${tag} class="${note.cls}">${esc(note.text)}</${tag}>`;

const deviceLabel = (d) => d.kind === "mig" ? `GPU ${d.index} MIG ${d.mig_profile || ""}` : `GPU ${d.index}`;
const shortId = (s, n) => s.length > n ? s.slice(0, n) : s;
// "alice (job 4817263)", "bob (pod 1a2b3c4d)": who holds the memory.
const ownerText = (o) => `${o.user || "?"}${o.slurm_job_id ? ` (job ${o.slurm_job_id})` : o.pod_uid ? ` (pod ${shortId(o.pod_uid, 8)})` : ""}`;
const ownersText = (uuid) => (state.owners[uuid] || []).map(ownerText).join(", ");
const untilText = (ms) => { const m = Math.max(0, Math.round((ms - Date.now()) / MIN)); return m < 1 ? "under a minute" : `${m} min`; };

// A tile's class and contents; the element itself is kept across updates
// so that a click or a hover is never lost to a re-render.
function tileParts(d) {
  const { n, a, firing, lvl } = deviceLevel(d);
  const label = d.kind === "mig" ? `MIG ${esc(d.mig_profile || "")}` : `GPU ${d.index}`;
  const levelText = firing ? `ALERT: ${a.rules.map(esc).join(", ")}` : LEVEL_TEXT[lvl];
  const owners = ownersText(d.uuid);
  const ownerLine = owners ? `<div class="owners" title="${esc(owners)}">${esc(owners)}</div>` : "";
  const cls = `tile lvl-${lvl}${firing ? " alerting" : ""}`;
  if (!n) return { cls, inner: `<span class="level">${levelText}</span><div class="name">${label}</div><div class="muted">${esc(d.name)}</div>${ownerLine}` };
  const { s, total, frac, peakFrac } = n;
  return {
    cls,
    inner: `<span class="level">${levelText}</span><div class="name">${label}${d.kind === "mig" ? ` <span class="mig muted">GI ${d.mig_gpu_instance_id}</span>` : ""}</div>
    <div class="big">${fmtBytes(s.memory_used_bytes)} / ${fmtBytes(total)}</div>
    <div class="bar"><span class="used" style="width:${Math.min(100, frac * 100).toFixed(1)}%"></span><span class="peak" style="left:${Math.min(100, peakFrac * 100).toFixed(1)}%"></span></div>
    <div>peak ${fmtBytes(s.memory_used_max_bytes)} · headroom <b>${fmtBytes(s.headroom_bytes)}</b> (${s.headroom_pct.toFixed(0)} %)</div>${ownerLine}`,
  };
}

// A cell's class and its text equivalent (what a screen reader says): the
// level is in a pattern and in words, not only in colour. The words change
// only when the level, the headroom's whole percent, an alert or an owner
// does, so a live update rewrites few of 2,000 labels; the tooltip has the bytes.
function cellParts(d) {
  const { n, a, firing, lvl } = deviceLevel(d);
  const parts = [`${d.node} ${deviceLabel(d)}`, LEVEL_TEXT[lvl]];
  if (n) parts.push(`headroom ${n.s.headroom_pct.toFixed(0)} %`);
  parts.push(...alertNotes(a).map((note) => note.text));
  const owners = ownersText(d.uuid);
  if (owners) parts.push(`used by ${owners}`);
  const pending = a && a.pending.length;
  return { cls: `cell lvl-${lvl}${firing ? " firing" : pending ? " pending" : ""}`, label: parts.join(" · ") };
}

// Ranked for the at-risk list: firing critical, firing, pending or
// forecast, below 10 % headroom; then the least headroom. Exposed for the
// browser test, which checks the ranking on fixtures too.
function rankAtRisk(devices, deviceAlerts) {
  const tier = (d, a) => {
    if (a && a.rules.length) return a.severity === "critical" ? 0 : 1;
    if (a && (a.pending.length || a.oom_at_ms)) return 2;
    return d.latest && d.latest.headroom_pct < 10 ? 3 : 4;
  };
  return devices.map((d) => {
    const a = deviceAlerts[d.uuid];
    return { d, a, tier: tier(d, a), oom: a && a.oom_at_ms ? a.oom_at_ms : Infinity, headroom: d.latest ? d.latest.headroom_pct : Infinity };
  }).sort((x, y) => (x.tier - y.tier) || (x.oom - y.oom) || (x.headroom - y.headroom) || x.d.uuid.localeCompare(y.d.uuid));
}
window.__headroomRankAtRisk = rankAtRisk;
const AT_RISK_ROWS = 6;

// `counts`, where the devices are only those at risk of a larger fleet:
// how many are at risk and how many there are in all.
function renderAtRisk(devices, counts = null) {
  const box = document.getElementById("at-risk-list");
  if (!box) return;
  const ranked = rankAtRisk(devices.filter((d) => d.latest || state.deviceAlerts[d.uuid]), state.deviceAlerts);
  const atRisk = counts ? counts.atRisk : ranked.filter((r) => r.tier < 4).length;
  const inAll = counts ? counts.devices : devices.length;
  const rows = ranked.slice(0, AT_RISK_ROWS).map(({ d, a, tier }) => {
    const why = alertNotes(a).map((note) => noteHtml(note));
    if (!why.length) why.push(tier === 3 ? "below 10 % headroom" : "least headroom");
    const s = d.latest;
    return `<tr data-uuid="${esc(d.uuid)}"><td><a href="/?gpu=${encodeURIComponent(d.uuid)}">${esc(d.node)} · ${esc(deviceLabel(d))}</a></td><td class="wrap">${why.join(" · ")}</td>
      <td class="num">${s ? `${fmtBytes(s.headroom_bytes)} (${s.headroom_pct.toFixed(0)} %)` : "—"}</td><td>${clipped(ownersText(d.uuid) || "—")}</td></tr>`;
  });
  const html = rows.length ? `<table class="at-risk"><thead><tr><th>device</th><th>why</th><th class="num">headroom</th><th>used by</th></tr></thead><tbody>${rows.join("")}</tbody></table>
    <p class="muted small">${atRisk} of ${inAll} devices at risk (alert firing or pending, OOM forecast, or below 10 % headroom)${atRisk > AT_RISK_ROWS ? ` · <a href="/?view=alerts">all alerts</a> · sort the tiles by headroom to see more` : ""}</p>`
    : `<p class="muted">no device</p>`;
  if (box.dataset.sig !== html) { box.innerHTML = html; box.dataset.sig = html; }
}

const tileShell = (d) => `<a class="tile" href="/?gpu=${encodeURIComponent(d.uuid)}" data-uuid="${esc(d.uuid)}" title="${esc(d.node)}: ${esc(d.name)}"></a>`;
const cellShell = (d) => `<a class="cell" href="/?gpu=${encodeURIComponent(d.uuid)}" data-uuid="${esc(d.uuid)}" tabindex="-1"></a>`;
let fleetLayoutKey = "";

// GPUs in index order, each followed by its MIG instances.
function byNodeOrder(list) {
  const rank = (d) => [d.index, d.kind === "mig" ? 1 : 0, d.mig_gpu_instance_id || 0, d.mig_compute_instance_id || 0];
  return list.sort((a, b) => { const x = rank(a), y = rank(b); for (let i = 0; i < x.length; i++) if (x[i] !== y[i]) return x[i] - y[i]; return 0; });
}

function renderFleet() {
  const box = document.getElementById("fleet");
  if (!box) return;
  if (state.scope === "nodes") return renderNodeCells(box);
  const byProcess = devicesMatchingProcesses();
  const nodeFilter = fleetFilter.node;
  const devices = [...state.gpus.values()].filter((d) =>
    (!nodeFilter || d.node.includes(nodeFilter)) && (!byProcess || byProcess.has(d.uuid)));
  renderAtRisk(devices);
  const headroom = (d) => d.latest ? d.latest.headroom_pct : Infinity;
  const used = (d) => d.latest ? (d.latest.memory_used_bytes + d.latest.memory_reserved_bytes) / Math.max(1, d.latest.memory_total_bytes) : -1;
  const byName = fleetFilter.sort === "name";
  if (!byName) devices.sort(fleetFilter.sort === "headroom" ? (a, b) => headroom(a) - headroom(b) : (a, b) => used(b) - used(a));
  const grid = fleetFilter.mode === "grid" || (fleetFilter.mode === "auto" && devices.length > TILES_UP_TO);
  // Rebuild the layout only when the set or order of devices changes;
  // every other update rewrites the tiles or cells that changed, in place.
  const key = `${grid}|${fleetFilter.sort}|${state.nodes.map((n) => n.name).join(",")}|${devices.map((d) => d.uuid).join(",")}`;
  if (key !== fleetLayoutKey || !box.firstChild) {
    fleetLayoutKey = key;
    const shell = grid ? cellShell : tileShell;
    const wrap = (list) => grid ? `<div class="cells">${list.map(shell).join("")}</div>` : `<div class="tiles">${list.map(shell).join("")}</div>`;
    let html = "";
    if (byName) {
      const groups = new Map();
      for (const d of devices) {
        if (!groups.has(d.node)) groups.set(d.node, []);
        groups.get(d.node).push(d);
      }
      for (const n of state.nodes) {
        const list = groups.get(n.name);
        if (!list) continue;
        byNodeOrder(list);
        html += grid
          ? `<div class="cell-group" role="group" aria-label="${esc(n.name)}" style="--cols:${Math.min(8, list.length)}"><div class="cell-node" title="${esc(n.name)}">${esc(n.name)}<span class="stale" data-node="${esc(n.name)}"></span></div>${wrap(list)}</div>`
          : `<div class="node-group"><h2>${esc(n.name)} <span class="muted">${n.gpu_count} GPUs${n.mig_instance_count ? `, ${n.mig_instance_count} MIG instances` : ""}, driver ${esc(n.driver_version)}</span><span class="stale" data-node="${esc(n.name)}"></span></h2>
          ${wrap(list)}</div>`;
      }
    } else {
      html = grid ? `<div class="cell-group" style="--cols:${Math.min(64, devices.length)}">${wrap(devices)}</div>` : wrap(devices);
    }
    box.className = grid ? "grid-view" : "";
    box.setAttribute("aria-label", grid ? "devices by node; arrow keys move, Enter opens" : "devices");
    box.innerHTML = html ? (grid ? `${gridLegend()}<div class="cell-groups" role="group" aria-label="devices by node; arrow keys move between devices, Enter opens one">${html}</div>` : html)
      : `<p class="muted">no device matches</p>`;
    const first = box.querySelector(".cell");
    if (first) first.tabIndex = 0;
    if (grid) fitGrid(box);
  }
  for (const el of box.querySelectorAll(".tile")) {
    const d = state.gpus.get(el.dataset.uuid);
    if (!d) continue;
    const { cls, inner } = tileParts(d);
    if (el.className !== cls) el.className = cls;
    if (el.dataset.sig !== inner) { el.innerHTML = inner; el.dataset.sig = inner; }
  }
  const counts = { ok: 0, warn: 0, crit: 0, none: 0, firing: 0 };
  for (const el of box.querySelectorAll(".cell")) {
    const d = state.gpus.get(el.dataset.uuid);
    if (!d) continue;
    const { cls, label } = cellParts(d);
    counts[cls.split(" ")[1].slice(4)] += 1;
    if (cls.includes(" firing")) counts.firing += 1;
    if (el.className !== cls) el.className = cls;
    if (el.dataset.sig !== label) { el.setAttribute("aria-label", label); el.dataset.sig = label; }
  }
  const legend = box.querySelector(".legend");
  if (legend) for (const [k, v] of Object.entries(counts)) { const c = legend.querySelector(`[data-count="${k}"]`); if (c) c.textContent = v; }
  if (tipUuid) showTip(tipUuid);
  for (const el of box.querySelectorAll(".stale")) {
    const n = state.nodes.find((x) => x.name === el.dataset.node);
    const ageS = n ? Math.round((Date.now() - n.last_seen_ms) / 1000) : 0;
    const text = ageS > 10 ? ` silent for ${ageS} s` : "";
    if (el.textContent !== text) { el.textContent = text; el.className = `stale${text ? " text-crit" : ""}`; }
  }
  document.getElementById("f-count").textContent = `${devices.length} of ${state.gpus.size} devices`;
}

// Nodes that a process matching the user/job/pod filters runs on.
function nodesMatchingProcesses() {
  const matching = processesMatchingFilters();
  return matching && new Set(matching.map((p) => p.node));
}

// A node's cell: its worst device's level, in colour, pattern and words;
// the words change only when what the cell shows does.
function nodeCellParts(r) {
  const parts = [r.node, LEVEL_TEXT[r.level]];
  if (r.headroom_pct != null) parts.push(`least headroom ${r.headroom_pct} %`);
  if (r.used_pct != null) parts.push(`${r.used_pct} % used`);
  parts.push(`${r.gpus} GPUs${r.mig_instances ? `, ${r.mig_instances} MIG instances` : ""}`);
  if (r.firing) parts.push(`${r.firing} with an alert firing`);
  if (r.pending) parts.push(`${r.pending} with an alert pending or an OOM forecast`);
  if (r.low) parts.push(`${r.low} below 10 % headroom`);
  if (r.silent_since_ms) parts.push(`silent since ${fmtTime(r.silent_since_ms)}`);
  const cls = `cell lvl-${r.level}${r.firing ? " firing" : r.pending ? " pending" : ""}${r.silent_since_ms ? " silent" : ""}`;
  return { cls, label: parts.join(" · ") };
}

// A fleet too large to send device by device: one cell per node, the
// at-risk list from the devices at risk the stream sends; a node's cell
// opens its devices (`/?node=`).
function renderNodeCells(box) {
  const byProcess = nodesMatchingProcesses();
  const filter = fleetFilter.node;
  const rows = [...state.nodeRows.values()].filter((r) => (!filter || r.node.includes(filter)) && (!byProcess || byProcess.has(r.node)));
  let atRisk = 0;
  for (const r of state.nodeRows.values()) atRisk += r.at_risk;
  renderAtRisk([...state.gpus.values()], { atRisk, devices: state.devicesInFleet });
  const headroom = (r) => r.headroom_pct ?? Infinity;
  if (fleetFilter.sort === "headroom") rows.sort((a, b) => headroom(a) - headroom(b));
  else if (fleetFilter.sort === "used") rows.sort((a, b) => (b.used_pct ?? -1) - (a.used_pct ?? -1));
  const key = `nodes|${fleetFilter.sort}|${rows.map((r) => r.node).join(",")}`;
  if (key !== fleetLayoutKey || !box.firstChild) {
    fleetLayoutKey = key;
    box.className = "grid-view";
    box.setAttribute("aria-label", "nodes; arrow keys move, Enter opens");
    box.innerHTML = rows.length
      ? `${gridLegend("node")}<div class="cell-groups" role="group" aria-label="nodes; arrow keys move between nodes, Enter opens one's devices"><div class="node-cells">${
        rows.map((r) => `<a class="cell" href="/?node=${encodeURIComponent(r.node)}" data-node="${esc(r.node)}" tabindex="-1"></a>`).join("")}</div></div>`
      : `<p class="muted">no node matches</p>`;
    const first = box.querySelector(".cell");
    if (first) first.tabIndex = 0;
    fitGrid(box);
  }
  const counts = { ok: 0, warn: 0, crit: 0, none: 0, firing: 0 };
  for (const el of box.querySelectorAll(".cell")) {
    const r = state.nodeRows.get(el.dataset.node);
    if (!r) continue;
    const { cls, label } = nodeCellParts(r);
    counts[r.level] += 1;
    if (r.firing) counts.firing += 1;
    if (el.className !== cls) el.className = cls;
    if (el.dataset.sig !== label) { el.setAttribute("aria-label", label); el.dataset.sig = label; }
  }
  const legend = box.querySelector(".legend");
  if (legend) for (const [k, v] of Object.entries(counts)) { const c = legend.querySelector(`[data-count="${k}"]`); if (c) c.textContent = v; }
  if (tipNode) showNodeTip(tipNode);
  document.getElementById("f-count").textContent = `${rows.length} of ${state.nodeRows.size} nodes · ${state.devicesInFleet} devices: a cell per node`;
}

// The legend says what each colour and pattern means, with counts: the
// grid's summary in words.
function gridLegend(each = "device") {
  const item = (cls, text, key) => `<span><i class="${cls}" aria-hidden="true"></i> ${text} <b data-count="${key}">0</b></span>`;
  const help = each === "node"
    ? "a cell per node, at its fullest device's level; hover or focus for its figures, Enter opens its devices"
    : "hover or focus a cell for its figures and owners; arrow keys move, Enter opens";
  return `<div class="legend" aria-live="off">${item("swatch lvl-ok", "OK", "ok")}${item("swatch lvl-warn", "HIGH (≥ 90 % at peak)", "warn")}${item("swatch lvl-crit", "CRITICAL (≥ 95 %)", "crit")}${item("swatch lvl-none", "no data", "none")}${item("swatch lvl-ok firing", "alert firing", "firing")}
    <span class="muted">${help}</span></div>`;
}

// The largest cell that lets the whole grid fit the window's height, so a
// fleet of 2,000 GPUs needs no scrolling; at least 6 px.
const CELL_SIZES = [20, 18, 16, 14, 12, 11, 10, 9, 8, 7, 6];
function fitGrid(box) {
  const groups = box.querySelector(".cell-groups");
  if (!groups) return;
  const top = groups.getBoundingClientRect().top + window.scrollY;
  const room = window.innerHeight - top - 6;
  let lo = 0, hi = CELL_SIZES.length - 1;
  // Binary search for the first (largest) size that fits.
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    groups.style.setProperty("--cell", `${CELL_SIZES[mid]}px`);
    if (groups.scrollHeight <= room) hi = mid; else lo = mid + 1;
  }
  groups.style.setProperty("--cell", `${CELL_SIZES[lo]}px`);
}
let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => {
    const box = document.getElementById("fleet");
    if (box && currentView === "fleet") fitGrid(box);
    // Charts follow the window's width, so a narrower window never scrolls sideways.
    for (const c of state.charts) {
      const width = Math.max(320, c.root.parentElement.clientWidth - 10);
      if (width !== c.width) c.setSize({ width, height: c.height });
    }
  }, 150);
});

// Hover or focus: the device's figures and owners beside its cell.
let tipUuid = null;
function showTip(uuid, anchor) {
  const tip = document.getElementById("cell-tip");
  const d = state.gpus.get(uuid);
  if (!tip || !d) return hideTip();
  tipUuid = uuid;
  const { n, a } = deviceLevel(d);
  const owners = state.owners[uuid] || [];
  tip.innerHTML = `<b>${esc(d.node)} · ${esc(deviceLabel(d))}</b> <span class="muted">${esc(d.name)}</span>
    ${n ? `<div>${fmtBytes(n.s.memory_used_bytes)} of ${fmtBytes(n.total)} used · peak ${fmtBytes(n.s.memory_used_max_bytes)} · headroom <b>${fmtBytes(n.s.headroom_bytes)} (${n.s.headroom_pct.toFixed(0)} %)</b></div>` : `<div class="muted">no sample yet</div>`}
    ${alertNotes(a).map((note) => noteHtml(note, "div")).join("")}
    <div>${owners.length ? owners.map((o) => `${esc(ownerText(o))} ${fmtBytes(o.memory_bytes)}`).join("<br>") : `<span class="muted">no process</span>`}</div>`;
  placeTip(tip, anchor || document.querySelector(`.cell[data-uuid="${CSS.escape(uuid)}"]`));
}
// A node's cell: its figures beside it.
let tipNode = null;
function showNodeTip(name, anchor) {
  const tip = document.getElementById("cell-tip");
  const r = state.nodeRows.get(name);
  if (!tip || !r) return hideTip();
  tipNode = name;
  tip.innerHTML = `<b>${esc(r.node)}</b> <span class="muted">${r.gpus} GPUs${r.mig_instances ? `, ${r.mig_instances} MIG instances` : ""}</span>
    <div>${LEVEL_TEXT[r.level]}${r.used_pct != null ? ` · ${r.used_pct} % used` : ""}${r.headroom_pct != null ? ` · least headroom <b>${r.headroom_pct} %</b>` : " · no sample yet"}</div>
    ${r.firing ? `<div class="text-crit">${r.firing} with an alert firing</div>` : ""}${r.pending ? `<div class="text-warn">${r.pending} with an alert pending or an OOM forecast</div>` : ""}
    ${r.low ? `<div>${r.low} below 10 % headroom</div>` : ""}${r.silent_since_ms ? `<div class="text-crit">silent since ${fmtTime(r.silent_since_ms)}</div>` : ""}`;
  placeTip(tip, anchor || document.querySelector(`.cell[data-node="${CSS.escape(name)}"]`));
}
const showCellTip = (c) => c.dataset.node && !c.dataset.uuid ? showNodeTip(c.dataset.node, c) : showTip(c.dataset.uuid, c);

function placeTip(tip, el) {
  tip.hidden = false;
  if (!el) return;
  const r = el.getBoundingClientRect();
  const w = tip.offsetWidth, h = tip.offsetHeight;
  const left = Math.min(window.innerWidth - w - 8, Math.max(8, r.left));
  const below = r.bottom + 6 + h < window.innerHeight;
  tip.style.left = `${left + window.scrollX}px`;
  tip.style.top = `${(below ? r.bottom + 6 : r.top - h - 6) + window.scrollY}px`;
}

function hideTip() {
  tipUuid = null;
  tipNode = null;
  const tip = document.getElementById("cell-tip");
  if (tip) tip.hidden = true;
}

// One tab stop for the grid; arrows move between cells in reading order
// (left, right) and to the nearest cell of the row above or below.
function wireGrid(box) {
  box.addEventListener("mouseover", (e) => { const c = e.target.closest(".cell"); if (c) showCellTip(c); });
  box.addEventListener("mouseout", (e) => { if (e.target.closest(".cell") && !e.relatedTarget?.closest?.(".cell")) hideTip(); });
  box.addEventListener("focusin", (e) => {
    const c = e.target.closest(".cell");
    if (!c) return;
    for (const other of box.querySelectorAll(".cell[tabindex='0']")) if (other !== c) other.tabIndex = -1;
    c.tabIndex = 0;
    showCellTip(c);
  });
  box.addEventListener("focusout", (e) => { if (!e.relatedTarget?.closest?.(".cell")) hideTip(); });
  box.addEventListener("keydown", (e) => {
    const c = e.target.closest(".cell");
    if (!c) return;
    const cells = [...box.querySelectorAll(".cell")];
    const i = cells.indexOf(c);
    let next = null;
    if (e.key === "ArrowRight") next = cells[i + 1];
    else if (e.key === "ArrowLeft") next = cells[i - 1];
    else if (e.key === "Home") next = cells[0];
    else if (e.key === "End") next = cells[cells.length - 1];
    else if (e.key === "ArrowDown" || e.key === "ArrowUp") next = verticalNeighbour(cells, c, e.key === "ArrowDown");
    else if (e.key === "Escape") { hideTip(); return; }
    else return;
    e.preventDefault();
    if (next) next.focus();
  });
}

function verticalNeighbour(cells, from, down) {
  const r = from.getBoundingClientRect();
  const cx = r.left + r.width / 2;
  let rowTop = null, best = null, bestDx = Infinity;
  for (const el of cells) {
    const q = el.getBoundingClientRect();
    const beyond = down ? q.top > r.top + r.height / 2 : q.top < r.top - r.height / 2;
    if (!beyond) continue;
    if (rowTop === null || (down ? q.top < rowTop - 0.5 : q.top > rowTop + 0.5)) { rowTop = q.top; best = null; bestDx = Infinity; }
    if (Math.abs(q.top - rowTop) > 0.5) continue;
    const dx = Math.abs(q.left + q.width / 2 - cx);
    if (dx < bestDx) { bestDx = dx; best = el; }
  }
  return best;
}

// The fleet over a range, from the rollups: memory used against capacity,
// and devices short of headroom with the alerts that fired; the charts
// share one time axis and one cursor.
const HISTORY_RANGES = [["6h", 360 * MIN], ["24h", 1440 * MIN], ["7d", 7 * 1440 * MIN], ["30d", 30 * 1440 * MIN]];
async function showFleetHistory(gen, span) {
  const ranges = document.getElementById("history-ranges");
  if (!ranges) return;
  ranges.innerHTML = HISTORY_RANGES.map(([name, ms]) => `<button data-range="${ms}" class="${ms === span ? "active" : ""}">${name}</button>`).join("") +
    ` <span class="muted">from the minute and hour rollups; the last two minutes are not in them yet</span>`;
  for (const b of ranges.querySelectorAll("button")) b.addEventListener("click", () => showFleetHistory(gen, Number(b.dataset.range)));
  const to = Date.now(), from = to - span;
  let history;
  try { history = await getJson(`/api/v1/fleet/history?from=${from}&to=${to}&max_points=600`); } catch (err) {
    if (isCurrent(gen)) document.getElementById("chart-fleet-memory").innerHTML = `<p class="muted">${esc(err.message)}</p>`;
    return;
  }
  if (!isCurrent(gen)) return;
  for (const c of state.charts.filter((c) => c.headroomName?.startsWith("fleet-"))) c.destroy();
  state.charts = state.charts.filter((c) => !c.headroomName?.startsWith("fleet-"));
  const pts = history.points || history;
  const x = pts.map((p) => seconds(p.timestamp_ms));
  const common = { scales: { x: { time: true, min: seconds(from), max: seconds(to) } }, cursor: { sync: { key: "fleet" } } };
  const memory = document.getElementById("chart-fleet-memory"), risk = document.getElementById("chart-fleet-risk");
  memory.innerHTML = ""; risk.innerHTML = "";
  const m = new uPlot({
    ...common, width: chartWidth("chart-fleet-memory"), height: 200,
    scales: { ...common.scales, y: { range: (u, min, max) => [0, Math.max(max, 1)] } },
    series: [{}, { label: "used (average)", stroke: "#1565c0", width: 1.5, value: (u, v) => fmtBytes(v) },
      { label: "used at peaks", stroke: "rgba(198,40,40,.7)", width: 1, value: (u, v) => fmtBytes(v) },
      { label: "capacity", stroke: "#333", width: 1.5, value: (u, v) => fmtBytes(v) }],
    axes: [{}, { ...gibAxis, size: AXIS_SIZE, values: (u, vals) => vals.map((v) => fmtTiB(v)) }],
  }, [x, ...["used_bytes", "used_max_bytes", "capacity_bytes"].map((k) => pts.map((p) => memoryKnown(p) ? p[k] : null))], memory);
  m.headroomName = "fleet-memory";
  const r = new uPlot({
    ...common, width: chartWidth("chart-fleet-risk"), height: 160,
    scales: { ...common.scales, y: { range: (u, min, max) => [0, Math.max(max, 1)] } },
    series: [{}, { label: "devices below 10 % headroom", stroke: "#b26a00", width: 1.5, fill: "rgba(178,106,0,.12)" },
      { label: "alerts fired", stroke: "#c62828", width: 0, points: { show: true, size: 6, fill: "#c62828" } }],
    axes: [{}, { size: AXIS_SIZE }],
  }, [x, pts.map((p) => memoryKnown(p) ? p.devices_below_10pct : null), pts.map((p) => p.alerts_fired || null)], risk);
  r.headroomName = "fleet-risk";
  state.charts.push(m, r);
}
// A bucket newer than the rollups carries only its alerts: a gap in the
// memory lines, not a dip to zero.
const memoryKnown = (p) => p.devices > 0;
const fmtTiB = (b) => b >= 1024 * GiB ? (b / 1024 / GiB).toFixed(1) + " TiB" : (b / GiB).toFixed(0) + " GiB";

// ---------------------------------------------------------------- one GPU

function rangeFromUrl(p) {
  const to = Number(p.get("to")) || Date.now();
  const from = Number(p.get("from")) || to - 15 * MIN;
  return { from, to };
}

async function showGpu(view, p, gen) {
  const uuid = p.get("gpu");
  const { from, to } = rangeFromUrl(p);
  const live = !p.get("to");
  // The device, its GPU and the GPU's instances (the MIG layout, the
  // processes): from the stream where it sends them all, else asked for,
  // never the whole fleet's list. Kept apart from the stream's devices,
  // which a large fleet's stream replaces every second.
  let d = state.scope === "nodes" ? null : state.gpus.get(uuid);
  let family;
  if (d) {
    const gpuUuid = d.parent_uuid || d.uuid;
    family = [...state.gpus.values()].filter((g) => g.uuid === gpuUuid || g.parent_uuid === gpuUuid);
  } else {
    family = await getJson(`/api/v1/gpus?uuid=${encodeURIComponent(uuid)}`);
    d = family.find((g) => g.uuid === uuid);
  }
  if (!isCurrent(gen)) return;
  if (!d) throw new Error(`no GPU or MIG instance ${uuid}`);
  family = new Map(family.map((g) => [g.uuid, g]));
  document.title = `Headroom — ${d.node} GPU ${d.index}`;
  const span = to - from;
  const rangeButtons = RANGES.map(([name, ms]) =>
    `<button data-range="${ms}" class="${Math.abs(ms - span) < 1000 ? "active" : ""}">${name}</button>`).join("");
  const s = d.latest;
  view.innerHTML = `
    <h2>${esc(d.node)} · ${d.kind === "mig" ? `MIG ${esc(d.mig_profile)} on GPU ${d.index}` : `GPU ${d.index}`} <span class="muted">${esc(d.name)} · ${esc(d.uuid)}</span></h2>
    <p>${s ? `used ${fmtBytes(s.memory_used_bytes)} of ${fmtBytes(s.memory_total_bytes)}, peak ${fmtBytes(s.memory_used_max_bytes)}, reserved ${fmtBytes(s.memory_reserved_bytes)}, <b>headroom ${fmtBytes(s.headroom_bytes)} (${s.headroom_pct.toFixed(1)} %)</b>` : "no sample yet"}</p>
    <div class="ranges">${rangeButtons} <span class="muted">${fmtTime(from)} → ${live ? "now" : fmtTime(to)}</span></div>
    <h3>Memory</h3><div id="chart-memory" class="chart"></div>
    <h3>Memory by process (stacked)</h3><div id="chart-processes" class="chart"></div>
    <h3>PCIe</h3><div id="chart-pcie" class="chart"></div>
    <div id="mig-layout"></div>
    <h3>Processes now</h3><div id="gpu-processes"></div>
    <section id="gpu-composition" hidden><h3>Where each training process's memory goes</h3>
      <p class="muted small">At the process's peak, in shares that add up to its total; below, the parts over this page's range.</p><div id="gpu-composition-list"></div></section>
    <h3>Allocator of reporting processes</h3><div id="gpu-allocators" class="muted">none reports</div>
    <h3>Alerts and events in this range</h3><div id="gpu-events"></div>`;
  for (const b of view.querySelectorAll("button[data-range]")) {
    b.addEventListener("click", () => {
      const ms = Number(b.dataset.range);
      navigate(`/?gpu=${encodeURIComponent(uuid)}&from=${Date.now() - ms}`);
    });
  }
  const q = `from=${from}&to=${to}&max_points=600`;
  const [series, procSeries, events, alerts] = await Promise.all([
    getJson(`/api/v1/gpus/${encodeURIComponent(uuid)}/series?${q}`),
    getJson(`/api/v1/gpus/${encodeURIComponent(uuid)}/processes/series?${q}`),
    getJson(`/api/v1/gpus/${encodeURIComponent(uuid)}/events?from=${from}&to=${to}`),
    getJson("/api/v1/alerts?state=active"),
  ]);
  const resolved = await getJson("/api/v1/alerts?state=resolved&limit=500");
  if (!isCurrent(gen)) return;
  const deviceAlerts = [...alerts, ...resolved].filter((a) => a.labels.device_uuid === uuid &&
    (a.fired_at_ms || a.started_at_ms) <= to && (a.resolved_at_ms == null || a.resolved_at_ms >= from));
  const markers = [
    ...events.map((e) => ({ t: e.timestamp_ms, text: e.kind === "xid" ? `XID ${e.code}` : e.kind, color: "#c62828" })),
    ...deviceAlerts.map((a) => ({ t: a.fired_at_ms || a.started_at_ms, text: a.rule, color: "#b26a00" })),
  ].filter((m) => m.t >= from && m.t <= to);
  drawMemoryChart(series, markers, from, to);
  drawProcessChart(procSeries, from, to);
  drawPcieChart(series, from, to, d.kind === "mig");
  renderMigLayout(d, family);
  renderGpuProcesses(d, family, gen, from, to);
  renderEvents(events, deviceAlerts);
}

const chartWidth = (id) => Math.max(320, (document.getElementById(id)?.clientWidth || 800) - 10);
const seconds = (ms) => ms / 1000;

// Vertical lines with a label for XID events and alerts.
function markerPlugin(markers) {
  return {
    hooks: {
      draw: [(u) => {
        const ctx = u.ctx;
        ctx.save();
        ctx.font = `${11 * devicePixelRatio}px sans-serif`;
        for (const m of markers) {
          const x = Math.round(u.valToPos(seconds(m.t), "x", true));
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          ctx.strokeStyle = m.color; ctx.fillStyle = m.color; ctx.lineWidth = 1.5 * devicePixelRatio;
          ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
          ctx.fillText(m.text, x + 3 * devicePixelRatio, u.bbox.top + 12 * devicePixelRatio);
        }
        ctx.restore();
      }],
    },
  };
}

// Charts on one page share one time axis: the same range, the same width,
// the same room for the value axis (so their times line up one above the
// other) and one cursor.
const AXIS_SIZE = 72;
const gibAxis = { size: AXIS_SIZE, values: (u, vals) => vals.map((v) => (v / GiB).toFixed(0) + " GiB") };
const gpuCursor = { sync: { key: "gpu" } };

function drawMemoryChart(series, markers, from, to) {
  const pts = series.points;
  const x = pts.map((p) => seconds(p.timestamp_ms));
  const data = [x, pts.map((p) => p.memory_used_bytes), pts.map((p) => p.memory_used_min_bytes), pts.map((p) => p.memory_used_max_bytes),
    pts.map((p) => p.memory_reserved_bytes), pts.map((p) => p.memory_total_bytes)];
  const chart = new uPlot({
    width: chartWidth("chart-memory"), height: 260,
    scales: { x: { time: true, min: seconds(from), max: seconds(to) }, y: { range: (u, min, max) => [0, Math.max(max, 1)] } },
    series: [{}, { label: "used (mean)", stroke: "#1565c0", width: 1.5 },
      { label: "min", stroke: "rgba(21,101,192,.35)", width: 1 }, { label: "max (peak between samples)", stroke: "rgba(198,40,40,.7)", width: 1 },
      { label: "reserved", stroke: "#7b1fa2", width: 1, dash: [4, 4] }, { label: "total", stroke: "#333", width: 1.5 }],
    bands: [{ series: [3, 2], fill: "rgba(21,101,192,.12)" }],
    axes: [{}, gibAxis],
    cursor: gpuCursor,
    plugins: [markerPlugin(markers)],
  }, data, document.getElementById("chart-memory"));
  chart.headroomName = "memory";
  state.charts.push(chart);
}

const PALETTE = ["#1565c0", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#5d4037", "#9e9d24", "#455a64", "#c62828"];

function drawProcessChart(procSeries, from, to) {
  const box = document.getElementById("chart-processes");
  const procs = procSeries.processes;
  if (procs.length === 0) { box.innerHTML = `<p class="muted">no process in this range</p>`; return; }
  // One x axis for every process: the union of their bucket times.
  const times = [...new Set(procs.flatMap((p) => p.points.map((pt) => pt[0])))].sort((a, b) => a - b);
  const index = new Map(times.map((t, i) => [t, i]));
  const top = procs.slice(0, 9);
  const rest = procs.slice(9);
  const columns = top.map((p) => {
    const col = new Array(times.length).fill(0);
    for (const [t, v] of p.points) col[index.get(t)] = v;
    return col;
  });
  if (rest.length) {
    const col = new Array(times.length).fill(0);
    for (const p of rest) for (const [t, v] of p.points) col[index.get(t)] += v;
    columns.push(col);
  }
  const labels = top.map((p) => `pid ${p.pid} ${p.user} ${p.name.slice(0, 30)}`).concat(rest.length ? [`${rest.length} more`] : []);
  // Stacked: each series is the sum of itself and those below; drawn top
  // first so each fill covers only its own slice.
  const stacked = columns.map((_, i) => columns.slice(0, i + 1).reduce((acc, col) => acc.map((v, j) => v + col[j])));
  const order = stacked.map((_, i) => i).reverse();
  const chart = new uPlot({
    width: chartWidth("chart-processes"), height: 220,
    scales: { x: { time: true, min: seconds(from), max: seconds(to) }, y: { range: (u, min, max) => [0, Math.max(max, 1)] } },
    series: [{}, ...order.map((i) => ({ label: labels[i], stroke: PALETTE[i % PALETTE.length], fill: PALETTE[i % PALETTE.length] + "99", width: 1,
      value: (u, v, si, di) => di == null ? "—" : fmtBytes(columns[i][di]) }))],
    axes: [{}, gibAxis],
    cursor: gpuCursor,
    legend: { live: true },
  }, [times.map(seconds), ...order.map((i) => stacked[i])], box);
  chart.headroomName = "processes";
  state.charts.push(chart);
}

function drawPcieChart(series, from, to, isMig) {
  const box = document.getElementById("chart-pcie");
  if (isMig) { box.innerHTML = `<p class="muted">NVML reports PCIe per GPU, not per MIG instance</p>`; return; }
  const pts = series.points;
  const chart = new uPlot({
    width: chartWidth("chart-pcie"), height: 220,
    scales: { x: { time: true, min: seconds(from), max: seconds(to) } },
    series: [{}, { label: "TX", stroke: "#00838f", width: 1.5, value: (u, v) => fmtRate(v) }, { label: "RX", stroke: "#ef6c00", width: 1.5, value: (u, v) => fmtRate(v) }],
    axes: [{}, { size: AXIS_SIZE, values: (u, vals) => vals.map((v) => (v / 1e9).toFixed(1) + " GB/s") }],
    cursor: gpuCursor,
  }, [pts.map((p) => seconds(p.timestamp_ms)), pts.map((p) => p.pcie_tx_bytes_per_s), pts.map((p) => p.pcie_rx_bytes_per_s)], box);
  chart.headroomName = "pcie";
  state.charts.push(chart);
}

// The GPU's memory as a bar cut into its MIG instances, in proportion to
// each instance's memory, with what each one uses.
function renderMigLayout(d, family) {
  const gpuUuid = d.kind === "mig" ? d.parent_uuid : d.uuid;
  const gpu = family.get(gpuUuid);
  const instances = [...family.values()].filter((m) => m.parent_uuid === gpuUuid)
    .sort((a, b) => (a.mig_gpu_instance_id - b.mig_gpu_instance_id) || (a.mig_compute_instance_id - b.mig_compute_instance_id));
  const box = document.getElementById("mig-layout");
  if (!gpu || instances.length === 0) { box.innerHTML = ""; return; }
  const width = 800, height = 46;
  const total = gpu.memory_total_bytes || instances.reduce((acc, m) => acc + m.memory_total_bytes, 0);
  let x = 0;
  const rects = instances.map((m, i) => {
    const w = Math.max(2, m.memory_total_bytes / total * width);
    const used = m.latest ? m.latest.memory_used_bytes / Math.max(1, m.memory_total_bytes) : 0;
    const color = PALETTE[i % PALETTE.length];
    const here = m.uuid === d.uuid ? `stroke="#000" stroke-width="3"` : "";
    const out = `<a href="/?gpu=${encodeURIComponent(m.uuid)}"><g><title>${esc(m.mig_profile)} GI ${m.mig_gpu_instance_id} CI ${m.mig_compute_instance_id}: ${fmtBytes(m.latest?.memory_used_bytes)} of ${fmtBytes(m.memory_total_bytes)}</title>
      <rect x="${x}" y="0" width="${w}" height="${height}" fill="${color}" opacity=".45" ${here}></rect>
      <rect x="${x}" y="0" width="${w * Math.min(1, used)}" height="${height}" fill="${color}"></rect>
      <text x="${x + 6}" y="18">${esc(m.mig_profile)} (GI ${m.mig_gpu_instance_id})</text>
      <text x="${x + 6}" y="36">${fmtBytes(m.latest?.memory_used_bytes)} / ${fmtBytes(m.memory_total_bytes)}</text></g></a>`;
    x += w;
    return out;
  }).join("");
  const free = Math.max(0, width - x);
  box.innerHTML = `<h3>MIG layout of GPU ${gpu.index} <span class="muted">(${instances.length} instances; darker = used)</span></h3>
    <svg class="mig-layout" width="${width}" height="${height}" role="img" aria-label="MIG layout">${rects}
    ${free > 1 ? `<rect x="${x}" y="0" width="${free}" height="${height}" fill="#ddd"></rect><text x="${x + 6}" y="28" style="fill:#555">unallocated</text>` : ""}</svg>`;
}

async function renderGpuProcesses(d, family, gen, from, to) {
  const uuid = d.uuid;
  const inside = new Set([uuid, ...[...family.values()].filter((m) => m.parent_uuid === uuid).map((m) => m.uuid)]);
  // The node's processes, not the fleet's (200,000 at 100,000 GPUs).
  let onNode = [];
  try { onNode = await getJson(`/api/v1/processes?node=${encodeURIComponent(d.node)}`); } catch (_) { /* the charts still show */ }
  if (!isCurrent(gen)) return;
  const procs = onNode.filter((p) => inside.has(p.device_uuid));
  document.getElementById("gpu-processes").innerHTML = processTable(procs, true, family);
  const reporting = procs.filter((p) => p.allocator).slice(0, 6);
  if (reporting.length) {
    // One read of each allocator's series over the page's range, for both
    // its composition chart and its allocated/reserved sparkline.
    const list = await Promise.all(reporting.map(async (p) => ({ p, series: await allocatorSeries(p, from, to) })));
    if (!isCurrent(gen)) return;
    renderGpuComposition(list, from, to);
    document.getElementById("gpu-allocators").innerHTML = list.map(({ p, series }) => allocatorBlock(p, series)).join("");
    document.getElementById("gpu-allocators").classList.remove("muted");
  }
}

function renderEvents(events, alerts) {
  const rows = [
    ...alerts.map((a) => ({ t: a.fired_at_ms || a.started_at_ms, what: `<b>${esc(a.rule)}</b> ${esc(a.state)}: ${esc(a.summary)}` })),
    ...events.map((e) => ({ t: e.timestamp_ms, what: `${esc(e.kind)}${e.code ? " " + e.code : ""}${e.pid ? " pid " + e.pid : ""} ${esc(e.detail)}` })),
  ].sort((a, b) => b.t - a.t);
  document.getElementById("gpu-events").innerHTML = rows.length
    ? `<table><thead><tr><th>when</th><th>what</th></tr></thead><tbody>${rows.map((r) => `<tr><td>${fmtTime(r.t)}</td><td class="wrap">${r.what}</td></tr>`).join("")}</tbody></table>`
    : `<p class="muted">none</p>`;
}

// ---------------------------------------------------------------- processes

function owner(p) {
  return [p.slurm_job_id && "job " + p.slurm_job_id, p.pod_uid && "pod " + p.pod_uid.slice(0, 8), p.container_id && "ctr " + p.container_id.slice(0, 12)].filter(Boolean).join(", ") || "—";
}

// The allocator's figures in one cell: what a reporting process's own
// allocator says, folded so that the table fits the page.
function allocatorCell(a) {
  if (!a) return `<td class="muted">—</td>`;
  const cache = `<span class="${a.fragmentation_ratio >= 0.3 ? "text-warn" : ""}" title="Reserved but in no live tensor now">${fmtBytes(a.fragmentation_bytes)} not in tensors (${(a.fragmentation_ratio * 100).toFixed(0)} %)</span>`;
  const trouble = [a.alloc_retries ? `${a.alloc_retries} retries` : "", a.ooms ? `<span class="text-crit">${a.ooms} OOMs</span>` : ""].filter(Boolean).join(" · ");
  return `<td class="wrap alloc"><span title="Bytes in live tensors / bytes the allocator reserved">${fmtBytes(a.allocated_bytes)} / ${fmtBytes(a.reserved_bytes)}</span> · ${cache}${trouble ? ` · ${trouble}` : ""}</td>`;
}

// Long text cut to its column, whole in the tooltip.
const clipped = (text, cls = "clip") => `<span class="${cls}" title="${esc(text)}">${esc(text)}</span>`;

// Processes, the columns that matter first. On a GPU's page its node and
// GPU go without saying; a GPU in MIG mode keeps the instance column.
// `devices`: where to find the devices the processes run on.
function processTable(procs, onGpuPage = false, devices = state.gpus) {
  if (procs.length === 0) return `<p class="muted">none</p>`;
  const where = !onGpuPage || new Set(procs.map((p) => p.device_uuid)).size > 1;
  const device = (p) => {
    const d = devices.get(p.device_uuid);
    const label = d && d.kind === "mig" ? `MIG ${esc(d.mig_profile || "")}` : `${p.gpu_index}`;
    return `<a href="/?gpu=${encodeURIComponent(p.device_uuid)}">${label}</a>`;
  };
  return `<table class="procs"><thead><tr>${onGpuPage ? "" : "<th>node</th>"}${where ? "<th>GPU</th>" : ""}<th class="num">pid</th><th>process</th><th>user</th><th>job / pod / container</th><th class="num">memory</th><th class="num">peak</th>
    <th title="What the process's own allocator (PyTorch) says">allocator</th></tr></thead><tbody>
    ${procs.map((p) => `<tr>${onGpuPage ? "" : `<td>${esc(p.node)}</td>`}${where ? `<td>${device(p)}</td>` : ""}<td class="num">${p.pid}</td>
      <td>${clipped(p.name)}</td><td>${clipped(p.user, "clip short")}</td><td>${clipped(owner(p), "clip short")}</td>
      <td class="num">${fmtBytes(p.memory_used_bytes)}</td><td class="num">${fmtBytes(p.memory_peak_bytes)}</td>${allocatorCell(p.allocator)}</tr>`).join("")}
    </tbody></table>`;
}

function allocatorChart(series) {
  const pts = series.points;
  const w = 360, h = 110;
  if (pts.length < 2) return `<svg width="${w}" height="${h}"><text x="8" y="20" fill="#666">waiting for reports…</text></svg>`;
  const top = Math.max(...pts.map((p) => p.reserved_bytes), 1);
  const x = (t) => ((t - series.from) / (series.to - series.from) * w).toFixed(1);
  const y = (b) => (h - 4 - b / top * (h - 14)).toFixed(1);
  const line = (f) => pts.map((p) => `${x(p.timestamp_ms)},${y(f(p))}`).join(" ");
  return `<svg width="${w}" height="${h}" role="img" aria-label="allocated and reserved memory over time">
    <polyline fill="none" stroke="#7b1fa2" stroke-width="1.5" points="${line((p) => p.reserved_bytes)}"/>
    <polyline fill="none" stroke="#1565c0" stroke-width="1.5" points="${line((p) => p.allocated_bytes)}"/>
    <text x="4" y="11" font-size="10" fill="#666">${fmtBytes(top)}</text></svg>`;
}

function allocatorBlock(p, series) {
  if (!series) return "";
  const a = p.allocator;
  return `<div class="alloc"><b>${esc(p.node)} GPU ${p.gpu_index} · pid ${p.pid}</b> ${esc(p.user)} ${esc(p.name.slice(0, 40))}
    ${allocatorChart(series)}
    <span style="color:#1565c0">— allocated ${fmtBytes(a.allocated_bytes)}</span> · <span style="color:#7b1fa2">— reserved ${fmtBytes(a.reserved_bytes)}</span> ·
    not in tensors ${fmtBytes(a.fragmentation_bytes)} · retries ${a.alloc_retries} · OOMs ${a.ooms}</div>`;
}

// One owner kind's largest groups, as the collector summed them
// (`/api/v1/processes/summary`), saying how many there are beyond those.
function groupTable(title, { groups, largest }) {
  const more = groups > largest.length ? ` <span class="muted small">(the ${largest.length} largest of ${groups})</span>` : "";
  return `<div class="owner-groups"><h3>${title}${more}</h3>${largest.length ? `<table><thead><tr><th>${title.split(" ").pop()}</th><th class="num">memory</th><th class="num">processes</th><th class="num">GPUs</th><th class="num">nodes</th></tr></thead><tbody>
    ${largest.map((g) => `<tr><td>${esc(g.key)}</td><td class="num">${fmtBytes(g.memory_used_bytes)}</td><td class="num">${g.processes}</td><td class="num">${g.devices}</td><td class="num">${g.nodes}</td></tr>`).join("")}
    </tbody></table>` : `<p class="muted">none</p>`}</div>`;
}

async function showProcesses(view, p, gen) {
  document.title = "Headroom — processes and jobs";
  view.innerHTML = `<p class="muted">loading…</p>`;
  // Summed by the collector: the fleet's processes are 200,000 at 100,000 GPUs.
  const [alerts, summary] = await Promise.all([getJson("/api/v1/alerts?state=active"), getJson("/api/v1/processes/summary")]);
  if (!isCurrent(gen)) return;
  const leaks = alerts.filter((a) => a.rule === "leak");
  view.innerHTML = `
    <div class="grid2">
      ${groupTable("Memory by user", summary.by_user)}
      ${groupTable("Memory by Slurm job", summary.by_slurm_job)}
      ${groupTable("Memory by pod", summary.by_pod)}
      ${groupTable("Memory by container", summary.by_container)}
    </div>
    <h3>Leak suspects</h3>
    ${leaks.length ? `<table><thead><tr><th>state</th><th>process</th><th class="num">growth</th><th>since</th><th>GPU</th></tr></thead><tbody>
      ${leaks.map((a) => `<tr><td>${esc(a.state)}</td><td>${clipped(`pid ${a.labels.pid} ${a.labels.process || ""} (${a.labels.user || ""})`)}</td>
        <td class="num">${fmtBytes(a.details.growth_bytes_per_min)}/min</td><td>${a.details.since_ms ? fmtTime(a.details.since_ms) : "—"}</td>
        <td><a href="/?gpu=${encodeURIComponent(a.labels.device_uuid)}">${esc(a.labels.node)} GPU ${esc(a.labels.gpu)}</a></td></tr>`).join("")}</tbody></table>`
      : `<p class="muted">no process leaks right now</p>`}
    <section id="job-composition"><h3>Where each job's memory goes</h3>
      <p class="muted small">Each job's memory at its ranks' peaks, summed over the ranks that count their tensors, and what to try for its largest share.</p><div id="job-bars"></div></section>
    <h3>Top consumers across the fleet</h3>${processTable(summary.largest)}
    <h3>Allocator of reporting processes</h3><div id="proc-allocators" class="muted">none reports</div>`;
  renderJobCompositions(summary);
  const reporting = summary.largest_reporting;
  if (reporting.length) {
    const blocks = await Promise.all(reporting.map(async (p) => allocatorBlock(p, await allocatorSeries(p))));
    if (!isCurrent(gen)) return;
    const box = document.getElementById("proc-allocators");
    box.innerHTML = blocks.join("");
    box.classList.remove("muted");
  }
}

// ---------------------------------------------------------------- where memory goes

// A training process's (or a job's) memory at its peak in six shares that
// add up to its total: what its client counts (weights, gradients,
// optimizer state), the rest of the allocator's peak of live tensors, the
// allocator's cache beyond that peak, and what lies outside the allocator.
// Each share has a colour and a pattern (app.css `.sh-*`), and its name in
// words beside it, so that colour is never the only signal.
const SHARES = [
  { key: "weights", label: "weights", bytes: (b) => b.weights_bytes, dtype: (b) => b.weights_dtype },
  { key: "gradients", label: "gradients", bytes: (b) => b.gradients_bytes, dtype: (b) => b.gradients_dtype },
  { key: "optimizer_state", label: "optimizer state", bytes: (b) => b.optimizer_state_bytes, dtype: (b) => b.optimizer_state_dtype },
  { key: "activations", label: "activations and temporaries", bytes: (b) => b.activations_bytes, dtype: () => null },
  { key: "cache", label: "allocator's cache", bytes: (b) => b.cache_bytes, dtype: () => null },
  { key: "outside_allocator", label: "outside the allocator", bytes: (b) => b.outside_allocator_bytes, dtype: () => null },
];
const SHARE_TIPS = {
  activations: "The rest of the allocator's peak of live tensors: activations kept for the backward pass, temporaries, buffers",
  cache: "Reserved by PyTorch's caching allocator beyond the most its tensors ever needed",
  outside_allocator: "What the driver reports beyond the allocator: CUDA context, cuBLAS/cuDNN workspaces, NCCL, other libraries",
};

// The parts the client did not count, in words ("gradients and optimizer state").
const uncounted = (b) => {
  const names = SHARES.slice(0, 3).filter((s) => s.bytes(b) == null).map((s) => s.label);
  return names.length > 1 ? `${names.slice(0, -1).join(", ")} and ${names[names.length - 1]}` : names[0] || "";
};

// The shares of a breakdown with their bytes (null: not counted), fraction
// of the total and label; the largest is the one the API picks a remedy by
// (`largest_share`: activations only when every part was counted, since
// otherwise they hold the uncounted parts too).
function shareList(b) {
  const total = b.total_bytes;
  const list = SHARES.map((s) => {
    const bytes = s.bytes(b);
    const label = s.key === "activations" && !b.complete ? `activations and other tensors (${uncounted(b)} not counted)` : s.label;
    return { key: s.key, label, bytes, dtype: s.dtype(b), frac: bytes != null && total > 0 ? bytes / total : 0,
      largest: s.key === b.largest_share };
  });
  return list;
}
// Floored, as the API's advice words it: a share short of all never reads 100 %.
const fmtPct = (frac) => frac > 0 && frac < 0.01 ? "<1 %" : `${Math.floor(frac * 100)} %`;
const shareWords = (s) => s.bytes == null ? `${s.label} not counted`
  : `${s.label} ${fmtBytes(s.bytes)} (${fmtPct(s.frac)}${s.dtype ? `, ${s.dtype}` : ""})`;

// The stacked bar and its legend. The bar's accessible name says every
// share in words; a share wide enough carries its name inside it.
function compositionHtml(b, caption) {
  const list = shareList(b);
  const largest = list.find((s) => s.largest);
  const name = `${caption}, ${fmtBytes(b.total_bytes)} at the peak: ${list.map(shareWords).join("; ")}${largest ? `. Largest${b.complete ? "" : " counted"}: ${largest.label}` : ""}`;
  const segments = list.filter((s) => s.bytes > 0).map((s) =>
    `<span class="sh-${s.key}" data-share="${s.key}" style="width:${(s.frac * 100).toFixed(2)}%" title="${esc(shareWords(s))}">${s.frac >= 0.12 ? `<i>${esc(s.key !== "activations" ? s.label : b.complete ? "activations" : "activations + other")} ${fmtPct(s.frac)}</i>` : ""}</span>`).join("");
  const legend = list.map((s) => `<li data-share="${s.key}" data-bytes="${s.bytes ?? ""}"${s.largest ? " data-largest" : ""}${SHARE_TIPS[s.key] ? ` title="${esc(SHARE_TIPS[s.key])}"` : ""}>
      <i class="swatch sh-${s.key}" aria-hidden="true"></i> ${esc(s.label)}${s.bytes == null ? ` <span class="muted">not counted</span>`
        : ` <b class="bytes">${fmtBytes(s.bytes)}</b> ${fmtPct(s.frac)}${s.dtype ? ` <span class="dtype">${esc(s.dtype)}</span>` : ""}`}${s.largest ? ` <b class="largest">${b.complete ? "largest" : "largest counted"}</b>` : ""}</li>`).join("");
  return `<div class="comp" data-total="${b.total_bytes}">
    <div class="comp-bar" role="img" aria-label="${esc(name)}">${segments}</div>
    <ul class="comp-legend">${legend}<li class="comp-total">total at the peak <b class="bytes">${fmtBytes(b.total_bytes)}</b></li></ul></div>`;
}

// Canvas patterns for the chart's fills, drawn like the bar's CSS ones.
const SHARE_STYLE = {
  weights: ["#1565c0", null], gradients: ["#2e7d32", "diag"], optimizer_state: ["#e65100", "cross"],
  activations: ["#6a1b9a", "dots"], cache: ["#9e9e9e", "vert"],
};
const patterns = new Map();
function shareFill(key) {
  const [color, kind] = SHARE_STYLE[key];
  if (!kind) return color;
  if (!patterns.has(key)) {
    const c = document.createElement("canvas");
    c.width = c.height = 8;
    const g = c.getContext("2d");
    g.fillStyle = color; g.fillRect(0, 0, 8, 8);
    g.strokeStyle = "rgba(255,255,255,.6)"; g.fillStyle = "rgba(255,255,255,.75)"; g.lineWidth = 1.5;
    g.beginPath();
    if (kind === "diag" || kind === "cross") { g.moveTo(0, 8); g.lineTo(8, 0); g.moveTo(-2, 2); g.lineTo(2, -2); g.moveTo(6, 10); g.lineTo(10, 6); }
    if (kind === "cross") { g.moveTo(0, 0); g.lineTo(8, 8); g.moveTo(6, -2); g.lineTo(10, 2); g.moveTo(-2, 6); g.lineTo(2, 10); }
    if (kind === "vert") { g.moveTo(2, 0); g.lineTo(2, 8); g.moveTo(6, 0); g.lineTo(6, 8); }
    g.stroke();
    if (kind === "dots") { g.beginPath(); g.arc(4, 4, 1.4, 0, 2 * Math.PI); g.fill(); }
    patterns.set(key, g.createPattern(c, "repeat"));
  }
  return patterns.get(key);
}

// The parts over time from the allocator's series, stacked: what the client
// counted, activations (the rest of the peak of live tensors) and the cache
// (reserved beyond that peak). On the GPU page's time axis and cursor.
function drawCompositionChart(box, series, from, to, name) {
  const pts = series.points;
  if (pts.length < 2) { box.innerHTML = `<p class="muted">waiting for reports…</p>`; return; }
  const counted = (p) => (p.weights_bytes ?? 0) + (p.gradients_bytes ?? 0) + (p.optimizer_state_bytes ?? 0);
  const complete = pts.every((p) => p.weights_bytes != null && p.gradients_bytes != null && p.optimizer_state_bytes != null);
  const parts = [
    ["weights", "weights", (p) => p.weights_bytes],
    ["gradients", "gradients", (p) => p.gradients_bytes],
    ["optimizer_state", "optimizer state", (p) => p.optimizer_state_bytes],
    ["activations", complete ? "activations and temporaries" : "activations and other tensors", (p) => Math.max(0, p.peak_allocated_bytes - counted(p))],
    ["cache", "allocator's cache", (p) => Math.max(0, p.reserved_bytes - p.peak_allocated_bytes)],
  ].filter(([, , f]) => pts.some((p) => f(p) != null));
  const columns = parts.map(([, , f]) => pts.map((p) => f(p) ?? 0));
  const stacked = columns.map((_, i) => columns.slice(0, i + 1).reduce((acc, col) => acc.map((v, j) => v + col[j])));
  const order = stacked.map((_, i) => i).reverse();
  const chart = new uPlot({
    width: chartWidth(box.id), height: 200,
    scales: { x: { time: true, min: seconds(from), max: seconds(to) }, y: { range: (u, min, max) => [0, Math.max(max, 1)] } },
    series: [{}, ...order.map((i) => ({ label: parts[i][1], stroke: SHARE_STYLE[parts[i][0]][0], fill: () => shareFill(parts[i][0]), width: 1,
      value: (u, v, si, di) => di == null ? "—" : fmtBytes(columns[i][di]) }))],
    axes: [{}, gibAxis],
    cursor: gpuCursor,
  }, [pts.map((p) => seconds(p.timestamp_ms)), ...order.map((i) => stacked[i])], box);
  // The legend's markers in the bar's patterns too (uPlot colours only their border).
  chart.root.querySelectorAll(".u-legend .u-series").forEach((row, si) => {
    if (si > 0) row.querySelector(".u-marker")?.classList.add(`sh-${parts[order[si - 1]][0]}`);
  });
  chart.headroomName = name;
  state.charts.push(chart);
}

// The allocator's series of a process over [from, to], or null.
async function allocatorSeries(p, from, to) {
  const range = from ? `&from=${from}&to=${to}&max_points=600` : "&max_points=360";
  try {
    return await getJson(`/api/v1/gpus/${encodeURIComponent(p.device_uuid)}/processes/${p.pid}/allocator?start_time_ms=${p.start_time_ms}${range}`);
  } catch (_) { return null; }
}

// On a GPU's page: for each reporting process whose client counts its
// parts, its bar at the peak and its parts over the page's range.
function renderGpuComposition(list, from, to) {
  const section = document.getElementById("gpu-composition");
  const counting = list.filter(({ p }) => p.allocator.breakdown);
  section.hidden = counting.length === 0;
  if (!counting.length) return;
  const who = (p) => `pid ${p.pid} · ${p.user}${p.slurm_job_id ? ` · job ${p.slurm_job_id}` : p.pod_uid ? ` · pod ${shortId(p.pod_uid, 8)}` : ""}`;
  document.getElementById("gpu-composition-list").innerHTML = counting.map(({ p }, i) => `<div class="comp-proc" data-pid="${p.pid}">
    <h4>${esc(who(p))} <span class="muted">${clipped(p.name)}</span></h4>
    ${compositionHtml(p.allocator.breakdown, `Where the memory of pid ${p.pid} goes`)}
    <div id="chart-comp-${i}" class="chart" aria-label="parts of pid ${p.pid}'s memory over time"></div></div>`).join("");
  counting.forEach(({ p, series }, i) => {
    const box = document.getElementById(`chart-comp-${i}`);
    if (series) drawCompositionChart(box, series, from, to, `composition-${p.pid}`);
    else box.innerHTML = `<p class="muted">no allocator series</p>`;
  });
}

// `/api/v1/jobs` (`query` picks some), or null when it fails (the job
// filter's bar then stays empty until the filter changes).
async function fetchJobs(query = "") {
  try {
    const r = await fetch(`/api/v1/jobs${query}`);
    return r.ok ? await r.json() : null;
  } catch (_) { return null; }
}

const jobName = (j) => j.kind === "slurm" ? `Slurm job ${j.id}` : `pod ${shortId(j.id, 8)}`;
const listText = (items, n = 3) => items.length > n ? `${items.slice(0, n).join(", ")} and ${items.length - n} more` : items.join(", ");

// One job: who and where, its bar summed over the ranks that count, and
// what its owner can do about the largest share.
function jobCompositionHtml(j) {
  const ranks = j.reporting === j.processes ? `${j.reporting} of ${j.processes} ranks report`
    : `${j.reporting} of ${j.processes} ranks report; the bar sums those ${j.reporting}`;
  return `<div class="job-comp" data-job="${esc(j.id)}" data-kind="${esc(j.kind)}">
    <div class="job-head"><b title="${esc(j.id)}">${esc(jobName(j))}</b> · ${clipped(listText(j.users), "clip short")} · ${clipped(listText(j.nodes))}
      · <span class="ranks">${ranks}</span> · ${fmtBytes(j.memory_used_bytes)} on the GPUs</div>
    ${compositionHtml(j.breakdown, `Where the memory of ${jobName(j)} goes`)}
    ${j.advice ? `<p class="advice">${esc(j.advice.text)}</p>` : ""}</div>`;
}

// The bars of the largest jobs that count their tensors, from the summary.
function renderJobCompositions(summary) {
  const { largest_counting_jobs: shown, jobs_counting: counting, jobs_silent: silent } = summary;
  document.getElementById("job-bars").innerHTML = (shown.length ? shown.map(jobCompositionHtml).join("")
    : `<p class="muted">no job reports where its memory goes yet</p>`) +
    `<p class="muted small">${counting > shown.length ? `The ${shown.length} largest of ${counting} jobs that count their tensors. ` : ""}${silent ? `${silent} other job${silent === 1 ? "" : "s"} count${silent === 1 ? "s" : ""} nothing: ` : ""}a job's ranks count their weights, gradients and optimizer state with the Python client's <code>enable(model=, optimizer=)</code>.</p>`;
}

// The fleet filtered by job: the job's bar above the devices. The job
// filter matches part of an id, as the tiles do; an exact match first, at
// most three.
async function renderJobFilterComposition(gen) {
  const box = document.getElementById("job-filter-composition");
  const wanted = fleetFilter.job;
  if (!box) return;
  if (!wanted) { box.innerHTML = ""; return; }
  const jobs = await fetchJobs(`?slurm_job_id=${encodeURIComponent(wanted)}`);
  if (!isCurrent(gen) || fleetFilter.job !== wanted) return;
  const matches = (jobs || []).filter((j) => j.kind === "slurm" && j.breakdown && j.id.includes(wanted))
    .sort((a, b) => (b.id === wanted) - (a.id === wanted)).slice(0, 3);
  box.innerHTML = matches.map(jobCompositionHtml).join("");
  // The grid's cells are sized to what is left of the window below.
  const fleet = document.getElementById("fleet");
  if (fleet) fitGrid(fleet);
}

// ---------------------------------------------------------------- alerts

// Signed in, the record names the user (the server insists); signed out
// (`[http_auth] mode = "none"`), the operator types a name.
function operator() { return (state.session && state.session.user) || localStorage.getItem("headroom-operator") || ""; }
const mayAct = () => !state.session || state.session.may_act;

async function showAlerts(view, p, gen) {
  document.title = "Headroom — alerts";
  const which = p.get("state") === "resolved" ? "resolved" : "active";
  view.innerHTML = `
    <div class="controls">
      ${state.session && state.session.user ? "" : `<label>your name (for acknowledgements and silences) <input id="operator" value="${esc(operator())}" placeholder="alice"></label>`}
      <span><a href="/?view=alerts">active</a> · <a href="/?view=alerts&state=resolved">resolved</a></span>
    </div>
    <div id="alert-list"><p class="muted">loading…</p></div>
    <h3>Silences</h3><div id="silence-list"></div>`;
  const name = document.getElementById("operator");
  if (name) name.addEventListener("input", (e) => localStorage.setItem("headroom-operator", e.target.value.trim()));
  await renderAlertList(which, gen);
  await renderSilences(gen);
}

async function renderAlertList(which, gen = routeGen) {
  const alerts = await getJson(`/api/v1/alerts?state=${which}&limit=500`);
  if (!isCurrent(gen)) return;
  const rows = alerts.map((a) => {
    const where = a.labels.device_uuid ? `<a href="/?gpu=${encodeURIComponent(a.labels.device_uuid)}&from=${(a.fired_at_ms || a.started_at_ms) - 3_600_000}&to=${Math.min(Date.now(), (a.resolved_at_ms || Date.now()) + 600_000)}">${esc(a.labels.node)} GPU ${esc(a.labels.gpu)}</a>` : esc(a.labels.node || "");
    const act = which === "active" && mayAct();
    const ack = a.acknowledged_by ? `ack ${esc(a.acknowledged_by)}` : (act ? `<button class="small" data-ack="${a.id}">acknowledge</button>` : "");
    const silence = act ? `<button class="small" data-silence="${a.id}">silence 1 h</button>` : "";
    return `<tr data-alert="${a.id}"><td class="${a.severity === "critical" ? "text-crit" : "text-warn"}">${esc(a.severity)}</td><td>${esc(a.state)}</td><td>${esc(a.rule)}</td>
      <td>${where}</td><td class="wrap">${esc(a.summary)}${a.remedy ? `<div class="remedy">What to try: ${esc(a.remedy)}</div>` : ""}</td>
      <td>${fmtTime(a.fired_at_ms || a.started_at_ms)}${a.resolved_at_ms ? " → " + fmtTime(a.resolved_at_ms) : ""}</td><td class="ack">${ack} ${silence}</td></tr>`;
  });
  const box = document.getElementById("alert-list");
  box.innerHTML = rows.length ? `<table><thead><tr><th>severity</th><th>state</th><th>rule</th><th>where</th><th>what</th><th>when</th><th></th></tr></thead><tbody>${rows.join("")}</tbody></table>`
    : `<p class="muted">no ${which} alerts</p>`;
  for (const b of box.querySelectorAll("button[data-ack]")) b.addEventListener("click", () => acknowledge(b.dataset.ack, which));
  for (const b of box.querySelectorAll("button[data-silence]")) {
    b.addEventListener("click", () => silence(alerts.find((a) => String(a.id) === b.dataset.silence), which));
  }
}

function whoOrComplain() {
  const who = operator();
  if (!who) {
    const input = document.getElementById("operator");
    input.focus();
    setStatus("enter your name first: acknowledgements and silences say who did them");
  }
  return who;
}

async function acknowledge(id, which) {
  const who = whoOrComplain();
  if (!who) return;
  try {
    await getJson(`/api/v1/alerts/${id}/ack`, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ by: who }) });
  } catch (err) { setStatus(err.message); }
  await renderAlertList(which);
}

async function silence(alert, which) {
  const who = whoOrComplain();
  if (!who || !alert) return;
  const matchers = {};
  for (const k of ["node", "device_uuid", "rule"]) if (alert.labels[k]) matchers[k] = alert.labels[k];
  matchers.rule = alert.rule;
  try {
    await getJson("/api/v1/silences", { method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ matchers, comment: `silenced from the dashboard: ${alert.summary.slice(0, 200)}`, created_by: who, ends_at_ms: Date.now() + 3_600_000 }) });
  } catch (err) { setStatus(err.message); }
  await renderAlertList(which);
  await renderSilences();
}

async function renderSilences(gen = routeGen) {
  const list = await getJson("/api/v1/silences");
  if (!isCurrent(gen)) return;
  const box = document.getElementById("silence-list");
  box.innerHTML = list.length ? `<table><thead><tr><th>matches</th><th>by</th><th>until</th><th>comment</th><th></th></tr></thead><tbody>
    ${list.map((s) => `<tr><td>${esc(Object.entries(s.matchers).map(([k, v]) => `${k}=${v}`).join(", "))}</td><td>${esc(s.created_by)}</td><td>${fmtTime(s.ends_at_ms)}</td>
      <td class="wrap">${esc(s.comment)}</td><td>${mayAct() ? `<button class="small" data-expire="${s.id}">expire</button>` : ""}</td></tr>`).join("")}</tbody></table>` : `<p class="muted">none</p>`;
  for (const b of box.querySelectorAll("button[data-expire]")) {
    b.addEventListener("click", async () => {
      try { await getJson(`/api/v1/silences/${b.dataset.expire}`, { method: "DELETE" }); } catch (err) { setStatus(err.message); }
      await renderSilences();
    });
  }
}

// ---------------------------------------------------------------- sign-in

// `[http_auth] mode = "tokens"`: a form for a dashboard token, which the
// server keeps in a cookie no script can read; "proxy": the proxy signs in.
function showSignIn(answer) {
  if (stream) { stream.close(); stream = null; }
  state.session = null;
  setStatus("not signed in");
  document.getElementById("who").innerHTML = "";
  const view = document.getElementById("view");
  if (answer.auth !== "tokens") {
    view.innerHTML = `<h2>Not signed in</h2><p>${esc(answer.error || "sign in through your organisation's proxy, then reload")}</p>`;
    return;
  }
  view.innerHTML = `<h2>Sign in</h2>
    <form id="sign-in" class="controls">
      <label>dashboard token <input id="token" type="password" autocomplete="off" placeholder="hrd_…" size="40" required></label>
      <button type="submit">sign in</button>
    </form>
    <p class="muted">An operator makes one with <code>headroom-collector token create --role viewer --name you</code> (or <code>--role admin</code> to acknowledge and silence).</p>
    <p id="sign-in-error" class="text-crit" role="alert"></p>`;
  document.getElementById("sign-in").addEventListener("submit", async (e) => {
    e.preventDefault();
    const r = await fetch("/api/v1/session", { method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ token: document.getElementById("token").value }) });
    if (r.ok) { location.reload(); return; }
    const body = await r.json().catch(() => ({}));
    document.getElementById("sign-in-error").textContent = body.error || `HTTP ${r.status}`;
  });
}

function showSession(session) {
  state.session = session.auth === "none" ? null : session;
  const who = document.getElementById("who");
  if (!state.session) { who.innerHTML = ""; return; }
  who.innerHTML = `${esc(session.user || "token")} · ${esc(session.role)}${session.auth === "tokens" ? ' <button class="small" id="sign-out">sign out</button>' : ""}`;
  const out = document.getElementById("sign-out");
  if (out) out.addEventListener("click", async () => { await fetch("/api/v1/session", { method: "DELETE" }); location.reload(); });
}

// ---------------------------------------------------------------- start

async function start() {
  const r = await fetch("/api/v1/session");
  const answer = await r.json().catch(() => ({}));
  if (r.status === 401) { showSignIn(answer); return; }
  if (r.ok) showSession(answer);
  connectStream();
  route();
}
start();
