// Where a real training process's memory goes, as the GPU page shows it.
// Usage: node composition.mjs BASE_URL GPU_UUID PID ARTIFACT_DIR
// Opens the GPU's page, finds the process's bar, and checks that its
// shares are the bytes the process counted (weights and gradients in
// bfloat16, optimizer state in float32 and the largest share), that they
// add up to the total shown, and that the chart of the parts is drawn.
// Exits non-zero, naming the step, on the first failure.
import { launchChromium, scriptArgs, watchedPage } from "./chromium.mjs";
import { join } from "node:path";

const [base, uuid, pid, artifacts] = scriptArgs("composition.mjs", ["BASE_URL", "GPU_UUID", "PID", "ARTIFACT_DIR"]);
const GIB = 2 ** 30;

const browser = await launchChromium();
const { page, errors } = await watchedPage(browser, { width: 1280, height: 1000 });
let step = "start";
try {
  step = "the process's bar is drawn on its GPU's page";
  await page.goto(`${base}/?gpu=${encodeURIComponent(uuid)}`);
  const bar = `.comp-proc[data-pid="${pid}"] .comp`;
  await page.waitForFunction((sel) => document.querySelector(`${sel} li[data-largest]`) !== null, bar, { timeout: 15000 });
  const shown = await page.evaluate((sel) => {
    const c = document.querySelector(sel);
    return {
      total: Number(c.dataset.total),
      label: c.querySelector(".comp-bar")?.getAttribute("aria-label") ?? "",
      items: [...c.querySelectorAll(".comp-legend li[data-share]")].map((li) => ({
        key: li.dataset.share, bytes: li.dataset.bytes === "" ? null : Number(li.dataset.bytes),
        largest: li.hasAttribute("data-largest"), text: li.textContent.replace(/\s+/g, " ").trim() })),
    };
  }, bar);
  const share = (key) => shown.items.find((i) => i.key === key);

  step = "the shares are what the process counted";
  const expected = { weights: 8, gradients: 8, optimizer_state: 32, activations: 10, cache: 1, outside_allocator: 1 };
  for (const [key, gib] of Object.entries(expected)) {
    if (share(key)?.bytes !== gib * GIB) throw new Error(`${key}: ${JSON.stringify(share(key))}, expected ${gib} GiB`);
  }
  if (shown.total !== 60 * GIB) throw new Error(`total ${shown.total}`);
  if (!/bfloat16/.test(share("weights").text) || !/float32/.test(share("optimizer_state").text)) {
    throw new Error(`dtypes not shown: ${share("weights").text} | ${share("optimizer_state").text}`);
  }
  const largest = shown.items.filter((i) => i.largest).map((i) => i.key);
  if (largest.join() !== "optimizer_state" || !/optimizer state/i.test(shown.label)) {
    throw new Error(`largest share shown: ${largest.join()} (${shown.label})`);
  }

  step = "the parts are charted over time";
  await page.waitForFunction((p) => document.querySelector(`.comp-proc[data-pid="${p}"] canvas`) !== null, pid, { timeout: 15000 });
  await page.locator(`.comp-proc[data-pid="${pid}"]`).screenshot({ path: join(artifacts, "composition-python.png") });

  if (errors.length) throw new Error(`errors in the page: ${errors.join(" | ")}`);
  console.log(JSON.stringify({ ok: true }));
} catch (e) {
  await page.screenshot({ path: join(artifacts, "composition-failure.png"), fullPage: true }).catch(() => {});
  console.error(`step "${step}" failed: ${e.message}`);
  process.exitCode = 1;
} finally {
  await browser.close();
}
