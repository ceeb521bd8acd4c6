// The releases: signed manifests, their artifacts with sizes, types and block lists
// (collapsed), and how many devices run each and which rollouts use it.
"use strict";

const RELEASE_PAGE = 50;

function size(bytes) {
  if (bytes < 1024) return bytes + " B";
  if (bytes < 1048576) return (bytes / 1024).toFixed(1) + " KiB";
  return (bytes / 1048576).toFixed(1) + " MiB";
}

function blockList(a) {
  if (!a.block_size) return "no block list";
  const blocks = Math.ceil(a.size / a.block_size);
  return el("details", {}, el("summary", {}, blocks + (blocks === 1 ? " block of " : " blocks of ") + size(a.block_size)),
    el("code", {}, "block list sha256 " + a.block_list_sha256));
}

async function drawReleases(params) {
  const q = new URLSearchParams({ limit: RELEASE_PAGE });
  if (params.get("after")) q.set("after", params.get("after"));
  const { status, reply } = await api("GET", "/api/v1/releases?" + q);
  if (status === 401) return needLogin(reply && reply.error);
  $("releases-error").textContent = status === 200 ? "" : (reply && reply.error) || "the coordinator answered " + status;
  const list = $("release-list");
  list.replaceChildren();
  const page = (status === 200 && reply.result) || { items: [] };
  for (const r of page.items) {
    const artifacts = el("tbody", {});
    for (const a of r.artifacts) {
      artifacts.append(el("tr", {}, el("td", {}, a.name), el("td", {}, a.target), el("td", {}, a.type || "bytes"),
        el("td", {}, size(a.size)), el("td", { class: "key", title: a.sha256 }, a.sha256.slice(0, 16)), el("td", {}, blockList(a))));
    }
    const rollouts = r.rollouts && r.rollouts.length
      ? r.rollouts.flatMap((n, i) => [i ? ", " : "", el("a", { href: "#/rollouts/" + encodeURIComponent(n) }, n)])
      : ["none"];
    list.append(el("article", { class: "release", "data-release": r.name },
      el("h2", {}, r.name + " ", el("span", { class: "muted" }, "version " + r.version + " · counter " + r.counter + " · signed manifest")),
      el("p", {}, "runs on " + (r.devices == null ? "?" : r.devices) + " device" + (r.devices === 1 ? "" : "s") +
        " · hardware " + r.hardware.join(", ") + " · rollouts: ", ...rollouts),
      el("table", {}, el("thead", {}, el("tr", {}, ...["Artifact", "Target", "Type", "Size", "sha256", "Blocks"].map((h) => el("th", {}, h)))), artifacts)));
  }
  if (!page.items.length) list.append(el("p", {}, "no releases yet: make one with flotilla release create"));
  const more = $("releases-more");
  more.replaceChildren();
  if (params.get("after")) more.append(el("a", { href: "#/releases" }, "first page"), " ");
  if (page.next) more.append(el("a", { href: "#/releases?after=" + encodeURIComponent(page.next) }, "next page"));
  show("releases");
}
