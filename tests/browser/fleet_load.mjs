// Benchmark (not a test): how fast the fleet view of a large fleet loads and
// how it keeps up with live updates. Usage: node fleet_load.mjs BASE_URL TILES
// Prints one JSON line: load times to all tiles filled (5 fresh loads), the
// bytes the page transferred, and over 20 s of live updates the time from a
// sample to its tile (sample_to_screen) and the cost of each fleet render.
import { launchChromium } from "./chromium.mjs";

const [base, tilesArg] = process.argv.slice(2);
const want = Number(tilesArg || 1000);
const browser = await launchChromium();
const pct = (xs, p) => { const s = [...xs].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor(s.length * p))]; };
const median = (xs) => pct(xs, 0.5);

const loads = [];
const snapshots = [];
let bytes = 0;
for (let i = 0; i < 5; i++) {
  const context = await browser.newContext({ viewport: { width: 1600, height: 1000 } });
  const page = await context.newPage();
  const t0 = Date.now();
  await page.goto(base);
  await page.waitForFunction(() => window.__headroom && window.__headroom.updates >= 1, null, { timeout: 30000, polling: 10 });
  snapshots.push(Date.now() - t0);
  await page.waitForFunction((n) => document.querySelectorAll(".tile[data-sig]").length >= n, want, { timeout: 30000, polling: 10 });
  loads.push(Date.now() - t0);
  if (i === 0) {
    bytes = await page.evaluate(() => {
      const entries = [...performance.getEntriesByType("navigation"), ...performance.getEntriesByType("resource")]
        .filter((e) => !e.name.includes("/api/v1/stream"));
      return entries.reduce((acc, e) => acc + (e.transferSize || e.encodedBodySize || 0), 0);
    });
  }
  if (i === 4) {
    await page.evaluate(() => { window.__headroom.sampleToScreenMs.length = 0; window.__headroom.renderMs.length = 0; });
    await page.waitForTimeout(20000);
    const live = await page.evaluate(() => ({ s2s: window.__headroom.sampleToScreenMs, render: window.__headroom.renderMs }));
    console.log(JSON.stringify({
      tiles: want,
      load_ms: loads, load_median_ms: median(loads),
      snapshot_received_ms: snapshots, snapshot_median_ms: median(snapshots),
      page_bytes_excluding_stream: bytes,
      sample_to_screen_ms: { median: median(live.s2s), p99: pct(live.s2s, 0.99), n: live.s2s.length },
      render_ms: { median: +median(live.render).toFixed(2), p99: +pct(live.render, 0.99).toFixed(2), n: live.render.length },
    }));
  }
  await context.close();
}
await browser.close();
