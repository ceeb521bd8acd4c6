// The flotilla console: reads through the HTTP API with a session, follows live events, and
// signs every change with the operator's own ed25519 key in this browser (WebCrypto). The key
// never leaves the browser: it is kept, not extractable, in IndexedDB. No build step.
"use strict";

const ROOT = document.querySelector('meta[name="flotilla-root"]').content;
const $ = (id) => document.getElementById(id);
let me = null; // { operator, role }
let view = { name: "list" };
let refreshTimer = null;
let events = null; // the live event stream, while logged in

// ---- the operator's key: IndexedDB and WebCrypto ------------------------------------------

function db() {
  return new Promise((resolve, reject) => {
    const open = indexedDB.open("flotilla", 1);
    open.onupgradeneeded = () => open.result.createObjectStore("keys");
    open.onsuccess = () => resolve(open.result);
    open.onerror = () => reject(open.error);
  });
}

async function storeKey(entry) {
  const d = await db();
  await new Promise((resolve, reject) => {
    const tx = d.transaction("keys", "readwrite");
    tx.objectStore("keys").put(entry, "operator");
    tx.oncomplete = resolve;
    tx.onerror = () => reject(tx.error);
  });
}

async function loadKey() {
  const d = await db();
  return new Promise((resolve, reject) => {
    const get = d.transaction("keys").objectStore("keys").get("operator");
    get.onsuccess = () => resolve(get.result || null);
    get.onerror = () => reject(get.error);
  });
}

async function forgetKey() {
  const d = await db();
  d.transaction("keys", "readwrite").objectStore("keys").delete("operator");
}

const hex = (bytes) => Array.from(new Uint8Array(bytes), (b) => b.toString(16).padStart(2, "0")).join("");
const unhex = (text) => new Uint8Array(text.match(/../g).map((h) => parseInt(h, 16)));
const b64url = (text) => Uint8Array.from(atob(text.replace(/-/g, "+").replace(/_/g, "/")), (c) => c.charCodeAt(0));

// A key file holds the 32-byte ed25519 seed in hex; WebCrypto takes it wrapped in PKCS#8.
async function importKeyFile(text) {
  const seed = text.trim();
  if (!/^[0-9a-fA-F]{64}$/.test(seed)) {
    throw new Error("this is not an operator key file: it should hold 64 hex digits");
  }
  const pkcs8 = new Uint8Array([...unhex("302e020100300506032b657004220420"), ...unhex(seed)]);
  const once = await crypto.subtle.importKey("pkcs8", pkcs8, { name: "Ed25519" }, true, ["sign"]);
  const jwk = await crypto.subtle.exportKey("jwk", once);
  const publicHex = hex(b64url(jwk.x));
  const key = await crypto.subtle.importKey("pkcs8", pkcs8, { name: "Ed25519" }, false, ["sign"]);
  return { key, publicHex };
}

function nonce() {
  return hex(crypto.getRandomValues(new Uint8Array(16)));
}

// A signed control request: the envelope of docs/protocol.md, over the exact request text.
async function signed(command) {
  const entry = await loadKey();
  if (!entry) throw new Error("no key in this browser: log in again");
  const id = "console-" + nonce();
  const text = JSON.stringify(Object.assign({
    id,
    reply_to: ROOT + "/v1/control/reply/" + id,
    at: Math.floor(Date.now() / 1000),
    nonce: nonce(),
  }, command));
  const signature = await crypto.subtle.sign({ name: "Ed25519" }, entry.key, new TextEncoder().encode(text));
  return JSON.stringify({ request: text, key: entry.publicHex, signature: hex(signature) });
}

// ---- the API -------------------------------------------------------------------------------

async function api(method, path, body) {
  const init = { method, credentials: "same-origin", headers: {} };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = body;
  }
  const response = await fetch(path, init);
  let reply = null;
  try { reply = await response.json(); } catch (_) { reply = null; }
  return { status: response.status, reply };
}

async function control(command) {
  const { status, reply } = await api("POST", "/api/v1/control", await signed(command));
  if (status !== 200 || !reply || !reply.ok) {
    throw new Error((reply && reply.error) || "the coordinator answered " + status);
  }
  return reply.result;
}

