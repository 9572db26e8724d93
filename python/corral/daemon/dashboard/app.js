// The corral dashboard: polls the daemon's JSON API and renders it. Every value from the
// daemon (labels, commands, output) is set as text, never as HTML: it comes from sandboxes.
"use strict";

const KEY = "corral-dashboard-token";
const POLL_MS = 2000;
// what a poll reads of a sandbox's log: its last entries, outputs cut (the log is the agent's)
const LOG_TAIL = 200;
const LOG_OUTPUT = 8192;
let token = sessionStorage.getItem(KEY) || "";
let timer = null;
let last = null; // previous summary, for rates

function $(id) { return document.getElementById(id); }

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

// The token arrives in the fragment (#token=...), which browsers never send to a server;
// it is kept in this tab's sessionStorage and removed from the address bar.
function takeToken() {
  const m = location.hash.match(/^#token=([^&]*)(?:&(.*))?$/);
  if (!m) return;
  token = decodeURIComponent(m[1]);
  sessionStorage.setItem(KEY, token);
  history.replaceState(null, "", location.pathname + "#" + (m[2] || "/"));
}

async function api(path) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const r = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
  if (r.status === 401) throw Object.assign(new Error("unauthorized"), { auth: true });
  const body = await r.json();
  if (!r.ok) throw new Error((body.error && body.error.code) || ("HTTP " + r.status));
  return body;
}

function showAuth(msg) {
  for (const s of ["overview", "detail"]) $(s).hidden = true;
  $("auth").hidden = false;
  $("auth-error").textContent = msg || "";
  $("status").textContent = "not authorised";
}

