"use strict";
// memplan's HTML report: draws the embedded data (no library, no network). See planner/report/html_report.py.
const ERRORS = [];
window.addEventListener("error", (e) => ERRORS.push(String(e.message)));
window.addEventListener("unhandledrejection", (e) => ERRORS.push(String(e.reason)));
const consoleError = console.error.bind(console);
console.error = (...a) => { ERRORS.push(a.join(" ")); consoleError(...a); };

const DATA = JSON.parse(document.getElementById("data").textContent);
const CATS = DATA.categories, PHASES = DATA.phases, COLORS = DATA.colors, PHASE_COLORS = DATA.phase_colors;
const ZOOM_EXACT = 400000; // zoomed ranges up to this many events are recomputed exactly from the buffers
const H = 260, PAD = {l: 78, r: 12, t: 10, b: 24};
const $ = (tag, attrs = {}, text) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
};

function human(b) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let k = 0, v = b;
  while (Math.abs(v) >= 1024 && k < u.length - 1) { v /= 1024; k++; }
  return (k ? v.toFixed(1) : String(v)) + " " + u[k];
}
const num = (x) => x.toLocaleString("en-US");

async function unpack(p) {
  const s = atob(p.buffers.blob), bytes = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  const buf = await new Response(stream).arrayBuffer();
  const n = p.buffers.n;
  const sizeTable = Float64Array.from(p.buffers.sizes), sizeIdx = new Uint32Array(buf, 8 * n, n);
  const size = new Float64Array(n);
  for (let i = 0; i < n; i++) size[i] = sizeTable[sizeIdx[i]];
  return {n, alloc: new Int32Array(buf, 0, n), free: new Int32Array(buf, 4 * n, n), size,
          op: new Uint32Array(buf, 12 * n, n), module: new Uint32Array(buf, 16 * n, n),
          kind: new Uint8Array(buf, 20 * n, n)};
}

function details(p, i) {
  const b = p.b, k = b.kind[i];
  return {buffer: i, size: b.size[i], category: CATS[k >> 2], phase: PHASES[k & 3],
          op: p.buffers.ops[b.op[i]] || "-", module: p.buffers.modules[b.module[i]] || "-",
          alloc: b.alloc[i], free: b.free[i]};
}
function detailsText(d) {
  return `buffer #${d.buffer}: ${human(d.size)} (${num(d.size)} B)\n${d.category}, ${d.phase} phase\n` +
         `op ${d.op}\nmodule ${d.module}\nallocated at ${num(d.alloc)}, freed at ${num(d.free)}`;
}

// Live bytes per category at time t, and the buffer drawn at height y (stacked by category, then allocation).
function at(p, t, y) {
  const b = p.b, live = new Float64Array(CATS.length), hits = [];
  for (let i = 0; i < b.n; i++) {
    if (b.alloc[i] <= t && b.free[i] > t && b.size[i] > 0) {
      live[b.kind[i] >> 2] += b.size[i];
      hits.push(i);
    }
  }
  let found = -1;
  if (y !== undefined) {
    hits.sort((x, z) => (b.kind[x] >> 2) - (b.kind[z] >> 2) || b.alloc[x] - b.alloc[z] || x - z);
    let acc = 0;
    for (const i of hits) { acc += b.size[i]; if (acc > y) { found = i; break; } }
  }
  return {live, found};
}

