// Formatting shared by the views: bytes, rates, times, the level words,
// HTML escaping. Pure functions and constants; no state.

export const GiB = 1024 ** 3;
export const MIN = 60_000;
export const fmtBytes = (b) => b == null ? "—" : (Math.abs(b) >= GiB ? (b / GiB).toFixed(1) + " GiB" : (b / 1024 ** 2).toFixed(0) + " MiB");
export const fmtRate = (b) => b == null ? "—" : (b / 1e9).toFixed(2) + " GB/s";
export const fmtTime = (ms) => new Date(ms).toLocaleString();
export const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
// Used fraction decides the level; the text says it too, so colour is never the only signal.
export const level = (frac) => frac >= 0.95 ? "crit" : frac >= 0.9 ? "warn" : "ok";
export const LEVEL_TEXT = { ok: "OK", warn: "HIGH", crit: "CRITICAL", none: "NO DATA" };
export const shortId = (s, n) => s.length > n ? s.slice(0, n) : s;
export const untilText = (ms) => { const m = Math.max(0, Math.round((ms - Date.now()) / MIN)); return m < 1 ? "under a minute" : `${m} min`; };

// Long text cut to its column, whole in the tooltip.
export const clipped = (text, cls = "clip") => `<span class="${cls}" title="${esc(text)}">${esc(text)}</span>`;
