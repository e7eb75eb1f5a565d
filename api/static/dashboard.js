// Kiln dashboard: plain JavaScript polling the JSON API (no build step, no external resources).
// Views: "#/" (builds, workers, engines per model and target), "#/engine/<digest>" (one engine),
// "#/compare?a=<digest>&b=<digest>" (two side by side), "#/trend/<model>" (its metrics across builds) and
// "#/grid" (model × precision × target: what is servable now, or why not).
// Every value from the API goes into the page through textContent or attributes, never as HTML.
"use strict";

const U = KilnUnits;  // the one number formatter (units.js, twin of kiln/units.py)
const STAGES = ["resolve", "quantize", "compile", "validate", "publish"];
const POLL_MS = 2500;
const state = { timer: null, token: localStorage.getItem("kiln.token") || "", showInactive: true, activeOnly: false };

// -- helpers ---------------------------------------------------------------------------------------------------
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function headers() {
  return state.token ? { Authorization: "Bearer " + state.token } : {};
}

class HttpError extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || ("HTTP " + status));
    this.status = status;
  }
}

async function api(path) {
  const resp = await fetch(path, { headers: headers(), cache: "no-store" });
  if (resp.status === 401 || resp.status === 403) {
    document.getElementById("auth").hidden = false;
  }
  if (!resp.ok) {
    let body = null;
    try { body = await resp.json(); } catch (e) { /* not JSON */ }
    throw new HttpError(resp.status, body);
  }
  return resp.json();
}

async function blobUrl(path) {
  const resp = await fetch(path, { headers: headers() });
  if (!resp.ok) throw new HttpError(resp.status, null);
  return URL.createObjectURL(await resp.blob());
}

function shortDigest(d) { return d ? d.slice(0, 19) + "…" : ""; }
function badge(text, kind) { return h("span", { class: "badge b-" + (kind || text) }, text); }
function engineHref(digest) { return "#/engine/" + encodeURIComponent(digest); }

// The index stores UTC; SQLite hands timestamps back without an offset, which Date.parse would read as local time.
function parseTime(iso) {
  if (!iso) return NaN;
  return Date.parse(/(Z|[+-]\d\d:?\d\d)$/.test(iso) ? iso : iso + "Z");
}

function ago(iso) {
  if (!iso) return "";
  const s = (Date.now() - parseTime(iso)) / 1000;
  if (!isFinite(s)) return "";
  if (s < 60) return Math.max(0, Math.round(s)) + " s ago";
  if (s < 3600) return Math.round(s / 60) + " min ago";
  if (s < 86400) return Math.round(s / 3600) + " h ago";
  return Math.round(s / 86400) + " d ago";
}

function secs(v) { return (v === null || v === undefined) ? "" : U.duration(v); }

function duration(b) {
  if (!b.started_at) return "";
  const end = b.finished_at ? parseTime(b.finished_at) : Date.now();
  const s = (end - parseTime(b.started_at)) / 1000;
  return isFinite(s) ? U.duration(Math.max(0, s)) : "";
}

function bytes(n) { return (n === null || n === undefined) ? "" : U.bytesIec(n); }

function profileName(spec) {
  const p = spec && spec.profile;
  if (!p) return "";
  return typeof p === "string" ? p : (p.name || "custom");
}

function showError(err) {
  const el = document.getElementById("error");
  if (!err) { el.hidden = true; return; }
  el.hidden = false;
  el.textContent = "Cannot reach the Kiln API: " + err.message;
}

