// The fleet view of a 2,000-GPU fleet in a real browser: Debian's Chromium,
// driven by playwright-core. Usage: node fleet_grid.mjs BASE_URL ARTIFACT_DIR
// Checks, against the collector's own API: every device has a cell and
// every cell lies within one 1440x900 screen; a device with a firing alert
// says so on its cell; the at-risk list ranks the devices the API's
// alerts, forecasts and headroom say it should; hover and keyboard reach a
// device, show its owners and open its page; live updates rewrite cells in
// place; the fleet history is drawn; nothing scrolls sideways at 1280 px;
// and a node filter shows tiles naming the owners. Saves screenshots in
// ARTIFACT_DIR. Exits non-zero, naming the step, on the first failure.
import { fleetWithSamples, launchChromium, scriptArgs, watchedPage } from "./chromium.mjs";
import { join } from "node:path";

const [base, artifacts] = scriptArgs("fleet_grid.mjs", ["BASE_URL", "ARTIFACT_DIR"]);

const browser = await launchChromium();
let step = "start";
const { page, errors } = await watchedPage(browser, { width: 1440, height: 900 });
const shot = (name, fullPage = false) => page.screenshot({ path: join(artifacts, `${name}.png`), fullPage });
const api = (path) => page.evaluate(async (p) => (await fetch(p)).json(), path);

