// The dashboard in a real browser: Debian's Chromium, driven by
// playwright-core. Usage: node dashboard.mjs BASE_URL ARTIFACT_DIR
// Opens the fleet overview of the demo fleet, sees its tiles and a live
// update, follows a tile to its GPU page, sees the memory chart drawn with
// data, sees the process tables fit 1280 px, acknowledges an alert, and
// finds each device with a firing alert saying so on its tile. Saves a screenshot of each step in
// ARTIFACT_DIR. Exits non-zero, naming the step, on the first failure.
import { launchChromium } from "./chromium.mjs";
import { mkdirSync } from "node:fs";
import { join } from "node:path";

const [base, artifacts] = process.argv.slice(2);
if (!base || !artifacts) {
  console.error("usage: node dashboard.mjs BASE_URL ARTIFACT_DIR");
  process.exit(2);
}
mkdirSync(artifacts, { recursive: true });

const browser = await launchChromium();
let step = "start";
const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
const errors = [];
page.on("pageerror", (e) => errors.push(e.message));
page.on("console", (m) => { if (m.type() === "error" && !m.text().startsWith("Failed to load resource")) errors.push(m.text()); });
page.on("response", (r) => { if (r.status() >= 400) errors.push(`HTTP ${r.status()} for ${r.url()}`); });
const shot = (name) => page.screenshot({ path: join(artifacts, `${name}.png`), fullPage: true });