// -- summary bar -----------------------------------------------------------------------------------------------
function renderSummary(builds, workers, artifacts) {
  const count = (rows, key, value) => rows.filter((r) => r[key] === value).length;
  const nav = document.getElementById("summary");
  const chip = (label, value) => h("span", { class: "chip" }, h("b", null, String(value)), " " + label);
  nav.replaceChildren(
    chip("running", count(builds, "status", "running")),
    chip("queued", count(builds, "status", "queued")),
    chip("workers live", workers.filter((w) => w.live).length),
    chip("fresh engines", count(artifacts, "status", "fresh")),
  );
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

// -- builds ----------------------------------------------------------------------------------------------------
function stageStrip(b) {
  const done = Object.fromEntries((b.stages || []).map((s) => [s.name, s]));
  return h("span", { class: "stages", "aria-hidden": "true" }, STAGES.map((name) => {
    let cls = "";
    if (done[name]) cls = "s-" + done[name].status;
    else if (b.status === "running" && b.stage === name) cls = "s-running";
    else if (b.status === "failed" && b.stage === name) cls = "s-failed";
    const title = name + (done[name] ? ": " + done[name].status + " " + secs(done[name].seconds) : "");
    return h("span", { class: cls, title });
  }));
}

function currentStage(b) {
  if (b.status === "running" && b.progress && b.progress.stage === b.stage) {
    const p = b.progress;  // the stage's latest step (kiln/progress.py), e.g. "validate: evaluation window 37/128"
    return b.stage + ": " + p.step + (p.i != null && p.n ? " " + p.i + "/" + p.n : "");
  }
  if (b.status === "running") return b.stage ? b.stage + "…" : "starting…";
  if (b.status === "queued") return "waiting";
  if (b.status === "failed" && b.stage) return "failed in " + b.stage;
  if (b.status === "succeeded") return b.cache_hit ? "cache hit" : "done";
  return b.status;
}

function buildsTable(builds, engines) {
  if (!builds.length && state.activeOnly) return h("p", { class: "empty", id: "builds-empty" }, "No build is running.");
  if (!builds.length && engines) {  // engines built with kiln build on a machine and published: no build row here
    return h("p", { class: "empty", id: "builds-empty" }, "No builds submitted to this server; its " + U.count(engines) +
      (engines === 1 ? " engine was" : " engines were") + " built elsewhere (kiln build) and published. " +
      "Submit a build with POST /v1/builds or kiln build --server " + location.origin + ".");
  }
  if (!builds.length) return h("p", { class: "empty", id: "builds-empty" }, "No builds yet. Submit one with POST /v1/builds or kiln build --server " + location.origin + ".");
  const rows = builds.map((b) => {
    const s = b.spec || {};
    const note = b.error ? (b.error.message || b.error.code) : b.reason;
    return h("tr", { "data-build": b.id, "data-status": b.status },
      h("td", null, h("span", { class: "mono", title: b.id }, b.id.slice(0, 12))),
      h("td", null, s.model_name || ""),
      h("td", null, [s.precision, s.target, profileName(s), s.backend].filter(Boolean).join(" · "),
        note ? h("div", { class: "sub" + (b.status === "failed" ? " err" : "") }, note) : null),
      h("td", null, badge(b.status)),
      h("td", null, stageStrip(b), currentStage(b)),
      h("td", null, b.worker || h("span", { class: "muted" }, b.queue || "")),
      h("td", { title: b.created_at || "" }, ago(b.created_at)),
      h("td", { class: "num" }, duration(b)),
      h("td", null, b.digest ? h("a", { class: "mono", href: engineHref(b.digest), "data-digest": b.digest }, shortDigest(b.digest)) : ""),
    );
  });
  return h("table", { id: "builds-table" },
    h("thead", null, h("tr", null, ["build", "model", "spec", "status", "stage", "worker / queue", "submitted", "took", "engine"]
      .map((t) => h("th", null, t)))),
    h("tbody", null, rows));
}

function workersList(workers) {
  if (!workers.length) return h("p", { class: "empty" }, "No workers registered.");
  return h("table", null,
    h("thead", null, h("tr", null, ["worker", "state", "queues", "last heartbeat"].map((t) => h("th", null, t)))),
    h("tbody", null, workers.map((w) => h("tr", null,
      h("td", { class: "mono" }, w.name),
      h("td", null, badge(w.live ? "live" : "gone", w.live ? "fresh" : "queued")),
      h("td", { class: "sub" }, (w.queues || []).join(", ")),
      h("td", null, ago(w.last_heartbeat))))));
}

// -- engines ---------------------------------------------------------------------------------------------------
function tagsByDigest(tags) {
  const out = {};
  for (const t of tags) (out[t.digest] = out[t.digest] || []).push(t.repository + ":" + t.name);
  return out;
}

function enginesSection(artifacts, tags) {
  const byTag = tagsByDigest(tags);
  const shown = state.showInactive ? artifacts : artifacts.filter((a) => a.status === "fresh");
  if (!shown.length) return [h("p", { class: "empty" }, "No engines published yet.")];
  const models = {};
  for (const a of shown) (models[a.repository] = models[a.repository] || []).push(a);
  return Object.keys(models).sort().map((model) => {
    const rows = models[model].slice().sort((x, y) =>
      x.target.localeCompare(y.target) || (y.created_at || "").localeCompare(x.created_at || ""));
    const fresh = rows.filter((a) => a.status === "fresh").length;
    let prevTarget = null;
    const body = rows.map((a) => {
      const start = a.target !== prevTarget;
      prevTarget = a.target;
      const v = a.validation || {};
      return h("tr", { class: start ? "group-start" : null, "data-digest": a.digest, "data-status": a.status },
        h("td", null, start ? h("strong", null, a.target) : ""),
        h("td", null, a.precision),
        h("td", null, a.profile),
        h("td", null, a.backend),
        h("td", null, badge(a.status), a.status_reason ? h("div", { class: "sub" }, a.status_reason) : null),
        h("td", null, (byTag[a.digest] || []).map((t) => h("span", { class: "tag" }, t))),
        h("td", null, v.passed === true ? badge("pass") : v.passed === false ? badge("fail") : ""),
        h("td", null, h("a", { class: "mono", href: engineHref(a.digest) }, shortDigest(a.digest))),
        h("td", { class: "num" }, bytes(a.size)),
        h("td", { title: a.created_at || "" }, ago(a.created_at)));
    });
    return h("div", { class: "model", "data-model": model },
      h("h3", { class: "model" }, model, h("span", { class: "muted" }, U.count(fresh) + " fresh of " + U.count(rows.length)),
        h("a", { class: "trend-link", href: trendHref(model) }, "trend")),
      h("table", null,
        h("thead", null, h("tr", null, ["target", "precision", "profile", "backend", "state", "tags", "validation",
          "engine", "size", "built"].map((t) => h("th", null, t)))),
        h("tbody", null, body)));
  });
}

async function renderHome(view) {
  const [builds, workers, artifacts, tags] = await Promise.all([
    api("/v1/builds?limit=50" + (state.activeOnly ? "&status=running" : "")),
    api("/v1/workers"), api("/v1/artifacts?limit=500"), api("/v1/tags")]);
  renderSummary(builds.builds, workers.workers, artifacts.artifacts);
  const active = h("label", null, h("input", { type: "checkbox", checked: state.activeOnly,
    onchange: (e) => { state.activeOnly = e.target.checked; refresh(); } }), " running only");
  const inactive = h("label", null, h("input", { type: "checkbox", checked: state.showInactive,
    onchange: (e) => { state.showInactive = e.target.checked; refresh(); } }), " show stale, revoked and rejected");
  view.replaceChildren(
    h("section", { class: "card", id: "builds" },
      h("h2", null, "Builds", h("span", { class: "muted" }, builds.total + " in all, newest first"),
        h("span", { class: "toolbar" }, active)),
      buildsTable(builds.builds, artifacts.artifacts.length)),
    h("section", { class: "card", id: "engines" },
      h("h2", null, "Engines", h("span", { class: "muted" }, "per model and target"),
        h("a", { href: "#/grid", id: "grid-link" }, "what is servable now"),
        h("span", { class: "toolbar" }, inactive)),
      enginesSection(artifacts.artifacts, tags.tags)),
    h("section", { class: "card", id: "workers" }, h("h2", null, "Workers"), workersList(workers.workers)));
}

// -- one engine ------------------------------------------------------------------------------------------------
function dl(pairs) {
  return h("dl", { class: "grid" }, pairs.filter((p) => p[1] !== null && p[1] !== undefined && p[1] !== "")
    .map(([k, v]) => [h("dt", null, k), h("dd", null, v)]));
}

function ms(v) { return U.duration(v / 1000); }

// [key in validation.metrics, label, formatter, how a difference reads: "points" (percent-valued), "fraction" or "relative"]
const METRICS = [["perplexity", "perplexity", U.number, "relative"],
  ["reference_perplexity", "reference perplexity", U.number, "relative"],
  ["ppl_increase_pct", "perplexity increase", U.percent, "points"],
  ["top1_agreement", "top-1 agreement", U.fraction, "fraction"],
  ["mean_kl", "mean KL", U.number, "relative"],
  ["peak_memory_bytes", "peak memory", U.bytesIec, "relative"],
  ["ttft_ms", "TTFT", ms, "relative"],
  ["tpot_ms", "TPOT", ms, "relative"],
  ["tokens", "evaluation tokens", U.count, "relative"]];

function metricsTable(m) {
  const rows = METRICS.filter((r) => typeof m[r[0]] === "number");
  return h("table", { id: "metrics" }, h("tbody", null, rows.map(([key, k, f]) => h("tr", { "data-metric": key },
    h("th", null, k), h("td", { class: "num" }, f(m[key]))))));
}

function gatesTable(gates) {
  if (!gates || !gates.length) return h("p", { class: "empty" }, "No gates recorded.");
  return h("table", { id: "gates" },
    h("thead", null, h("tr", null, ["gate", "value", "interval", "threshold", ""].map((t) => h("th", null, t)))),
    h("tbody", null, gates.map((g) => h("tr", null,
      h("td", { title: g.name, "data-gate": g.name }, U.gateLabel(g.name) + gateSubject(g)),
      h("td", { class: "num" }, U.gateValue(g.name, g.value)),
      h("td", { class: "num" }, U.gateInterval(g)),
      h("td", { class: "num" }, U.gateOp(g.name) + " " + U.gateValue(g.name, g.threshold)),
      h("td", null, badge(g.decision || (g.passed ? "pass" : "fail")))))));
}

function sequentialNote(m) {
  const s = m.sequential;
  if (!s) return null;
  return h("p", { class: "sub", id: "sequential" }, "evaluated " + s.windows + " of " + s.of + " windows" +
    (s.stopped_early ? " (stopped once every accuracy gate was decided; " + (s.of - s.windows) + " skipped)" : "") +
    "; one-sided bounds at " + U.fraction(s.confidence_per_look) + " per look over " + s.looks.length + " looks");
}

function tasksTable(tasks) {
  if (!tasks || !tasks.length) return null;
  const iv = (t) => "[" + U.points(t.interval.low) + ", " + U.points(t.interval.high) + "]"
    + (typeof t.interval.confidence === "number" ? " (" + U.fraction(t.interval.confidence) + ")" : "");
  // sequential evaluation: "64 of 200" when the task gate was decided before every item ran
  const items = (t) => U.count(t.items) + (typeof t.total === "number" && t.total !== t.items ? " of " + U.count(t.total) : "");
  return h("table", { id: "tasks" },
    h("thead", null, h("tr", null, ["task", "items", "engine", "reference", "drop", "interval", "detectable"]
      .map((t) => h("th", null, t)))),
    h("tbody", null, tasks.map((t) => h("tr", null, h("td", { class: "mono" }, t.task),
      h("td", { class: "num" }, items(t)), h("td", { class: "num" }, U.fraction(t.engine_accuracy)),
      h("td", { class: "num" }, U.fraction(t.reference_accuracy)), h("td", { class: "num" }, U.points(t.drop_pts)),
      h("td", { class: "num" }, iv(t)), h("td", { class: "num" }, U.points(t.mde_pts))))));
}

function throughputTable(points) {
  if (!points || !points.length) return null;
  return h("table", { id: "throughput" },
    h("thead", null, h("tr", null, ["batch", "sequence", "throughput", "time (median)"].map((t) => h("th", null, t)))),
    h("tbody", null, points.slice().sort((x, y) => x.batch_size - y.batch_size || x.seq_len - y.seq_len).map((p) => h("tr", null, h("td", { class: "num" }, U.count(p.batch_size)), h("td", { class: "num" }, U.count(p.seq_len)),
      h("td", { class: "num" }, U.rate(p.tokens_per_s)),
      h("td", { class: "num" }, typeof p.seconds_median === "number" ? U.duration(p.seconds_median) : "")))));
}

async function renderEngine(view, digest) {
  const path = "/v1/artifacts/" + encodeURIComponent(digest);
  const [a, tags] = await Promise.all([api(path), api("/v1/tags?digest=" + encodeURIComponent(digest))]);
  const v = a.validation || {};
  const m = v.metrics || {};
  const prov = a.provenance || {};
  const spec = prov.spec || {};
  const prof = (spec.profile && typeof spec.profile === "object") ? spec.profile : {};
  const limits = ["max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"].filter((k) => k in prof)
    .map((k) => k.replace("max_", "") + " " + prof[k]).join(", ");
  const reportLink = h("a", { href: path + "/report.html", target: "_blank", rel: "noopener", id: "report-link",
    onclick: async (e) => {
      if (!state.token) return;  // a plain link works without a token
      e.preventDefault();
      window.open(await blobUrl(path + "/report.html"), "_blank", "noopener");
    } }, "validation report (HTML)");
  const charts = h("div", { class: "charts" });
  const siblings = (await api("/v1/artifacts?limit=100&model=" + encodeURIComponent(a.repository))).artifacts
    .filter((x) => x.digest !== a.digest);
  const compareWith = siblings.length ? h("select", { id: "compare-with", onchange: (e) => {
    if (e.target.value) location.hash = compareHref(a.digest, e.target.value); } },
    h("option", { value: "" }, "compare with…"),
    siblings.map((x) => h("option", { value: x.digest }, x.tag + " " + shortDigest(x.digest) + " (" + x.status + ", " + ago(x.created_at) + ")"))) : null;
  const stages = (prov.stages || []).map((s) => s.name + " " + s.status + " " + secs(s.seconds)).join(" · ");
  view.replaceChildren(
    h("p", null, h("a", { href: "#/" }, "← all builds and engines"), " · ",
      h("a", { href: trendHref(a.repository), id: "trend-link" }, "trend of " + a.repository), " ", compareWith),
    h("section", { class: "card", id: "engine", "data-digest": a.digest },
      h("h2", null, a.repository + ":" + a.tag, badge(a.status)),
      a.status_reason ? h("p", { class: "sub" }, a.status_reason) : null,
      dl([["digest", h("code", null, a.digest)],
        ["tags", (tags.tags || []).length ? tags.tags.map((t) => h("span", { class: "tag" }, t.repository + ":" + t.name))
          : h("span", { class: "muted" }, "none (tags move only to fresh, validated engines)")],
        ["target", a.target], ["precision", a.precision + (spec.kv_cache && spec.kv_cache !== "none" ? ", KV cache " + spec.kv_cache : "")],
        ["profile", a.profile + (limits ? " (" + limits + ")" : "")], ["backend", a.backend],
        ["checkpoint", a.checkpoint ? [a.checkpoint.ref, a.checkpoint.revision ? " @ " + a.checkpoint.revision : ""].join("") : ""],
        ["checkpoint digest", a.checkpoint ? h("code", null, a.checkpoint.digest) : ""],
        ["build key", h("code", null, a.build_key)], ["size", bytes(a.size)],
        ["toolchain", Object.entries(prov.toolchain || {}).map(([k, x]) => k + " " + x).join(", ")],
        ["stages", stages], ["built", (a.created_at || "") + " (" + ago(a.created_at) + ")"],
        ["pull", h("div", { class: "copy", id: "pull-hint" }, "kiln pull " + a.repository + "@" + a.digest + " ./engine --server " + location.origin)]])),
    h("div", { class: "cols" },
      h("section", { class: "card", id: "validation" },
        h("h2", null, "Validation", badge(v.passed ? "pass" : "fail"), h("span", { class: "muted" }, reportLink)),
        metricsTable(m), sequentialNote(m), (m.tasks && m.tasks.length) ? h("h3", null, "Tasks") : null,
        tasksTable(m.tasks), h("h3", null, "Gates"), gatesTable(v.gates)),
      h("section", { class: "card", id: "charts" },
        h("h2", null, "Throughput", h("span", { class: "muted" }, "prefill tokens/s inside the profile's envelope")),
        charts, throughputTable(m.throughput))),
    h("section", { class: "card" }, h("details", null, h("summary", null, "provenance (JSON)"),
      h("pre", { class: "json" }, JSON.stringify(prov, null, 2)))));
  for (const by of ["batch", "seq"]) {
    const src = state.token ? await blobUrl(path + "/throughput.svg?by=" + by) : path + "/throughput.svg?by=" + by;
    charts.append(h("img", { src, alt: "tokens/s against " + (by === "batch" ? "batch size" : "sequence length"),
      width: 520, height: 280, "data-chart": by }));
  }
  document.title = a.repository + ":" + a.tag + " — Kiln";
  return false;  // an engine's page changes rarely: no polling
}

// -- two engines side by side ----------------------------------------------------------------------------------
function compareHref(a, b) { return "#/compare?a=" + encodeURIComponent(a) + "&b=" + encodeURIComponent(b); }
function trendHref(model) { return "#/trend/" + encodeURIComponent(model); }

function difference(kind, a, b) {
  if (typeof a !== "number" || typeof b !== "number") return "";
  if (kind === "points") return U.points(b - a);
  if (kind === "fraction") return U.points((b - a) * 100);
  return a === 0 ? "" : U.percent((b - a) / Math.abs(a) * 100);
}

function gateKey(g) { return g.name + gateSubject(g); }

// What a verdict was measured on beside its gate (kiln/units.py gate_subject): a task, or a longer window length.
function gateSubject(g) { return g.task ? " [" + g.task + "]" : g.seq_len ? " [" + g.seq_len + "-token windows]" : ""; }

// A JSON value as flat "path → text" pairs: objects by key ("toolchain.torch"), lists of named objects by name
// ("stages.quantize.seconds"), other lists of objects by index ("spec.tasks[0].path"), lists of plain values
// whole; a string as itself, anything else as JSON. Every text goes into the page as text, never as HTML.
function flatten(value, prefix, out) {
  const named = Array.isArray(value) && value.length > 0 && value.every((x) => x && typeof x === "object" && !Array.isArray(x))
    && value.every((x) => typeof x.name === "string") && new Set(value.map((x) => x.name)).size === value.length;
  if (value && typeof value === "object" && !Array.isArray(value) && Object.keys(value).length) {
    for (const k of Object.keys(value)) flatten(value[k], prefix ? prefix + "." + k : k, out);
  } else if (named) {
    for (const x of value) flatten(x, prefix + "." + x.name, out);
  } else if (Array.isArray(value) && value.length && value.every((x) => x && typeof x === "object")) {
    value.forEach((x, i) => flatten(x, prefix + "[" + i + "]", out));
  } else if (prefix) {
    out[prefix] = typeof value === "string" ? value : JSON.stringify(value);
  }
  return out;
}

// The engine's identity (what the artifact row says), compared beside its provenance.
function identity(a) {
  return { repository: a.repository, tag: a.tag, status: a.status, target: a.target, precision: a.precision,
    profile: a.profile, backend: a.backend, checkpoint: a.checkpoint, build_key: a.build_key, created_at: a.created_at };
}

// One section of the diff table: a heading row, then a row per flattened field with A's and B's value; a field
// whose values differ is marked twice: the row's class "differs" (highlighted) and "≠" before its name.
function diffRows(section, fa, fb) {
  const paths = [...new Set([...Object.keys(fa), ...Object.keys(fb)])].sort();
  const value = (v) => v === undefined ? h("span", { class: "muted" }, "—") : v;
  const rows = paths.map((p) => {
    const differs = fa[p] !== fb[p];
    return h("tr", { "data-field": p, "data-section": section, class: differs ? "differs" : null },
      h("td", { class: "mark", title: differs ? "A and B differ" : null }, differs ? "≠" : ""),
      h("td", { class: "mono field" }, p), h("td", { class: "sub mono" }, value(fa[p])),
      h("td", { class: "sub mono" }, value(fb[p])));
  });
  return { paths, differ: paths.filter((p) => fa[p] !== fb[p]),
    body: h("tbody", { "data-section": section }, h("tr", { class: "section" }, h("th", { colspan: 4 }, section)), rows) };
}

function engineHead(a, side) {
  return h("div", { class: "side", "data-side": side },
    h("div", null, h("b", null, side.toUpperCase() + " "), h("a", { href: engineHref(a.digest), class: "mono" }, shortDigest(a.digest)),
      " ", badge(a.status), " ", (a.validation || {}).passed ? badge("pass") : badge("fail")),
    h("div", { class: "sub" }, a.repository + ":" + a.tag + " · " + [a.precision, a.target, a.profile, a.backend].join(" · ")
      + " · " + U.bytesIec(a.size) + " · built " + (a.created_at || "")));
}

async function renderCompare(view, query) {
  const q = new URLSearchParams(query);
  const da = q.get("a"), db = q.get("b");
  if (!da || !db) throw new HttpError(404, { error: { message: "compare needs two engines: #/compare?a=<digest>&b=<digest>" } });
  const [a, b] = await Promise.all([api("/v1/artifacts/" + encodeURIComponent(da)), api("/v1/artifacts/" + encodeURIComponent(db))]);
  const ma = (a.validation || {}).metrics || {}, mb = (b.validation || {}).metrics || {};
  const peak = (m) => { const t = (m.throughput || []).map((p) => p.tokens_per_s).filter((x) => typeof x === "number");
    return t.length ? Math.max(...t) : undefined; };
  const rows = METRICS.filter(([k]) => typeof ma[k] === "number" || typeof mb[k] === "number")
    .map(([k, label, f, kind]) => [k, label, f, kind, ma[k], mb[k]]);
  if (peak(ma) !== undefined || peak(mb) !== undefined) rows.push(["peak_tokens_per_s", "peak throughput", U.rate, "relative", peak(ma), peak(mb)]);
  const cell = (f, v) => h("td", { class: "num" }, typeof v === "number" ? f(v) : "—");
  const metrics = h("table", { id: "compare-metrics" },
    h("thead", null, h("tr", null, ["metric", "A", "B", "B − A"].map((t) => h("th", null, t)))),
    h("tbody", null, rows.map(([k, label, f, kind, x, y]) => h("tr", { "data-metric": k }, h("th", null, label),
      cell(f, x), cell(f, y), h("td", { class: "num diff" }, difference(kind, x, y))))));
  const ga = Object.fromEntries(((a.validation || {}).gates || []).map((g) => [gateKey(g), g]));
  const gb = Object.fromEntries(((b.validation || {}).gates || []).map((g) => [gateKey(g), g]));
  const names = [...new Set([...Object.keys(ga), ...Object.keys(gb)])];
  const gateCells = (g) => g ? [h("td", { class: "num" }, U.gateValue(g.name, g.value)),
    h("td", { class: "num" }, U.gateOp(g.name) + " " + U.gateValue(g.name, g.threshold)),
    h("td", null, badge(g.decision || (g.passed ? "pass" : "fail")))] : [h("td", { class: "muted" }, "not gated"), h("td"), h("td")];
  const gates = names.length ? h("table", { id: "compare-gates" },
    h("thead", null, h("tr", null, ["gate", "A value", "A threshold", "A", "B value", "B threshold", "B"].map((t) => h("th", null, t)))),
    h("tbody", null, names.map((n) => {
      const x = ga[n], y = gb[n], verdict = (g) => g && (g.decision || (g.passed ? "pass" : "fail"));
      return h("tr", { "data-gate": n, class: verdict(x) !== verdict(y) ? "differs" : null },
        h("td", null, U.gateLabel((x || y).name) + gateSubject(x || y)), gateCells(x), gateCells(y));
    }))) : h("p", { class: "empty" }, "No gates recorded.");
  const engine = diffRows("engine", flatten(identity(a), "", {}), flatten(identity(b), "", {}));
  const provenance = diffRows("provenance", flatten(a.provenance || {}, "", {}), flatten(b.provenance || {}, "", {}));
  const differ = engine.differ.length + provenance.differ.length, fields = engine.paths.length + provenance.paths.length;
  const prov = h("table", { id: "compare-provenance", class: "diff-table" },
    h("thead", null, h("tr", null, ["", "field", "A", "B"].map((t) => h("th", null, t)))), engine.body, provenance.body);
  const raw = h("details", { id: "compare-raw" }, h("summary", null, "provenance (raw JSON)"),
    h("div", { class: "sides" }, [["A", a], ["B", b]].map(([side, x]) => h("div", { class: "side", "data-side": side.toLowerCase() },
      h("b", null, side), h("pre", { class: "json" }, JSON.stringify(x.provenance || {}, null, 2))))));
  view.replaceChildren(
    h("p", null, h("a", { href: "#/" }, "← all builds and engines"), " · ",
      h("a", { href: trendHref(a.repository) }, "trend of " + a.repository), " · ",
      h("a", { href: compareHref(b.digest, a.digest) }, "swap A and B")),
    h("section", { class: "card", id: "compare", "data-a": a.digest, "data-b": b.digest },
      h("h2", null, "Compare engines"), h("div", { class: "sides" }, engineHead(a, "a"), engineHead(b, "b"))),
    h("div", { class: "cols" },
      h("section", { class: "card" }, h("h2", null, "Metrics", h("span", { class: "muted" }, "B − A: points for percentages, relative change otherwise")), metrics),
      h("section", { class: "card" }, h("h2", null, "Gates", h("span", { class: "muted" }, "a row whose verdicts differ is highlighted")), gates)),
    h("section", { class: "card" }, h("h2", null, "Provenance", h("span", { class: "muted", id: "differ-count" },
      U.count(differ) + " of " + U.count(fields) + " fields differ (marked ≠)")), prov, raw));
  document.title = "Compare — Kiln";
  return false;
}

// -- a model's metrics across its builds ------------------------------------------------------------------------
const TREND = [["ppl_increase_pct", "perplexity increase", U.percent], ["mean_kl", "mean KL", U.number],
  ["peak_tokens_per_s", "peak throughput", U.rate], ["ttft_ms", "TTFT", ms]];
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];
const SVGNS = "http://www.w3.org/2000/svg";