// Stacked series over [t0, t1): the embedded thinned one, or recomputed exactly from the buffers when zoomed in.
function seriesFor(p, t0, t1) {
  const s = p.series;
  if (t1 - t0 > ZOOM_EXACT || (t0 === 0 && t1 === p.end)) {
    const idx = [];
    for (let k = 0; k < s.t.length; k++) if (s.t[k] >= t0 && s.t[k] < t1) idx.push(k);
    return {t: idx.map((k) => s.t[k]), cats: Object.fromEntries(
      Object.entries(s.cats).map(([c, v]) => [c, idx.map((k) => v[k])])), exact: s.exact};
  }
  const b = p.b, R = t1 - t0, present = Object.keys(s.cats), delta = {};
  for (const c of present) delta[c] = new Float64Array(R + 1);
  for (let i = 0; i < b.n; i++) {
    const a = b.alloc[i], f = b.free[i];
    if (f <= t0 || a >= t1 || b.size[i] === 0) continue;
    const d = delta[CATS[b.kind[i] >> 2]];
    d[Math.max(a, t0) - t0] += b.size[i];
    d[Math.min(f, t1) - t0] -= b.size[i];
  }
  const total = new Float64Array(R), cum = {};
  for (const c of present) {
    const v = new Float64Array(R);
    let acc = 0;
    for (let k = 0; k < R; k++) { acc += delta[c][k]; v[k] = acc; total[k] += acc; }
    cum[c] = v;
  }
  const w = Math.max(1, Math.ceil(R / 3000)), t = [], cats = Object.fromEntries(present.map((c) => [c, []]));
  for (let k0 = 0; k0 < R; k0 += w) {
    let best = k0;
    for (let k = k0; k < Math.min(R, k0 + w); k++) if (total[k] > total[best]) best = k;
    t.push(t0 + best);
    for (const c of present) cats[c].push(cum[c][best]);
  }
  return {t, cats, exact: w === 1};
}

function sizeCanvas(canvas, width, height) {
  const r = window.devicePixelRatio || 1;
  canvas.width = width * r; canvas.height = height * r;
  canvas.style.width = width + "px"; canvas.style.height = height + "px";
  const g = canvas.getContext("2d");
  g.setTransform(r, 0, 0, r, 0, 0);
  return g;
}

function axes(g, width, height, t0, t1, ymax, ylabel) {
  g.strokeStyle = "#888"; g.fillStyle = "#333"; g.font = "11px sans-serif"; g.lineWidth = 1;
  g.beginPath(); g.moveTo(PAD.l, PAD.t); g.lineTo(PAD.l, height - PAD.b); g.lineTo(width - PAD.r, height - PAD.b);
  g.stroke();
  g.textAlign = "right";
  for (let k = 0; k <= 4; k++) {
    const v = ymax * k / 4, y = height - PAD.b - (height - PAD.t - PAD.b) * k / 4;
    g.fillText(human(Math.round(v)), PAD.l - 4, y + 4);
    g.strokeStyle = "#eee"; g.beginPath(); g.moveTo(PAD.l + 1, y); g.lineTo(width - PAD.r, y); g.stroke();
  }
  g.textAlign = "center";
  for (let k = 0; k <= 4; k++) {
    const x = PAD.l + (width - PAD.l - PAD.r) * k / 4;
    g.fillText(num(Math.round(t0 + (t1 - t0) * k / 4)), x, height - 8);
  }
  g.save(); g.translate(10, height / 2); g.rotate(-Math.PI / 2); g.fillText(ylabel, 0, 0); g.restore();
}

const STATE = {ymax: 1, panels: []};

