// The dsv4-agent status page: polls /status, /cluster and /cache, follows /events (SSE). Read-only.
// plot.js (loaded first) draws the hit-rate plot.
// Everything from the agent is inserted as text (textContent), never as markup: member records come from
// other nodes through etcd.
"use strict";

const STATUS_MS = 2000;
const CLUSTER_MS = 3000;
const FETCH_TIMEOUT_MS = 5000;
const EVENTS_RECONNECT_MS = 3000;
const MAX_EVENTS = 300;
const ROLES = ["startup", "liveness", "readiness"];

const ui = {
  status: null, cluster: null, cache: null,
  events: new Map(), eventsLive: false,
  lastOk: null, downSince: null, downReason: "",
  offset: 0, // agent clock − browser clock, seconds (the agent may be reached through a tunnel)
};

// ---- small helpers -------------------------------------------------------------------------------------------
const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function clock(ts) {
  return ts === null || ts === undefined ? "—" : timeLabel(ts, true);
}

function dur(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "—";
  let s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  const d = Math.floor(s / 86400); s -= d * 86400;
  const h = Math.floor(s / 3600); s -= h * 3600;
  const m = Math.floor(s / 60); s -= m * 60;
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  return `${m}m ${s}s`;
}

const agentNow = () => Date.now() / 1000 + ui.offset;
const ago = (ts) => (ts ? `${dur(agentNow() - ts)} ago` : "—");
const pct = (v) => (v === null || v === undefined ? "n/a" : `${(v * 100).toFixed(1)}%`);
const badge = (text, cls) => el("span", { class: `badge s-${cls || text}` }, text);

function replaceRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

async function fetchJSON(path) {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
  try {
    const response = await fetch(path, { cache: "no-store", signal: ctl.signal });
    let body = null;
    try { body = await response.json(); } catch (_) { body = null; }
    return { status: response.status, body };
  } catch (err) {
    throw new Error(err.name === "AbortError" ? `no answer within ${FETCH_TIMEOUT_MS / 1000} s` : "connection failed");
  } finally {
    clearTimeout(timer);
  }
}

// ---- reachability ----------------------------------------------------------------------------------------------
function reachable() {
  ui.lastOk = Date.now() / 1000;
  ui.downSince = null;
  ui.downReason = "";
}

function unreachable(reason) {
  if (ui.downSince === null) ui.downSince = Date.now() / 1000;
  ui.downReason = reason;
}

function renderConnection() {
  const banner = $("banner");
  const conn = $("conn");
  const down = ui.downSince !== null;
  document.body.classList.toggle("stale", down);
  banner.hidden = !down;
  if (down) {
    const last = ui.lastOk ? `; the data below is from ${clock(ui.lastOk)}` : "";
    banner.textContent = `agent unreachable since ${clock(ui.downSince)} (${ui.downReason}); ` +
      `retrying every ${STATUS_MS / 1000} s${last}`;
    conn.className = "conn down";
    conn.textContent = "unreachable";
  } else if (ui.lastOk) {
    conn.className = "conn ok";
    conn.textContent = `live · updated ${clock(ui.lastOk)}`;
  }
}

// ---- this node: header and components ------------------------------------------------------------------------
function renderHeader(st) {
  const node = st.node || {};
  $("node").textContent = node.name || "dsv4-agent";
  $("node-meta").textContent = `${node.role || ""} · ${node.ip || ""} · cluster ${node.cluster || "?"}`;
  const agent = st.agent || {};
  $("agent-line").textContent = `dsv4-agent ${agent.version || "?"} · pid ${agent.pid || "?"} · up ` +
    `${dur(agent.uptime_s)}${agent.stopping ? " · STOPPING" : ""} · ${agent.config || ""}`;
  document.title = `${node.name || "dsv4-agent"} — dsv4-agent`;
  const flags = [];
  if (st.paused) {
    const p = st.pause || {};
    flags.push(badge(`paused (${p.scope || "node"}) by ${p.by || "?"} ${ago(p.at)}`, "warn"));
  }
  if (st.redeploying) flags.push(badge("node redeploy in progress", "running"));
  const policy = st.node_policy || {};
  if (policy.failed) flags.push(badge(`node FAILED: ${policy.failed_reason || ""}`, "failed"));
  if (policy.redeploys_total) flags.push(el("span", { class: "muted" }, ` ${policy.redeploys_total} redeploys`));
  $("node-flags").replaceChildren(...flags);
  const box = st.container;
  $("container-line").hidden = !box;
  $("container-line").textContent = box ? containerLine(box) : "";
  const alerts = nodeAlerts(st);
  $("node-alerts").hidden = !alerts.length;
  $("node-alerts").replaceChildren(...alerts.map((line) => el("div", {}, line)));
}