function age(s) {
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + " m " + Math.floor(s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " m";
}

function ms(s) { return s < 1 ? (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms" : s.toFixed(2) + " s"; }

// A bucket bound, short: 0.5 ms, 25 ms, 2.5 s.
function bound(s) { return s < 1 ? +(s * 1000).toPrecision(3) + " ms" : +s.toPrecision(3) + " s"; }

function card(parent, value, key) {
  const c = el("div", null, "card");
  c.append(el("div", value, "v"), el("div", key, "k"));
  parent.append(c);
}

// A quantile from cumulative buckets [le, count]: the upper bound of its bucket.
function quantile(h, q) {
  if (!h.count) return null;
  for (const [le, n] of h.buckets) if (n >= q * h.count) return le === "+Inf" ? Infinity : +le;
  return null;
}

function rate(now, key) {
  if (!last || now.now <= last.now) return "–";
  return ((now.totals[key] - last.totals[key]) / (now.now - last.now)).toFixed(1) + "/s";
}

function renderOverview(d) {
  const cards = $("cards");
  cards.replaceChildren();
  card(cards, d.count + " / " + d.capacity, "live sandboxes / capacity");
  card(cards, rate(d, "created"), "creates");
  card(cards, rate(d, "execs"), "execs");
  card(cards, rate(d, "errors"), "API errors");
  card(cards, d.totals.infra_failures, "infra failures (total)");
  card(cards, d.totals.lost, "sandboxes lost (total)");
  card(cards, d.totals.crashed, "sandboxes crashed (total)");

  const hists = $("hists");
  hists.replaceChildren();
  for (const op of ["create", "exec", "snapshot"]) {
    const h = d.latency[op];
    const box = el("div", null, "hist");
    box.dataset.op = op;
    const p50 = quantile(h, 0.5), p99 = quantile(h, 0.99);
    box.append(el("h3", op + " latency: " + h.count + " calls" +
      (h.count ? ", mean " + ms(h.sum / h.count) + ", p50 ≤ " + ms(p50) +
                 ", p99 ≤ " + (p99 === Infinity ? "∞" : ms(p99)) : "")));
    let prev = 0, top = 0;
    const max = Math.max(1, ...h.buckets.map(([, n], i) => n - (i ? h.buckets[i - 1][1] : 0)));
    for (const [le, n] of h.buckets) {
      const inBucket = n - prev; prev = n;
      if (le !== "+Inf") top = +le;
      const row = el("div", null, "bar");
      const b = el("div", null, "b");
      b.style.width = Math.round(200 * inBucket / max) + "px";
      row.append(el("span", le === "+Inf" ? "> " + bound(top) : "≤ " + bound(+le), "l"), b,
                 el("span", inBucket || ""));
      box.append(row);
    }
    hists.append(box);
  }

  $("count").textContent = "(" + d.count + (d.count > d.sandboxes.length ?
    ", newest " + d.sandboxes.length + " shown" : "") + ")";
  const tbody = $("sandboxes").tBodies[0];
  tbody.replaceChildren();
  for (const sb of d.sandboxes) {
    const tr = el("tr");
    tr.dataset.id = sb.id;
    const link = el("a", sb.id, "sb-link");
    link.href = "#/sandbox/" + encodeURIComponent(sb.id);
    const idCell = el("td", null, "mono");
    idCell.append(link);
    const labels = el("td");
    for (const [k, v] of Object.entries(sb.labels || {})) labels.append(el("span", k + "=" + v, "label"));
    tr.append(idCell, el("td", sb.state), el("td", sb.substrate), el("td", sb.image), labels,
              el("td", age(sb.age_s)));
    tbody.append(tr);
  }
  last = d;
}

function cmdText(cmd) { return Array.isArray(cmd) ? cmd.join(" ") : String(cmd ?? ""); }

function outcome(e) {
  if (e.status !== "done") return e.status;
  if (e.error) return "error " + ((e.error.error || {}).code || "?");
  const r = e.result || {};
  if ("exit_code" in r) return "exit " + r.exit_code + (r.timed_out ? " (timed out)" : "");
  if ("pid" in r) return "pid " + r.pid;
  if (r.id) return String(r.id);
  return "ok";
}

function renderDetail(sid, info, log) {
  const cards = $("sb-cards");
  cards.replaceChildren();
  const sb = log.sandbox || {};
  card(cards, sid, "sandbox");
  card(cards, info ? info.state : "ended" + (sb.reason ? " (" + sb.reason + ")" : ""), "state");
  if (info) {
    card(cards, info.image + " / " + info.substrate, "image / substrate");
    card(cards, age(Date.now() / 1000 - info.created_at), "age");
    const labels = Object.entries(info.labels || {}).map(([k, v]) => k + "=" + v).join(" ");
    card(cards, labels || "–", "labels");
  }

  const term = $("terminal");
  term.replaceChildren();
  const tbody = $("log").tBodies[0];
  tbody.replaceChildren();
  for (const e of log.entries) {
    const req = e.request || {};
    const tr = el("tr");
    tr.dataset.op = e.op;
    tr.append(el("td", e.index), el("td", e.op), el("td", e.status),
              el("td", e.duration_s == null ? "" : ms(e.duration_s)),
              el("td", e.op === "exec" ? cmdText(req.cmd) : (req.path || req.name || ""), "mono"),
              el("td", outcome(e)));
    tbody.append(tr);
    if (e.op !== "exec") continue;
    const r = e.result || {};
    term.append(el("span", "$ " + cmdText(req.cmd) + "\n", "cmd"));
    if (r.stdout) term.append(el("span", r.stdout.endsWith("\n") ? r.stdout : r.stdout + "\n"));
    if (r.stderr) term.append(el("span", r.stderr.endsWith("\n") ? r.stderr : r.stderr + "\n", "err"));
    term.append(el("span", "[" + outcome(e) + "]\n", "exit"));
  }
  if (!term.childNodes.length) term.textContent = "(no commands yet)";
}

async function tick() {
  clearTimeout(timer);
  const m = location.hash.match(/^#\/sandbox\/(.+)$/);
  try {
    if (m) {
      const sid = decodeURIComponent(m[1]);
      const log = await api("/v1/sandboxes/" + encodeURIComponent(sid) + "/log?tail=" + LOG_TAIL +
                            "&max_output=" + LOG_OUTPUT);
      let info = null;
      try { info = await api("/v1/sandboxes/" + encodeURIComponent(sid)); } catch (e) {
        if (e.auth) throw e;
      }
      $("crumb").textContent = "/ " + sid;
      renderDetail(sid, info, log);
      $("overview").hidden = true; $("detail").hidden = false;
    } else {
      const d = await api("/v1/dashboard");
      $("crumb").textContent = "";
      renderOverview(d);
      $("detail").hidden = true; $("overview").hidden = false;
    }
    $("auth").hidden = true;
    $("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    if (e.auth) { showAuth(token ? "wrong token" : ""); return; }
    $("status").textContent = "error: " + e.message;
  }
  timer = setTimeout(tick, POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  takeToken();
  $("auth").addEventListener("submit", (ev) => {
    ev.preventDefault();
    token = $("token").value.trim();
    sessionStorage.setItem(KEY, token);
    tick();
  });
  window.addEventListener("hashchange", () => { takeToken(); last = null; tick(); });
  tick();
});
