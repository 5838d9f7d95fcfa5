// The page's session with the collector: every API read (getJson), the
// status line, the sign-in form and who is signed in. Owns the list of what
// to close on a sign-out (the stream registers itself).

import { esc } from "./format.js";
import { setSession, state } from "./state.js";

export async function getJson(url, options) {
  const r = await fetch(url, options);
  // Signed out meanwhile (token revoked, cookie expired): offer to sign in again.
  if (r.status === 401 && url !== "/api/v1/session") showSignIn(await r.json().catch(() => ({})));
  if (!r.ok) {
    let message = `HTTP ${r.status}`;
    try { message = (await r.json()).error || message; } catch (_) { /* not JSON */ }
    throw new Error(`${url}: ${message}`);
  }
  return r.json();
}

export function setStatus(text) { document.getElementById("status").textContent = text; }

// What holds a connection the server would refuse once signed out.
const closeOnSignOut = [];
export function onSignOut(close) { closeOnSignOut.push(close); }

// `[http_auth] mode = "tokens"`: a form for a dashboard token, which the
// server keeps in a cookie no script can read; "proxy": the proxy signs in.
export function showSignIn(answer) {
  for (const close of closeOnSignOut) close();
  setSession(null);
  setStatus("not signed in");
  document.getElementById("who").innerHTML = "";
  const view = document.getElementById("view");
  if (answer.auth !== "tokens") {
    view.innerHTML = `<h2>Not signed in</h2><p>${esc(answer.error || "sign in through your organisation's proxy, then reload")}</p>`;
    return;
  }
  view.innerHTML = `<h2>Sign in</h2>
    <form id="sign-in" class="controls">
      <label>dashboard token <input id="token" type="password" autocomplete="off" placeholder="hrd_…" size="40" required></label>
      <button type="submit">sign in</button>
    </form>
    <p class="muted">An operator makes one with <code>headroom-collector token create --role viewer --name you</code> (or <code>--role admin</code> to acknowledge and silence).</p>
    <p id="sign-in-error" class="text-crit" role="alert"></p>`;
  document.getElementById("sign-in").addEventListener("submit", async (e) => {
    e.preventDefault();
    const r = await fetch("/api/v1/session", { method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ token: document.getElementById("token").value }) });
    if (r.ok) { location.reload(); return; }
    const body = await r.json().catch(() => ({}));
    document.getElementById("sign-in-error").textContent = body.error || `HTTP ${r.status}`;
  });
}

export function showSession(session) {
  setSession(session.auth === "none" ? null : session);
  const who = document.getElementById("who");
  if (!state.session) { who.innerHTML = ""; return; }
  who.innerHTML = `${esc(session.user || "token")} · ${esc(session.role)}${session.auth === "tokens" ? ' <button class="small" id="sign-out">sign out</button>' : ""}`;
  const out = document.getElementById("sign-out");
  if (out) out.addEventListener("click", async () => { await fetch("/api/v1/session", { method: "DELETE" }); location.reload(); });
}
