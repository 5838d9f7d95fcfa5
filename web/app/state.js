// What the page knows, shared by the views: this module is its one owner.
// The views read `state`; only the functions here change it (a stream
// message, the processes the fleet's filters read, the session, the charts
// drawn). Tests read it through window.__headroom.

// `scope` is what the stream sends: `devices` (every one), `node` (the
// devices of the node the page names) or `nodes` (a fleet too large to
// send device by device: a row per node in `nodeRows`, and the devices at
// risk in `gpus`).
export const state = { scope: "devices", nodeRows: new Map(), devicesInFleet: 0, nodes: [], gpus: new Map(), alerts: { pending: 0, firing: 0 }, deviceAlerts: {}, owners: {}, processes: [], processesMatch: null, updates: 0, charts: [], connected: false };
window.__headroom = state;

// How long after a sample its tile changes, and what a fleet render costs
// (the last few hundred of each), for the benchmark in tests/browser.
state.sampleToScreenMs = [];
state.renderMs = [];
const remember = (list, value) => { list.push(value); if (list.length > 500) list.shift(); };

// A message of the stream (`snapshot`: the whole of it), into the state;
// says whether the alert counts changed.
export function applyFleet(msg, snapshot) {
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
  let alertsChanged = false;
  if (msg.alerts) {
    alertsChanged = msg.alerts.pending !== state.alerts.pending || msg.alerts.firing !== state.alerts.firing;
    state.alerts = msg.alerts;
  }
  state.updates += 1;
  return { alertsChanged };
}

// The processes the fleet's user, job and pod filters read, and the
// filter they were read for (null: a node's, matched as typed).
export function setProcesses(found, match) {
  state.processes = found;
  state.processesMatch = match;
}

// Who is signed in (null: nobody, or no sign-in at all).
export function setSession(session) { state.session = session; }

// Whether the live stream is open.
export function setConnected(connected) { state.connected = connected; }

// What a fleet render cost, in ms.
export function noteRender(ms) { remember(state.renderMs, ms); }

// The uPlot charts on the page, each named by `headroomName` for the tests
// and the resize; dropped (and destroyed) on every navigation.
export function keepChart(...charts) { state.charts.push(...charts); }
export function dropCharts(which = () => true) {
  for (const c of state.charts.filter(which)) c.destroy();
  state.charts = state.charts.filter((c) => !which(c));
}
