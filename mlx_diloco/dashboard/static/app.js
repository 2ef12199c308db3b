// The dashboard's page: asks the server for the run (api/run) every second, until the run has its
// summary, and draws it: a post-training run's held-out accuracy, reward and KL, and what generating
// cost (a collapse said above all), the ring, the workers, loss against steps and against wall-clock
// time (with the events as dashed lines), the exchanges and the events. Charts by uPlot (static/vendor).
// What the page shows is also in data- attributes (counts, states), for tests and scripts.
"use strict";

const token = new URLSearchParams(location.search).get("token");
const API = "api/run" + (token ? "?token=" + encodeURIComponent(token) : "");
const COLORS = { eval: "#2563eb", train: "#f59e0b" };
const LINKS = [[/thunderbolt/i, "#7c3aed"], [/ethernet|gbe|data center/i, "#2563eb"], [/wi-?fi/i, "#d97706"]];
const STATE_COLORS = { training: "#16a34a", syncing: "#2563eb", waiting: "#d97706", starting: "#6b7280",
  restarting: "#7c3aed", failed: "#dc2626", lost: "#991b1b", done: "#374151" };
// Where a worker's wall-clock went (training/clock.py's split, records.TIME; a cluster's restarts, the
// launcher's): the parts and their names as the server sends them (time_parts), coloured in this order.
let TIME_PARTS = [];
const TIME_COLORS = ["#9ca3af", "#16a34a", "#0d9488", "#2563eb", "#f59e0b", "#db2777", "#0891b2", "#7c3aed"];
// data-compute: compute's share of the time the workers trained or waited on each other (the measured
// utilisation: start-up, saves and evaluations apart), the number a script reads off the page.
const COMPUTE = "compute_s", WAITS = ["compute_s", "link_s", "straggler_s", "restart_s"];
const computeShare = t => { const w = WAITS.reduce((a, k) => a + (t[k] || 0), 0); return w ? (t[COMPUTE] || 0) / w : ""; };
const charts = {};
let events = [];  // the run's events that the wall-clock chart marks (all but the shards shipped)

// ------------------------------------------------------------ small helpers
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("data-")) node.setAttribute(k, v); else node[k] = v;
  }
  node.append(...children.filter(c => c !== null && c !== undefined));
  return node;
}
function svg(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
const num = (x, digits = 3) => (x === null || x === undefined) ? "—" : Number(x).toPrecision(digits);
const count = x => (x === null || x === undefined) ? "—" : Math.round(x).toLocaleString("en-US");
function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return n.toFixed(n < 10 && i ? 1 : 0) + " " + units[i];
}
const seconds = s => (s === null || s === undefined) ? "—" : s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s";
const clock = t => new Date(t * 1000).toLocaleTimeString("en-GB");
const linkColor = kind => (LINKS.find(([re]) => re.test(kind || "")) || [null, "#6b7280"])[1];
const stateBadge = state => el("span", { className: "state state-" + state, title: state }, state);

// ------------------------------------------------------------ the parts of the page
function renderHeader(run) {
  const c = run.config || {}, s = run.status || {};
  document.getElementById("run-name").textContent = run.run;
  const step = s.step !== undefined ? `step ${s.step} of ${s.steps}` : "";
  const where = s.source === "launch" ? "a cluster" : "simulated workers";
  document.getElementById("run-about").textContent =
    [c.strategy && `${c.strategy} × ${c.workers}`, c.model && `model ${c.model}`, step, s.source && `on ${where}`]
      .filter(Boolean).join(" · ");
}

