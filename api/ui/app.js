// The service's page: every figure comes from a public API route called with the key the user signs in with
// (kept in sessionStorage), so the page can show nothing that key could not read itself. Plain DOM, no build.
"use strict";

const KEY = "packscore.key";
const POLL_MS = 2000;
// The API's root: the page is served at <root>/ui/, behind a proxy's path prefix too.
const ROOT = location.pathname.replace(/\/ui(\/.*)?$/, "");
const JOB_STATUSES = ["queued", "running", "succeeded", "failed", "cancelled"];
const BATCH_STATUSES = ["validating", "in_progress", "cancelling", "completed", "cancelled", "failed"];
const ENDED = new Set(["succeeded", "failed", "cancelled", "completed"]);

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// A call with the key; an error answer throws the API's own message (`{"error": {"code", "message"}}`).
async function api(path, { method = "GET", key = sessionStorage.getItem(KEY), as = "json", accept = [] } = {}) {
  const response = await fetch(ROOT + path, { method, headers: key ? { Authorization: `Bearer ${key}` } : {} });
  if (!response.ok && !accept.includes(response.status)) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON: the status line says it */ }
    throw new ApiError(response.status, message);
  }
  return as === "text" ? response.text() : as === "blob" ? response.blob() : response.json();
}

// Elements built from data with textContent only: a job's metadata or error message is never parsed as HTML.
function h(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else element.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child !== null && child !== undefined) element.append(child instanceof Node ? child : String(child));
  }
  return element;
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  const s = Math.round(value);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

const since = (when) => (when ? (Date.now() - Date.parse(when)) / 1000 : null);

function bar(done, total, label) {
  const text = total === null || total === undefined ? `${done} / ?` : `${done} / ${total}`;
  const attributes = { max: total || 1, "aria-label": `${label}: ${text}` };
  if (total !== null && total !== undefined) attributes.value = done;  // no value: indeterminate
  return h("span", { class: "progress" }, h("progress", attributes), h("span", {}, text));
}

// Items (or rows) per second since the work started, while it runs.
function rate(done, started, status) {
  const elapsed = since(started);
  const running = status === "running" || status === "in_progress";
  return running && elapsed > 0 ? `${(done / elapsed).toFixed(1)}/s` : "–";
}

function table(caption, headings, rows, empty) {
  if (!rows.length) return h("p", { class: "empty" }, empty);
  for (const row of rows) {  // each cell names its column: a phone's width shows the rows as stacked fields
    [...row.children].forEach((cell, i) => cell.setAttribute("data-label", headings[i]));
  }
  return h("div", { class: "scroll", tabindex: "0", role: "region", "aria-label": caption },
    h("table", {}, h("caption", {}, caption),
      h("thead", {}, h("tr", {}, headings.map((t) => h("th", { scope: "col" }, t)))), h("tbody", {}, rows)));
}

function fields(pairs) {
  return h("dl", {}, pairs.filter(([, value]) => value !== null && value !== undefined && value !== "")
    .map(([name, value]) => [h("dt", {}, name), h("dd", {}, value)]));
}

const badge = (status) => h("span", { class: `status ${status}` }, status.replace("_", " "));

// --- rendering and polling: one view at a time; a view's poll stops when another view starts.

let generation = 0;

function show(title, ...content) {
  const main = document.getElementById("main");
  main.replaceChildren(h("h1", { tabindex: "-1" }, title), ...content);
}

// Replaces a view's polled content, keeping keyboard focus on the same link or button across polls.
function refresh(container, ...children) {
  const focused = container.contains(document.activeElement) ? document.activeElement : null;
  const href = focused && focused.getAttribute("href");
  const selector = focused && focused.id ? `#${CSS.escape(focused.id)}` : href ? `[href="${CSS.escape(href)}"]` : null;
  container.replaceChildren(...children.filter((child) => child !== null && child !== undefined));
  const again = selector && container.querySelector(selector);
  if (again) again.focus();
}

function alertBox() {
  return h("p", { id: "error", role: "alert", class: "error", hidden: true });
}

