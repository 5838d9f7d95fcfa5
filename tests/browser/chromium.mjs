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