function sv(tag, attrs, ...children) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

function variantOf(e) { return [e.precision, e.target, e.profile, e.backend].join(" · "); }

// One metric's line chart: x = the engine's place in time order, y from 0 to the largest value; a line per variant.
function trendChart(engines, variants, [key, label, f]) {
  const W = 440, H = 190, L = 48, R = 48, T = 44, B = 16, pw = W - L - R, ph = H - T - B;
  const vals = engines.map((e) => e.metrics[key]).filter((v) => typeof v === "number");
  const max = vals.length ? Math.max(...vals.map(Math.abs)) || 1 : 1;
  const x = (i) => L + pw * (engines.length === 1 ? 0.5 : i / (engines.length - 1));
  const y = (v) => T + ph - ph * Math.max(0, v) / max;
  const svg = sv("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": label, "data-trend": key },
    sv("rect", { width: W, height: H, fill: "#fff" }),
    sv("text", { x: 12, y: 16, "font-size": 13, "font-weight": 600, fill: "#1f2933" }, label),
    sv("text", { x: W - 12, y: 16, "text-anchor": "end", "font-size": 11, fill: "#616e7c" }, "max " + (vals.length ? f(Math.max(...vals)) : "—")),
    sv("line", { x1: L, x2: W - R, y1: T + ph, y2: T + ph, stroke: "#9aa5b1" }),
    sv("line", { x1: L, x2: W - R, y1: T, y2: T, stroke: "#e4e7eb" }));
  if (!vals.length) svg.append(sv("text", { x: W / 2, y: T + ph / 2, "text-anchor": "middle", fill: "#616e7c" }, "not measured"));
  variants.forEach((variant, vi) => {
    const color = COLORS[vi % COLORS.length];
    const pts = engines.map((e, i) => [e, i]).filter(([e]) => variantOf(e) === variant && typeof e.metrics[key] === "number");
    if (pts.length > 1) svg.append(sv("polyline", { points: pts.map(([e, i]) => x(i) + "," + y(e.metrics[key])).join(" "),
      fill: "none", stroke: color, "stroke-width": 2 }));
    for (const [e, i] of pts) {
      svg.append(sv("circle", { cx: x(i), cy: y(e.metrics[key]), r: 4, fill: color, "data-digest": e.digest },
        sv("title", null, e.tag + " " + (e.created_at || "") + ": " + f(e.metrics[key]))));
    }
    const last = pts[pts.length - 1];
    if (last) svg.append(sv("text", { x: x(last[1]), y: y(last[0].metrics[key]) - 8, "text-anchor": "middle", "font-size": 11, fill: color },
      f(last[0].metrics[key])));
  });
  return svg;
}