function drawTimeline(view) {
  const p = view.p, width = view.canvas.clientWidth || 600, g = sizeCanvas(view.canvas, width, H);
  const [t0, t1] = view.range, X = (t) => PAD.l + (t - t0) / Math.max(1, t1 - t0) * (width - PAD.l - PAD.r);
  const Y = (v) => H - PAD.b - v / STATE.ymax * (H - PAD.t - PAD.b);
  g.clearRect(0, 0, width, H);
  for (const [a, z, code] of p.phases) {
    if (z <= t0 || a >= t1 || !PHASE_COLORS[PHASES[code]]) continue;
    g.fillStyle = PHASE_COLORS[PHASES[code]];
    g.fillRect(X(Math.max(a, t0)), PAD.t, X(Math.min(z, t1)) - X(Math.max(a, t0)), H - PAD.t - PAD.b);
  }
  const s = seriesFor(p, t0, t1), n = s.t.length, lower = new Float64Array(n);
  let drawn = 0;
  for (const c of CATS) {
    const v = s.cats[c];
    if (!v) continue;
    g.fillStyle = COLORS[c];
    g.beginPath();
    for (let k = 0; k < n; k++) {
      const x0 = X(s.t[k]), x1 = k + 1 < n ? X(s.t[k + 1]) : X(t1);
      g[k ? "lineTo" : "moveTo"](x0, Y(lower[k] + v[k]));
      g.lineTo(x1, Y(lower[k] + v[k]));
    }
    for (let k = n - 1; k >= 0; k--) {
      const x0 = X(s.t[k]), x1 = k + 1 < n ? X(s.t[k + 1]) : X(t1);
      g.lineTo(x1, Y(lower[k])); g.lineTo(x0, Y(lower[k]));
    }
    g.closePath(); g.fill();
    for (let k = 0; k < n; k++) lower[k] += v[k];
    drawn += n;
  }
  const line = (values, color, dash) => {
    if (!values) return;
    g.strokeStyle = color; g.lineWidth = 1.3; g.setLineDash(dash); g.beginPath();
    let first = true;
    for (let k = 0; k < p.series.t.length; k++) {
      const t = p.series.t[k];
      if (t < t0 || t >= t1) continue;
      g[first ? "moveTo" : "lineTo"](X(t), Y(values[k])); first = false;
    }
    g.stroke(); g.setLineDash([]);
  };
  line(p.series.reserved, DATA.line_colors.reserved, [4, 2]);
  line(p.series.plan, DATA.line_colors.plan, []);
  if (p.peak_t >= t0 && p.peak_t < t1) {
    g.fillStyle = "#000"; g.beginPath();
    g.moveTo(X(p.peak_t) - 4, Y(p.peak) - 8); g.lineTo(X(p.peak_t) + 4, Y(p.peak) - 8); g.lineTo(X(p.peak_t), Y(p.peak));
    g.fill();
  }
  view.canvas.dataset.marks = String(drawMarks(g, p, t0, t1, X, Y, width));
  axes(g, width, H, t0, t1, STATE.ymax, "live bytes");
  view.canvas.dataset.drawn = String(drawn);
  view.canvas.dataset.exact = String(s.exact);
  view.X = X; view.Y = Y; view.width = width;
}

// A whole program's marks (memplan check): its steps as labelled brackets along the top, each out-of-memory error
// as a red line at its time, and the memory the caching allocator had as a line across; returns how many were drawn.
function drawMarks(g, p, t0, t1, X, Y, width) {
  let drawn = 0;
  g.font = "11px system-ui"; g.textBaseline = "top";
  for (const [a, z, label] of p.steps) {
    if (z <= t0 || a >= t1) continue;
    const x0 = X(Math.max(a, t0)), x1 = X(Math.min(z, t1));
    g.strokeStyle = "#555"; g.lineWidth = 1; g.beginPath();
    g.moveTo(x0, PAD.t + 12); g.lineTo(x0, PAD.t + 2); g.lineTo(x1, PAD.t + 2); g.lineTo(x1, PAD.t + 12); g.stroke();
    g.fillStyle = "#333";
    if (x1 - x0 > g.measureText(label).width + 4) g.fillText(label, x0 + 3, PAD.t + 4);
    drawn++;
  }
  for (const [t, label] of p.events) {
    if (t < t0 || t >= t1) continue;
    g.strokeStyle = "#d00"; g.lineWidth = 1.5; g.beginPath();
    g.moveTo(X(t), PAD.t); g.lineTo(X(t), H - PAD.b); g.stroke();
    g.fillStyle = "#d00"; g.fillText(label, Math.min(X(t) + 3, width - PAD.r - g.measureText(label).width), PAD.t + 30);
    drawn++;
  }
  if (p.limit !== null) {
    g.strokeStyle = "#d00"; g.setLineDash([2, 3]); g.beginPath();
    g.moveTo(PAD.l, Y(p.limit)); g.lineTo(width - PAD.r, Y(p.limit)); g.stroke(); g.setLineDash([]);
    g.fillStyle = "#d00";
    g.fillText(`the allocator's limit ${human(p.limit)}`, PAD.l + 4, Y(p.limit) + 2);
    drawn++;
  }
  g.textBaseline = "alphabetic";
  return drawn;
}

