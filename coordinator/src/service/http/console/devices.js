// The devices pages: a paged, filtered list of devices, and one device with its actions.
// Loaded before app.js, whose helpers (el, api, control, time, actionButton...) these use.
"use strict";

const DEVICE_PAGE = 50;
// Filters of the devices list: the URL's query (#/devices?phase=failed...) names them.
const DEVICE_FILTERS = ["select", "site", "phase", "online", "enrollment"];

// The API query for the filters in `params`: a site is the device label `site`.
function deviceQuery(params) {
  const q = new URLSearchParams();
  const select = [params.get("select"), params.get("site") ? "site=" + params.get("site") : ""].filter((s) => s).join(",");
  if (select) q.set("select", select);
  for (const k of ["phase", "online", "enrollment", "after"]) if (params.get(k)) q.set(k, params.get(k));
  q.set("limit", DEVICE_PAGE);
  return q;
}

function ago(seconds) {
  const s = Math.max(0, Math.floor(Date.now() / 1000) - seconds);
  if (s < 90) return s + " s ago";
  if (s < 5400) return Math.round(s / 60) + " min ago";
  if (s < 172800) return Math.round(s / 3600) + " h ago";
  return Math.round(s / 86400) + " days ago";
}

// Last seen: online now, or offline since; overdue when offline for longer than expected.
function lastSeen(d) {
  if (d.online) return el("span", { class: "online" }, "online");
  // Whether a device that is not accepted is connected is not known: its states are not trusted.
  if (d.enrollment && !d.enrollment.startsWith("accepted")) return el("span", { class: "muted" }, "not known");
  const cell = el("span", {}, d.last_seen ? "offline since " + ago(d.last_seen) : "offline");
  if (d.overdue) cell.append(" ", el("span", { class: "overdue", title: "offline for longer than expected" }, "overdue"));
  return cell;
}

// Filled when the route changes, never by a redraw: a live event that redraws the list must not
// wipe what the operator is typing.
function fillFilters(params) {
  for (const k of DEVICE_FILTERS) $("filter-" + k).value = params.get(k) || "";
}

function applyFilters(event) {
  if (event) event.preventDefault();
  const q = new URLSearchParams();
  for (const k of DEVICE_FILTERS) if ($("filter-" + k).value.trim()) q.set(k, $("filter-" + k).value.trim());
  location.hash = "#/devices" + (q.toString() ? "?" + q : "");
}

async function drawDevices(params) {
  const { status, reply } = await api("GET", "/api/v1/devices?" + deviceQuery(params));
  if (status === 401) return needLogin(reply && reply.error);
  $("devices-error").textContent = status === 200 ? "" : (reply && reply.error) || "the coordinator answered " + status;
  const rows = $("devices-rows");
  rows.replaceChildren();
  const page = (status === 200 && reply.result) || { items: [] };
  for (const d of page.items) {
    const action = d.rollout ? d.rollout + ": " + (d.phase || "") : "";
    rows.append(el("tr", { "data-device": d.id },
      el("td", {}, el("a", { href: "#/devices/" + encodeURIComponent(d.id) }, d.id)),
      el("td", {}, d.labels.site || ""), el("td", {}, d.installed || ""), el("td", {}, lastSeen(d)),
      el("td", { class: d.phase ? "state-" + d.phase : "" }, action), el("td", {}, d.reason || ""),
      el("td", {}, d.enrollment || "")));
  }
  if (!page.items.length) rows.append(el("tr", {}, el("td", { colspan: 7 }, "no devices match")));
  const more = $("devices-more");
  more.replaceChildren();
  if (params.get("after")) {
    const first = new URLSearchParams(params);
    first.delete("after");
    more.append(el("a", { href: "#/devices?" + first }, "first page"), " ");
  }
  if (page.next) {
    const next = new URLSearchParams(params);
    next.set("after", page.next);
    more.append(el("a", { href: "#/devices?" + next, id: "devices-next" }, "next page"));
  }
  show("devices");
}

// The enrollment buttons an admin may use on a device in `state` (its enrollment text).
function enrollmentButtons(id, state, fingerprint, errorId) {
  const out = [];
  if (!me || me.role !== "admin" || !state) return out;
  const pinned = fingerprint ? { key: fingerprint } : {};
  if (state === "pending" || state.endsWith("new key pending")) {
    out.push(actionButton("Accept", Object.assign({ command: "accept_device", device: id }, pinned), errorId));
    out.push(actionButton("Reject", Object.assign({ command: "reject_device", device: id }, pinned), errorId));
  }
  if (state.startsWith("accepted")) out.push(actionButton("Revoke", { command: "revoke_device", device: id }, errorId));
  return out;
}

function bytesText(b) {
  return b ? b.coordinator + " from the coordinator, " + b.peers + " from peers, " + b.local + " local" : "";
}

async function drawDevice(id) {
  const { status, reply } = await api("GET", "/api/v1/devices/" + encodeURIComponent(id));
  if (status === 401) return needLogin(reply && reply.error);
  $("device-name").textContent = id;
  const facts = $("device-facts");
  facts.replaceChildren();
  $("device-actions").replaceChildren();
  $("device-history").replaceChildren();
  if (status !== 200) {
    $("device-error").textContent = (reply && reply.error) || "the coordinator answered " + status;
    show("device");
    return;
  }
  $("device-error").textContent = "";
  const d = reply.result;
  const fact = (k, v) => facts.append(el("dt", {}, k), el("dd", { "data-fact": k }, v));
  fact("enrollment", d.enrollment || "");
  fact("key fingerprint", d.fingerprint || "");
  if (d.new_key) fact("waiting key", d.new_key);
  fact("hardware", d.hardware_id);
  fact("installed", d.installed || "nothing known");
  fact("last seen", lastSeen(d));
  fact("labels", Object.entries(d.labels).map(([k, v]) => k + "=" + v).join(", "));
  fact("bytes", bytesText(d.bytes));
  const pin = d.enrollment && d.enrollment.endsWith("new key pending") ? d.new_key : d.fingerprint;
  $("device-actions").append(...enrollmentButtons(d.id, d.enrollment, pin, "device-error"));
  const rows = $("device-history");
  for (const a of d.actions) {
    rows.append(el("tr", { "data-action": a.rollout },
      el("td", {}, el("a", { href: "#/rollouts/" + encodeURIComponent(a.rollout) }, a.rollout)),
      el("td", {}, a.release), el("td", {}, a.group), el("td", { class: "state-" + a.phase }, a.phase),
      el("td", {}, a.reason || ""), el("td", {}, a.attempt), el("td", {}, time(a.started_at)),
      el("td", {}, time(a.ended_at)), el("td", {}, bytesText(a.bytes))));
  }
  if (!d.actions.length) rows.append(el("tr", {}, el("td", { colspan: 9 }, "no rollout has held this device")));
  show("device");
}