// In container mode, the node's container: the same line as nodeagent/api/node_alerts.py's container_line.
function containerLine(box) {
  let text = `container ${box.name} (${box.engine}, ${box.image})`;
  text += box.up ? ` ${box.id} up since ${box.up_since}` : ` NOT UP: ${box.held}`;
  if (box.deaths) text += ` · died ${box.deaths}x, last: ${(box.last_death || {}).detail}`;
  return text;
}

// The node-wide states an operator must see first: the same lines as nodeagent/api/node_alerts.py.
function nodeAlerts(st) {
  const lines = [];
  if (st.isolated) lines.push(`ISOLATED: ${st.isolated} — its NPU users stay stopped until \`nodeagentctl uncordon\``);
  const rung = (st.recovery || {}).rung;
  if (rung) {
    const chips = (rung.chips || []).join(", ");
    const on = chips ? ` of npu ${chips}` : "";
    if (rung.step === "failed") {
      lines.push(`CHIP RESET FAILED${on}: ${rung.why} — the NPU users stay stopped; the ladder judges again after ` +
        "its pause (another reset, or isolation)");
    } else {
      lines.push(`CHIP RESET IN PROGRESS${on} (step ${rung.step}): ${rung.why} — every NPU user here is stopped, ` +
        "its groups drained");
    }
  }
  return lines;
}

function componentNote(c) {
  if (c.held) return `held: ${c.held}`;
  if (c.failure) {
    const f = c.failure;
    return `failed: ${f.what || ""}${f.detail ? ` — ${f.detail}` : ""}${f.permanent ? ` (permanent: ${f.permanent})` : ""}`;
  }
  if (c.backoff_remaining_s) return `backoff: next try in ${dur(c.backoff_remaining_s)}`;
  if (c.load && c.load.loading_s != null) return c.load.note;
  if (c.draining) {
    const d = c.draining;
    return `draining: ${d.running} running, ${d.waiting} waiting, at most ${dur(d.remaining_s)} more`;
  }
  const blockers = Object.entries(c.ready_blockers || {});
  if (blockers.length) return `not ready: ${blockers.map(([k, v]) => `${k}: ${v}`).join("; ")}`;
  const policy = c.policy || {};
  if (policy.crash_loop) return `crash loop (${policy.failures_in_window} failures)`;
  if (c.kind === "vllm" && c.load) return c.load.note;
  return "";
}

function probeLines(c) {
  const roles = (c.probes && c.probes.roles) || {};
  const lines = [];
  for (const role of ROLES) {
    const r = roles[role];
    if (!r || !r.probes || !r.probes.length) continue;
    for (const p of r.probes) {
      const last = p.last;
      const mark = !last ? el("span", { class: "unk-mark" }, "…")
        : last.ok ? el("span", { class: "ok-mark" }, "✓") : el("span", { class: "bad-mark" }, "✗");
      const detail = last
        ? ` ${p.kind}: ${last.detail} (${Math.round((last.latency_s || 0) * 1000)} ms, ${ago(last.at)})`
        : ` ${p.kind}: not run yet`;
      const failures = p.consecutive_failures ? ` · ${p.consecutive_failures} failing in a row` : "";
      lines.push(el("div", { class: "probe", title: `${role} ${p.kind} ${p.target}\n${last ? last.detail : ""}`,
        "data-role": role },
      el("span", { class: "role" }, role), " ", badge(r.status, r.status), " ", mark, detail, failures));
    }
  }
  return lines.length ? lines : [el("span", { class: "muted" }, "no probes")];
}

function renderComponents(st) {
  const rows = [];
  for (const [name, c] of Object.entries(st.components || {})) {
    const exit = c.last_exit ? `${c.last_exit.reason || "exited"} · ${ago(c.last_exit.at)}` : "—";
    rows.push(el("tr", { "data-component": name },
      el("td", { "data-field": "name" }, el("b", {}, name), " ", el("span", { class: "muted" }, c.kind)),
      el("td", { "data-field": "state" }, badge(c.state), c.ready ? "" : el("span", { class: "muted" }, " not ready")),
      el("td", { "data-field": "desired" }, c.desired || ""),
      el("td", { "data-field": "pid", class: "num mono" }, c.pid ?? "—"),
      el("td", { "data-field": "uptime", class: "num" }, dur(c.uptime_s)),
      el("td", { "data-field": "restarts", class: "num" }, c.restarts ?? 0),
      el("td", { "data-field": "last_exit" }, exit),
      el("td", { "data-field": "note", class: "note" }, componentNote(c)),
      el("td", { "data-field": "probes" }, probeLines(c))));
  }
  replaceRows($("components").tBodies[0], rows);
}