function renderRing(run) {
  const hops = run.ring || [], box = document.getElementById("ring");
  const states = Object.fromEntries(((run.status || {}).workers || []).map(w => [w.worker, w.state]));
  box.replaceChildren();
  box.dataset.hops = hops.length;
  const n = hops.length, cx = 180, cy = 150, r = n > 1 ? 105 : 0;
  const at = i => [cx + r * Math.sin(2 * Math.PI * i / n), cy - r * Math.cos(2 * Math.PI * i / n)];
  hops.forEach((hop, i) => {  // the link from each rank to the next
    if (n < 2) return;
    const [x1, y1] = at(i), [x2, y2] = at((i + 1) % n), color = linkColor(hop.kind);
    box.append(svg("line", { x1, y1, x2, y2, stroke: color, "stroke-width": 3,
      "stroke-dasharray": hop.modelled ? "6 4" : "none" }));
    if (hop.modelled || n > 8) return;  // one link for all (said below), or too many to label
    const mx = (x1 + x2) / 2, my = (y1 + y2) / 2, out = Math.hypot(mx - cx, my - cy) || 1;
    const x = mx + 34 * (mx - cx) / out, y = my + 22 * (my - cy) / out;
    box.append(svg("text", { x, y, "text-anchor": "middle", style: `fill:${color}` }, hop.kind || "link ?"));
    box.append(svg("text", { x, y: y + 13, "text-anchor": "middle" },
      hop.gbps ? `${num(hop.gbps, 3)} Gbit/s` + (hop.latency_ms ? ` · ${num(hop.latency_ms, 2)} ms` : "") : "not measured"));
  });
  hops.forEach((hop, i) => {
    const [x, y] = at(i), state = states[hop.worker];
    box.append(svg("circle", { cx: x, cy: y, r: 17, fill: STATE_COLORS[state] || "#9ca3af", stroke: "#fff", "stroke-width": 2 }));
    box.append(svg("text", { x, y: y + 4, "text-anchor": "middle", class: "node-label", fill: "#fff" }, `w${hop.worker}`));
    if (hop.host && hop.host !== "sim") box.append(svg("text", { x, y: y + 31, "text-anchor": "middle" }, hop.host));
  });
  const modelled = hops.length && hops[0].modelled;
  document.getElementById("ring-note").textContent = !hops.length ? "no ring yet" :
    modelled ? `simulated: every link is a modelled ${hops[0].kind} (${num(hops[0].gbps, 3)} Gbit/s, ` +
      `${num(hops[0].latency_ms, 2)} ms; --link) that times the exchanges` :
    hops.some(h => h.gbps) ? "each link's kind and measured speed, from this ring's start" :
    "the ring in rank order; its links not measured";
}

// A worker's seconds by part: its own split (time_s), and on a cluster the launcher's restarts.
function timeOf(w) {
  const t = Object.assign({}, w.time_s || {});
  if (w.restart_s) t.restart_s = (t.restart_s || 0) + w.restart_s;
  return t;
}

// A bar of the worker's time split as TIME_PARTS, its seconds in the tooltip.
function timeBar(w) {
  const t = timeOf(w), total = TIME_PARTS.reduce((a, [key]) => a + (t[key] || 0), 0);
  if (!total) return "—";
  const title = TIME_PARTS.map(([key, name]) => `${name} ${seconds(t[key] || 0)}`).join(", ");
  return el("span", { className: "time", title, "data-compute": computeShare(t) },
    ...TIME_PARTS.map(([key], i) => el("i", { style: `width:${100 * (t[key] || 0) / total}%;background:${TIME_COLORS[i]}` })));
}

// The job's time: the workers' sums, as shares, and the job's MFU (their mean).
function renderTimeNote(workers) {
  const times = workers.map(timeOf);
  const sums = TIME_PARTS.map(([key]) => times.reduce((a, t) => a + (t[key] || 0), 0));
  const total = sums.reduce((a, b) => a + b, 0), mfus = workers.filter(w => w.mfu).map(w => w.mfu);
  const note = document.getElementById("time-note");
  note.replaceChildren(...(!total ? ["where the time went: no step yet"] : ["all workers:",
    ...TIME_PARTS.map(([, name], i) => sums[i] ? el("span", {}, el("span", { className: "key",
      style: `background:${TIME_COLORS[i]}` }), `${name} ${(100 * sums[i] / total).toFixed(1)}%`) : ""),
    mfus.length ? ` · MFU ${(100 * mfus.reduce((a, b) => a + b, 0) / mfus.length).toFixed(1)}%` : ""]));
  note.dataset.compute = total ? computeShare(Object.fromEntries(TIME_PARTS.map(([key], i) => [key, sums[i]]))) : "";
}

