// Signing in to the dashboard in a real browser (Debian's Chromium, driven
// by playwright-core), against a collector with `[http_auth] mode = "tokens"`.
// Usage: node signin.mjs BASE_URL VIEWER_TOKEN ADMIN_TOKEN ARTIFACT_DIR
// A wrong token is refused on the form; a viewer reads but is offered no
// action; the cookie is out of scripts' reach; sign-out returns to the form;
// an admin expires a silence through the browser (the same-origin check
// lets the page's own change through). Exits non-zero, naming the step, on
// the first failure.
import { launchChromium, scriptArgs, watchedPage } from "./chromium.mjs";
import { join } from "node:path";

const [base, viewer, admin, artifacts] = scriptArgs("signin.mjs", ["BASE_URL", "VIEWER_TOKEN", "ADMIN_TOKEN", "ARTIFACT_DIR"]);

// A silence to look at and expire, made the way a script would: a bearer token.
const made = await fetch(`${base}/api/v1/silences`, {
  method: "POST",
  headers: { authorization: `Bearer ${admin}`, "content-type": "application/json" },
  body: JSON.stringify({ matchers: { node: "gpu-node-01" }, comment: "maintenance", ends_at_ms: Date.now() + 3_600_000 }),
});
if (made.status !== 201) throw new Error(`creating a silence: HTTP ${made.status}`);

const browser = await launchChromium();
let step = "start";
// Refusals are expected while signed out and for the wrong token; nothing
// else may fail.
let signedIn = false;
const { page, errors } = await watchedPage(browser, { width: 1200, height: 800 },
  (r) => r.status() === 401 && (r.url().endsWith("/api/v1/session") || !signedIn));
const shot = (name) => page.screenshot({ path: join(artifacts, `${name}.png`), fullPage: true });

async function signIn(token) {
  await page.fill("#token", token);
  signedIn = true;
  await Promise.all([page.waitForEvent("load"), page.click("#sign-in button[type=submit]")]);
}

try {
  step = "a signed-out visitor sees the sign-in form and no data";
  await page.goto(base);
  await page.waitForSelector("#sign-in", { timeout: 10000 });
  if (await page.locator(".tile").count() !== 0) throw new Error("tiles shown before sign-in");
  await shot("signin-1-form");

  step = "a wrong token is refused on the form";
  await page.fill("#token", "hrd_" + "0".repeat(64));
  await page.click("#sign-in button[type=submit]");
  await page.waitForFunction(() => /unknown or revoked/.test(document.getElementById("sign-in-error")?.textContent ?? ""), null, { timeout: 5000 });

  step = "a viewer reads the alerts view but is offered no action";
  await signIn(viewer);
  await page.waitForFunction(() => /carol · viewer/.test(document.getElementById("who")?.textContent ?? ""), null, { timeout: 5000 });
  const cookieSeen = await page.evaluate(() => document.cookie.includes("headroom_token"));
  if (cookieSeen) throw new Error("the sign-in cookie is readable by scripts");
  await page.goto(`${base}/?view=alerts`);
  await page.waitForFunction(() => /maintenance/.test(document.getElementById("silence-list")?.textContent ?? ""), null, { timeout: 5000 });
  if (await page.locator("button[data-expire]").count() !== 0) throw new Error("a viewer is offered to expire a silence");
  if (await page.locator("#operator").count() !== 0) throw new Error("a signed-in user is asked for a name");
  const by = await page.locator("#silence-list td").nth(1).innerText();
  if (by !== "alice") throw new Error(`the silence says it was made by ${by}, not the admin token's holder`);
  await shot("signin-2-viewer");

  step = "signing out returns to the form";
  signedIn = false;
  await Promise.all([page.waitForEvent("load"), page.click("#sign-out")]);
  await page.waitForSelector("#sign-in", { timeout: 5000 });

  step = "an admin expires the silence from the page";
  await signIn(admin);
  await page.goto(`${base}/?view=alerts`);
  await page.waitForSelector("button[data-expire]", { timeout: 5000 });
  await page.click("button[data-expire]");
  await page.waitForFunction(() => /none/.test(document.getElementById("silence-list")?.textContent ?? ""), null, { timeout: 5000 });
  await shot("signin-3-admin");

  if (errors.length) throw new Error(`page errors: ${errors.join("; ")}`);
  console.log(JSON.stringify({ ok: true }));
} catch (e) {
  await shot("signin-failed").catch(() => {});
  console.error(`FAILED at step "${step}": ${e.message}`);
  process.exitCode = 1;
} finally {
  await browser.close();
}