// ---- drawing -------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k.startsWith("on")) node.addEventListener(k.slice(2), v); else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(child == null ? "" : String(child)));
  return node;
}

function time(seconds) {
  return seconds ? new Date(seconds * 1000).toISOString().replace(".000Z", "Z") : "";
}

// Ready, failed and canceled drawn apart: a failed group never looks done.
function bar(counts) {
  const total = counts.total || 1;
  // Widths through the CSSOM: the page's policy forbids inline style attributes.
  const part = (n, cls, what) => {
    const span = el("span", { class: cls, title: n + " " + what });
    span.style.width = (100 * n / total) + "%";
    return span;
  };
  return el("div", { class: "bar", role: "img", "aria-label": counts.ready + " ready, " + counts.failed + " failed of " + counts.total },
    part(counts.ready, "ready", "ready"), part(counts.failed, "failed", "failed"),
    part(counts.canceled, "canceled", "canceled"), part(counts.in_progress, "running", "running"));
}

function totals(status) {
  const t = { total: 0, ready: 0, failed: 0, canceled: 0, in_progress: 0, scheduled: 0 };
  for (const g of status.groups) for (const k of Object.keys(t)) t[k] += g[k] || 0;
  return t;
}

function startedBy(status) {
  const started = (status.trace || []).find((t) => t.kind === "started");
  return started && started.by ? started.by : "";
}

// The page's sections; the pages of devices.js, queues.js and releases.js add theirs.
const SECTIONS = ["login", "rollouts", "rollout", "devices", "device", "queues", "releases"];

function show(section) {
  for (const id of SECTIONS) $(id).hidden = id !== section;
  $("nav").hidden = section === "login";
  for (const link of document.querySelectorAll("#nav a")) {
    link.classList.toggle("here", link.dataset.page === section || link.dataset.page + "s" === section);
  }
}

async function drawList() {
  const { status, reply } = await api("GET", "/api/v1/rollouts?limit=200");
  if (status === 401) return needLogin(reply && reply.error);
  const rows = $("rollout-rows");
  rows.replaceChildren();
  for (const r of (reply && reply.result && reply.result.items) || []) {
    const t = totals(r);
    const started = r.groups.filter((g) => g.state !== "scheduled").length;
    rows.append(el("tr", { "data-rollout": r.name },
      el("td", {}, el("a", { href: "#/rollouts/" + encodeURIComponent(r.name) }, r.name)),
      el("td", {}, r.release), el("td", {}, r.strategy),
      el("td", { class: "state-" + r.state }, r.state),
      el("td", {}, "group " + started + " of " + r.groups.length),
      el("td", {}, t.ready + " ready, " + t.failed + " failed, " + t.in_progress + " running of " + t.total),
      el("td", {}, bar(t)), el("td", {}, startedBy(r))));
  }
  show("rollouts");
}

// A button that signs `command`, posts it and redraws; a refusal is shown in `errorId`.
function actionButton(label, command, errorId) {
  const where = () => $(errorId || "action-error");
  return el("button", { onclick: async () => {
    where().textContent = "";
    try { await control(command); await refresh(); } catch (e) { where().textContent = label + ": " + e.message; }
  } }, label);
}

