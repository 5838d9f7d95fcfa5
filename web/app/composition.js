// Where memory goes: a training process's or a job's shares at its peak
// (the bar and its legend), the parts over time (a chart), the allocator's
// series they come from, and the jobs' bars. Used by the GPU page, the
// processes view and the fleet's job filter. Owns the canvas patterns.

import { clipped, esc, fmtBytes, shortId } from "./format.js";
import { chartWidth, gibAxis, gpuCursor, seconds } from "./charts.js";
import { getJson } from "./session.js";
import { keepChart } from "./state.js";

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
  keepChart(chart);
}

// The allocator's series of a process over [from, to], or null.
export async function allocatorSeries(p, from, to) {
  const range = from ? `&from=${from}&to=${to}&max_points=600` : "&max_points=360";
  try {
    return await getJson(`/api/v1/gpus/${encodeURIComponent(p.device_uuid)}/processes/${p.pid}/allocator?start_time_ms=${p.start_time_ms}${range}`);
  } catch (_) { return null; }
}

// On a GPU's page: for each reporting process whose client counts its
// parts, its bar at the peak and its parts over the page's range.
export function renderGpuComposition(list, from, to) {
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
export async function fetchJobs(query = "") {
  try {
    const r = await fetch(`/api/v1/jobs${query}`);
    return r.ok ? await r.json() : null;
  } catch (_) { return null; }
}

const jobName = (j) => j.kind === "slurm" ? `Slurm job ${j.id}` : `pod ${shortId(j.id, 8)}`;
const listText = (items, n = 3) => items.length > n ? `${items.slice(0, n).join(", ")} and ${items.length - n} more` : items.join(", ");

// One job: who and where, its bar summed over the ranks that count, and
// what its owner can do about the largest share.
export function jobCompositionHtml(j) {
  const ranks = j.reporting === j.processes ? `${j.reporting} of ${j.processes} ranks report`
    : `${j.reporting} of ${j.processes} ranks report; the bar sums those ${j.reporting}`;
  return `<div class="job-comp" data-job="${esc(j.id)}" data-kind="${esc(j.kind)}">
    <div class="job-head"><b title="${esc(j.id)}">${esc(jobName(j))}</b> · ${clipped(listText(j.users), "clip short")} · ${clipped(listText(j.nodes))}
      · <span class="ranks">${ranks}</span> · ${fmtBytes(j.memory_used_bytes)} on the GPUs</div>
    ${compositionHtml(j.breakdown, `Where the memory of ${jobName(j)} goes`)}
    ${j.advice ? `<p class="advice">${esc(j.advice.text)}</p>` : ""}</div>`;
}

// The bars of the largest jobs that count their tensors, from the summary.
export function renderJobCompositions(summary) {
  const { largest_counting_jobs: shown, jobs_counting: counting, jobs_silent: silent } = summary;
  document.getElementById("job-bars").innerHTML = (shown.length ? shown.map(jobCompositionHtml).join("")
    : `<p class="muted">no job reports where its memory goes yet</p>`) +
    `<p class="muted small">${counting > shown.length ? `The ${shown.length} largest of ${counting} jobs that count their tensors. ` : ""}${silent ? `${silent} other job${silent === 1 ? "" : "s"} count${silent === 1 ? "s" : ""} nothing: ` : ""}a job's ranks count their weights, gradients and optimizer state with the Python client's <code>enable(model=, optimizer=)</code>.</p>`;
}
