// What waits on a person: devices waiting to be accepted, and approval requests across all
// rollouts, newest first, with the buttons the operator's role may use.
"use strict";

const QUEUE_PAGE = 200;

async function drawQueues() {
  const [devices, approvals] = await Promise.all([
    api("GET", "/api/v1/enrollment?limit=" + QUEUE_PAGE),
    api("GET", "/api/v1/approvals?phase=pending&limit=" + QUEUE_PAGE),
  ]);
  const ended = [devices, approvals].find((a) => a.status === 401);
  if (ended) return needLogin(ended.reply && ended.reply.error);
  $("queues-error").textContent = [devices, approvals]
    .filter((r) => r.status !== 200).map((r) => (r.reply && r.reply.error) || "the coordinator answered " + r.status).join("; ");
  const waiting = (devices.status === 200 && devices.reply.result.items) || [];
  waiting.sort((a, b) => b.since - a.since);
  const rows = $("enrollment-rows");
  rows.replaceChildren();
  for (const p of waiting) {
    const key = p.new_key || p.key;
    const state = p.new_key ? p.status + ", new key pending" : p.status;
    const buttons = el("td", {}, ...enrollmentButtons(p.device, state, key.slice(0, 16), "queues-error").filter((b) => b.textContent !== "Revoke"));
    rows.append(el("tr", { "data-pending": p.device },
      el("td", {}, el("a", { href: "#/devices/" + encodeURIComponent(p.device) }, p.device)),
      el("td", {}, state), el("td", { class: "key" }, key.slice(0, 16)), el("td", {}, p.hardware_id || ""),
      el("td", {}, Object.entries(p.labels || {}).map(([k, v]) => k + "=" + v).join(", ")),
      el("td", {}, time(p.since)), buttons));
  }
  if (!waiting.length) rows.append(el("tr", {}, el("td", { colspan: 7 }, "no device is waiting")));
  if (devices.status === 200 && devices.reply.result.next) rows.append(el("tr", {}, el("td", { colspan: 7 }, "more are waiting: see flotilla devices pending")));

  const pending = (approvals.status === 200 && approvals.reply.result.items) || [];
  pending.sort((a, b) => b.created_at - a.created_at);
  const arows = $("queue-approval-rows");
  arows.replaceChildren();
  const may = me && me.role !== "viewer";
  for (const a of pending) {
    const buttons = el("td", {});
    if (may) {
      buttons.append(actionButton("Approve", { command: "approve", name: a.name }, "queues-error"),
        actionButton("Deny", { command: "deny", name: a.name, reason: "denied in the console by " + me.operator }, "queues-error"));
    }
    arows.append(el("tr", { "data-approval": a.name }, el("td", {}, a.name),
      el("td", {}, el("a", { href: "#/rollouts/" + encodeURIComponent(a.rollout) }, a.rollout)),
      el("td", {}, a.when + " " + a.group), el("td", {}, time(a.created_at)), buttons));
  }
  if (!pending.length) arows.append(el("tr", {}, el("td", { colspan: 5 }, "no approval is waiting")));
  show("queues");
}
