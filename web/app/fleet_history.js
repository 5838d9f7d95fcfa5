// The fleet's history under the fleet view: memory against capacity and
// the devices short of headroom, from the rollups, over a range picked.

import { esc, fmtBytes, GiB, MIN } from "./format.js";
import { AXIS_SIZE, chartWidth, gibAxis, seconds } from "./charts.js";
import { isCurrent } from "./router.js";
import { getJson } from "./session.js";
import { dropCharts, keepChart } from "./state.js";

// The fleet over a range, from the rollups: memory used against capacity,
// and devices short of headroom with the alerts that fired; the charts
// share one time axis and one cursor.
const HISTORY_RANGES = [["6h", 360 * MIN], ["24h", 1440 * MIN], ["7d", 7 * 1440 * MIN], ["30d", 30 * 1440 * MIN]];
export async function showFleetHistory(gen, span) {
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
  dropCharts((c) => c.headroomName?.startsWith("fleet-"));
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
  keepChart(m, r);
}
// A bucket newer than the rollups carries only its alerts: a gap in the
// memory lines, not a dip to zero.
const memoryKnown = (p) => p.devices > 0;
const fmtTiB = (b) => b >= 1024 * GiB ? (b / 1024 / GiB).toFixed(1) + " TiB" : (b / GiB).toFixed(0) + " GiB";