async function drawRollout(name) {
  const { status, reply } = await api("GET", "/api/v1/rollouts/" + encodeURIComponent(name) + "?limit=200");
  if (status === 401) return needLogin(reply && reply.error);
  if (status !== 200) {
    $("rollout-name").textContent = name;
    $("rollout-summary").textContent = (reply && reply.error) || "not found";
    show("rollout");
    return;
  }
  const r = reply.result.status;
  const t = totals(r);
  $("rollout-name").textContent = r.name;
  $("rollout-summary").replaceChildren(
    el("span", { class: "state-" + r.state, id: "rollout-state" }, r.state), " · release " + r.release + " · " + r.strategy +
    " · " + t.ready + " ready, " + t.failed + " failed, " + t.in_progress + " running of " + t.total +
    (r.bytes ? " · bytes " + r.bytes.coordinator + " from the coordinator, " + r.bytes.peers + " from peers, " + r.bytes.local + " local" + (r.bytes.http ? ", " + r.bytes.http + " from http" : "") : ""));
  $("rollout-waiting").textContent = r.waiting ? "waiting: " + r.waiting : "";
  const actions = $("rollout-actions");
  actions.replaceChildren();
  const may = me && me.role !== "viewer";
  if (may) {
    const on = (states, label, command) => { if (states.includes(r.state)) actions.append(actionButton(label, command)); };
    on(["ready"], "Start", { command: "start_rollout", rollout: r.name });
    on(["scheduled", "running"], "Pause", { command: "pause_rollout", rollout: r.name });
    on(["paused"], "Resume", { command: "resume_rollout", rollout: r.name });
    on(["ready", "scheduled", "running", "paused"], "Stop", { command: "stop_rollout", rollout: r.name });
    on(["running"], "Next group", { command: "trigger_next", rollout: r.name });
    if (t.failed > 0) on(["paused", "stopped", "finished", "failed"], "Retry failed", { command: "retry_rollout", rollout: r.name });
  }
  const approvals = $("approval-rows");
  approvals.replaceChildren();
  for (const a of r.approvals || []) {
    const state = a.approved ? "approved " + time(a.approved_at) : a.denied ? "denied by " + a.denied : a.withdrawn ? "withdrawn" : "pending since " + time(a.created_at);
    const buttons = el("td", {});
    if (may && !a.approved && !a.denied && !a.withdrawn) {
      buttons.append(actionButton("Approve", { command: "approve", name: a.name }),
        actionButton("Deny", { command: "deny", name: a.name, reason: "denied in the console by " + me.operator }));
    }
    approvals.append(el("tr", { "data-approval": a.name }, el("td", {}, a.name), el("td", {}, a.group), el("td", {}, a.when), el("td", {}, state), buttons));
  }
  const groups = $("group-rows");
  groups.replaceChildren();
  for (const g of r.groups) {
    groups.append(el("tr", {}, el("td", {}, g.name), el("td", { class: "state-" + g.state }, g.state), el("td", {}, g.ready), el("td", {}, g.failed),
      el("td", {}, g.in_progress), el("td", {}, g.scheduled), el("td", {}, g.canceled), el("td", {}, bar(g))));
  }
  const devices = $("device-rows");
  devices.replaceChildren();
  for (const d of reply.result.items || []) {
    devices.append(el("tr", { "data-device": d.id }, el("td", {}, d.id), el("td", {}, d.group), el("td", {}, d.phase), el("td", {}, d.reason || "")));
  }
  const trace = $("trace");
  trace.replaceChildren();
  for (const entry of (r.trace || []).slice().reverse()) {
    trace.append(el("li", {}, time(entry.at) + "  " + entry.message));
  }
  show("rollout");
}

async function refresh() {
  if (!me) return;
  const pages = {
    rollout: () => drawRollout(view.rollout),
    devices: () => drawDevices(view.query),
    device: () => drawDevice(view.device),
    queues: () => drawQueues(),
    releases: () => drawReleases(view.query),
  };
  await (pages[view.name] || drawList)();
}

// Many events in a burst make one redraw. The coordinator sends a changed rollout at most every
// 200 ms, so a short wait is enough to gather what comes together (a rollout and its trace).
function soon() {
  if (refreshTimer) return;
  refreshTimer = setTimeout(() => { refreshTimer = null; refresh(); }, 50);
}

// ---- login, routing, live events -----------------------------------------------------------

// The login form, saying why when a session ended (`reason`: the coordinator's 401 answer,
// whichever request of the page met it first); none when the operator logged out.
function needLogin(reason) {
  me = null;
  // A stream of a session that ended would only reconnect to be refused.
  if (events) { events.close(); events = null; }
  if (retryTimer) { clearTimeout(retryTimer); retryTimer = null; }
  $("banner").hidden = true;
  $("live").textContent = "offline"; $("live").classList.remove("on");
  $("who").textContent = "";
  $("logout").hidden = true;
  $("login-error").textContent = reason || "";
  show("login");
}