try {
  step = "every device of the fleet has a sample";
  await page.goto(base);
  const gpus = await fleetWithSamples(page, 2000);

  step = "every device has a cell, all on one 1440x900 screen";
  await page.goto(base);
  await page.waitForFunction((n) => document.querySelectorAll(".cell[data-sig]").length >= n, gpus.length, { timeout: 30000 });
  const layout = await page.evaluate(() => {
    const cells = [...document.querySelectorAll(".cell[data-uuid]")];
    const off = cells.filter((c) => { const r = c.getBoundingClientRect(); return r.top < 0 || r.left < 0 || r.bottom > innerHeight || r.right > innerWidth; });
    return { uuids: cells.map((c) => c.dataset.uuid), off: off.length, scrollY: scrollY, pageWidth: document.documentElement.scrollWidth,
      size: parseFloat(getComputedStyle(document.querySelector(".cell")).width) };
  });
  const missing = gpus.filter((g) => !layout.uuids.includes(g.uuid));
  if (missing.length || layout.uuids.length !== gpus.length) throw new Error(`${missing.length} devices without a cell; ${layout.uuids.length} cells for ${gpus.length} devices`);
  if (layout.off) throw new Error(`${layout.off} cells outside the 1440x900 window (cell ${layout.size} px)`);
  if (layout.pageWidth > 1440) throw new Error(`the page is ${layout.pageWidth} px wide at 1440`);
  await shot("5-grid");

  step = "a device with a firing alert says so on its cell";
  const active = await api("/api/v1/alerts?state=active");
  const firing = [...new Set(active.filter((a) => a.state === "firing" && a.labels.device_uuid).map((a) => a.labels.device_uuid))];
  if (firing.length === 0) throw new Error("no firing alert on a device to look for");
  await page.waitForFunction((uuids) => uuids.every((u) => {
    const c = document.querySelector(`.cell[data-uuid="${u}"]`);
    return c && c.classList.contains("firing") && /ALERT: /.test(c.getAttribute("aria-label")) && !/\bOK\b/.test(c.getAttribute("aria-label"));
  }), firing, { timeout: 10000 });

  step = "the at-risk list ranks what the API's alerts and headroom say";
  // What the list should start with, from the API alone: devices with a
  // firing critical alert, then firing, then pending or forecast, then
  // below 10 % headroom.
  const expected = await page.evaluate(async () => {
    const [alerts, devices] = await Promise.all([(await fetch("/api/v1/alerts?state=active")).json(), (await fetch("/api/v1/gpus")).json()]);
    const tier = new Map();
    for (const a of alerts) {
      const u = a.labels.device_uuid;
      if (!u) continue;
      const t = a.state === "firing" ? (a.severity === "critical" ? 0 : 1) : 2;
      tier.set(u, Math.min(t, tier.has(u) ? tier.get(u) : 9));
    }
    for (const d of devices) if (!tier.has(d.uuid) && d.latest && d.latest.headroom_pct < 10) tier.set(d.uuid, 3);
    return { atRisk: tier.size, top: Math.min(...tier.values()), byTier: [...tier.entries()] };
  });
  await page.waitForFunction((n) => new RegExp(`^${n} of \\d+ devices at risk`).test(document.querySelector("#at-risk-list p")?.textContent || ""), expected.atRisk, { timeout: 10000 });
  const rows = await page.evaluate(() => [...document.querySelectorAll("#at-risk-list tr[data-uuid]")].map((r) => ({ uuid: r.dataset.uuid, text: r.innerText })));
  const tierOf = new Map(expected.byTier);
  const rowTiers = rows.map((r) => tierOf.get(r.uuid));
  if (rows.length !== Math.min(6, gpus.length)) throw new Error(`at-risk list has ${rows.length} rows`);
  for (let i = 0; i < rows.length; i++) {
    if (i < Math.min(6, expected.atRisk) && rowTiers[i] === undefined) throw new Error(`row ${i + 1} (${rows[i].text}) is not at risk by the API`);
    if (i > 0 && rowTiers[i] !== undefined && (rowTiers[i - 1] === undefined || rowTiers[i] < rowTiers[i - 1])) throw new Error(`rows out of order: ${rowTiers}`);
  }
  if (rowTiers[0] !== expected.top) throw new Error(`first row is tier ${rowTiers[0]}, the API says ${expected.top}`);
  // Each row names a user of its device. Owners are read every 5 s, so a
  // device that has just come to be at risk may show none yet: look again
  // for up to 12 s before calling it missing.
  let unnamed = [];
  let processes = [];
  const userOf = (uuid) => processes.filter((p) => p.device_uuid === uuid).map((p) => p.user);
  for (let attempt = 0; attempt < 25; attempt++) {
    processes = await api("/api/v1/processes");
    const shown = await page.evaluate(() => [...document.querySelectorAll("#at-risk-list tr[data-uuid]")].map((r) => ({ uuid: r.dataset.uuid, text: r.innerText })));
    unnamed = shown.filter((r) => !userOf(r.uuid).some((u) => r.text.includes(u))).map((r) => `row ${r.text} names none of its users ${userOf(r.uuid)}`);
    if (unnamed.length === 0) break;
    await new Promise((resolve) => setTimeout(resolve, 500));
  }
  if (unnamed.length) throw new Error(unnamed.join("; "));
  // The ranking itself, on fixtures: firing critical, firing warning,
  // pending by the soonest forecast, low headroom, then the rest by headroom.
  const order = await page.evaluate(() => {
    const dev = (uuid, pct) => ({ uuid, latest: { headroom_pct: pct } });
    const now = Date.now();
    const ranked = window.__headroomRankAtRisk(
      [dev("calm", 50), dev("low", 5), dev("later", 40), dev("sooner", 60), dev("warn", 30), dev("crit", 45), dev("calmer", 70)],
      { warn: { severity: "warning", rules: ["leak"], pending: [], oom_at_ms: null }, crit: { severity: "critical", rules: ["watermark"], pending: [], oom_at_ms: null },
        later: { severity: null, rules: [], pending: ["time_to_oom"], oom_at_ms: now + 20 * 60000 }, sooner: { severity: null, rules: [], pending: ["time_to_oom"], oom_at_ms: now + 5 * 60000 } });
    return ranked.map((r) => r.d.uuid).join(",");
  });
  if (order !== "crit,warn,sooner,later,low,calm,calmer") throw new Error(`ranking on fixtures: ${order}`);

  step = "hover shows a device's figures and owners";
  const hot = firing[0];
  await page.hover(`.cell[data-uuid="${hot}"]`);
  await page.waitForSelector("#cell-tip:not([hidden])", { timeout: 5000 });
  const tip = await page.locator("#cell-tip").innerText();
  const hotDevice = gpus.find((g) => g.uuid === hot);
  if (!tip.includes(hotDevice.node) || !/ALERT/.test(tip) || !userOf(hot).some((u) => tip.includes(u))) throw new Error(`tooltip says: ${tip}`);
  await shot("6-grid-tooltip");

  step = "the keyboard reaches a device and opens it";
  await page.mouse.move(0, 0);
  await page.focus(".cell[tabindex='0']");
  const firstUuid = await page.evaluate(() => document.activeElement.dataset.uuid);
  await page.keyboard.press("ArrowRight");
  await page.keyboard.press("ArrowDown");
  const moved = await page.evaluate((first) => {
    const a = document.activeElement, f = document.querySelector(`.cell[data-uuid="${first}"]`);
    return { uuid: a.dataset.uuid, isCell: a.classList.contains("cell"), below: a.getBoundingClientRect().top > f.getBoundingClientRect().bottom,
      tabStops: document.querySelectorAll(".cell[tabindex='0']").length, tip: document.getElementById("cell-tip").hidden ? "" : document.getElementById("cell-tip").innerText };
  }, firstUuid);
  if (!moved.isCell || !moved.below || moved.tabStops !== 1) throw new Error(`after →↓ focus is on ${JSON.stringify(moved)}`);
  const movedDevice = gpus.find((g) => g.uuid === moved.uuid);
  if (!moved.tip.includes(movedDevice.node)) throw new Error(`focus shows no tooltip for ${movedDevice.node}: ${moved.tip}`);
  await page.keyboard.press("Enter");
  await page.waitForFunction((u) => new URLSearchParams(location.search).get("gpu") === u, moved.uuid, { timeout: 5000 });
  await page.waitForFunction(() => window.__headroom.charts.some((c) => c.headroomName === "memory"), null, { timeout: 10000 });

  step = "charts on the GPU page share one time axis";
  const axes = await page.evaluate(() => window.__headroom.charts.map((c) => ({ name: c.headroomName, min: c.scales.x.min, max: c.scales.x.max, left: c.bbox.left, width: c.bbox.width })));
  const mem = axes.find((a) => a.name === "memory");
  for (const a of axes) {
    if (a.min !== mem.min || a.max !== mem.max || Math.abs(a.left - mem.left) > 1 || Math.abs(a.width - mem.width) > 1) throw new Error(`chart axes differ: ${JSON.stringify(axes)}`);
  }
  if (axes.length < 3) throw new Error(`${axes.length} charts on the GPU page`);

  step = "live updates rewrite cells in place";
  await page.goBack();
  await page.waitForFunction((n) => document.querySelectorAll(".cell[data-sig]").length >= n, gpus.length, { timeout: 10000 });
  const kept = await page.evaluateHandle(() => document.querySelector(".cell"));
  const updates = await page.evaluate(() => window.__headroom.updates);
  await page.waitForFunction((u) => window.__headroom.updates >= u + 2, updates, { timeout: 10000 });
  if (!(await kept.evaluate((el) => el.isConnected))) throw new Error("an update rebuilt the grid instead of rewriting its cells");

  step = "the fleet history is drawn from the rollups";
  await page.waitForFunction(() => ["fleet-memory", "fleet-risk"].every((n) => window.__headroom.charts.some((c) => c.headroomName === n)), null, { timeout: 10000 });

  step = "nothing scrolls sideways at 1280 px";
  await page.setViewportSize({ width: 1280, height: 900 });
  await page.waitForTimeout(400);
  const at1280 = await page.evaluate(() => ({ page: document.documentElement.scrollWidth, wide: [...document.querySelectorAll("table")].filter((t) => t.scrollWidth > t.parentElement.clientWidth + 1).length }));
  if (at1280.page > 1280 || at1280.wide) throw new Error(`at 1280 px: page ${at1280.page} px wide, ${at1280.wide} tables wider than their box`);
  await page.setViewportSize({ width: 1440, height: 900 });

  step = "a node's tiles name who holds each GPU";
  const node = hotDevice.node;
  await page.fill("#f-node", node);
  await page.waitForFunction((n) => document.querySelectorAll(".tile[data-sig]").length > 0 && [...document.querySelectorAll(".tile")].every((t) => t.title.startsWith(n)), node, { timeout: 10000 });
  const tiles = await page.evaluate(() => [...document.querySelectorAll(".tile")].map((t) => ({ uuid: t.dataset.uuid, owners: t.querySelector(".owners")?.innerText || "" })));
  for (const t of tiles) {
    const users = userOf(t.uuid);
    if (users.length && !users.some((u) => t.owners.includes(u))) throw new Error(`tile ${t.uuid} names ${t.owners}, processes say ${users}`);
  }
  if (!tiles.some((t) => t.owners)) throw new Error(`no tile of ${node} names an owner`);
  await shot("7-node-tiles");

  if (errors.length) throw new Error(`errors in the page: ${errors.join(" | ")}`);
  console.log(JSON.stringify({ ok: true, cells: layout.uuids.length, cell_px: layout.size, firing: firing.length, at_risk: expected.atRisk }));
} catch (e) {
  await shot("failure-grid").catch(() => {});
  console.error(`FAILED at "${step}": ${e.message}`);
  if (errors.length) console.error(`page errors: ${errors.join(" | ")}`);
  process.exitCode = 1;
} finally {
  await browser.close();
}