async function renderTrend(view, model) {
  const body = await api("/v1/trend?model=" + encodeURIComponent(model));
  const engines = body.engines;
  const variants = [...new Set(engines.map(variantOf))];
  const previous = {};  // digest → the engine of the same variant built just before it
  const lastOf = {};
  for (const e of engines) { previous[e.digest] = lastOf[variantOf(e)]; lastOf[variantOf(e)] = e.digest; }
  view.replaceChildren(
    h("p", null, h("a", { href: "#/" }, "← all builds and engines"), " · ", h("a", { href: "#/grid" }, "servable grid")),
    h("section", { class: "card", id: "trend", "data-model": model },
      h("h2", null, "Trend: " + model, h("span", { class: "muted" }, U.count(engines.length) + " engines, oldest first")),
      h("div", { class: "legend" }, variants.map((v, i) => h("span", null, h("i", { class: "swatch c" + (i % COLORS.length) }), v))),
      h("div", { class: "charts" }, TREND.map((t) => trendChart(engines, variants, t)))),
    h("section", { class: "card" }, h("h2", null, "Builds"),
      h("table", { id: "trend-table" },
        h("thead", null, h("tr", null, ["built", "engine", "variant", "state", "validation"].concat(TREND.map((t) => t[1]), [""])
          .map((t) => h("th", null, t)))),
        h("tbody", null, engines.map((e) => h("tr", { "data-digest": e.digest },
          h("td", { title: e.created_at || "" }, (e.created_at || "").slice(0, 19).replace("T", " ")),
          h("td", null, h("a", { class: "mono", href: engineHref(e.digest) }, shortDigest(e.digest))),
          h("td", null, variantOf(e)), h("td", null, badge(e.status)),
          h("td", null, e.passed === true ? badge("pass") : e.passed === false ? badge("fail") : ""),
          TREND.map(([k, , f]) => h("td", { class: "num", "data-metric": k }, typeof e.metrics[k] === "number" ? f(e.metrics[k]) : "—")),
          h("td", null, previous[e.digest] ? h("a", { href: compareHref(previous[e.digest], e.digest), class: "compare-prev" }, "compare with previous") : "")))))));
  document.title = "Trend " + model + " — Kiln";
  return false;
}

