// The rampserve dashboard: polls /dashboard/data once per sampler interval for the samples it has not seen, keeps
// the last `capacity` of them, and draws each open model's charts with uPlot (vendored, served by rampserve).
// Its state is window.rampserveDashboard, which tests read.
"use strict";

(() => {
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                  "#bcbd22", "#7f7f7f"];
  const FINAL_COLOR = "#b8c0cc";
  const CHART_HEIGHT = 170;
  const OPEN_BY_DEFAULT = 4;
  // Whole seconds between ticks at least: samples come once a second
  const TIME_AXIS = {space: 60, incrs: [1, 2, 5, 10, 15, 30, 60, 120, 300, 600]}; // with more models than this, cards start closed (charts of closed cards are not drawn)

  const state = {
    started: null, seq: 0, capacity: 600, interval: 1, samples: [], events: [], summary: {models: {}, apps: {}},
    sampler: {}, charts: {}, open: {}, renders: 0, renderMs: null, polls: 0, failures: 0, lastError: null,
    // Per model and chart: the uPlot instance's data (x first), as drawn
    chartData() {
      const out = {};
      for (const [model, charts] of Object.entries(this.charts)) {
        out[model] = {};
        for (const [name, chart] of Object.entries(charts)) out[model][name] = chart.plot.data;
      }
      return out;
    },
    // Per model: the exit sites, in the order the exits chart stacks them
    exitSites() {
      const out = {};
      for (const [model, charts] of Object.entries(this.charts)) if (charts.exits) out[model] = charts.exits.sites;
      return out;
    },
  };
  window.rampserveDashboard = state;

  const $ = (selector, root = document) => root.querySelector(selector);
  const fmt = (value, digits = 1) => (value === null || value === undefined || Number.isNaN(value)) ? "–"
    : Number(value).toFixed(digits);
  const clock = (t) => new Date(t * 1000).toLocaleTimeString();

  function element(tag, attributes = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attributes)) {
      if (key === "text") node.textContent = value; else node.setAttribute(key, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  // ---- data ------------------------------------------------------------------------------------------------------

  async function poll() {
    try {
      const response = await fetch(`/dashboard/data?since=${state.seq}`, {cache: "no-store"});
      if (!response.ok) throw new Error(`${response.status} ${await response.text()}`);
      const data = await response.json();
      if (state.started !== null && data.started !== state.started) {
        // Another server (or the same one restarted): its samples are numbered afresh, and the next poll asks
        // for all it kept
        Object.assign(state, {started: null, seq: 0, samples: [], events: []});
        return;
      }
      absorb(data);
      state.polls += 1;
      render();
    } catch (error) {
      state.failures += 1;
      state.lastError = String(error);
      $("#status").textContent = `no data: ${error}`;
    } finally {
      setTimeout(poll, state.interval * 1000);
    }
  }

  function absorb(data) {
    Object.assign(state, {started: data.started, seq: data.seq, capacity: data.capacity, interval: data.interval_s,
                          summary: {models: data.models, apps: data.apps}, sampler: data.sampler});
    state.samples.push(...data.samples);
    if (state.samples.length > state.capacity) state.samples.splice(0, state.samples.length - state.capacity);
    state.events.push(...data.events);
    const oldest = state.samples.length ? state.samples[0].t : Infinity;
    state.events = state.events.filter((event) => event.t >= oldest);
  }

  function column(model, pick) {
    return state.samples.map((sample) => {
      const point = sample.models[model];
      const value = point === undefined ? null : pick(point);
      return value === undefined ? null : value;
    });
  }

  // Sites in the order they first appear, the final layer last
  function sitesOf(model, key) {
    const sites = [];
    for (const sample of state.samples) {
      const point = sample.models[model];
      if (!point) continue;
      for (const site of Object.keys(point[key] || {})) if (!sites.includes(site)) sites.push(site);
    }
    return sites.filter((s) => s !== "final").concat(sites.includes("final") ? ["final"] : []);
  }

  // ---- charts ----------------------------------------------------------------------------------------------------

  // Dashed vertical lines at this model's configuration changes
  function changeMarkers(model) {
    return {
      hooks: {
        draw: (u) => {
          const ctx = u.ctx;
          const [min, max] = [u.scales.x.min, u.scales.x.max];
          ctx.save();
          ctx.strokeStyle = "#9aa3ae";
          ctx.fillStyle = "#66717f";
          ctx.setLineDash([4, 4]);
          ctx.lineWidth = devicePixelRatio;
          ctx.font = `${10 * devicePixelRatio}px system-ui`;
          for (const event of state.events) {
            if (event.model !== model || event.t < min || event.t > max) continue;
            const x = Math.round(u.valToPos(event.t, "x", true));
            ctx.beginPath();
            ctx.moveTo(x, u.bbox.top);
            ctx.lineTo(x, u.bbox.top + u.bbox.height);
            ctx.stroke();
            ctx.fillText(`v${event.version}`, x + 3 * devicePixelRatio, u.bbox.top + 10 * devicePixelRatio);
          }
          ctx.restore();
        },
      },
    };
  }

  function lineSeries(label, color, extra = {}) {
    return {label, stroke: color, width: 1.5, spanGaps: false, ...extra};
  }

  // A chart's definition for a model: its series and data from the samples (`key` names the series set: a chart
  // whose key changes is made again)
  const CHARTS = {
    load: (model) => ({
      title: "requests/s", key: "load",
      series: [lineSeries("answered/s", COLORS[0]), lineSeries("refused or failed/s", COLORS[3])],
      data: [column(model, (p) => p.rps), column(model, (p) => p.errors_ps)],
    }),
    latency: (model) => ({
      title: "latency (ms, request read to response)", key: "latency",
      series: [lineSeries("p50", COLORS[0]), lineSeries("p99", COLORS[1])],
      data: [column(model, (p) => p.p50_ms), column(model, (p) => p.p99_ms)],
    }),
    queue: (model) => ({
      title: "queue and batch size (inputs)", key: "queue",
      series: [lineSeries("queued", COLORS[4]), lineSeries("mean batch", COLORS[2])],
      data: [column(model, (p) => p.queue), column(model, (p) => p.batch)],
    }),
    exits: (model) => {
      const sites = sitesOf(model, "exits");
      const raw = sites.map((site) => column(model, (p) => (p.exits ? p.exits[site] || 0 : null)));
      // Stacked: layer k is the sum of the first k sites; each layer's band fills down to the one below
      const stacked = [];
      raw.forEach((values, k) => stacked.push(values.map((v, i) => (v === null ? null
        : v + (k ? stacked[k - 1][i] || 0 : 0)))));
      const series = sites.map((site, k) => {
        const color = site === "final" ? FINAL_COLOR : COLORS[k % COLORS.length];
        return {label: site, stroke: color, fill: color + (site === "final" ? "" : "b0"), width: 1,
                value: (u, v, si, i) => (i === null || raw[si - 1][i] === null ? "–" : raw[si - 1][i])};
      });
      const bands = sites.slice(1).map((_, k) => ({series: [k + 2, k + 1]}));
      return {title: "answers per sample by exit site (stacked)", key: `exits:${sites.join("|")}`, series,
              data: stacked, bands, sites};
    },
    thresholds: (model) => {
      const sites = sitesOf(model, "thresholds");
      return {
        title: "thresholds of the active ramps (error score below exits)", key: `thresholds:${sites.join("|")}`,
        series: sites.map((site, k) => lineSeries(site, COLORS[k % COLORS.length], {paths: uPlot.paths.stepped({align: 1})})),
        data: sites.map((site) => column(model, (p) => (p.thresholds ? (p.thresholds[site] ?? null) : null))),
        sites,
      };
    },
    accuracy: (model) => {
      const floor = state.summary.models[model]?.accuracy_floor ?? null;
      const accuracy = column(model, (p) => p.accuracy);
      const bound = column(model, (p) => p.accuracy_bound);
      return {
        title: "accuracy vs the original model", key: "accuracy",
        series: [lineSeries("window accuracy", COLORS[0]), lineSeries("guaranteed (lower bound)", COLORS[2]),
                 lineSeries("constraint", COLORS[3], {dash: [6, 4]})],
        data: [accuracy, bound, accuracy.map((v) => (v === null ? null : floor))],
        // From just under the lowest of the data and the constraint, up to 1
        range: (u, low) => [Math.max(0, Math.min(low ?? 1, floor ?? 1) - 0.005), 1.0005],
      };
    },
  };
  const EXECUTOR_CHARTS = ["load", "latency", "queue", "exits", "thresholds", "accuracy"];
  const OTHER_CHARTS = ["load", "latency"];

  function drawChart(model, name, holder) {
    const definition = CHARTS[name](model);
    const x = state.samples.map((sample) => sample.t);
    const data = [x, ...definition.data];
    const charts = state.charts[model] || (state.charts[model] = {});
    let chart = charts[name];
    const width = Math.max(300, holder.clientWidth);
    if (chart && chart.key !== definition.key) {
      chart.plot.destroy();
      chart = null;
    }
    if (!chart) {
      holder.replaceChildren(element("h4", {text: definition.title}));
      const options = {
        width, height: CHART_HEIGHT, legend: {live: true},
        scales: {x: {time: true}, y: definition.range ? {range: definition.range} : {}},
        series: [{}, ...definition.series], bands: definition.bands || [],
        plugins: [changeMarkers(model)],
        axes: [TIME_AXIS, {size: 50}],
      };
      chart = {plot: new uPlot(options, data, holder), key: definition.key};
      charts[name] = chart;
    } else {
      if (chart.plot.width !== width) chart.plot.setSize({width, height: CHART_HEIGHT});
      chart.plot.setData(data);
    }
    chart.sites = definition.sites;
    return chart;
  }

  // ---- page ------------------------------------------------------------------------------------------------------

  function modelCard(model) {
    let card = document.getElementById(`model-${model}`);
    if (card) return card;
    card = element("section", {class: "model", id: `model-${model}`});
    card.dataset.model = model;
    card.append(element("h3", {text: model}), element("div", {class: "facts"}), element("div", {class: "charts"}),
                element("h4", {text: "controller's latest decisions"}), element("ol", {class: "decisions"}));
    $("#models").append(card);
    return card;
  }

  // Where a model served before it was prepared stands: its phase, with what it is doing or why it failed
  function learningText(learning) {
    if (!learning) return null;
    if (learning.phase === "recording") return `recording ${learning.recorded} of ${learning.record_target} requests`;
    if (learning.phase === "failed") return `failed, served vanilla: ${learning.reason}`;
    return learning.phase + (learning.detail ? ` (${learning.detail})` : "");
  }

  function renderModel(model) {
    const summary = state.summary.models[model] || {};
    const card = modelCard(model);
    card.hidden = !state.open[model];
    if (card.hidden) return;
    const facts = [];
    if (summary.learning) facts.push(learningText(summary.learning));
    if (summary.unavailable) facts.push(`executor unavailable: ${summary.unavailable}`);
    if (summary.executor) facts.push(`executor ${summary.executor.kind} pid ${summary.executor.pid}`);
    if (summary.vanilla !== undefined) facts.push(summary.vanilla ? "vanilla (no ramps)" : `exit mode ${summary.exit_mode}`);
    if (summary.slo_ms) facts.push(`SLO ${fmt(summary.slo_ms, 2)} ms, batch limit ${fmt(summary.batch_limit, 1)}`);
    if (summary.accuracy_floor != null) facts.push(`constraint: accuracy ≥ ${fmt(summary.accuracy_floor, 3)} at ` +
                                                   `${fmt(100 * summary.confidence, 0)}% confidence`);
    if (summary.risk_scale != null) facts.push(`risk control serves ${fmt(100 * summary.risk_scale, 0)}% of the ` +
                                               "certified thresholds");
    if (summary.exits) facts.push("answers since start: " + Object.entries(summary.exits).map(([s, n]) => `${s} ${n}`).join(" · "));
    $(".facts", card).textContent = facts.join(" — ");
    $(".facts", card).classList.toggle("unavailable", Boolean(summary.unavailable));
    const holder = $(".charts", card);
    const names = summary.executor ? EXECUTOR_CHARTS : OTHER_CHARTS;
    for (const name of names) {
      let slot = holder.querySelector(`[data-chart="${name}"]`);
      if (!slot) {
        slot = element("div", {class: "chart"});
        slot.dataset.chart = name;
        holder.append(slot);
      }
      drawChart(model, name, slot);
    }
    const decisions = (summary.decisions || []).slice().reverse();
    $(".decisions", card).replaceChildren(...decisions.map((d) => element("li", {
      text: `${clock(d.seen)} v${d.version}: ${d.reason} — ` +
            (d.sites.length ? d.sites.map((s, i) => `${s} ${fmt(d.thresholds[i], 3)}`).join(", ") : "no ramps") +
            ` (${fmt(d.decision_ms, 1)} ms)`,
    })));
  }

  function recent(model, count) {
    return state.samples.slice(-count).map((s) => s.models[model]).filter(Boolean);
  }

  function renderOverview(models) {
    const rows = models.map((model) => {
      const summary = state.summary.models[model] || {};
      const points = recent(model, 10);
      const last = points[points.length - 1] || {};
      let early = 0, all = 0;
      for (const p of points) {
        for (const [site, n] of Object.entries(p.exits || {})) { all += n; if (site !== "final") early += n; }
      }
      const executor = summary.executor ? `${summary.executor.kind} ${summary.executor.pid ?? ""}` +
        (summary.executor.restarts ? ` (${summary.executor.restarts} restarts)` : "") : "–";
      const phase = summary.learning ? ` (${summary.learning.phase})` : "";
      const cells = [model + phase, fmt(last.rps), fmt(last.errors_ps), fmt(last.p50_ms, 2), fmt(last.p99_ms, 2),
                     fmt(last.queue, 0), fmt(last.batch, 2), all ? `${fmt(100 * early / all, 1)}%` : "–",
                     fmt(last.accuracy, 4), fmt(last.accuracy_bound, 4),
                     last.config_version == null ? "–" : `v${last.config_version}`, executor];
      const row = element("tr", {}, ...cells.map((text) => element("td", {text})));
      row.dataset.model = model;
      row.addEventListener("click", () => {
        state.open[model] = !state.open[model];
        render();
      });
      return row;
    });
    $("#overview tbody").replaceChildren(...rows);
  }

  function renderApps() {
    const apps = state.summary.apps || {};
    const names = Object.keys(apps);
    $("#apps-section").hidden = names.length === 0;
    if (!names.length) return;
    const rows = [];
    for (const name of names) {
      const app = apps[name];
      const models = Object.entries(app.models);
      models.forEach(([model, stats], i) => {
        const head = i === 0 ? [name, app.policy || "", app.requests, app.defaults] : ["", "", "", ""];
        rows.push(element("tr", {}, ...[...head, model, stats.asked, stats.answered, stats.wins, stats.late,
                                        stats.failed].map((v) => element("td", {text: String(v)}))));
      });
    }
    $("#apps tbody").replaceChildren(...rows);
    const x = state.samples.map((s) => s.t);
    const series = [], data = [];
    names.forEach((name, k) => {
      series.push(lineSeries(`${name} queries/s`, COLORS[k % COLORS.length]),
                  lineSeries(`${name} defaults/s`, COLORS[k % COLORS.length], {dash: [4, 3]}));
      data.push(state.samples.map((s) => s.apps[name]?.qps ?? null),
                state.samples.map((s) => s.apps[name]?.defaults_ps ?? null));
    });
    const holder = $("#apps-chart");
    const key = names.join("|");
    const width = Math.max(300, holder.clientWidth);
    if (!state.appsChart || state.appsChart.key !== key) {
      if (state.appsChart) state.appsChart.plot.destroy();
      holder.replaceChildren(element("h4", {text: "application queries and defaults per second"}));
      state.appsChart = {key, plot: new uPlot({width, height: CHART_HEIGHT, scales: {x: {time: true}},
                                               series: [{}, ...series], axes: [TIME_AXIS, {size: 50}]}, [x, ...data],
                                              holder)};
    } else {
      state.appsChart.plot.setData([x, ...data]);
    }
  }

  function render() {
    const began = performance.now();
    const models = Object.keys(state.summary.models);
    for (const model of models) {
      if (state.open[model] === undefined) state.open[model] = models.length <= OPEN_BY_DEFAULT;
    }
    renderOverview(models);
    for (const model of models) renderModel(model);
    renderApps();
    const last = state.samples[state.samples.length - 1];
    const cost = state.sampler.cpu_ms_per_tick;
    $("#status").textContent = `${models.length} model${models.length === 1 ? "" : "s"} · last sample ${last ? clock(last.t) : "–"} · ` +
      `${state.samples.length} samples kept (every ${state.interval} s) · sampler ${fmt(cost, 2)} ms CPU per sample`;
    state.renders += 1;
    state.renderMs = performance.now() - began;
  }

  document.addEventListener("DOMContentLoaded", poll);
})();
