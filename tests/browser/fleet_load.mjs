// Benchmark (not a test): how fast the fleet view of a large fleet loads and
// how it keeps up with live updates.
// Usage: node fleet_load.mjs BASE_URL DEVICES [grid|tiles] [LOADS]
// Prints one JSON line: load times to every device's cell (grid) or tile
// filled (LOADS fresh loads, default 5), the bytes the page transferred,
// and over 20 s of live updates the time from a sample to its cell or tile
// (sample_to_screen) and the cost of each fleet render.
import { launchChromium } from "./chromium.mjs";

const [base, devicesArg, modeArg, loadsArg] = process.argv.slice(2);
const want = Number(devicesArg || 1000);
const mode = modeArg || "tiles";
const selector = mode === "grid" ? ".cell[data-sig]" : ".tile[data-sig]";
const runs = Number(loadsArg || 5);
const browser = await launchChromium();
const pct = (xs, p) => { const s = [...xs].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor(s.length * p))]; };
const median = (xs) => pct(xs, 0.5);

const loads = [];
const snapshots = [];
let bytes = 0;
for (let i = 0; i < runs; i++) {
  const context = await browser.newContext({ viewport: mode === "grid" ? { width: 1440, height: 900 } : { width: 1600, height: 1000 } });
  const page = await context.newPage();
  const t0 = Date.now();
  await page.goto(`${base}/?show=${mode}`);
  await page.waitForFunction(() => window.__headroom && window.__headroom.updates >= 1, null, { timeout: 30000, polling: 10 });
  snapshots.push(Date.now() - t0);
  await page.waitForFunction(([sel, n]) => document.querySelectorAll(sel).length >= n, [selector, want], { timeout: 60000, polling: 10 });
  loads.push(Date.now() - t0);
  if (i === 0) {
    bytes = await page.evaluate(() => {
      const entries = [...performance.getEntriesByType("navigation"), ...performance.getEntriesByType("resource")]
        .filter((e) => !e.name.includes("/api/v1/stream"));
      return entries.reduce((acc, e) => acc + (e.transferSize || e.encodedBodySize || 0), 0);
    });
  }
  if (i === runs - 1) {
    await page.evaluate(() => { window.__headroom.sampleToScreenMs.length = 0; window.__headroom.renderMs.length = 0; });
    await page.waitForTimeout(20000);
    const live = await page.evaluate(() => ({ s2s: window.__headroom.sampleToScreenMs, render: window.__headroom.renderMs }));
    console.log(JSON.stringify({
      mode, devices: want,
      load_ms: loads, load_median_ms: median(loads), load_p99_ms: pct(loads, 0.99),
      snapshot_received_ms: snapshots, snapshot_median_ms: median(snapshots),
      page_bytes_excluding_stream: bytes,
      sample_to_screen_ms: { median: median(live.s2s), p99: pct(live.s2s, 0.99), n: live.s2s.length },
      render_ms: { median: +median(live.render).toFixed(2), p99: +pct(live.render, 0.99).toFixed(2), n: live.render.length },
    }));
  }
  await context.close();
}
await browser.close();