function renderWorkers(run) {
  const workers = (run.status || {}).workers || [];
  TIME_PARTS = run.time_parts || TIME_PARTS;
  renderTimeNote(workers);
  const rows = workers.map(w => {
    const memory = w.memory_bytes ? el("span", {},
      w.memory_limit_bytes ? el("span", { className: "memory", title: "memory against its limit" },
        el("i", { style: `width:${Math.min(100, 100 * w.memory_bytes / w.memory_limit_bytes)}%` })) : null,
      bytes(w.memory_bytes) + (w.memory_limit_bytes ? " / " + bytes(w.memory_limit_bytes) : "")) :
      (w.memory_limit_bytes ? "limit " + bytes(w.memory_limit_bytes) : "—");
    return el("tr", { "data-worker": w.worker ?? "", "data-state": w.state },
      el("td", {}, w.worker ?? "—"), el("td", {}, w.host || "—"),
      el("td", { title: (run.states || {})[w.state] || "" }, stateBadge(w.state)),
      el("td", {}, w.step ?? "—"), el("td", {}, num(w.steps_per_s)), el("td", {}, count(w.tokens_per_s)),
      el("td", {}, num(w.loss, 4)), el("td", {}, memory), el("td", {}, timeBar(w)),
      el("td", {}, w.mfu ? (100 * w.mfu).toFixed(1) + "%" : "—"));
  });
  document.querySelector("#workers tbody").replaceChildren(...rows);
}

// Vertical dashed lines at the events' times, with their names.
const eventMarkers = { hooks: { draw: [u => {
  const ctx = u.ctx, top = u.bbox.top, height = u.bbox.height, ratio = devicePixelRatio || 1;
  ctx.save();
  ctx.setLineDash([5 * ratio, 4 * ratio]);
  ctx.lineWidth = 1.5 * ratio;
  ctx.font = `${11 * ratio}px sans-serif`;
  ctx.textAlign = "left";  // uPlot leaves its axes' alignment set
  ctx.textBaseline = "alphabetic";
  const free = [-Infinity, -Infinity, -Infinity];  // where each of three label rows is free from
  events.forEach(e => {
    const x = u.valToPos(e.time, "x", true);
    if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) return;
    const color = /failure|left|refused/.test(e.event) ? "#dc2626" : /waiting|joining/.test(e.event) ? "#d97706" : "#16a34a";
    ctx.strokeStyle = ctx.fillStyle = color;
    ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
    const row = free.findIndex(f => f <= x);  // a label that fits nowhere is left out (the list has it)
    if (row < 0) return;
    ctx.fillText(e.event, x + 3 * ratio, top + 12 * (row + 1) * ratio);
    free[row] = x + ctx.measureText(e.event).width + 8 * ratio;
  });
  ctx.restore();
}] } };

function lossChart(id, xLabel, time) {
  const box = document.getElementById(id);
  const series = [{ label: xLabel, value: time ? (u, v) => v === null ? "—" : clock(v) : undefined },
    { label: "eval loss", stroke: COLORS.eval, width: 2, spanGaps: true, points: { show: true, size: 6 } },
    { label: "train loss", stroke: COLORS.train, width: 1.5, spanGaps: true, points: { show: true, size: 4 } }];
  const range = (u, min, max) => {  // the events too, on the wall-clock chart
    const times = time ? events.map(e => e.time) : [];
    const lo = Math.min(min ?? Infinity, ...times), hi = Math.max(max ?? -Infinity, ...times);
    const pad = time ? Math.max(1, (hi - lo) * 0.03) : lo === hi ? 1 : 0;  // room for the edge markers' labels
    return [lo - pad, hi + pad];
  };
  return new uPlot({ width: box.clientWidth || 500, height: 260, series, plugins: time ? [eventMarkers] : [],
    scales: { x: { time, range } }, axes: [{ label: xLabel }, { label: "loss" }], legend: { live: true } },
  [[], [], []], box);
}

function renderLoss(run) {
  events = (run.events || []).filter(e => e.event !== "shipped");
  charts.steps = charts.steps || lossChart("loss-steps", "step", false);
  charts.time = charts.time || lossChart("loss-time", "wall-clock", true);
  const rows = (run.metrics || []).filter(r => r.eval_loss !== null || r.train_loss !== null);
  const timed = rows.filter(r => typeof r.time === "number");
  const columns = (list, x) => [list.map(x), list.map(r => r.eval_loss), list.map(r => r.train_loss)];
  charts.steps.setData(columns(rows, r => r.step));
  charts.time.setData(columns(timed, r => r.time));
  document.getElementById("loss-steps").dataset.points = rows.filter(r => r.eval_loss !== null).length;
  document.getElementById("loss-time").dataset.points = timed.filter(r => r.eval_loss !== null).length;
  document.getElementById("loss-time").dataset.markers = events.length;
}