function showError(error) {
  if (error instanceof ApiError && error.status === 401) {  // the key stopped working: sign in again
    sessionStorage.removeItem(KEY);
    signIn(error.message);
    return;
  }
  const box = document.getElementById("error");
  if (box) {
    box.textContent = error.message;
    box.hidden = false;
  }
}

// Runs `update` now and every POLL_MS while this view is shown; `update` returns false to stop (the work ended).
function poll(update) {
  const mine = ++generation;
  const tick = async () => {
    if (mine !== generation) return;
    let again = true;
    try {
      again = (await update(() => mine === generation)) !== false;
      const box = document.getElementById("error");
      if (box && mine === generation) box.hidden = true;
    } catch (error) {
      if (mine === generation) showError(error);
    }
    if (again && mine === generation) setTimeout(tick, POLL_MS);
  };
  tick();
}

// --- sign-in

function signIn(message) {
  generation++;
  document.getElementById("nav").hidden = true;
  const input = h("input", { id: "key", name: "key", type: "password", autocomplete: "off", required: true,
    placeholder: "psk_…" });
  const error = h("p", { id: "error", role: "alert", class: "error", hidden: !message }, message || "");
  const form = h("form", { id: "sign-in", onsubmit: async (event) => {
    event.preventDefault();
    try {
      await api("/v1/models", { key: input.value.trim() });  // any key-authenticated route checks the key
      sessionStorage.setItem(KEY, input.value.trim());
      route();
    } catch (failure) {
      error.textContent = failure.message;
      error.hidden = false;
    }
  } }, h("label", { for: "key" }, "API key"), input, h("button", { type: "submit" }, "Sign in"),
  h("p", { class: "hint" }, "Kept in this tab's session storage only; `packscore create-key` makes one."));
  show("Sign in", form, error);
  input.focus();
}

// --- jobs and batches

function listView() {
  const jobFilter = h("select", { id: "job-status", "aria-label": "Jobs' status" },
    h("option", { value: "" }, "all"), JOB_STATUSES.map((s) => h("option", { value: s }, s)));
  const batchFilter = h("select", { id: "batch-status", "aria-label": "Batches' status" },
    h("option", { value: "" }, "all"), BATCH_STATUSES.map((s) => h("option", { value: s }, s.replace("_", " "))));
  const jobs = h("section", { id: "jobs" });
  const batches = h("section", { id: "batches" });
  show("Jobs and batches", alertBox(),
    h("h2", {}, "Batches"), h("label", { class: "filter" }, "Status ", batchFilter), batches,
    h("h2", {}, "Jobs"), h("label", { class: "filter" }, "Status ", jobFilter), jobs);
  const update = async (current) => {
    const status = jobFilter.value ? `&status=${jobFilter.value}` : "";
    const [jobList, batchList] = await Promise.all([api(`/jobs?limit=50${status}`), api("/batches?limit=50")]);
    if (!current()) return;
    refresh(batches, table("Batches, newest first", ["Batch", "Model", "Status", "Progress", "Rate", "ETA",
      "Age", "Errors"], batchList.data.filter((b) => !batchFilter.value || b.status === batchFilter.value)
      .map(batchRow), "No batches."));
    refresh(jobs, table("Jobs, newest first", ["Job", "Kind", "Model", "Status", "Progress", "Rate", "ETA",
      "Age", "Error"], jobList.data.map(jobRow), "No jobs."));
  };
  jobFilter.addEventListener("change", () => poll(update));
  batchFilter.addEventListener("change", () => poll(update));
  poll(update);
}

function batchRow(batch) {
  const done = batch.rows ? batch.rows.done : batch.progress.items_done;
  const total = batch.rows ? batch.rows.total : batch.progress.items_total;
  const failed = batch.rows ? batch.rows.failed : batch.counts.failed;
  return h("tr", { "data-id": batch.id }, h("td", {}, h("a", { href: `#/batches/${batch.id}` }, batch.id)),
    h("td", {}, batch.model), h("td", {}, badge(batch.status)),
    h("td", {}, bar(done, total, batch.rows ? "rows" : "items")), h("td", {}, rate(done, batch.in_progress_at,
      batch.status)), h("td", {}, seconds(batch.eta_seconds)), h("td", {}, seconds(since(batch.created_at))),
    h("td", {}, batch.error ? batch.error.message : failed ? `${failed} failed` : ""));
}

