// The live chart of the mesh dashboard (an anywidget front end drawing with uPlot).
//
// `uPlot` is defined above this module: Python puts the vendored uPlot build in front
// of it, so nothing is fetched at runtime.
//
// The kernel sends points as they come ("append" messages, a few a second at most) and
// the whole history once when a view asks for it ("sync" -> "reset"). Each point carries
// its arrival index, so an append that overlaps a reset is not drawn twice. A series
// whose x goes back (a run that started again at step 0) starts a new run, drawn as its
// own line. Many series are drawn as their mean with a min/max band per group.

const PALETTE = [
  "#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
];
const CAP = 3000; // points kept per run before every other one is dropped
const MAX_RUNS = 4; // runs kept per series (older runs are dropped)
const REDRAW_MS = 250; // at most four redraws a second

function themeColor(el, name, fallback) {
  const v = getComputedStyle(el).getPropertyValue(name).trim();
  return v || fallback;
}

function fmtNum(v) {
  if (v == null || !isFinite(v)) return "—";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e4 || a < 1e-3) return v.toExponential(2);
  return String(Number(v.toPrecision(4)));
}

function fmtRate(v) {
  if (v == null || !isFinite(v)) return "—";
  const units = [[1e9, "GB/s"], [1e6, "MB/s"], [1e3, "KB/s"]];
  for (const [s, u] of units) if (Math.abs(v) >= s) return (v / s).toFixed(1) + " " + u;
  return v.toFixed(0) + " B/s";
}

function ema(ys, alpha) {
  const out = new Array(ys.length);
  let acc = null;
  for (let i = 0; i < ys.length; i++) {
    const y = ys[i];
    if (y == null || !isFinite(y)) { out[i] = y; continue; }
    acc = acc == null ? y : acc + alpha * (y - acc);
    out[i] = acc;
  }
  return out;
}