// -- what is servable now ---------------------------------------------------------------------------------------
async function renderGrid(view) {
  const body = await api("/v1/grid");
  const models = body.models.map((m) => {
    const cells = Object.fromEntries(m.cells.map((c) => [c.precision + "|" + c.target, c]));
    return h("div", { class: "model", "data-model": m.model },
      h("h3", { class: "model" }, m.model, " ", h("a", { href: trendHref(m.model), class: "muted" }, "trend")),
      m.cells.length ? h("table", { class: "grid-table" },
        h("thead", null, h("tr", null, h("th", null, "precision \\ target"), m.targets.map((t) => h("th", null, t)))),
        h("tbody", null, m.precisions.map((p) => h("tr", null, h("th", null, p), m.targets.map((t) => {
          const c = cells[p + "|" + t];
          return h("td", { class: c.servable ? "servable" : "unservable", "data-cell": m.model + "|" + p + "|" + t },
            c.engines.map((e) => h("div", null, h("a", { class: "mono", href: engineHref(e.digest), "data-digest": e.digest }, shortDigest(e.digest)),
              h("span", { class: "sub" }, " " + e.profile + " · " + e.backend))),
            c.reasons.map((r) => h("div", { class: "sub", "data-code": r.code },
              (r.profile ? r.profile + " · " + r.backend + ": " : "") + r.code + " — " + r.reason)));
        }))))) : h("p", { class: "empty" }, "Tracked, with no matrix and no engine yet."));
  });
  view.replaceChildren(
    h("p", null, h("a", { href: "#/" }, "← all builds and engines")),
    h("section", { class: "card", id: "grid" },
      h("h2", null, "Servable now", h("span", { class: "muted" }, "model × precision × target: the engine GET /v1/resolve answers, or why none")),
      models.length ? models : h("p", { class: "empty" }, "No models tracked and no engines published yet.")));
  document.title = "Servable grid — Kiln";
}