function jobRow(job) {
  return h("tr", { "data-id": job.id }, h("td", {}, h("a", { href: `#/jobs/${job.id}` }, job.id)),
    h("td", {}, job.kind), h("td", {}, job.model), h("td", {}, badge(job.status)),
    h("td", {}, bar(job.progress.items_done, job.progress.items_total, "items")),
    h("td", {}, rate(job.progress.items_done, job.started_at, job.status)), h("td", {}, seconds(job.eta_seconds)),
    h("td", {}, seconds(since(job.created_at))), h("td", {}, job.error ? job.error.message : ""));
}

// --- one job

function webhookFields(webhook, url) {
  if (!webhook) return h("p", { class: "empty" }, url ? `To ${url}: none yet.` : "No webhook.");
  return fields([["URL", webhook.url], ["Status", badge(webhook.status)], ["Attempts", webhook.attempts],
    ["Last HTTP status", webhook.last_status_code], ["Last error", webhook.last_error],
    ["Delivered", webhook.delivered_at]]);
}

function jobView(id) {
  const body = h("div", { id: "job" });
  show(`Job ${id}`, alertBox(), body);
  poll(async (current) => {
    const job = await api(`/jobs/${encodeURIComponent(id)}`);
    if (!current()) return;
    const cancel = ENDED.has(job.status) ? null : h("button", { type: "button", id: "cancel", onclick: async () => {
      if (!confirm(`Cancel job ${job.id}?`)) return;
      try { await api(`/jobs/${encodeURIComponent(id)}/cancel`, { method: "POST" }); } catch (e) { showError(e); }
    } }, "Cancel job");
    refresh(body, fields([["Status", badge(job.status)], ["Kind", job.kind], ["Model", job.model],
      ["Progress", bar(job.progress.items_done, job.progress.items_total, "items")],
      ["Rate", rate(job.progress.items_done, job.started_at, job.status)], ["ETA", seconds(job.eta_seconds)],
      ["Created", job.created_at], ["Started", job.started_at], ["Finished", job.finished_at],
      ["Attempts", job.attempts], ["Prompt tokens", job.usage.prompt_tokens],
      ["Error", job.error ? `${job.error.code}: ${job.error.message}` : null],
      ["Metadata", job.metadata ? JSON.stringify(job.metadata) : null]]), cancel,
    h("h2", {}, "Results"), results(job),
    h("h2", {}, "Webhook deliveries"), webhookFields(job.webhook, job.webhook_url));
    return !ENDED.has(job.status) || (job.webhook && job.webhook.status === "pending");
  });
}

function results(job) {
  if (job.results) {
    return table("Ranked documents", ["Rank", "Document", "Relevance"], job.results.map((r, rank) =>
      h("tr", {}, h("td", {}, rank + 1), h("td", {}, r.document ? r.document.text : `#${r.index}`),
        h("td", {}, r.relevance_score.toFixed(4)))), "No results.");
  }
  if (job.scores) {
    const shown = job.scores.slice(0, 200);
    return h("div", {}, table("Scores per item (one column per label)", ["Item", "Scores"], shown.map((s, i) =>
      h("tr", {}, h("td", {}, i), h("td", {}, s.map((v) => v.toFixed(4)).join("  ")))), "No items."),
    job.scores.length > shown.length ? h("p", {}, `The first ${shown.length} of ${job.scores.length} items.`) : null);
  }
  return h("p", { class: "empty" }, ENDED.has(job.status) ? "No results." : "Once it has succeeded.");
}

// --- one batch

