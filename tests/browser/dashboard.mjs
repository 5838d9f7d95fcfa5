// The dashboard in a real browser: Debian's Chromium, driven by
// playwright-core. Usage: node dashboard.mjs BASE_URL ARTIFACT_DIR
// Opens the fleet overview of the demo fleet, sees its tiles and a live
// update, follows a tile to its GPU page, sees the memory chart drawn with
// data, sees the process tables fit 1280 px, sees where a training
// process's memory goes (a bar of six shares that add up to its total, and
// the parts over time) and each job's bar with its advice, acknowledges an
// alert, and finds each device with a firing alert saying so on its tile.
// Saves a screenshot of each step in ARTIFACT_DIR. Exits non-zero, naming
// the step, on the first failure.
import { launchChromium, scriptArgs, watchedPage } from "./chromium.mjs";
import { join } from "node:path";

const [base, artifacts] = scriptArgs("dashboard.mjs", ["BASE_URL", "ARTIFACT_DIR"]);

const browser = await launchChromium();
let step = "start";
const { page, errors } = await watchedPage(browser, { width: 1400, height: 1000 });
const shot = (name) => page.screenshot({ path: join(artifacts, `${name}.png`), fullPage: true });
// Retries `check` (async, in node) until it returns something truthy; a
// throw counts as not yet.
async function until(what, check, timeoutMs = 10000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check().catch(() => null);
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 250));
  }
}
// "18.6 GiB", "512 MiB" as the page shows them, in GiB.
const shownGiB = (text) => {
  const m = /([\d.]+) (GiB|MiB)/.exec(text);
  if (!m) throw new Error(`no bytes in ${JSON.stringify(text)}`);
  return Number(m[1]) / (m[2] === "MiB" ? 1024 : 1);
};
// A composition bar as the page shows it: the legend's shares (bytes as
// data and as text), the total, the bar's accessible name and segments.
const readComposition = (selector) => page.evaluate((sel) => {
  const c = document.querySelector(sel);
  if (!c) return null;
  const bar = c.querySelector(".comp-bar");
  return {
    total: Number(c.dataset.total),
    totalShown: c.querySelector(".comp-total .bytes")?.textContent ?? "",
    label: bar.getAttribute("aria-label") ?? "",
    barWidth: bar.clientWidth,
    items: [...c.querySelectorAll(".comp-legend li[data-share]")].map((li) => ({
      key: li.dataset.share, bytes: li.dataset.bytes === "" ? null : Number(li.dataset.bytes), largest: li.hasAttribute("data-largest"),
      text: li.textContent.replace(/\s+/g, " ").trim(), shown: li.querySelector(".bytes")?.textContent ?? "" })),
    segments: [...bar.children].map((el) => ({ key: el.dataset.share, width: el.getBoundingClientRect().width })),
  };
}, selector);
// The shares add up to the total, in bytes and as shown (each figure
// rounded to 0.1 GiB), and the bar's segments fill the bar.
function checkAddsUp(c, where) {
  const keys = c.items.map((i) => i.key).join(",");
  if (keys !== "weights,gradients,optimizer_state,activations,cache,outside_allocator") throw new Error(`${where}: shares ${keys}`);
  const sum = c.items.reduce((acc, i) => acc + (i.bytes ?? 0), 0);
  if (sum !== c.total) throw new Error(`${where}: shares add up to ${sum} bytes, the total is ${c.total}`);
  const shownSum = c.items.filter((i) => i.bytes != null).reduce((acc, i) => acc + shownGiB(i.shown), 0);
  if (Math.abs(shownSum - shownGiB(c.totalShown)) > 0.35) throw new Error(`${where}: shown shares add up to ${shownSum.toFixed(2)} GiB, the total shows ${c.totalShown}`);
  const filled = c.segments.reduce((acc, s) => acc + s.width, 0);
  if (Math.abs(filled - c.barWidth) > 2) throw new Error(`${where}: segments fill ${filled} of ${c.barWidth} px`);
}