// -- routing and polling ---------------------------------------------------------------------------------------
async function refresh() {
  clearTimeout(state.timer);
  const view = document.getElementById("view");
  const route = decodeURIComponent(location.hash.replace(/^#\/?/, ""));
  let poll = true;
  try {
    if (route.startsWith("engine/")) {
      poll = await renderEngine(view, route.slice("engine/".length));
    } else if (route.startsWith("compare")) {
      poll = await renderCompare(view, route.slice("compare".length).replace(/^\?/, ""));
    } else if (route.startsWith("trend/")) {
      poll = await renderTrend(view, route.slice("trend/".length));
    } else if (route === "grid") {
      await renderGrid(view);
    } else {
      document.title = "Kiln";
      await renderHome(view);
    }
    showError(null);
  } catch (err) {
    if (err instanceof HttpError && err.status === 404) {
      view.replaceChildren(h("p", null, h("a", { href: "#/" }, "← back")), h("p", { class: "banner" }, err.message));
      poll = false;
    } else if (err instanceof HttpError && (err.status === 401 || err.status === 403)) {
      view.replaceChildren(h("p", { class: "muted" }, "Waiting for an API token."));
      poll = false;  // until a token is entered (the form calls refresh)
    } else {
      showError(err);
    }
  }
  if (poll !== false) state.timer = setTimeout(refresh, POLL_MS);
}

document.getElementById("auth-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.token = document.getElementById("token").value.trim();
  localStorage.setItem("kiln.token", state.token);
  document.getElementById("auth").hidden = true;
  refresh();
});
window.addEventListener("hashchange", refresh);
refresh();
