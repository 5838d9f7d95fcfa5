// What a device says, in the fleet's tiles, cells, tooltips and at-risk
// list alike: its figures, its level (alerts included), its alerts in
// words, its label and who holds its memory. Reads the state; owns nothing.

import { esc, level, shortId, untilText } from "./format.js";
import { state } from "./state.js";

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
export function deviceLevel(d) {
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
export function alertNotes(a) {
  if (!a) return [];
  const notes = [];
  if (a.rules.length) notes.push({ text: `ALERT: ${a.rules.join(", ")}`, cls: a.severity === "critical" ? "text-crit" : "text-warn" });
  if (a.pending.length) notes.push({ text: `pending: ${a.pending.join(", ")}`, cls: "text-warn" });
  if (a.oom_at_ms) notes.push({ text: `OOM forecast in ${untilText(a.oom_at_ms)}`, cls: "forecast" });
  return notes;
}
export const noteHtml = (note, tag = "span") => `<${tag} class="${note.cls}">${esc(note.text)}</${tag}>`;

export const deviceLabel = (d) => d.kind === "mig" ? `GPU ${d.index} MIG ${d.mig_profile || ""}` : `GPU ${d.index}`;
// "alice (job 4817263)", "bob (pod 1a2b3c4d)": who holds the memory.
export const ownerText = (o) => `${o.user || "?"}${o.slurm_job_id ? ` (job ${o.slurm_job_id})` : o.pod_uid ? ` (pod ${shortId(o.pod_uid, 8)})` : ""}`;
export const ownersText = (uuid) => (state.owners[uuid] || []).map(ownerText).join(", ");
