// The fleet's grid of cells: its legend, its fit to the window, the
// tooltip of a device's or a node's cell (owns which one it shows:
// `tipUuid`, `tipNode`) and the keyboard's way between cells.

import { esc, fmtBytes, fmtTime, LEVEL_TEXT } from "./format.js";
import { alertNotes, deviceLabel, deviceLevel, noteHtml, ownerText } from "./devices.js";
import { state } from "./state.js";

// The legend says what each colour and pattern means, with counts: the
// grid's summary in words.
export function gridLegend(each = "device") {
  const item = (cls, text, key) => `<span><i class="${cls}" aria-hidden="true"></i> ${text} <b data-count="${key}">0</b></span>`;
  const help = each === "node"
    ? "a cell per node, at its fullest device's level; hover or focus for its figures, Enter opens its devices"
    : "hover or focus a cell for its figures and owners; arrow keys move, Enter opens";
  return `<div class="legend" aria-live="off">${item("swatch lvl-ok", "OK", "ok")}${item("swatch lvl-warn", "HIGH (≥ 90 % at peak)", "warn")}${item("swatch lvl-crit", "CRITICAL (≥ 95 %)", "crit")}${item("swatch lvl-none", "no data", "none")}${item("swatch lvl-ok firing", "alert firing", "firing")}
    <span class="muted">${help}</span></div>`;
}

// The largest cell that lets the whole grid fit the window's height, so a
// fleet of 2,000 GPUs needs no scrolling; at least 6 px.
const CELL_SIZES = [20, 18, 16, 14, 12, 11, 10, 9, 8, 7, 6];
export function fitGrid(box) {
  const groups = box.querySelector(".cell-groups");
  if (!groups) return;
  const top = groups.getBoundingClientRect().top + window.scrollY;
  const room = window.innerHeight - top - 6;
  let lo = 0, hi = CELL_SIZES.length - 1;
  // Binary search for the first (largest) size that fits.
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    groups.style.setProperty("--cell", `${CELL_SIZES[mid]}px`);
    if (groups.scrollHeight <= room) hi = mid; else lo = mid + 1;
  }
  groups.style.setProperty("--cell", `${CELL_SIZES[lo]}px`);
}

// Hover or focus: the device's figures and owners beside its cell.
export let tipUuid = null;
export function showTip(uuid, anchor) {
  const tip = document.getElementById("cell-tip");
  const d = state.gpus.get(uuid);
  if (!tip || !d) return hideTip();
  tipUuid = uuid;
  const { n, a } = deviceLevel(d);
  const owners = state.owners[uuid] || [];
  tip.innerHTML = `<b>${esc(d.node)} · ${esc(deviceLabel(d))}</b> <span class="muted">${esc(d.name)}</span>
    ${n ? `<div>${fmtBytes(n.s.memory_used_bytes)} of ${fmtBytes(n.total)} used · peak ${fmtBytes(n.s.memory_used_max_bytes)} · headroom <b>${fmtBytes(n.s.headroom_bytes)} (${n.s.headroom_pct.toFixed(0)} %)</b></div>` : `<div class="muted">no sample yet</div>`}
    ${alertNotes(a).map((note) => noteHtml(note, "div")).join("")}
    <div>${owners.length ? owners.map((o) => `${esc(ownerText(o))} ${fmtBytes(o.memory_bytes)}`).join("<br>") : `<span class="muted">no process</span>`}</div>`;
  placeTip(tip, anchor || document.querySelector(`.cell[data-uuid="${CSS.escape(uuid)}"]`));
}
// A node's cell: its figures beside it.
export let tipNode = null;
export function showNodeTip(name, anchor) {
  const tip = document.getElementById("cell-tip");
  const r = state.nodeRows.get(name);
  if (!tip || !r) return hideTip();
  tipNode = name;
  tip.innerHTML = `<b>${esc(r.node)}</b> <span class="muted">${r.gpus} GPUs${r.mig_instances ? `, ${r.mig_instances} MIG instances` : ""}</span>
    <div>${LEVEL_TEXT[r.level]}${r.used_pct != null ? ` · ${r.used_pct} % used` : ""}${r.headroom_pct != null ? ` · least headroom <b>${r.headroom_pct} %</b>` : " · no sample yet"}</div>
    ${r.firing ? `<div class="text-crit">${r.firing} with an alert firing</div>` : ""}${r.pending ? `<div class="text-warn">${r.pending} with an alert pending or an OOM forecast</div>` : ""}
    ${r.low ? `<div>${r.low} below 10 % headroom</div>` : ""}${r.silent_since_ms ? `<div class="text-crit">silent since ${fmtTime(r.silent_since_ms)}</div>` : ""}`;
  placeTip(tip, anchor || document.querySelector(`.cell[data-node="${CSS.escape(name)}"]`));
}
const showCellTip = (c) => c.dataset.node && !c.dataset.uuid ? showNodeTip(c.dataset.node, c) : showTip(c.dataset.uuid, c);