// ------------------------------------------------------------ post-training (a run with an objective)
// Each objective's curves against steps (its metrics rows' keys, records.OBJECTIVE, whose help the server
// sends as metric_help): [key, name, colour, scale]; a chart's first scale is on its left, a second on
// its right. Held out: GRPO's greedy accuracy (and reward), DPO's and ORPO's pair accuracy beside the
// chosen answers' log-probability (a preference learnt by unlearning the answer shows there); GRPO's
// training reward and KL to the reference.
const POST_CURVES = {
  grpo: { held: [["eval_accuracy", "held-out accuracy", "#16a34a", "share"], ["eval_reward", "held-out reward", "#d97706", "reward"]],
          reward: [["reward", "reward", "#2563eb", "reward"], ["kl", "KL to the reference", "#dc2626", "kl"]] },
  pairs: { held: [["eval_pair_accuracy", "held-out pair accuracy", "#16a34a", "share"],
                  ["eval_logps_chosen", "chosen answers' log-probability", "#7c3aed", "nats"]] },
};
const WORK_COLORS = { generate: "#0d9488", train: "#16a34a" };  // as the time bars' generation and compute

function postChart(id, curves) {
  const box = document.getElementById(id), scales = [...new Set(curves.map(c => c[3]))];
  const series = [{ label: "step" }, ...curves.map(([, label, stroke, scale]) =>
    ({ label, stroke, scale, width: 2, spanGaps: true, points: { show: true, size: 5 } }))];
  const axes = [{ label: "step" }, ...scales.map((scale, i) => ({ scale, side: i ? 1 : 3, grid: { show: !i },
    label: curves.filter(c => c[3] === scale).map(c => c[1]).join(", ") }))];
  return new uPlot({ width: box.clientWidth || 500, height: 240, series, axes, legend: { live: true },
    scales: { x: { time: false }, share: { range: [0, 1] } } }, [[], ...curves.map(() => [])], box);
}

function renderPostTraining(run) {
  const objective = (run.config || {}).objective || "sft", section = document.getElementById("post-section");
  section.hidden = objective === "sft";
  section.dataset.objective = objective;
  if (section.hidden) return;
  const grpo = objective === "grpo", curves = POST_CURVES[grpo ? "grpo" : "pairs"], help = run.metric_help || {};
  document.getElementById("post-objective").textContent = grpo ?
    "GRPO: completions sampled, rewarded and trained on" : `${objective.toUpperCase()} on preference pairs`;
  const rows = (run.metrics || []).filter(r => typeof r.step === "number");
  document.getElementById("post-reward-box").hidden = !curves.reward;
  for (const [part, id] of [["held", "post-held-out"], ["reward", "post-reward"]]) {
    if (!curves[part]) continue;
    const box = document.getElementById(id);
    charts[id] = charts[id] || postChart(id, curves[part]);
    const shown = rows.filter(r => curves[part].some(([key]) => typeof r[key] === "number"));
    charts[id].setData([shown.map(r => r.step), ...curves[part].map(([key]) => shown.map(r => r[key] ?? null))]);
    box.dataset.points = shown.length;
    box.title = curves[part].map(([key, name]) => `${name}: ${help[key] || key}`).join("\n");
  }
  renderWork(rows.filter(r => typeof r.tokens_trained === "number").pop());
  renderCollapse(rows);
}

// Generation counted as work: the tokens generated and trained, and the time generating against training
// (a worker's mean, GRPO's); DPO's reference passes.
function renderWork(row) {
  const note = document.getElementById("post-work");
  note.dataset.generateShare = "";
  if (!row) { note.textContent = "no step yet"; return; }
  if (typeof row.tokens_generated !== "number") {
    note.textContent = `${count(row.tokens_trained)} completion tokens trained, all workers` +
      (typeof row.reference_s === "number" ? ` · reference passes ${seconds(row.reference_s)} per worker` : "");
    return;
  }
  const generating = row.generate_s || 0, training = row.train_s || 0, total = generating + training;
  const share = total ? generating / total : 0;
  note.dataset.generateShare = share;
  note.replaceChildren(`${count(row.tokens_generated)} tokens generated, ${count(row.tokens_trained)} trained, all workers ` +
    `· per worker: generating ${seconds(generating)}, training ${seconds(training)}`,
    el("span", { className: "work", title: `generating ${(100 * share).toFixed(1)}% of the time, training the rest` },
      el("i", { style: `width:${100 * share}%;background:${WORK_COLORS.generate}` }),
      el("i", { style: `width:${100 * (1 - share)}%;background:${WORK_COLORS.train}` })),
    `${(100 * share).toFixed(0)}% generating`);
}

