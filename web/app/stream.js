// The live-data client: the server-sent event stream of the fleet (or of
// one node), each message into the state and onto the screen, and the
// header's summary. Owns the EventSource and the node it follows
// (`streamNode`).

import { esc } from "./format.js";
import { params, viewUpdated } from "./router.js";
import { onSignOut, setStatus, showSignIn } from "./session.js";
import { applyFleet, setConnected, state } from "./state.js";

let stream = null;
export let streamNode = "";
// The fleet's stream, or one node's when the page names one (`/?node=`).
export function connectStream() {
  const node = params().get("node") || "";
  if (stream && node === streamNode) return;
  if (stream) stream.close();
  streamNode = node;
  stream = new EventSource(node ? `/api/v1/stream?node=${encodeURIComponent(node)}` : "/api/v1/stream");
  stream.addEventListener("snapshot", (e) => { received(JSON.parse(e.data), true); });
  stream.addEventListener("update", (e) => { received(JSON.parse(e.data), false); });
  stream.addEventListener("unavailable", (e) => { setStatus(`figures may be stale: ${e.data}`); });
  stream.onopen = () => { setConnected(true); };
  stream.onerror = () => {
    setConnected(false);
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

// Signed out: the stream would only be refused.
function closeStream() {
  if (stream) { stream.close(); stream = null; }
}
onSignOut(closeStream);

// A message: into the state, then the status line, the header and the
// view shown (the alerts view follows new and resolved alerts, the fleet
// redraws).
function received(msg, snapshot) {
  const { alertsChanged } = applyFleet(msg, snapshot);
  setStatus(`live · updated ${new Date().toLocaleTimeString()}`);
  renderSummary();
  viewUpdated({ alertsChanged });
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