function renderHostSections(st) {
  const parts = [];
  const pre = st.preflight;
  if (pre) {
    const counts = Object.entries(pre.counts || {}).map(([k, v]) => `${v} ${k}`).join(", ");
    const failed = (pre.failed || []).length ? ` · failed: ${pre.failed.join(", ")}` : "";
    const warned = (pre.warnings || []).length ? ` · warnings: ${pre.warnings.join(", ")}` : "";
    parts.push(el("div", { class: "host", "data-section": "preflight" }, el("b", {}, "preflight"),
      `${pre.mode}: ${counts}${failed}${warned}`,
      (pre.blocking || []).length ? el("span", { class: "note" }, ` — holds the stack: ${pre.blocking.join("; ")}`) : ""));
  }
  const npu = st.npu;
  if (npu) {
    let text;
    if (!npu.checked) text = `not checked: ${npu.skipped || "?"}`;
    else {
      const faults = (npu.faults || []).map((f) => `${f.npu ?? "node"} ${f.what} ${f.level}${f.overridden ? " (overridden)" : ""}`);
      text = `${(npu.npus || []).length} chips seen, ${npu.expected_npus} NPUs expected, polled ${ago(npu.polled_at)}` +
        (faults.length ? ` · faults: ${faults.join("; ")}` : " · no faults");
    }
    const start = npu.start || {};
    parts.push(el("div", { class: "host", "data-section": "npu" }, el("b", {}, "NPUs"), text,
      start.allowed === false ? el("span", { class: "note" }, ` — vLLM start held: ${(start.reasons || []).join("; ")}`) : ""));
  }
  const mqtt = st.mqtt;
  if (mqtt) {
    const link = mqtt.connected ? `connected to ${mqtt.broker} since ${clock(mqtt.connected_since)}`
      : `NOT connected to ${mqtt.broker}${mqtt.last_error ? `: ${mqtt.last_error}` : ""}`;
    parts.push(el("div", { class: "host", "data-section": "mqtt" }, el("b", {}, "MQTT"),
      `${link} · queued ${mqtt.queued}, dropped ${mqtt.dropped}, published ${mqtt.published}`));
  }
  $("host-sections").replaceChildren(...parts);
}

async function pollStatus() {
  try {
    const r = await fetchJSON("/status");
    if (r.status !== 200 || !r.body) throw new Error(`HTTP ${r.status}`);
    const agent = r.body.agent || {};
    if (agent.started_at && agent.uptime_s !== undefined) {
      ui.offset = agent.started_at + agent.uptime_s - Date.now() / 1000;
    }
    ui.status = r.body;
    reachable();
  } catch (err) {
    unreachable(err.message);
  }
  if (ui.status) {
    renderHeader(ui.status);
    renderComponents(ui.status);
    renderHostSections(ui.status);
    renderCache(); // its notes follow the components' state
  }
  renderConnection();
  setTimeout(pollStatus, STATUS_MS);
}

// ---- the cluster -----------------------------------------------------------------------------------------------
function memberComponents(record) {
  return Object.entries(record.components || {}).map(([n, c]) => `${n} ${c.state}${c.ready ? " ✓" : ""}` +
    (c.load ? ` (${c.load})` : c.last_load_s != null ? ` (load ${dur(c.last_load_s)})` : "")).join(" · ");
}

function gangBarrier(g) {
  const barrier = g.barrier || {};
  const arrived = barrier.arrived || [];
  if (barrier.released) return `released${arrived.length ? ` · arrived: ${arrived.join(", ")}` : ""}`;
  if (!arrived.length) return "—";
  const waiting = (g.nodes || []).filter((n) => !arrived.includes(n));
  return `waiting for ${waiting.join(", ") || "release"} · arrived: ${arrived.join(", ")}`;
}