try {
  step = "fleet overview shows a tile per GPU and MIG instance";
  const started = Date.now();
  await page.goto(base);
  // Every tile with a sample: the demo prints its address before the first samples arrive.
  await page.waitForFunction(() => document.querySelectorAll(".tile:not(.lvl-none)").length >= 35, null, { timeout: 15000 });
  const loadMs = Date.now() - started;
  const tiles = await page.locator(".tile").count();
  const firstTile = await page.locator(".tile").first().innerText();
  if (!/GiB/.test(firstTile) || !/(OK|HIGH|CRITICAL|ALERT)/.test(firstTile)) throw new Error(`tile text says no memory or level: ${firstTile}`);
  await shot("1-fleet");

  step = "live updates arrive over server-sent events and change tiles";
  const sigs = await page.evaluate(() => [...document.querySelectorAll(".tile")].map((t) => t.dataset.sig));
  await page.waitForFunction(() => window.__headroom.sampleToScreenMs.length > 0, null, { timeout: 5000 });
  await page.waitForFunction((before) => [...document.querySelectorAll(".tile")].some((t, i) => t.dataset.sig !== before[i]), sigs, { timeout: 5000 });

  step = "filters and sorting";
  await page.selectOption("#f-sort", "headroom");
  await page.fill("#f-user", "alice");
  await page.waitForFunction(() => /of \d+ devices/.test(document.getElementById("f-count")?.textContent ?? "")
    && document.querySelectorAll(".tile").length > 0 && document.querySelectorAll(".tile").length < 35, null, { timeout: 5000 });
  await page.fill("#f-user", "");
  await page.selectOption("#f-sort", "name");
  await page.waitForFunction(() => /^35 of 35 devices/.test(document.getElementById("f-count")?.textContent ?? ""), null, { timeout: 5000 });

  step = "a tile leads to its GPU page with the memory chart drawn";
  const uuid = await page.locator(".tile.lvl-ok, .tile.lvl-warn, .tile.lvl-crit").first().getAttribute("data-uuid");
  // The GPU page draws the history it fetches and does not extend it: wait
  // until the demo (started seconds ago) has stored two samples of this GPU.
  const seenMs = await page.evaluate((u) => window.__headroom.gpus.get(u).latest.timestamp_ms, uuid);
  await page.waitForFunction(([u, t]) => window.__headroom.gpus.get(u).latest.timestamp_ms >= t + 1000,
    [uuid, seenMs], { timeout: 10000 });
  await page.locator(`.tile[data-uuid="${uuid}"]`).click();
  // The page navigates with pushState: wait on the URL itself, not a load.
  await page.waitForFunction((u) => new URLSearchParams(location.search).get("gpu") === u, uuid, { timeout: 5000 });
  await page.waitForFunction(() => {
    const c = window.__headroom.charts.find((c) => c.headroomName === "memory");
    return c && c.data[0].length >= 2 && c.data[1].some((v) => v > 0);
  }, null, { timeout: 10000 });
  if ((await page.locator("#chart-memory canvas").count()) === 0) throw new Error("no canvas in the memory chart");
  await shot("2-gpu");

  step = "the GPU page and the processes view fit 1280 px without a sideways scroll";
  await page.setViewportSize({ width: 1280, height: 900 });
  const fits = () => page.evaluate(() => {
    const wide = [...document.querySelectorAll("table")].filter((t) => t.scrollWidth > t.parentElement.clientWidth + 1).length;
    return { page: document.documentElement.scrollWidth, viewport: window.innerWidth, wideTables: wide };
  });
  // The widest process rows of the demo: a GPU whose processes report their allocator.
  const reporting = await page.evaluate(async () => {
    const procs = await (await fetch("/api/v1/processes")).json();
    const p = procs.find((x) => x.allocator) || procs[0];
    return p.device_uuid;
  });
  for (const url of [`${base}/?gpu=${encodeURIComponent(reporting)}`, `${base}/?view=processes`]) {
    await page.goto(url);
    await page.waitForSelector("table.procs", { timeout: 10000 });
    const w = await fits();
    if (w.page > w.viewport || w.wideTables) throw new Error(`${url} at 1280 px: page ${w.page} px wide, ${w.wideTables} tables wider than their box`);
  }
  await shot("2b-gpu-1280");
  await page.setViewportSize({ width: 1400, height: 1000 });
  await page.goto(`${base}/?gpu=${encodeURIComponent(uuid)}`);
  await page.waitForFunction(() => window.__headroom.charts.some((c) => c.headroomName === "memory"), null, { timeout: 10000 });

  step = "the range picker reads a longer range";
  await page.click("button[data-range='3600000']");
  await page.waitForFunction(() => {
    const p = new URLSearchParams(location.search);
    const c = window.__headroom.charts.find((c) => c.headroomName === "memory");
    return p.get("from") !== null && c && c.scales.x.max - c.scales.x.min > 3000;
  }, null, { timeout: 10000 });

  step = "an alert is acknowledged";
  await page.goto(`${base}/?view=alerts`);
  await page.fill("#operator", "playwright");
  // The list follows the alert counts live; an alert to acknowledge may
  // still be minutes away in a fresh demo.
  await page.waitForSelector("button[data-ack]", { timeout: 120000 });
  const row = page.locator("tr:has(button[data-ack])").first();
  const id = await row.getAttribute("data-alert");
  await row.locator("button[data-ack]").click();
  await page.waitForSelector(`tr[data-alert="${id}"] td.ack:has-text("ack playwright")`, { timeout: 5000 });
  await shot("3-alerts");

  step = "a device with a firing alert shows it on its tile, never OK";
  await page.goto(base);
  const firing = await page.evaluate(async () => {
    const alerts = await (await fetch("/api/v1/alerts?state=active")).json();
    return [...new Set(alerts.filter((a) => a.state === "firing" && a.labels.device_uuid).map((a) => a.labels.device_uuid))];
  });
  if (firing.length === 0) throw new Error("no firing alert on a device to look for");
  await page.waitForFunction((uuids) => uuids.every((u) => {
    const t = document.querySelector(`.tile[data-uuid="${u}"]`);
    return t && t.classList.contains("alerting") && /ALERT: /.test(t.innerText) && !/\bOK\b/.test(t.innerText);
  }), firing, { timeout: 10000 });
  const calm = await page.evaluate(() => [...document.querySelectorAll(".tile.lvl-ok")].filter((t) => t.classList.contains("alerting")).length);
  if (calm) throw new Error(`${calm} alerting tiles are drawn as OK`);
  await shot("4-fleet-alerts");

  if (errors.length) throw new Error(`errors in the page: ${errors.join(" | ")}`);
  console.log(JSON.stringify({ ok: true, tiles, fleet_load_ms: loadMs }));
} catch (e) {
  await shot("failure").catch(() => {});
  console.error(`FAILED at "${step}": ${e.message}`);
  if (errors.length) console.error(`page errors: ${errors.join(" | ")}`);
  process.exitCode = 1;
} finally {
  await browser.close();
}
