// Debian's Chromium (or $CHROMIUM), headless and quiet: no network of its
// own (updates, sync), so a test's traffic is only the page's.
import { chromium } from "playwright-core";

export function launchChromium() {
  return chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
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