function renderCluster() {
  const note = $("cluster-note");
  const members = $("members");
  const gangs = $("gangs");
  if (ui.status && !ui.status.cluster) {
    note.hidden = false;
    note.className = "note plain";
    note.textContent = "Single-node config: this config lists no cluster.nodes, so there is no cluster table " +
      "(members, groups, gangs).";
    members.hidden = gangs.hidden = true;
    $("cluster-warnings").replaceChildren();
    $("cluster-meta").textContent = "";
    $("coordination-extra").textContent = "";
    return;
  }
  const view = ui.cluster;
  if (!view) return;
  note.hidden = true;
  const etcd = view.etcd || {};
  $("cluster-meta").textContent = `${view.cluster} · seen from ${view.self} · etcd ${etcd.state || "?"}` +
    `${etcd.endpoint ? ` (${etcd.endpoint})` : ""}${etcd.last_error && etcd.state !== "reachable" ? `: ${etcd.last_error}` : ""}` +
    `${view.view_complete ? "" : " · view not complete yet"}`;
  const warnings = view.warnings || [];
  const items = warnings.map((w) => el("li", { "data-code": w.code, "data-node": w.node }, `${w.code} · ${w.node}: ${w.message}`));
  if (view.conflict) items.unshift(el("li", {}, `name conflict: ${JSON.stringify(view.conflict)}`));
  $("cluster-warnings").replaceChildren(...items);
  const byNode = {};
  for (const w of warnings) (byNode[w.node] = byNode[w.node] || []).push(w.code);
  const rows = (view.members || []).map((m) => {
    const cls = [m.present ? "" : "missing", m.name === view.self ? "self" : ""].join(" ").trim();
    const ranks = m.ranks ? (m.ranks.count > 1 ? `${m.ranks.start}–${m.ranks.start + m.ranks.count - 1}` : `${m.ranks.start}`) : "—";
    const link = m.present && m.api_url && m.name !== view.self
      ? el("a", { href: `${m.api_url}/ui`, title: "this member's own status page" }, " ↗") : "";
    const offset = m.clock_offset_s === null || m.clock_offset_s === undefined ? "—"
      : `${m.clock_offset_s >= 0 ? "+" : ""}${m.clock_offset_s.toFixed(3)} s`;
    return el("tr", { class: cls, "data-member": m.name },
      el("td", { "data-field": "name" }, m.name, m.name === view.self ? el("span", { class: "muted" }, " (this node)") : "", link,
        m.listed === false ? el("span", { class: "note" }, " (not in the cluster file)") : ""),
      el("td", { "data-field": "role" }, m.role || ""),
      el("td", { "data-field": "ip", class: "mono" }, m.ip || ""),
      el("td", { "data-field": "group" }, m.group || "—"),
      el("td", { "data-field": "ranks" }, ranks),
      el("td", { "data-field": "present" }, m.present ? badge("present", "ok") : badge("missing", "missing")),
      el("td", { "data-field": "age", class: "num" }, m.present ? dur(m.age_s) : "—"),
      el("td", { "data-field": "offset", class: "num" }, offset),
      el("td", { "data-field": "components" }, m.present ? memberComponents(m) : ""),
      el("td", { "data-field": "warnings", class: "note" }, (byNode[m.name] || []).join(", ")));
  });
  members.hidden = false;
  replaceRows(members.tBodies[0], rows);

  const co = view.coordination || {};
  const gangRows = Object.entries(co.gangs || {}).map(([name, g]) => {
    const state = [g.pending ? "restart pending" : "", g.crash_loop ? "crash loop" : "",
      g.acted !== null && g.acted !== undefined ? `acted on ${g.acted}` : ""].filter(Boolean).join(" · ");
    return el("tr", { "data-gang": name },
      el("td", { "data-field": "name" }, name),
      el("td", { "data-field": "kind" }, g.kind || ""),
      el("td", { "data-field": "nodes" }, (g.nodes || []).join(", ")),
      el("td", { "data-field": "generation", class: "num" }, g.generation ?? "—"),
      el("td", { "data-field": "reason" }, g.reason ? `${g.reason}${g.by ? ` (by ${g.by})` : ""}` : "—"),
      el("td", { "data-field": "barrier" }, gangBarrier(g)),
      el("td", { "data-field": "state" }, state || "—"));
  });
  gangs.hidden = gangRows.length === 0;
  replaceRows(gangs.tBodies[0], gangRows);
  const extra = [];
  if (co.etcd) extra.push(`coordination: etcd ${co.etcd}`);
  if (co.pause) extra.push(`cluster paused by ${co.pause.by || "?"}${co.pause.reason ? `: ${co.pause.reason}` : ""}`);
  if (co.redeploy) extra.push(`cluster redeploy ${co.redeploy.id || ""}: ${co.redeploy.here || "pending"}`);
  for (const p of co.proxies || []) extra.push(`proxy ${p.proxy}: ${JSON.stringify(p.groups)}`);
  $("coordination-extra").textContent = extra.join(" · ");
  renderRollout(view.rollout);
}

