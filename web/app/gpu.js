// One GPU's page (`/?gpu=UUID&from=&to=`): its figures, its charts on one
// time axis, its MIG layout, its processes with their allocators and
// composition, and its alerts and events in the range.

import { esc, fmtBytes, fmtRate, fmtTime, MIN } from "./format.js";
import { AXIS_SIZE, chartWidth, gibAxis, gpuCursor, markerPlugin, PALETTE, seconds } from "./charts.js";
import { allocatorSeries, renderGpuComposition } from "./composition.js";
import { allocatorBlock, processTable } from "./processes.js";
import { isCurrent, navigate } from "./router.js";
import { getJson } from "./session.js";
import { keepChart, state } from "./state.js";

const RANGES = [["15m", 15 * MIN], ["1h", 60 * MIN], ["6h", 360 * MIN], ["24h", 1440 * MIN], ["7d", 7 * 1440 * MIN], ["30d", 30 * 1440 * MIN], ["90d", 90 * 1440 * MIN], ["1y", 365 * 1440 * MIN]];

function rangeFromUrl(p) {
  const to = Number(p.get("to")) || Date.now();
  const from = Number(p.get("from")) || to - 15 * MIN;
  return { from, to };
}

export async function showGpu(view, p, gen) {
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
  keepChart(chart);
}

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
  keepChart(chart);
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
  keepChart(chart);
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
