// A fleet over `[http] stream_devices_max` in a real browser: Debian's
// Chromium, driven by playwright-core. Usage: node fleet_nodes.mjs BASE_URL ARTIFACT_DIR
// Checks, against the collector's own API: the fleet view shows one cell
// per node (no device's), all on one 1440x900 screen, and the stream sends
// rows, not devices; the node of a device with a firing alert says so; the
// at-risk list starts with that device and counts the whole fleet; hover
// and keyboard reach a node and open its devices as tiles, streamed for
// that node alone; a GPU's page opened by its link loads that GPU and its
// node's processes without the fleet's lists, and a MIG GPU's its layout
// and its instances' processes; "whole fleet" goes back to
// the nodes; the user and job filters ask the collector for the matching
// processes and jobs, not the fleet's lists. Saves screenshots in ARTIFACT_DIR. Exits non-zero, naming the
// step, on the first failure.
import { fleetWithSamples, launchChromium, scriptArgs, watchedPage } from "./chromium.mjs";
import { join } from "node:path";

const [base, artifacts] = scriptArgs("fleet_nodes.mjs", ["BASE_URL", "ARTIFACT_DIR"]);

const browser = await launchChromium();
let step = "start";
const { page, errors } = await watchedPage(browser, { width: 1440, height: 900 });
const requests = [];
page.on("request", (r) => requests.push(r.url()));
const shot = (name) => page.screenshot({ path: join(artifacts, `${name}.png`) });
const api = (path) => page.evaluate(async (p) => (await fetch(p)).json(), path);