function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "mk-uplot";
  root.dataset.chart = model.get("chart_id");
  const bar = document.createElement("div");
  bar.className = "mk-uplot-bar";
  const title = document.createElement("b");
  title.textContent = model.get("title");
  const scaleBtn = document.createElement("button");
  scaleBtn.className = "mk-scale";
  scaleBtn.title = "Switch the y axis between linear and log scale";
  const smoothLabel = document.createElement("label");
  const smoothBox = document.createElement("input");
  smoothBox.type = "checkbox";
  smoothBox.className = "mk-smooth";
  smoothLabel.append(smoothBox, " smooth");
  smoothLabel.title = "Exponential moving average of each line";
  const hint = document.createElement("span");
  hint.className = "mk-uplot-hint";
  hint.textContent = "drag: zoom · double-click: reset";
  bar.append(title, scaleBtn, smoothLabel, hint);
  const plotEl = document.createElement("div");
  plotEl.className = "mk-uplot-plot";
  const readout = document.createElement("div");
  readout.className = "mk-readout";
  readout.textContent = " ";
  root.append(bar, plotEl, readout);
  el.appendChild(root);

  const rate = model.get("unit") === "B/s";
  const fmt = rate ? fmtRate : fmtNum;
  const store = new Map(); // key -> {label, dash, group, idx, runs: [{x, y}], count}
  let plot = null;
  let shown = []; // uPlot series index -> {label}
  let zoomed = false;
  let timer = null;

  function add(s) {
    let entry = store.get(s.key);
    if (!entry || s.reset) {
      entry = { label: s.label, dash: !!s.dash, group: s.group || "", idx: entry ? entry.idx : store.size,
        runs: [{ x: [], y: [] }], count: 0 };
      store.set(s.key, entry);
    }
    const skip = Math.max(0, entry.count - s.start);
    for (let i = skip; i < s.x.length; i++) {
      let run = entry.runs[entry.runs.length - 1];
      const x = s.x[i];
      if (run.x.length && x < run.x[run.x.length - 1]) {
        run = { x: [], y: [] };
        entry.runs.push(run);
      }
      run.x.push(x);
      run.y.push(s.y[i]);
    }
    entry.count = Math.max(entry.count, s.start + s.x.length, s.count || 0);
    for (const run of entry.runs) {
      if (run.x.length > CAP) {
        const last = [run.x[run.x.length - 1], run.y[run.y.length - 1]];
        run.x = run.x.filter((_, i) => i % 2 === 0);
        run.y = run.y.filter((_, i) => i % 2 === 0);
        if (run.x[run.x.length - 1] !== last[0]) { run.x.push(last[0]); run.y.push(last[1]); }
      }
    }
    if (entry.runs.length > MAX_RUNS) entry.runs.splice(0, entry.runs.length - MAX_RUNS);
  }

  // uPlot wants one sorted x array shared by every line: uPlot.join aligns the runs.
  function build() {
    const smooth = smoothBox.checked;
    const log = model.get("log");
    const tables = [];
    const series = [];
    const entries = [...store.values()];
    const clean = (ys) => {
      let out = smooth ? ema(ys, 0.15) : ys;
      if (log) out = out.map((y) => (y != null && y > 0 ? y : null));
      return out;
    };
    // more series than max_lines: mean with a min/max band
    if (entries.length <= model.get("max_lines")) {
      for (const e of entries) {
        const color = PALETTE[e.idx % PALETTE.length];
        e.runs.forEach((run, ri) => {
          if (!run.x.length) return;
          const old = ri < e.runs.length - 1;
          const label = e.runs.length > 1 ? `${e.label} run ${ri + 1}` : e.label;
          tables.push([run.x, clean(run.y)]);
          series.push({ label, stroke: color, width: old ? 1 : 1.5, alpha: old ? 0.4 : 1,
            dash: e.dash ? [5, 3] : undefined, spanGaps: true, value: (u, v) => fmt(v) });
        });
      }
    } else {
      // many ranks: per group (e.g. "in", "out"), the mean of the latest runs with a
      // min/max band, so one slow or diverging rank shows as a widening band
      const groups = new Map();
      for (const e of entries) {
        const run = e.runs[e.runs.length - 1];
        if (!run.x.length) continue;
        if (!groups.has(e.group)) groups.set(e.group, []);
        groups.get(e.group).push([run.x, clean(run.y)]);
      }
      let gi = 0;
      for (const [group, runs] of groups) {
        const joined = uPlot.join(runs);
        const xs = joined[0];
        const mean = [], lo = [], hi = [];
        for (let i = 0; i < xs.length; i++) {
          let n = 0, sum = 0, mn = Infinity, mx = -Infinity;
          for (let k = 1; k < joined.length; k++) {
            const v = joined[k][i];
            if (v == null || !isFinite(v)) continue;
            n++; sum += v; mn = Math.min(mn, v); mx = Math.max(mx, v);
          }
          mean.push(n ? sum / n : null);
          lo.push(n ? mn : null);
          hi.push(n ? mx : null);
        }
        const color = PALETTE[gi++ % PALETTE.length];
        const name = group ? ` ${group}` : "";
        const dash = group === "out" ? [5, 3] : undefined;
        tables.push([xs, mean], [xs, hi], [xs, lo]);
        series.push(
          { label: `mean of ${runs.length}${name}`, stroke: color, width: 1.5, dash, spanGaps: true,
            value: (u, v) => fmt(v) },
          { label: `max${name}`, stroke: color, width: 0.5, alpha: 0.5, spanGaps: true,
            value: (u, v) => fmt(v), band: true },
          { label: `min${name}`, stroke: color, width: 0.5, alpha: 0.5, spanGaps: true,
            value: (u, v) => fmt(v), band: true },
        );
      }
    }
    const data = tables.length ? uPlot.join(tables) : [[]];
    return { data, series };
  }

  function bands(series) {
    const out = [];
    series.forEach((s, i) => {
      if (s.band && s.label.startsWith("max")) {
        out.push({ series: [i + 1, i + 2], fill: s.stroke + "30" });
      }
    });
    return out;
  }

  function opts(series) {
    const text = themeColor(el, "--jp-ui-font-color1", "#111827");
    const grid = themeColor(el, "--jp-border-color2", "#e5e7eb");
    const axis = { stroke: text, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } };
    const width = Math.max(280, Math.min(520, (root.clientWidth || 400) - 4));
    return {
      width,
      height: 190,
      legend: { show: false }, // the readout below is the legend (it stays one line)
      cursor: { drag: { x: true, y: false } },
      scales: { x: { time: false }, y: { distr: model.get("log") ? 3 : 1 } },
      axes: [
        { ...axis, label: model.get("x_label"), labelSize: 14, size: 32 },
        // wide enough for the longest tick label (so "500 KB/s" is never cut)
        { ...axis, values: (u, vals) => vals.map((v) => fmt(v)),
          size: (u, vals) => (vals ? Math.max(...vals.map((v) => String(v).length)) : 4) * 6.5 + 16 },
      ],
      series: [{ label: model.get("x_label") || "x" }, ...series],
      bands: bands(series),
      hooks: {
        setCursor: [(u) => showReadout(u)],
        setSelect: [(u) => { if (u.select.width > 0) zoomed = true; }],
        // the x range shown, for tests and for people reading the DOM
        setScale: [(u, key) => {
          if (key === "x") root.dataset.xRange = `${fmtNum(u.scales.x.min)}..${fmtNum(u.scales.x.max)}`;
        }],
      },
    };
  }

  function showReadout(u) {
    const i = u.cursor.idx;
    if (i == null) { readout.textContent = legendText(); return; }
    const x = u.data[0][i];
    const parts = [];
    for (let k = 1; k < u.data.length; k++) {
      const v = u.data[k][i];
      if (v != null) parts.push(`${shown[k - 1].label} ${fmt(v)}`);
    }
    readout.textContent = `${model.get("x_label") || "x"} ${fmtNum(x)}: ${parts.join(" · ")}`;
    readout.dataset.hover = "1";
  }

  function legendText() {
    readout.dataset.hover = "";
    return shown.map((s) => s.label).join(" · ") || "waiting for data";
  }

  function redraw() {
    timer = null;
    const { data, series } = build();
    const log = model.get("log");
    scaleBtn.textContent = log ? "log ▾" : "linear ▾";
    scaleBtn.dataset.scale = log ? "log" : "linear";
    root.dataset.points = String(data[0].length);
    const last = data[0].length ? data[0][data[0].length - 1] : "";
    root.dataset.lastX = String(last);
    root.dataset.series = String(series.length);
    const same = plot && shown.length === series.length &&
      shown.every((s, i) => s.label === series[i].label) && plot.__log === log;
    if (same) {
      plot.setData(data, !zoomed);
    } else {
      if (plot) plot.destroy();
      shown = series;
      plot = new uPlot(opts(series), data, plotEl);
      plot.__log = log;
    }
    shown = series;
    if (readout.dataset.hover !== "1") readout.textContent = legendText();
  }

  function schedule() {
    if (timer == null) timer = setTimeout(redraw, REDRAW_MS);
  }

  function onMsg(msg) {
    if (!msg || !msg.type) return;
    if (msg.type === "reset") store.clear();
    for (const s of msg.series || []) add(s);
    schedule();
  }

  scaleBtn.addEventListener("click", () => {
    model.set("log", !model.get("log"));
    model.save_changes();
  });
  smoothBox.addEventListener("change", () => { if (plot) { plot.destroy(); plot = null; } redraw(); });
  model.on("change:log", () => { if (plot) { plot.destroy(); plot = null; } redraw(); });
  model.on("change:max_lines", () => { if (plot) { plot.destroy(); plot = null; } redraw(); });
  plotEl.addEventListener("dblclick", () => { zoomed = false; });
  // the axes take the theme's colours when the plot is made: remake it on a theme change
  const themeWatch = new MutationObserver(() => { if (plot) { plot.destroy(); plot = null; } schedule(); });
  themeWatch.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-name"] });
  model.on("msg:custom", onMsg);
  redraw();
  model.send({ type: "sync" });
  return () => {
    themeWatch.disconnect();
    model.off("msg:custom", onMsg);
    if (timer != null) clearTimeout(timer);
    if (plot) plot.destroy();
  };
}

export default { render };