function batchView(id) {
  const body = h("div", { id: "batch" });
  show(`Batch ${id}`, alertBox(), body);
  const path = `/batches/${encodeURIComponent(id)}`;
  const update = async (current) => {
    const batch = await api(path);
    if (!current()) return;
    const cancel = ENDED.has(batch.status) ? null : h("button", { type: "button", id: "cancel", onclick: async () => {
      if (!confirm(`Cancel batch ${batch.id}? Requests not started are cancelled; finished ones keep their results.`))
        return;
      try {
        await api(`${path}/cancel`, { method: "POST" });
        poll(update);  // at once, not at the next tick
      } catch (e) { showError(e); }
    } }, "Cancel batch");
    const download = h("button", { type: "button", id: "download", onclick: async () => {
      try {
        const blob = await api(`${path}/results`, { as: "blob" });
        const link = h("a", { href: URL.createObjectURL(blob), download: `${batch.id}.jsonl` });
        link.click();
        URL.revokeObjectURL(link.href);
      } catch (e) { showError(e); }
    } }, ENDED.has(batch.status) ? "Download results (JSONL)" : "Download results so far (JSONL)");
    const done = batch.rows ? batch.rows.done : batch.progress.items_done;
    const total = batch.rows ? batch.rows.total : batch.progress.items_total;
    const c = batch.chunks;
    refresh(body, fields([["Status", badge(batch.status)], ["Model", batch.model],
      ["Progress", bar(done, total, batch.rows ? "rows" : "items")],
      ["Rate", rate(done, batch.in_progress_at, batch.status)], ["ETA", seconds(batch.eta_seconds)],
      ["Requests", `${batch.counts.succeeded} succeeded, ${batch.counts.failed} failed, ` +
        `${batch.counts.cancelled} cancelled of ${batch.counts.total}`],
      ["Input", batch.input ? [batch.input].flat().join(", ") : "uploaded"], ["Output", batch.output],
      ["Manifest", batch.manifest], ["Created", batch.created_at], ["Started", batch.in_progress_at],
      ["Finished", batch.finished_at], ["Error", batch.error ? `${batch.error.code}: ${batch.error.message}` : null],
      ["Metadata", batch.metadata ? JSON.stringify(batch.metadata) : null]]),
    h("p", { class: "actions" }, download, " ", cancel),
    h("h2", {}, "Chunks"), c ? table("Chunks by state", ["Done", "In flight", "Failed", "Cancelled", "Total"],
      [h("tr", {}, h("td", {}, c.done), h("td", {}, c.in_flight), h("td", {}, c.failed), h("td", {}, c.cancelled),
        h("td", {}, `${c.total}${c.total_final ? "" : " so far"}`))], "")
      : h("p", { class: "empty" }, "An uploaded batch: one job per request, counted above."),
    h("h2", {}, "Webhook deliveries"), webhookFields(batch.webhook, batch.webhook_url));
    return !ENDED.has(batch.status);
  };
  poll(update);
}

// --- workers: /workers lists each live worker with its last minute's passes and the hour's items/s per minute;
// /readyz the deployment's state, /v1/models each model's workers, /metrics the queue