// GRPO's collapse (a metrics row's `collapse`: why, or ''): the newest said as a warning above the page,
// and whether the rows since have recovered (accuracy and reward back above half their best).
function renderCollapse(rows) {
  const last = rows.filter(r => r.collapse).pop(), newest = rows[rows.length - 1], box = document.getElementById("collapse");
  const recovered = last && newest.step > last.step && !newest.collapse;
  box.hidden = !last;
  box.dataset.step = last ? last.step : "";
  box.className = "collapse" + (recovered ? " recovered" : "");
  box.textContent = !last ? "" : `step ${last.step}: ${last.collapse}` + (recovered ? ` (recovered by step ${newest.step})` : "");
}

function renderExchanges(run) {
  const rows = run.exchanges || [];
  const sent = rows.reduce((a, r) => a + (r.sent_bytes || 0), 0), blocked = rows.reduce((a, r) => a + (r.blocked_s || 0), 0);
  document.getElementById("exchange-totals").textContent = rows.length ?
    `${rows.length} exchanges: ${bytes(sent)} sent by each worker, ${seconds(blocked)} blocked in all (newest first)` :
    "no exchange yet" + (run.status && run.status.source === "launch" ? " (rank 0's, mirrored as they finish)" : "");
  document.querySelector("#exchanges tbody").replaceChildren(...rows.slice(-12).reverse().map(r =>
    el("tr", {}, el("td", {}, r.step), el("td", {}, r.what || "—"), el("td", {}, r.codec || "—"),
      el("td", {}, bytes(r.sent_bytes)), el("td", {}, seconds(r.blocked_s)), el("td", {}, seconds(r.modelled_s)))));
  document.getElementById("exchanges").dataset.rows = rows.length;
}

function renderEvents(run) {
  const list = document.getElementById("events");
  const items = (run.events || []).slice().reverse().map(e => {
    const detail = Object.entries(e).filter(([k]) => k !== "time" && k !== "event")
      .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join("  ");
    return el("li", { "data-event": e.event, className: "event-" + e.event },
      el("time", {}, clock(e.time)), el("b", {}, e.event), detail);
  });
  if (!items.length) items.push(el("li", { className: "note" },
    run.status && run.status.source === "sim" ? "none: a simulated run has no failures, restarts or joins" : "none yet"));
  list.replaceChildren(...items);
}

function setConnection(text, kind) {
  const p = document.getElementById("connection");
  p.textContent = text;
  p.className = "connection " + (kind || "");
}

// ------------------------------------------------------------ the loop
async function poll() {
  let finished = false;
  try {
    const answer = await fetch(API, { cache: "no-store" });
    if (!answer.ok) throw new Error(answer.status === 403 ? "forbidden: open the URL with its ?token=" : "HTTP " + answer.status);
    const run = await answer.json();
    for (const part of [renderHeader, renderPostTraining, renderRing, renderWorkers, renderLoss, renderExchanges,
      renderEvents]) part(run);
    finished = Boolean(run.summary);
    const age = run.status ? run.time - run.status.time : null;
    setConnection(finished ? "finished" : age !== null && age > 30 ? `no news for ${Math.round(age)} s: stopped?` :
      "live", finished ? "" : "live");
    document.body.dataset.finished = finished;
    document.body.dataset.updates = Number(document.body.dataset.updates) + 1;
  } catch (e) {
    setConnection("no answer from the dashboard: " + e.message, "error");
  }
  if (!finished) setTimeout(poll, 1000);  // a finished run's page stays as it is
}

window.addEventListener("resize", () => {
  for (const [id, chart, height] of [["loss-steps", charts.steps, 260], ["loss-time", charts.time, 260],
    ["post-held-out", charts["post-held-out"], 240], ["post-reward", charts["post-reward"], 240]]) {
    if (chart) chart.setSize({ width: document.getElementById(id).clientWidth, height });
  }
});
poll();