async function login() {
  $("login-error").textContent = "";
  try {
    const file = $("keyfile").files[0];
    if (!file) throw new Error("choose your key file first");
    await storeKey(await importKeyFile(await file.text()));
    const { status, reply } = await api("POST", "/api/v1/session", await signed({ command: "login" }));
    if (status !== 200) throw new Error((reply && reply.error) || "the coordinator answered " + status);
    await start();
  } catch (e) {
    $("login-error").textContent = e.message;
  }
}

async function logout() {
  await api("DELETE", "/api/v1/session");
  await forgetKey();
  needLogin();
}

// The stream dropped (the server ends each stream after a while, a restart, a failover, the
// network): ask whether the coordinator and the session are still there. Yes: follow again,
// quietly. No answer: a banner says so, and it asks again with a growing pause. The session
// gone: the login, with the coordinator's reason. No new login while the session lives.
let retryTimer = null;
let retryDelay = 1000;

function unreachable() {
  if (events) { events.close(); events = null; }
  $("live").textContent = "reconnecting"; $("live").classList.remove("on");
  if (!retryTimer) retryTimer = setTimeout(reconnect, 0);
}

async function reconnect() {
  retryTimer = null;
  let answer = null;
  try { answer = await api("GET", "/api/v1/session"); } catch (_) { answer = null; }
  if (answer && answer.status === 401) {
    return needLogin((answer.reply && answer.reply.error) || "your session ended; log in again");
  }
  if (!answer || answer.status !== 200) {
    $("live").textContent = "offline";
    $("banner").textContent = "coordinator unreachable, retrying\u2026";
    $("banner").hidden = false;
    retryTimer = setTimeout(reconnect, retryDelay);
    retryDelay = Math.min(retryDelay * 2, 8000);
    return;
  }
  retryDelay = 1000;
  $("banner").hidden = true;
  follow();
  refresh();
}

function follow() {
  if (events) return;
  events = new EventSource("/api/v1/events");
  events.onopen = () => { $("live").textContent = "live"; $("live").classList.add("on"); };
  events.onerror = unreachable;
  for (const kind of ["rollout", "approval", "trace"]) events.addEventListener(kind, soon);
}

// Hash routes: #/ (rollouts), #/rollouts/NAME, #/devices?FILTERS, #/devices/ID, #/queues,
// #/releases?after=CURSOR.
function route() {
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const params = new URLSearchParams(query || "");
  let m;
  if ((m = path.match(/^\/rollouts\/(.+)$/))) view = { name: "rollout", rollout: decodeURIComponent(m[1]) };
  else if ((m = path.match(/^\/devices\/(.+)$/))) view = { name: "device", device: decodeURIComponent(m[1]) };
  else if (path === "/devices") { view = { name: "devices", query: params }; fillFilters(params); }
  else if (path === "/queues") view = { name: "queues" };
  else if (path === "/releases") view = { name: "releases", query: params };
  else view = { name: "list" };
  refresh();
}

async function start() {
  const { status, reply } = await api("GET", "/api/v1/session");
  // A cookie that names no session any more: say why (expired, revoked); no cookie: just log in.
  if (status !== 200) {
    const why = reply && reply.error;
    return needLogin(status === 401 && why && !why.startsWith("no session:") ? why : "");
  }
  me = reply;
  $("who").textContent = me.operator + " (" + me.role + ")";
  $("logout").hidden = false;
  follow();
  route();
}

$("device-filters").addEventListener("submit", applyFilters);
$("login-button").addEventListener("click", login);
$("logout").addEventListener("click", logout);
window.addEventListener("hashchange", route);
// A page left for another stays in the browser's back-forward cache with its stream open, and
// the browser opens at most six connections to one host: close the stream when the page is
// hidden that way, and follow again when it is shown.
window.addEventListener("pagehide", () => { if (events) { events.close(); events = null; } });
window.addEventListener("pageshow", (e) => { if (e.persisted && me) { follow(); refresh(); } });
start();