function placeTip(tip, el) {
  tip.hidden = false;
  if (!el) return;
  const r = el.getBoundingClientRect();
  const w = tip.offsetWidth, h = tip.offsetHeight;
  const left = Math.min(window.innerWidth - w - 8, Math.max(8, r.left));
  const below = r.bottom + 6 + h < window.innerHeight;
  tip.style.left = `${left + window.scrollX}px`;
  tip.style.top = `${(below ? r.bottom + 6 : r.top - h - 6) + window.scrollY}px`;
}

function hideTip() {
  tipUuid = null;
  tipNode = null;
  const tip = document.getElementById("cell-tip");
  if (tip) tip.hidden = true;
}

// One tab stop for the grid; arrows move between cells in reading order
// (left, right) and to the nearest cell of the row above or below.
export function wireGrid(box) {
  box.addEventListener("mouseover", (e) => { const c = e.target.closest(".cell"); if (c) showCellTip(c); });
  box.addEventListener("mouseout", (e) => { if (e.target.closest(".cell") && !e.relatedTarget?.closest?.(".cell")) hideTip(); });
  box.addEventListener("focusin", (e) => {
    const c = e.target.closest(".cell");
    if (!c) return;
    for (const other of box.querySelectorAll(".cell[tabindex='0']")) if (other !== c) other.tabIndex = -1;
    c.tabIndex = 0;
    showCellTip(c);
  });
  box.addEventListener("focusout", (e) => { if (!e.relatedTarget?.closest?.(".cell")) hideTip(); });
  box.addEventListener("keydown", (e) => {
    const c = e.target.closest(".cell");
    if (!c) return;
    const cells = [...box.querySelectorAll(".cell")];
    const i = cells.indexOf(c);
    let next = null;
    if (e.key === "ArrowRight") next = cells[i + 1];
    else if (e.key === "ArrowLeft") next = cells[i - 1];
    else if (e.key === "Home") next = cells[0];
    else if (e.key === "End") next = cells[cells.length - 1];
    else if (e.key === "ArrowDown" || e.key === "ArrowUp") next = verticalNeighbour(cells, c, e.key === "ArrowDown");
    else if (e.key === "Escape") { hideTip(); return; }
    else return;
    e.preventDefault();
    if (next) next.focus();
  });
}

function verticalNeighbour(cells, from, down) {
  const r = from.getBoundingClientRect();
  const cx = r.left + r.width / 2;
  let rowTop = null, best = null, bestDx = Infinity;
  for (const el of cells) {
    const q = el.getBoundingClientRect();
    const beyond = down ? q.top > r.top + r.height / 2 : q.top < r.top - r.height / 2;
    if (!beyond) continue;
    if (rowTop === null || (down ? q.top < rowTop - 0.5 : q.top > rowTop + 0.5)) { rowTop = q.top; best = null; bestDx = Infinity; }
    if (Math.abs(q.top - rowTop) > 0.5) continue;
    const dx = Math.abs(q.left + q.width / 2 - cx);
    if (dx < bestDx) { bestDx = dx; best = el; }
  }
  return best;
}
