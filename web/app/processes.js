// The processes and jobs view (`/?view=processes`): memory by owner, leak
// suspects, each job's bar, the top consumers and their allocators; and
// the process table and allocator blocks the GPU page shows too.

import { clipped, esc, fmtBytes, fmtTime } from "./format.js";
import { allocatorSeries, renderJobCompositions } from "./composition.js";
import { isCurrent } from "./router.js";
import { getJson } from "./session.js";
import { state } from "./state.js";

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

// Processes, the columns that matter first. On a GPU's page its node and
// GPU go without saying; a GPU in MIG mode keeps the instance column.
// `devices`: where to find the devices the processes run on.
export function processTable(procs, onGpuPage = false, devices = state.gpus) {
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

export function allocatorBlock(p, series) {
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

export async function showProcesses(view, p, gen) {
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