try {
  step = "every device of the fleet has a sample";
  await page.goto(base);
  const gpus = await fleetWithSamples(page, 320);
  const nodes = [...new Set(gpus.map((g) => g.node))].sort();

  step = "a cell per node, none per device, all on one screen";
  await page.goto(base);
  await page.waitForFunction((n) => document.querySelectorAll(".cell[data-node][data-sig]").length === n, nodes.length, { timeout: 30000 });
  const layout = await page.evaluate(() => {
    const cells = [...document.querySelectorAll("#fleet .cell")];
    const off = cells.filter((c) => { const r = c.getBoundingClientRect(); return r.top < 0 || r.left < 0 || r.bottom > innerHeight || r.right > innerWidth; });
    return { nodes: cells.map((c) => c.dataset.node), devices: cells.filter((c) => c.dataset.uuid).length, off: off.length,
      scope: window.__headroom.scope, held: window.__headroom.gpus.size, count: document.getElementById("f-count").textContent };
  });
  if (layout.scope !== "nodes") throw new Error(`the stream's scope is ${layout.scope}`);
  if (layout.devices) throw new Error(`${layout.devices} device cells in the node view`);
  if (nodes.some((n) => !layout.nodes.includes(n))) throw new Error(`cells for ${layout.nodes.length} of ${nodes.length} nodes`);
  if (layout.off) throw new Error(`${layout.off} node cells outside the 1440x900 window`);
  if (layout.held >= gpus.length / 4) throw new Error(`the page holds ${layout.held} devices: the stream sent more than those at risk`);
  if (!layout.count.includes(`${gpus.length} devices`)) throw new Error(`the count says: ${layout.count}`);

  step = "the node of a device with a firing alert says so";
  const active = await api("/api/v1/alerts?state=active");
  const firing = [...new Set(active.filter((a) => a.state === "firing" && a.labels.device_uuid).map((a) => a.labels.device_uuid))];
  if (firing.length === 0) throw new Error("no firing alert on a device to look for");
  const hot = gpus.find((g) => g.uuid === firing[0]);
  await page.waitForFunction((n) => {
    const c = document.querySelector(`.cell[data-node="${n}"]`);
    return c && c.classList.contains("firing") && /with an alert firing/.test(c.getAttribute("aria-label")) && !/\bOK\b/.test(c.getAttribute("aria-label"));
  }, hot.node, { timeout: 10000 });
  await shot("8-nodes");

  step = "the at-risk list starts with the alerting device and counts the whole fleet";
  await page.waitForFunction((u) => document.querySelector("#at-risk-list tr[data-uuid]")?.dataset.uuid === u, hot.uuid, { timeout: 10000 });
  const summary = await page.locator("#at-risk-list p").innerText();
  if (!new RegExp(`^\\d+ of ${gpus.length} devices at risk`).test(summary)) throw new Error(`the list says: ${summary}`);

  step = "hover shows a node's figures";
  await page.hover(`.cell[data-node="${hot.node}"]`);
  await page.waitForSelector("#cell-tip:not([hidden])", { timeout: 5000 });
  const tip = await page.locator("#cell-tip").innerText();
  if (!tip.includes(hot.node) || !/8 GPUs/.test(tip) || !/alert firing/.test(tip)) throw new Error(`tooltip says: ${tip}`);

  step = "the keyboard reaches a node and opens its devices";
  await page.mouse.move(0, 0);
  await page.focus("#fleet .cell[tabindex='0']");
  await page.keyboard.press("ArrowRight");
  const target = await page.evaluate(() => document.activeElement.dataset.node);
  if (target !== layout.nodes[1]) throw new Error(`after → focus is on ${target}, not the second node ${layout.nodes[1]}`);
  const seenBefore = requests.length;
  await page.keyboard.press("Enter");
  await page.waitForFunction((n) => new URLSearchParams(location.search).get("node") === n, target, { timeout: 5000 });
  await page.waitForFunction(() => window.__headroom.scope === "node" && document.querySelectorAll(".tile[data-sig]").length === 8, null, { timeout: 10000 });
  const scoped = await page.evaluate(() => ({ held: [...window.__headroom.gpus.values()].map((d) => d.node), summary: document.getElementById("summary").innerText }));
  if (scoped.held.length !== 8 || scoped.held.some((n) => n !== target)) throw new Error(`the node's page holds ${JSON.stringify(scoped.held)}`);
  if (!scoped.summary.includes(target)) throw new Error(`the summary says: ${scoped.summary}`);
  if (!requests.slice(seenBefore).some((u) => u.includes(`/api/v1/stream?node=${encodeURIComponent(target)}`))) throw new Error("no stream of the node's own was opened");
  await shot("9-node-devices");

  step = "a GPU's link loads that GPU, not the fleet's list";
  const far = gpus.find((g) => g.node !== target && g.kind === "gpu");
  const seenGpu = requests.length;
  await page.goto(`${base}/?gpu=${encodeURIComponent(far.uuid)}`);
  await page.waitForFunction(() => window.__headroom.charts.some((c) => c.headroomName === "memory"), null, { timeout: 15000 });
  const title = await page.title();
  if (!title.includes(far.node)) throw new Error(`the GPU page is titled ${title}`);
  await page.waitForSelector("#gpu-processes table.procs", { timeout: 10000 });
  const asked = requests.slice(seenGpu).map((u) => new URL(u)).filter((u) => ["/api/v1/gpus", "/api/v1/processes"].includes(u.pathname));
  const gpusAsked = asked.filter((u) => u.pathname === "/api/v1/gpus");
  const processesAsked = asked.filter((u) => u.pathname === "/api/v1/processes");
  if (!gpusAsked.length || gpusAsked.some((u) => !u.search.includes("uuid="))) throw new Error(`the page asked for ${asked.map(String)}`);
  if (!processesAsked.length || processesAsked.some((u) => u.searchParams.get("node") !== far.node)) throw new Error(`the page asked for ${asked.map(String)}`);

  step = "a MIG GPU's page in the node view draws its instances and their processes";
  const migGpu = gpus.find((g) => g.node === "gpu-mig" && g.kind === "gpu");
  if (!migGpu) throw new Error("no GPU of node gpu-mig");
  await page.goto(`${base}/?gpu=${encodeURIComponent(migGpu.uuid)}`);
  await page.waitForSelector("#gpu-processes table.procs", { timeout: 15000 });
  // Past a few of the stream's messages, each of which replaces the devices it holds.
  await page.waitForTimeout(2500);
  const mig = await page.evaluate(() => ({
    instances: [...document.querySelectorAll("#mig-layout svg.mig-layout text")].map((t) => t.textContent).filter((t) => /GI \d/.test(t)),
    processes: document.getElementById("gpu-processes").innerText,
  }));
  if (mig.instances.length !== 2) throw new Error(`the MIG layout shows ${JSON.stringify(mig.instances)}`);
  if (!["priya", "svc-nlp"].every((u) => mig.processes.includes(u))) throw new Error(`the processes table says: ${mig.processes}`);

  step = "from a node's page, the whole fleet again";
  await page.goto(`${base}/?node=${encodeURIComponent(target)}`);
  await page.waitForFunction(() => document.querySelectorAll(".tile[data-sig]").length === 8, null, { timeout: 10000 });
  await page.click("#summary a[href='/']");
  await page.waitForFunction((n) => window.__headroom.scope === "nodes" && document.querySelectorAll(".cell[data-node][data-sig]").length === n, nodes.length, { timeout: 10000 });
  const filter = await page.inputValue("#f-node");
  if (filter) throw new Error(`the node filter still says ${filter}`);

  step = "the user and job filters ask the collector for the matching processes only";
  const seenFilter = requests.length;
  await page.fill("#f-user", "priy");
  await page.waitForFunction(() => [...document.querySelectorAll("#fleet .cell[data-node]")].map((c) => c.dataset.node).join() === "gpu-mig", null, { timeout: 10000 });
  // A filter left set is read again, so that it follows jobs that start and end.
  await page.waitForTimeout(6000);
  const userReads = requests.slice(seenFilter).filter((u) => u.endsWith("/api/v1/processes?user=priy")).length;
  if (userReads < 2) throw new Error(`the user filter's processes were read ${userReads} times in 6 s`);
  await page.fill("#f-user", "");
  await page.fill("#f-job", "4100007");
  await page.waitForFunction(() => [...document.querySelectorAll("#fleet .cell[data-node]")].map((c) => c.dataset.node).join() === "gpu-007", null, { timeout: 10000 });
  // The job's bar is read beside its processes.
  for (let i = 0; i < 50 && !requests.slice(seenFilter).some((u) => u.includes("/api/v1/jobs?slurm_job_id=4100007")); i++) await page.waitForTimeout(100);
  const filterReads = requests.slice(seenFilter).map((u) => new URL(u)).filter((u) => ["/api/v1/processes", "/api/v1/jobs"].includes(u.pathname));
  const unfiltered = filterReads.filter((u) => !u.searchParams.get("user") && !u.searchParams.get("slurm_job_id"));
  if (unfiltered.length) throw new Error(`the filters read the fleet's lists: ${unfiltered.map(String)}`);
  const asks = (path, key, value) => filterReads.some((u) => u.pathname === path && u.searchParams.get(key) === value);
  if (!asks("/api/v1/processes", "user", "priy") || !asks("/api/v1/processes", "slurm_job_id", "4100007") || !asks("/api/v1/jobs", "slurm_job_id", "4100007")) {
    throw new Error(`the filters asked for ${filterReads.map(String)}`);
  }
  await page.fill("#f-job", "");
  await page.waitForFunction((n) => document.querySelectorAll("#fleet .cell[data-node]").length === n, nodes.length, { timeout: 10000 });

  if (errors.length) throw new Error(`errors in the page: ${errors.join(" | ")}`);
  console.log(JSON.stringify({ ok: true, nodes: layout.nodes.length, devices: gpus.length, held: layout.held, firing: firing.length }));
} catch (e) {
  await shot("failure-nodes").catch(() => {});
  console.error(`FAILED at "${step}": ${e.message}`);
  if (errors.length) console.error(`page errors: ${errors.join(" | ")}`);
  process.exitCode = 1;
} finally {
  await browser.close();
}
