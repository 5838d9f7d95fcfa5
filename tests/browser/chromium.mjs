// Debian's Chromium (or $CHROMIUM), headless and quiet: no network of its
// own (updates, sync), so a test's traffic is only the page's.
import { mkdirSync } from "node:fs";
import { chromium } from "playwright-core";

export function launchChromium() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
}

// A test script's arguments, in the order `names` gives them; any missing,
// its usage line and exit 2. ARTIFACT_DIR, where named, is made.
export function scriptArgs(script, names) {
  const values = process.argv.slice(2, 2 + names.length);
  if (values.length < names.length || values.some((v) => !v)) {
    console.error(`usage: node ${script} ${names.join(" ")}`);
    process.exit(2);
  }
  const artifacts = names.indexOf("ARTIFACT_DIR");
  if (artifacts >= 0) mkdirSync(values[artifacts], { recursive: true });
  return values;
}

// A page of `browser` at `viewport` and the list of what went wrong in it:
// its script errors, console errors (a failed load is counted by its
// response) and responses of 400 and above, unless `expected(response)`
// says the test asked for that one.
export async function watchedPage(browser, viewport, expected = () => false) {
  const page = await browser.newPage({ viewport });
  const errors = [];
  page.on("pageerror", (e) => errors.push(e.message));
  page.on("console", (m) => { if (m.type() === "error" && !m.text().startsWith("Failed to load resource")) errors.push(m.text()); });
  page.on("response", (r) => { if (r.status() >= 400 && !expected(r)) errors.push(`HTTP ${r.status()} for ${r.url()}`); });
  return { page, errors };
}

// Every device of the collector's fleet, once there are at least `count`
// and each has a sample (within 2 min): what a fleet test checks its page
// against. `page` must be on the collector's origin.
export async function fleetWithSamples(page, count) {
  const deadline = Date.now() + 120000;
  for (;;) {
    const gpus = await page.evaluate(async () => (await fetch("/api/v1/gpus")).json());
    if (gpus.length >= count && gpus.every((g) => g.latest)) return gpus;
    if (Date.now() > deadline) throw new Error(`${gpus.filter((g) => g.latest).length} of ${gpus.length} devices have a sample after 2 min`);
    await page.waitForTimeout(1000);
  }
}
