// Routing: which view the URL names, the nav's active link, and the
// generation that keeps a view's late answers off the next one. Owns
// `currentView` and `routeGen` (read them through the live bindings); the
// views are handed to it at start (`setViews`), so that they may import it.

import { esc } from "./format.js";
import { dropCharts } from "./state.js";

export let currentView = null;
// Bumped on every navigation: a view whose data arrives after the user
// moved on must not draw over the next one.
export let routeGen = 0;
// name → { show(view, params, gen), updated(change)? }: what each view draws,
// and how it follows a stream message while shown.
let views = {};
const viewOf = (name) => Object.hasOwn(views, name) ? views[name] : null;
export function setViews(table) { views = table; }
export const isCurrent = (gen) => gen === routeGen;
export function params() { return new URLSearchParams(location.search); }

export function navigate(url) {
  history.pushState(null, "", url);
  route();
}

document.addEventListener("click", (e) => {
  const a = e.target.closest("a[href^='/']");
  if (!a || e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return;
  e.preventDefault();
  navigate(a.getAttribute("href"));
});
window.addEventListener("popstate", route);

export function route() {
  dropCharts();
  const p = params();
  currentView = p.get("gpu") ? "gpu" : (p.get("view") || "fleet");
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.view === currentView);
  const view = document.getElementById("view");
  view.innerHTML = "";
  const gen = ++routeGen;
  const show = (viewOf(currentView) || views.fleet).show;
  show(view, p, gen).catch((err) => { if (isCurrent(gen)) view.innerHTML = `<p class="text-crit">${esc(err.message)}</p>`; });
}

// A stream message arrived: the view shown follows it, where it does.
export function viewUpdated(change) {
  const v = viewOf(currentView);
  if (v && v.updated) v.updated(change);
}