// Prometheus' text format: "name{label="value",...} number" lines.
function metrics(text) {
  const found = [];
  for (const line of text.split("\n")) {
    const match = /^([a-z_:]+)(?:\{(.*)\})? ([-+0-9.eEnaNIf]+)$/.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, name, value] of (match[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[name] = value;
    found.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return found;
}

const total = (samples, name) => samples.filter((s) => s.name === name).reduce((sum, s) => sum + s.value, 0);
const sum = (rows, key) => rows.reduce((s, row) => s + row[key], 0);

function chips(group) {  // "tpu:0,1" as `packscore worker --devices` names a group; none: the process's own
  if (!group) return "the host's own";
  return group.includes(":") ? group.split(":", 2)[1] : "–";
}

// Items/s per minute over the last hour, from the service's own record of its passes (GET /workers).
function chart(points, history) {
  if (!points.length) return h("p", { class: "empty" }, "No passes recorded yet.");
  const width = 600, height = 120, top = Math.max(1, ...points.map((p) => p.items_per_second));
  const step = points.length > 1 ? width / (points.length - 1) : width;
  const xy = points.map((p, i) => `${(points.length > 1 ? i * step : width).toFixed(1)},` +
    `${(height - 3 - (height - 8) * p.items_per_second / top).toFixed(1)}`).join(" ");
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("role", "img");
  const now = points[points.length - 1].items_per_second;
  svg.setAttribute("aria-label", `Items per second per minute, at most ${top.toFixed(1)}; now ${now.toFixed(1)}`);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", xy);
  svg.append(line);
  return h("figure", { class: "chart" }, svg,
    h("figcaption", {}, `Items/s per minute over the last ${seconds(history)} (the service's record of the passes ` +
      `that ran jobs); peak ${top.toFixed(1)}.`));
}

function workersView() {
  const body = h("div", { id: "workers" });
  show("Workers", alertBox(), body);
  poll(async (current) => {
    const [ready, models, workers, text] = await Promise.all([api("/readyz", { accept: [503] }), api("/v1/models"),
      api("/workers"), api("/metrics", { as: "text" })]);
    if (!current()) return;
    const live = workers.data;
    const byPath = {};
    for (const w of live) byPath[w.attention || "–"] = (byPath[w.attention || "–"] || 0) + 1;
    const paths = Object.entries(byPath).map(([path, n]) => `${path} × ${n}`).join(", ");
    const busy = live.length ? sum(live, "busy") / live.length : null;
    refresh(body,
      fields([["Status", badge(ready.status)], ["Passes/s", sum(live, "passes_per_second").toFixed(2)],
        ["Items/s", sum(live, "items_per_second").toFixed(1)],
        ["Device busy", busy === null ? "–" : `${Math.round(100 * busy)}% (mean of the workers, last minute)`],
        ["Attention paths", paths || "–"], ["Queued jobs", total(metrics(text), "packscore_queue_depth")]]),
      h("h2", {}, "Live workers"),
      table("Live workers", ["Model", "Host", "Device", "Chips", "Attention", "Dtype", "State", "Passes/s", "Items/s",
        "Busy"], live.map((w) => {
        const state = w.programs ? `warming: ${w.programs.done}/${w.programs.total} programs` : w.state;
        return h("tr", {}, [w.model, w.host || "–", w.device_kind || "–", chips(w.device_group), w.attention || "–",
          w.dtype, state, w.passes_per_second.toFixed(2), w.items_per_second.toFixed(1),
          `${Math.round(100 * w.busy)}%`].map((cell) => h("td", {}, cell)));
      }), "No live worker: jobs wait in the queue until one starts."),
      h("h2", {}, "Models"),
      table("Models", ["Model", "Ready workers", "Warming", "Jobs waiting", "Default"], models.data.map((model) => {
        const waiting = ready.models[model.id] ? ready.models[model.id].jobs_waiting : false;
        return h("tr", {}, h("td", {}, model.id), h("td", {}, model.workers.ready), h("td", {}, model.workers.warming),
          h("td", {}, waiting ? "yes" : "no"), h("td", {}, model.default ? "yes" : ""));
      }), "No models."),
      h("h2", {}, "Throughput"), chart(workers.throughput, workers.history_seconds));
  });
}

// --- routes: #/, #/jobs/<id>, #/batches/<id>, #/workers

function route() {
  if (!sessionStorage.getItem(KEY)) {
    signIn();
    return;
  }
  document.getElementById("nav").hidden = false;
  const [, page, id] = location.hash.replace(/^#/, "").split("/");
  if (page === "jobs" && id) jobView(decodeURIComponent(id));
  else if (page === "batches" && id) batchView(decodeURIComponent(id));
  else if (page === "workers") workersView();
  else listView();
  for (const link of document.querySelectorAll("#nav a")) {
    link.toggleAttribute("aria-current", link.getAttribute("href") === `#/${page === "workers" ? "workers" : ""}`);
  }
}

window.addEventListener("hashchange", () => {
  route();
  document.querySelector("#main h1").focus();
});
document.getElementById("sign-out").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  location.hash = "#/";
  signIn();
});
route();
