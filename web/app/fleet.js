// The fleet view (`/`, `/?node=`, `/?show=`): its filters and the
// processes they read, the at-risk list, the tiles, the cells of devices
// or of nodes, and the job filter's bar. Owns the filters (`fleetFilter`),
// the pending render and the layout drawn.

import { clipped, esc, fmtBytes, fmtTime, LEVEL_TEXT, MIN } from "./format.js";
import { fetchJobs, jobCompositionHtml } from "./composition.js";
import { alertNotes, deviceLabel, deviceLevel, noteHtml, ownersText } from "./devices.js";
import { showFleetHistory } from "./fleet_history.js";
import { fitGrid, gridLegend, showNodeTip, showTip, tipNode, tipUuid, wireGrid } from "./grid.js";
import { currentView, isCurrent, params } from "./router.js";
import { getJson } from "./session.js";
import { noteRender, setProcesses, state } from "./state.js";
import { connectStream, streamNode } from "./stream.js";

// A fleet view shows tiles while they fit a screen or two, and one small
// cell per device beyond that: 2,000 GPUs on one screen.
const TILES_UP_TO = 64;
const fleetFilter = { node: "", user: "", job: "", pod: "", sort: "name", mode: "auto" };
let fleetRenderPending = false;
let nodeFromUrl = false;

export async function showFleet(view, p, gen) {
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
    setProcesses(found, match);
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
    noteRender(performance.now() - t0);
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

// A stream message while the fleet is shown.
export function fleetUpdated() {
  scheduleFleetRender();
  // A filtered fleet follows processes that start and end.
  if (ownerFilterSet()) refreshFilterProcesses();
}
