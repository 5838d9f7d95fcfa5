// The alerts view (`/?view=alerts`, `&state=resolved`): the alerts with
// their remedies, acknowledging and silencing them, and the silences.

import { esc, fmtTime } from "./format.js";
import { isCurrent, params, routeGen } from "./router.js";
import { getJson, setStatus } from "./session.js";
import { state } from "./state.js";

// Signed in, the record names the user (the server insists); signed out
// (`[http_auth] mode = "none"`), the operator types a name.
function operator() { return (state.session && state.session.user) || localStorage.getItem("headroom-operator") || ""; }
const mayAct = () => !state.session || state.session.may_act;

export async function showAlerts(view, p, gen) {
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

// A stream message while the alerts are shown: new and resolved alerts
// appear without a reload.
export function alertsUpdated({ alertsChanged }) {
  if (alertsChanged) renderAlertList(params().get("state") === "resolved" ? "resolved" : "active").catch(() => {});
}
