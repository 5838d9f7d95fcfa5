// Headroom's dashboard: one page, four views chosen by the URL, so every
// view (and a GPU with its time range) has a link a Slack alert can carry:
//   /?show=grid|tiles       fleet overview, live over server-sent events
//   /?node=NAME             one node's devices, whatever the fleet's size
//   /?gpu=UUID&from=&to=    one GPU or MIG instance
//   /?view=processes        memory by user, pod and job; leak suspects
//   /?view=alerts           firing, pending, resolved; acknowledge, silence
//
// The entry module: it hands the views to the router, fits the grid and
// the charts to the window, and starts. The views and what they share are
// ES modules in app/, loaded as they are (no build step); docs/dashboard.md
// says which module owns what.

import { alertsUpdated, showAlerts } from "./app/alerts.js";
import { fitCharts } from "./app/charts.js";
import { fleetUpdated, showFleet } from "./app/fleet.js";
import { showGpu } from "./app/gpu.js";
import { fitGrid } from "./app/grid.js";
import { showProcesses } from "./app/processes.js";
import { currentView, route, setViews } from "./app/router.js";
import { showSession, showSignIn } from "./app/session.js";
import { connectStream } from "./app/stream.js";

setViews({
  fleet: { show: showFleet, updated: fleetUpdated },
  gpu: { show: showGpu },
  processes: { show: showProcesses },
  alerts: { show: showAlerts, updated: alertsUpdated },
});

let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => {
    const box = document.getElementById("fleet");
    if (box && currentView === "fleet") fitGrid(box);
    fitCharts();
  }, 150);
});

async function start() {
  const r = await fetch("/api/v1/session");
  const answer = await r.json().catch(() => ({}));
  if (r.status === 401) { showSignIn(answer); return; }
  if (r.ok) showSession(answer);
  connectStream();
  route();
}
start();