function renderRollout(r) {
  // The plan, the step in progress, the floor and the time left (GET /cluster's `rollout`).
  const box = $("rollout");
  box.hidden = !r;
  if (!r) return;
  const steps = r.steps || [];
  const cur = r.current;
  const where = cur !== null && cur !== undefined && steps[cur] ? ` · step ${cur + 1}/${steps.length} ` +
    `${(steps[cur].groups || []).join(", ")} ${steps[cur].phase}` : "";
  // the floor: why the next step waits, else what serves per kind now (firstpaint.py writes the same lines)
  // under way: a copy of nodeagent/cluster/rollout_states.py's UNDER_WAY (tests/test_ui.py compares them)
  const moving = ["running", "paused", "rolling_back", "aborting"].includes(r.status);
  const out = Object.keys(r.held_out || {});
  $("rollout-meta").textContent = `${r.id} · ${r.status}${where}`;
  $("rollout-floor").textContent = moving ? `floor: ${r.floor || "?"} · time left ${dur(r.time_left_s)}` +
    (out.length ? ` · out of the proxy: ${out.join(", ")}` : "") : "";
  $("rollout-message").textContent = r.message || "";
  replaceRows($("rollout-steps").tBodies[0], steps.map((s, i) => el("tr", { "data-step": String(i + 1) },
    el("td", { class: "num" }, String(i + 1)),
    el("td", { "data-field": "groups" }, (s.groups || []).join(", ")),
    el("td", { "data-field": "phase" }, badge(s.phase, s.phase === "done" ? "ok" : s.failed ? "failed" : "starting")),
    el("td", { "data-field": "since" }, s.since ? ago(s.since) : "—"),
    el("td", { "data-field": "note", class: "note" }, [s.rollback ? "rollback" : "", s.failed || "", s.note || "",
      outageText(s)].filter(Boolean).join(" · ")))));
}

function outageText(s) {
  // What the step measured out of the proxy beside what its plan expected (cluster/rollout/states.py: outage_text).
  const actual = s.out_of_proxy_s, expected = s.expected_outage_s;
  if (typeof actual !== "number") return "";
  return `out of the proxy ${actual.toFixed(1)} s` + (typeof expected === "number" ? ` (expected ~${expected.toFixed(1)} s)` : "");
}

async function pollCluster() {
  // Only where /status has a cluster section: a single node has no /cluster to ask (it would answer 404).
  if (ui.status && ui.status.cluster) {
    try {
      const r = await fetchJSON("/cluster");
      if (r.status === 200 && r.body) ui.cluster = r.body;
    } catch (_) {
      // reachability is the status poll's business; keep the last view
    }
  }
  renderCluster();
  setTimeout(pollCluster, CLUSTER_MS);
}

// ---- the cache plot --------------------------------------------------------------------------------------------
function latestRates(samples, name) {
  for (let i = samples.length - 1; i >= 0; i--) {
    const row = samples[i].components[name];
    if (row) return { ts: samples[i].ts, row };
  }
  return null;
}

