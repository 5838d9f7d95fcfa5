// Helpers around uPlot (the vendored global `uPlot`) that every view's
// charts share: the width, the time axis, the value axis, the cursor, the
// markers, the palette, and following the window's width.

import { GiB } from "./format.js";
import { state } from "./state.js";

export const chartWidth = (id) => Math.max(320, (document.getElementById(id)?.clientWidth || 800) - 10);
export const seconds = (ms) => ms / 1000;

// Vertical lines with a label for XID events and alerts.
export function markerPlugin(markers) {
  return {
    hooks: {
      draw: [(u) => {
        const ctx = u.ctx;
        ctx.save();
        ctx.font = `${11 * devicePixelRatio}px sans-serif`;
        for (const m of markers) {
          const x = Math.round(u.valToPos(seconds(m.t), "x", true));
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          ctx.strokeStyle = m.color; ctx.fillStyle = m.color; ctx.lineWidth = 1.5 * devicePixelRatio;
          ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
          ctx.fillText(m.text, x + 3 * devicePixelRatio, u.bbox.top + 12 * devicePixelRatio);
        }
        ctx.restore();
      }],
    },
  };
}

// Charts on one page share one time axis: the same range, the same width,
// the same room for the value axis (so their times line up one above the
// other) and one cursor.
export const AXIS_SIZE = 72;
export const gibAxis = { size: AXIS_SIZE, values: (u, vals) => vals.map((v) => (v / GiB).toFixed(0) + " GiB") };
export const gpuCursor = { sync: { key: "gpu" } };

export const PALETTE = ["#1565c0", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#5d4037", "#9e9d24", "#455a64", "#c62828"];

// Charts follow the window's width, so a narrower window never scrolls sideways.
export function fitCharts() {
  for (const c of state.charts) {
    const width = Math.max(320, c.root.parentElement.clientWidth - 10);
    if (width !== c.width) c.setSize({ width, height: c.height });
  }
}