function drawAddress(view) {
  const p = view.p, a = p.address, width = view.acanvas.clientWidth || 600, g = sizeCanvas(view.acanvas, width, H);
  const X = (t) => PAD.l + t / Math.max(1, p.end) * (width - PAD.l - PAD.r);
  const amax = Math.max(1, ...STATE.panels.filter((v) => v.p.address).map((v) => v.p.address.arena));
  const Y = (v) => H - PAD.b - v / amax * (H - PAD.t - PAD.b);
  const b = p.b;
  view.rects = [];
  for (const [i, off] of a.rects) {
    const x0 = X(b.alloc[i]), x1 = Math.max(X(b.free[i]), x0 + 0.5), y0 = Y(off), y1 = Y(off + b.size[i]);
    g.fillStyle = COLORS[CATS[b.kind[i] >> 2]];
    g.fillRect(x0, y1, x1 - x0, Math.max(y0 - y1, 0.5));
    view.rects.push([x0, x1, y1, y0, i, off]);
  }
  g.strokeStyle = DATA.line_colors.plan; g.beginPath(); g.moveTo(PAD.l, Y(a.arena)); g.lineTo(width - PAD.r, Y(a.arena));
  g.stroke();
  axes(g, width, H, 0, p.end, amax, "offset");
  view.acanvas.dataset.drawn = String(a.rects.length);
}

function showTip(ev, text) {
  const tip = document.getElementById("tip");
  tip.textContent = text;
  tip.style.display = "block";
  tip.style.left = (ev.pageX + 14) + "px"; tip.style.top = (ev.pageY + 10) + "px";
}
function hideTip() { document.getElementById("tip").style.display = "none"; }

function hoverTimeline(view, ev) {
  const r = view.canvas.getBoundingClientRect(), x = ev.clientX - r.left, y = ev.clientY - r.top;
  const [t0, t1] = view.range;
  const t = Math.floor(t0 + (x - PAD.l) / (view.width - PAD.l - PAD.r) * (t1 - t0));
  if (t < t0 || t >= t1) { hideTip(); return; }
  const bytes = (H - PAD.b - y) / (H - PAD.t - PAD.b) * STATE.ymax;
  const {live, found} = at(view.p, t, bytes);
  const total = live.reduce((s, v) => s + v, 0);
  let text = `time ${num(t)}: ${human(total)} live\n`;
  CATS.forEach((c, k) => { if (live[k]) text += `  ${c}: ${human(live[k])}\n`; });
  if (found >= 0) text += "\n" + detailsText(details(view.p, found));
  showTip(ev, text.trimEnd());
}

function hoverAddress(view, ev) {
  const r = view.acanvas.getBoundingClientRect(), x = ev.clientX - r.left, y = ev.clientY - r.top;
  const hit = view.rects.find(([x0, x1, y1, y0]) => x >= x0 && x <= x1 && y >= y1 - 0.5 && y <= y0 + 0.5);
  if (!hit) { hideTip(); return; }
  showTip(ev, detailsText(details(view.p, hit[4])) + `\noffset ${num(hit[5])}`);
}