try {
  step = "start";

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

  step = "a training process's memory splits into its shares, with the parts over time";
  // hana's fp32 job on gpu-node-04 GPU 1 (sim/scenarios/demo.toml): weights
  // and gradients are its largest shares, weights listed first.
  const hana = await until("job 4817410 to report its composition", async () => {
    const procs = await (await fetch(`${base}/api/v1/processes`)).json();
    return procs.find((p) => p.slurm_job_id === "4817410" && p.allocator?.breakdown);
  });
  if (hana.node !== "gpu-node-04" || hana.gpu_index !== 1) throw new Error(`job 4817410 runs on ${hana.node} GPU ${hana.gpu_index}`);
  // The page draws the allocator's series it reads once: two reports first.
  await until("two allocator reports of job 4817410", async () => {
    const q = `start_time_ms=${hana.start_time_ms}&max_points=600`;
    const series = await (await fetch(`${base}/api/v1/gpus/${encodeURIComponent(hana.device_uuid)}/processes/${hana.pid}/allocator?${q}`)).json();
    return series.points.length >= 2;
  });
  await page.goto(`${base}/?gpu=${encodeURIComponent(hana.device_uuid)}`);
  const hanaBar = `.comp-proc[data-pid="${hana.pid}"] .comp`;
  await page.waitForFunction((sel) => /float32/.test(document.querySelector(`${sel} .comp-bar`)?.getAttribute("aria-label") ?? ""), hanaBar, { timeout: 10000 });
  const comp = await readComposition(hanaBar);
  checkAddsUp(comp, "job 4817410's bar");
  const largest = comp.items.filter((i) => i.largest);
  if (largest.length !== 1 || largest[0].key !== "weights") throw new Error(`the largest share is ${largest.map((i) => i.key)}, not weights`);
  const weights = comp.items[0];
  if (!/^weights .*float32.*largest/i.test(weights.text)) throw new Error(`the weights legend says ${weights.text}`);
  if (comp.items.some((i) => i.bytes > weights.bytes)) throw new Error(`a share holds more than the weights: ${comp.items.map((i) => i.text).join(" | ")}`);
  if (!/weights [\d.]+ GiB \(\d+ %, float32\)/.test(comp.label) || !/Largest: weights/.test(comp.label)) throw new Error(`the bar's accessible name says ${comp.label}`);
  const widest = comp.segments.reduce((a, b) => (b.width > a.width + 1 ? b : a));
  if (widest.key !== "weights") throw new Error(`the widest segment is ${widest.key}`);
  // The parts over time, on the page's time axis: the same range and width as the memory chart.
  const chartName = `composition-${hana.pid}`;
  await page.waitForFunction((name) => {
    const c = window.__headroom.charts.find((c) => c.headroomName === name);
    return c && c.data[0].length >= 2 && c.data[1].some((v) => v > 0);
  }, chartName, { timeout: 10000 });
  const axes = await page.evaluate((name) => {
    const [c, m] = [name, "memory"].map((n) => window.__headroom.charts.find((c) => c.headroomName === n));
    return { same: c.scales.x.min === m.scales.x.min && c.scales.x.max === m.scales.x.max && c.width === m.width,
      series: c.series.slice(1).map((s) => s.label), canvas: Boolean(c.root.closest(".comp-proc")?.querySelector("canvas")) };
  }, chartName);
  if (!axes.same) throw new Error("the composition chart does not share the memory chart's time axis");
  if (!axes.canvas || axes.series.join(",") !== "allocator's cache,activations and temporaries,optimizer state,gradients,weights") {
    throw new Error(`the composition chart draws ${axes.series.join(", ")}`);
  }
  await page.locator("#gpu-composition").screenshot({ path: join(artifacts, "8-composition.png") });

  step = "the processes view shows the owners the collector summed";
  await page.goto(`${base}/?view=processes`);
  await page.waitForSelector(".owner-groups table", { timeout: 10000 });
  const owners = await page.evaluate(() => [...document.querySelectorAll(".owner-groups")].map((box) => ({
    title: box.querySelector("h3").textContent,
    keys: [...box.querySelectorAll("tbody tr td:first-child")].map((td) => td.textContent),
  })));
  const listed = await (await fetch(`${base}/api/v1/processes`)).json();
  const users = new Set(listed.map((p) => p.user));
  const byUser = owners.find((o) => o.title.startsWith("Memory by user"));
  if (!byUser || !byUser.keys.length || byUser.keys.some((k) => !users.has(k))) throw new Error(`the users' table lists ${JSON.stringify(byUser)}; the processes' users are ${[...users]}`);
  const byContainer = owners.find((o) => o.title.startsWith("Memory by container"));
  if (!byContainer || byContainer.keys.some((k) => k.length > 12)) throw new Error(`the containers' table lists ${JSON.stringify(byContainer)}`);
  const consumers = await page.locator("table.procs").first().locator("tbody tr").count();
  if (consumers !== Math.min(25, listed.length)) throw new Error(`${consumers} top consumers listed of ${listed.length} processes`);

  step = "each job's bar names its largest share and what to try";
  const job = (id) => `.job-comp[data-job="${id}"]`;
  await page.waitForFunction((sel) => (document.querySelector(`${sel} .advice`)?.textContent ?? "") !== "", job("4817322"), { timeout: 10000 });
  const dmitri = await readComposition(`${job("4817322")} .comp`);
  checkAddsUp(dmitri, "job 4817322's bar");
  const top = dmitri.items.find((i) => i.largest);
  if (top?.key !== "optimizer_state" || !/^optimizer state .*largest/i.test(top.text) || !/Largest: optimizer state/.test(dmitri.label)) {
    throw new Error(`job 4817322's bar names ${top?.text} as its largest share`);
  }
  const advice = await page.locator(`${job("4817322")} .advice`).innerText();
  if (!/sharded optimizer|ZeroRedundancyOptimizer/.test(advice)) throw new Error(`job 4817322's advice: ${advice}`);
  const alice = await page.locator(`${job("4817263")} .job-head`).innerText();
  if (!/alice/.test(alice) || !/8 of 8 ranks report/.test(alice)) throw new Error(`job 4817263 says ${alice}`);
  const lora = await readComposition(`${job("4817263")} .comp`);
  if (lora.items.find((i) => i.largest)?.key !== "activations") throw new Error("job 4817263's largest share is not its activations");
  await page.locator("#job-composition").screenshot({ path: join(artifacts, "9-jobs.png") });

  step = "the fleet filtered by a job shows that job's bar above the devices";
  await page.goto(base);
  await page.fill("#f-job", "4817322");
  await page.waitForFunction(() => /optimizer state/.test(document.querySelector('#job-filter-composition .job-comp[data-job="4817322"] li[data-largest]')?.textContent ?? ""),
    null, { timeout: 10000 });
  await page.fill("#f-job", "");
  await page.waitForFunction(() => (document.getElementById("job-filter-composition")?.childElementCount ?? 1) === 0, null, { timeout: 5000 });

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
