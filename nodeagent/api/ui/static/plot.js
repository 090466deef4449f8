// The status page's hit-rate plot: an inline SVG of each vLLM's prefix-cache ratios over the last hour (GET /cache),
// one line per ratio, broken where samples are missing (vLLM down, nothing looked up in a window).
"use strict";

const RATIOS = ["local_total", "local_win", "ext_total", "ext_win", "eff_total"];
const RATIO_LABELS = {
  local_total: "local total", local_win: "local window", ext_total: "ext total", ext_win: "ext window",
  eff_total: "eff total",
};
const SVG_NS = "http://www.w3.org/2000/svg";

function timeLabel(ts, seconds) {
  const d = new Date(ts * 1000);
  const two = (n) => String(n).padStart(2, "0");
  return `${two(d.getHours())}:${two(d.getMinutes())}${seconds ? `:${two(d.getSeconds())}` : ""}`;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}

function hitRatePlot(name, data, width) {
  const height = 240;
  const m = { l: 44, r: 12, t: 10, b: 22 };
  const end = data.now;
  const start = end - data.history_s;
  const x = (ts) => m.l + ((ts - start) / data.history_s) * (width - m.l - m.r);
  const y = (v) => m.t + (1 - v) * (height - m.t - m.b);
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, "data-plot": name, role: "img",
    "aria-label": `prefix-cache hit rates of ${name}` });
  for (const v of [0, 0.25, 0.5, 0.75, 1]) {
    root.append(svg("line", { class: "grid", x1: m.l, x2: width - m.r, y1: y(v), y2: y(v) }));
    const label = svg("text", { class: "axis", x: m.l - 6, y: y(v) + 4, "text-anchor": "end" });
    label.textContent = `${v * 100}%`;
    root.append(label);
  }
  const step = data.history_s >= 3600 ? 600 : data.history_s >= 600 ? 120 : 30;
  for (let t = Math.ceil(start / step) * step; t <= end; t += step) {
    root.append(svg("line", { class: "grid", x1: x(t), x2: x(t), y1: m.t, y2: height - m.b }));
    const label = svg("text", { class: "axis", x: x(t), y: height - 6, "text-anchor": "middle" });
    label.textContent = timeLabel(t, step < 60);
    root.append(label);
  }
  const gap = data.period_s * 2.5;
  for (const kind of RATIOS) {
    let d = "";
    let points = 0;
    let prevTs = null;
    const dots = [];
    let run = [];
    const flush = () => {
      if (run.length === 1) dots.push(run[0]);
      run = [];
    };
    for (const s of data.samples) {
      const row = s.components[name];
      const v = row ? row[kind] : null;
      if (v === null || v === undefined || (prevTs !== null && s.ts - prevTs > gap)) flush();
      if (v === null || v === undefined) { prevTs = null; continue; }
      const px = x(s.ts).toFixed(1);
      const py = y(Math.min(1, Math.max(0, v))).toFixed(1);
      d += `${run.length ? "L" : "M"}${px},${py} `;
      run.push([px, py]);
      points++;
      prevTs = s.ts;
    }
    flush();
    const cls = `series c-${kind}${kind.endsWith("_win") ? " win" : ""}`;
    if (d) root.append(svg("path", { class: cls, d: d.trim(), "data-kind": kind, "data-points": points }));
    for (const [px, py] of dots) {
      root.append(svg("circle", { class: `dot c-${kind}`, cx: px, cy: py, r: 2.5, "data-kind": kind }));
    }
  }
  return root;
}