function zoomable(view) {
  const c = view.canvas, sel = view.sel;
  let start = null;
  const tAt = (x) => {
    const [t0, t1] = view.range;
    return Math.round(t0 + Math.min(Math.max(x - PAD.l, 0), view.width - PAD.l - PAD.r) /
                      (view.width - PAD.l - PAD.r) * (t1 - t0));
  };
  c.addEventListener("mousedown", (ev) => { start = ev.offsetX; });
  c.addEventListener("mousemove", (ev) => {
    if (start !== null) {
      sel.style.display = "block";
      sel.style.left = Math.min(start, ev.offsetX) + "px"; sel.style.width = Math.abs(ev.offsetX - start) + "px";
    }
    if (view.pending) return;
    view.pending = true;
    requestAnimationFrame(() => { view.pending = false; hoverTimeline(view, ev); });
  });
  c.addEventListener("mouseup", (ev) => {
    sel.style.display = "none";
    if (start !== null && Math.abs(ev.offsetX - start) > 4) {
      const a = tAt(Math.min(start, ev.offsetX)), z = tAt(Math.max(start, ev.offsetX));
      if (z - a >= 2) { view.range = [a, z]; drawTimeline(view); }
    }
    start = null;
  });
  c.addEventListener("mouseleave", () => { start = null; sel.style.display = "none"; hideTip(); });
  c.addEventListener("dblclick", () => { view.range = [0, view.p.end]; drawTimeline(view); });
}

function table(head, rows) {
  const box = $("div", {class: "scroll"}), t = $("table"), tr = $("tr");
  box.appendChild(t);
  head.forEach((h) => tr.appendChild($("th", {}, h)));
  t.appendChild(tr);
  for (const row of rows) {
    const r = $("tr");
    row.forEach((v) => r.appendChild($("td", {}, String(v))));
    t.appendChild(r);
  }
  return box;
}

function panel(p) {
  const box = $("section", {class: "panel"});
  box.appendChild($("h3", {}, p.title));
  const f = p.figures;
  const stats = [`${num(f.buffers)} buffers`, `peak live ${human(p.peak)} at ${num(p.peak_t)}`,
                 `caching allocator reserved ${human(f.caching_peak_reserved)}`];
  if (f.plan_arena !== null) stats.push(`plan arena ${human(f.plan_arena)} (${p.address.status})`);
  box.appendChild($("p", {class: "stats"}, stats.join(" · ")));
  const wrap = $("div", {class: "plot"}), canvas = $("canvas", {class: "timeline"}), sel = $("div", {class: "sel"});
  wrap.append(canvas, sel);
  box.appendChild(wrap);
  const view = {p, canvas, sel, range: [0, p.end]};
  if (p.address) {
    box.appendChild($("h4", {}, "Plan address space (time by offset)"));
    const a = p.address;
    if (a.rects.length < a.placed) {
      box.appendChild($("p", {class: "note"}, `the ${num(a.rects.length)} largest of ${num(a.placed)} placed ` +
                                               "buffers (size by lifetime) are drawn"));
    }
    view.acanvas = $("canvas", {class: "address"});
    box.appendChild(view.acanvas);
    view.acanvas.addEventListener("mousemove", (ev) => hoverAddress(view, ev));
    view.acanvas.addEventListener("mouseleave", hideTip);
  }
  if (p.verdict_text) box.appendChild($("pre", {class: "verdict"}, p.verdict_text));
  if (p.text) box.appendChild($("pre", {class: "verdict"}, p.text));
  box.appendChild($("h4", {}, `Largest buffers at the peak (time ${num(p.peak_t)})`));
  box.appendChild(table(["buffer", "size", "category", "phase", "op", "module", "alloc", "free"],
    p.largest.map((i) => { const d = details(p, i);
      return [`#${i}`, human(d.size), d.category, d.phase, d.op, d.module, num(d.alloc), num(d.free)]; })));
  box.appendChild($("h4", {}, "By module"));
  box.appendChild($("p", {class: "note"}, "held for backward: forward buffers live when backward begins; " +
                                         "temporaries and all bytes live at the peak"));
  box.appendChild(table(["module", "held for backward", "temporaries at peak", "live at peak"],
    p.modules.map((m) => [m.module, human(m.held), human(m.temporary), human(m.live)])));
  return {box, view};
}