function renderCache() {
  const data = ui.cache;
  const box = $("cache-plots");
  if (!data) return;
  const minutes = Math.round(data.history_s / 60);
  $("cache-meta").textContent = `last ${minutes} min, one sample every ${data.period_s} s` +
    (data.last_scrape_at ? ` · last scrape ${clock(data.last_scrape_at)}` : "");
  if (!data.components.length) {
    box.replaceChildren(el("div", { class: "note plain" }, "No vLLM component on this node: nothing to plot."));
    return;
  }
  const width = Math.max(320, box.clientWidth || 800);
  const plots = data.components.map((name) => {
    const latest = latestRates(data.samples, name);
    const legend = el("div", { class: "legend" }, RATIOS.map((kind) => el("span", { "data-kind": kind },
      el("span", { class: `swatch c-${kind}` }), `${RATIO_LABELS[kind]} `, el("b", {}, latest ? pct(latest.row[kind]) : "n/a"))));
    let status = "";
    if (data.scrape_ok[name] === false) status = `its /metrics did not answer at the last scrape`;
    else if (!data.latest[name]) {
      const comp = ui.status && ui.status.components && ui.status.components[name];
      status = comp && comp.up ? `up since the last scrape: the next one within ${data.period_s} s`
        : `not up${comp ? ` (${comp.state})` : ""}: no samples while it is down or loading`;
    }
    else if (latest) status = `${Math.round(latest.row.queries)} prompt tokens looked up so far`;
    const engines = (data.latest[name] || []).filter((r) => r.engine !== "all");
    const engineText = engines.length > 1
      ? ` · engines: ${engines.map((r) => `${r.engine} ${pct(r.local_total)}/${pct(r.eff_total)}`).join(", ")}` : "";
    return el("div", { class: "plot", "data-component": name },
      el("h3", {}, name, " ", el("span", { class: data.scrape_ok[name] === false ? "note" : "muted" }, status + engineText)),
      legend, data.samples.length ? hitRatePlot(name, data, width)
        : el("div", { class: "note plain" }, `waiting for the first scrape (one every ${data.period_s} s)`));
  });
  box.replaceChildren(...plots);
}

async function pollCache() {
  // The whole history once, then only the samples after the newest one held; another history (the agent or its
  // API restarted) is fetched whole again.
  let period = 5;
  let next = null;
  const held = ui.cache ? ui.cache.samples : [];
  try {
    const r = await fetchJSON(held.length ? `/cache?since=${held[held.length - 1].ts}` : "/cache");
    if (r.status === 200 && r.body && held.length && ui.cache.started_at !== r.body.started_at) {
      ui.cache = null;
      next = 0;
    } else if (r.status === 200 && r.body) {
      const oldest = r.body.now - r.body.history_s;
      ui.cache = { ...r.body, samples: held.concat(r.body.samples).filter((s) => s.ts >= oldest) };
      period = r.body.period_s;
      renderCache();
    } else if (r.status === 404) {
      $("cache-plots").replaceChildren(el("div", { class: "note plain" }, (r.body && r.body.error) || "no cache history"));
    }
  } catch (_) {
    // keep the last plot
  }
  setTimeout(pollCache, next ?? Math.min(5, Math.max(1, period)) * 1000);
}

// ---- events ----------------------------------------------------------------------------------------------------
let eventsQueued = false;

function renderEvents() {
  eventsQueued = false;
  const list = [...ui.events.values()].sort((a, b) => b.seq - a.seq);
  const rows = list.map((e) => el("tr", { class: `ev-${e.level}`, "data-seq": e.seq, "data-event": e.event,
    "data-component": e.component || "" },
  el("td", { class: "num" }, clock(e.ts)),
  el("td", { class: "num muted" }, e.seq),
  el("td", {}, el("span", { class: `badge l-${e.level}` }, e.level)),
  el("td", {}, e.component || "—"),
  el("td", {}, e.event),
  el("td", {}, e.message)));
  replaceRows($("events").tBodies[0], rows);
  $("events-meta").textContent = `${list.length} shown · ${ui.eventsLive ? "live" : "reconnecting…"}`;
}

function queueEvents() {
  if (!eventsQueued) {
    eventsQueued = true;
    requestAnimationFrame(renderEvents);
  }
}

function addEvent(event) {
  ui.events.set(event.seq, event);
  if (ui.events.size > MAX_EVENTS) {
    const oldest = [...ui.events.keys()].sort((a, b) => a - b).slice(0, ui.events.size - MAX_EVENTS);
    for (const seq of oldest) ui.events.delete(seq);
  }
  queueEvents();
}

function followEvents() {
  // EventSource reconnects by itself after a lost connection (sending Last-Event-ID, so the agent replays what
  // was missed); after a refused one (an HTTP error) it gives up, so start a new one.
  const source = new EventSource("/events?replay=100");
  source.onopen = () => { ui.eventsLive = true; queueEvents(); };
  source.onmessage = (msg) => {
    try { addEvent(JSON.parse(msg.data)); } catch (_) { /* not an event */ }
  };
  source.onerror = () => {
    ui.eventsLive = false;
    queueEvents();
    if (source.readyState === EventSource.CLOSED) setTimeout(followEvents, EVENTS_RECONNECT_MS);
  };
}

window.addEventListener("resize", renderCache);
pollStatus();
pollCluster();
pollCache();
followEvents();