function legend() {
  const l = $("p", {class: "legend"});
  for (const c of DATA.present) {
    const s = $("span"); s.appendChild($("i", {style: `background:${COLORS[c]}`})); s.append(c); l.appendChild(s);
  }
  for (const [ph, col] of Object.entries(PHASE_COLORS)) {
    const s = $("span"); s.appendChild($("i", {style: `background:${col}`})); s.append(`${ph} phase`); l.appendChild(s);
  }
  const lines = ["dashed: caching allocator reserved"];
  if (DATA.panels.some((p) => p.plan_peak !== null)) lines.push("red: plan arena + outside it");
  if (DATA.panels.some((p) => p.limit !== null)) lines.push("red dots: what the allocator can reserve");
  l.append(` ${[...lines, "drag to zoom, double-click to reset"].join(" · ")}`);
  return l;
}

// With #selftest in the address, the page checks itself and writes what it saw into <pre id=selftest> (tests read it
// through headless Chromium's --dump-dom): errors, elements drawn, a hover at the first panel's peak, a zoom.
function selftest() {
  const v = STATE.panels[0], p = v.p, r = v.canvas.getBoundingClientRect();
  const x = r.left + v.X(p.peak_t + 0.5), y = r.top + v.Y(p.peak / 2);
  const t = Math.floor(v.range[0] + (x - r.left - PAD.l) / (v.width - PAD.l - PAD.r) * (v.range[1] - v.range[0]));
  hoverTimeline(v, {clientX: x, clientY: y, pageX: x, pageY: y});
  const hover = at(p, t, (H - PAD.b - (y - r.top)) / (H - PAD.t - PAD.b) * STATE.ymax);
  const tooltip = document.getElementById("tip").textContent;
  const ev = (type, cx) => v.canvas.dispatchEvent(new MouseEvent(type, {clientX: cx, clientY: y, bubbles: true}));
  ev("mousedown", r.left + PAD.l + 2); ev("mousemove", r.left + PAD.l + 60); ev("mouseup", r.left + PAD.l + 60);
  const zoomed = {range: v.range.slice(), drawn: Number(v.canvas.dataset.drawn), exact: v.canvas.dataset.exact};
  v.canvas.dispatchEvent(new MouseEvent("dblclick", {bubbles: true}));
  const out = {errors: ERRORS, panels: STATE.panels.length, load_ms: STATE.load_ms,
               drawn: STATE.panels.map((w) => Number(w.canvas.dataset.drawn)),
               rects: STATE.panels.map((w) => (w.acanvas ? Number(w.acanvas.dataset.drawn) : 0)),
               marks: STATE.panels.map((w) => Number(w.canvas.dataset.marks)),
               hover: {time: t, live: Object.fromEntries(CATS.map((c, k) => [c, hover.live[k]]).filter((e) => e[1])),
                       buffer: hover.found, tooltip},
               zoomed, reset: v.range.slice()};
  document.getElementById("selftest").textContent = JSON.stringify(out);
}

async function main() {
  const t0 = performance.now();
  for (const p of DATA.panels) p.b = await unpack(p);
  STATE.ymax = Math.max(1, ...DATA.panels.map((p) => Math.max(p.peak, p.figures.caching_peak_reserved,
                                                              p.plan_peak || 0, p.limit || 0))) * 1.05;
  const row = document.getElementById("panels");
  row.style.gridTemplateColumns = `repeat(${DATA.panels.length}, minmax(420px, 1fr))`;
  document.getElementById("legend").appendChild(legend());
  for (const p of DATA.panels) {
    const {box, view} = panel(p);
    row.appendChild(box);
    STATE.panels.push(view);
  }
  for (const v of STATE.panels) {
    drawTimeline(v);
    zoomable(v);
    if (v.acanvas) drawAddress(v);
  }
  STATE.load_ms = Math.round(performance.now() - t0);
  document.body.dataset.ready = "1";
  if (location.hash === "#selftest") selftest();
}
main().catch((e) => { ERRORS.push(String(e && e.stack || e)); if (location.hash === "#selftest") selftest(); });
