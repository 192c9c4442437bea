// ditmem serve's page: builds the arguments from the form, asks the server (which answers as
// the CLI's --json) and draws the answer. No network beyond this server, no libraries.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

// The categories of a breakdown, in the CLI's order, with their names and colours.
const CATS = [
  ["weights", "weights", "#4e79a7"],
  ["master_weights", "master weights", "#59a14f"],
  ["weight_casts", "weight casts", "#9c755f"],
  ["gradients", "gradients", "#f28e2b"],
  ["optimizer_state", "optimizer state", "#e15759"],
  ["ema", "EMA", "#b07aa1"],
  ["activations", "activations", "#edc948"],
  ["workspace", "workspace", "#76b7b2"],
  ["encoder", "text encoders", "#ff9da7"],
  ["data", "data", "#bab0ac"],
  ["runtime", "runtime", "#8cd17d"],
];

// fmt_bytes of crates/budget/src/units.rs: binary units, 3 significant figures, ties to even
// (Rust's formatting), so the page prints what the CLI prints.
function fmtBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  if (bytes < 1024) return `${bytes} B`;
  let v = bytes;
  let u = 0;
  while (v >= 1024 && u < units.length - 1) {
    v /= 1024;
    u += 1;
  }
  const digits = v >= 100 ? 0 : v >= 10 ? 1 : 2;
  return `${fixedEven(v, digits)} ${units[u]}`;
}

function fixedEven(v, digits) {
  const scale = 10 ** digits;
  const x = v * scale;
  const floor = Math.floor(x);
  // An exact half (representable): round to even as Rust does; otherwise toFixed's nearest.
  if (x - floor === 0.5 && Number.isInteger(x * 2)) {
    const n = floor % 2 === 0 ? floor : floor + 1;
    return (n / scale).toFixed(digits);
  }
  return v.toFixed(digits);
}

function pct(part, whole) {
  return whole > 0 ? `${Math.round((100 * part) / whole)} %` : "";
}

const state = { presets: [], gpus: [], seq: 0, planSeq: 0, timer: null, lastArgs: null };

async function api(path, args) {
  const res = await fetch(path, {
    method: args === undefined ? "GET" : "POST",
    headers: args === undefined ? {} : { "Content-Type": "application/json" },
    body: args === undefined ? undefined : JSON.stringify(args),
  });
  let body = null;
  try {
    body = await res.json();
  } catch (e) {
    body = { error: "internal", message: `the server answered ${res.status} without JSON` };
  }
  return { ok: res.ok, status: res.status, body };
}

// The pasted config, parsed: {config} or {error} or {} when empty.
function pastedConfig() {
  const text = $("config").value.trim();
  if (!text) return {};
  try {
    const v = JSON.parse(text);
    if (v === null || typeof v !== "object" || Array.isArray(v)) {
      return { error: "invalid input: config.json: not a JSON object" };
    }
    return { config: v };
  } catch (e) {
    return { error: `invalid input: config.json is not JSON: ${e.message}` };
  }
}

function isVideo() {
  const pasted = pastedConfig().config;
  if (pasted) return String(pasted._class_name || "").includes("3D");
  const p = state.presets.find((x) => x.name === $("preset").value);
  return Boolean(p && p.video);
}

// The family an export targets, from the model's diffusers class.
function family() {
  const pasted = pastedConfig().config;
  const p = state.presets.find((x) => x.name === $("preset").value);
  const cls = String((pasted ? pasted._class_name : p && p.class) || "");
  if (cls.startsWith("Flux")) return "flux";
  if (cls.startsWith("SD3")) return "sd3";
  if (cls.startsWith("PixArt")) return "pixart";
  if (cls.startsWith("Sana")) return "sana";
  if (cls.startsWith("Wan")) return "wan";
  if (cls.startsWith("DiT")) return "dit-diffusers";
  return "dit";
}

const FIELDS = [
  "resolution", "frames", "batch", "ranks", "zero", "precision", "lora_rank", "lora_targets",
  "recompute", "attention", "optimizer", "base_quant", "text_encoders", "latents", "alloc_conf",
];
const NUMBERS = new Set(["frames", "batch", "ranks", "zero", "lora_rank"]);

// The estimate's arguments, named as the CLI's flags; empty fields are left to the defaults.
function estimateArgs() {
  const args = {};
  const pasted = pastedConfig();
  if (pasted.error) return { error: pasted.error };
  args.model = pasted.config || $("preset").value;
  if ($("gpu").value) args.gpu = $("gpu").value;
  for (const f of FIELDS) {
    if (f === "frames" && !isVideo()) continue;
    const v = $(f).value.trim();
    if (v === "") continue;
    args[f] = NUMBERS.has(f) && /^\d+$/.test(v) ? Number(v) : v;
  }
  const extra = extraFlags($("extra").value);
  if (extra.error) return { error: extra.error };
  Object.assign(args, extra.args);
  return { args };
}

// "--ema on --accumulation=4 --verbose" → {ema: "on", accumulation: "4", verbose: true}; the
// server's parser judges the names and values (an unknown one: the allowed list).
function extraFlags(text) {
  const args = {};
  const words = text.trim().split(/\s+/).filter((w) => w);
  for (let i = 0; i < words.length; i++) {
    const w = words[i];
    if (!w.startsWith("--") || w.length < 3) {
      return { error: `invalid input: more flags: '${w}' is not a flag; allowed: --name value, e.g. --ema on` };
    }
    let [name, value] = w.slice(2).split(/=(.*)/s);
    if (value === undefined) {
      value = i + 1 < words.length && !words[i + 1].startsWith("--") ? words[++i] : true;
    }
    args[name.replace(/-/g, "_")] = value;
  }
  return { args };
}

function schedule() {
  clearTimeout(state.timer);
  state.timer = setTimeout(estimate, 250);
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

async function estimate() {
  $("frames-label").hidden = !isVideo();
  const built = estimateArgs();
  const seq = ++state.seq;
  document.body.dataset.state = "loading";
  if (built.error) {
    $("config-state").textContent = "";
    showError(built.error);
    $("estimate").hidden = true;
    document.body.dataset.state = "error";
    return;
  }
  $("config-state").textContent = pastedConfig().config ? "using the pasted config (the preset is ignored)" : "";
  const r = await api("/api/estimate", built.args);
  if (seq !== state.seq) return; // a newer request is on its way
  state.lastArgs = built.args;
  document.body.dataset.args = JSON.stringify(built.args);
  if (!r.ok) {
    showError(r.body.message || `error ${r.status}`);
    $("summary").textContent = r.body.message || `error ${r.status}`;
    $("summary").className = "summary no";
    $("estimate").hidden = true;
    document.body.dataset.state = "error";
    return;
  }
  $("error").hidden = true;
  renderEstimate(r.body);
  document.body.dataset.state = "ready";
}

function conditionsLine(j) {
  const c = j.cuda;
  const spec = j.spec || {};
  if (c) {
    const card = c.gpu ? `on ${c.gpu}` : "on a CUDA GPU (no card chosen)";
    const conf = c.alloc_conf ? `PYTORCH_CUDA_ALLOC_CONF=${c.alloc_conf}` : "the default PYTORCH_CUDA_ALLOC_CONF";
    return `Predicted, not measured: ditmem's budget for ${spec.runtime || "pytorch:cuda"} ${card} — ` +
      `PyTorch's CUDA caching allocator replayed over ${c.events.toLocaleString("en")} allocator events (${conf}), ` +
      `CUDA context ${fmtBytes(c.context_bytes)}, cuBLAS workspace ${fmtBytes(c.cublas_workspace_bytes)}.`;
  }
  return `Predicted, not measured: ditmem's budget for the ${j.runtime} runtime.`;
}

function renderEstimate(j) {
  $("estimate").hidden = false;
  const spec = j.spec;
  const w = spec.workload;
  const frames = w.frames && w.frames > 1 ? `${w.frames} frames × ` : "";
  const lora = spec.recipe.lora ? `, LoRA rank ${spec.recipe.lora.rank}` : "";
  $("title").textContent = `${spec.model.name || "pasted config"} ${frames}${w.height}×${w.width} ` +
    `(${j.tokens.toLocaleString("en")} tokens), batch ${w.batch}; ${spec.recipe.precision}${lora}`;

  const need = j.need_bytes;
  const cap = j.cuda && j.cuda.capacity_bytes;
  const budgetText = $("budget").value.trim();
  const budget = cap ? null : parseBytes(budgetText);
  const limit = cap || budget;
  const fits = cap ? j.fits : budget ? need <= budget : null;
  const v = $("verdict");
  v.dataset.fits = fits === null ? "unknown" : String(fits);
  v.className = "verdict " + (fits === true ? "yes" : fits === false ? "no" : "");
  if (cap) {
    v.textContent = fits
      ? `Fits ${j.cuda.gpu}: yes — ${fmtBytes(cap - need)} free at the peak`
      : `Fits ${j.cuda.gpu}: no — the step needs ${fmtBytes(need)}, ${fmtBytes(need - cap)} more than the card's ${fmtBytes(cap)}`;
  } else if (budget) {
    v.textContent = fits
      ? `Within your budget of ${fmtBytes(budget)}: yes`
      : `Within your budget of ${fmtBytes(budget)}: no — ${fmtBytes(need - budget)} over`;
  } else {
    v.textContent = `No card chosen: the step needs ${fmtBytes(need)} on the device`;
  }
  $("summary").textContent = v.textContent;
  $("summary").className = v.className.replace("verdict", "summary");
  $("need").textContent = fmtBytes(need);
  $("need").dataset.bytes = String(need);
  $("capacity").textContent = limit ? fmtBytes(limit) + (cap ? " as CUDA reports it" : " (your budget)") : "—";
  $("capacity").dataset.bytes = limit ? String(limit) : "";
  $("peak-where").textContent = `${j.peak.phase}, ${j.peak.label}`;
  $("peak-where").dataset.phase = j.peak.phase;

  // The bar: the need against the card (the longer of the two spans the width).
  const span = Math.max(need, limit || need);
  $("bar-fill").style.width = `${(100 * need) / span}%`;
  $("bar-fill").className = "fill " + (fits === false ? "no" : "yes");
  $("bar-cap").hidden = !limit;
  if (limit) $("bar-cap").style.left = `calc(${(100 * limit) / span}% - 1px)`;
  $("bar").setAttribute("aria-label", `needs ${fmtBytes(need)}` + (limit ? ` of ${fmtBytes(limit)}` : ""));
  $("conditions").textContent = conditionsLine(j);

  const tbody = $("breakdown").querySelector("tbody");
  tbody.replaceChildren();
  const bd = j.peak.breakdown;
  const total = CATS.reduce((s, [k]) => s + (bd[k] || 0), 0);
  const rows = CATS.filter(([k]) => bd[k] > 0).sort((a, b) => bd[b[0]] - bd[a[0]]);
  for (const [k, name, colour] of rows) {
    const tr = document.createElement("tr");
    tr.dataset.key = k;
    tr.dataset.bytes = String(bd[k]);
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.background = colour;
    const td0 = document.createElement("td");
    td0.append(sw, name);
    const td1 = document.createElement("td");
    td1.textContent = fmtBytes(bd[k]);
    const td2 = document.createElement("td");
    td2.textContent = pct(bd[k], total);
    tr.append(td0, td1, td2);
    tbody.append(tr);
  }
  const trc = document.createElement("tr");
  trc.className = "note";
  const tdc = document.createElement("td");
  tdc.colSpan = 3;
  tdc.textContent = j.cuda
    ? `allocated at the peak ${fmtBytes(total)}; the device also holds the CUDA context and the allocator's cached, unused segments`
    : `allocated at the peak ${fmtBytes(total)}`;
  trc.append(tdc);
  tbody.append(trc);

  drawTimeline(j, limit, cap ? "card capacity" : "your budget");

  const ul = $("levers");
  ul.replaceChildren();
  for (const l of j.levers || []) {
    const li = document.createElement("li");
    li.className = l.fits ? "yes" : l.fits === false ? "no" : "";
    const pc = l.slowdown * 100;
    const slow = l.slowdown ? `, step ${pc >= 0 ? "+" : ""}${Math.abs(pc) < 10 ? pc.toFixed(1) : Math.round(pc)} %` : "";
    const fitText = l.fits === true ? " — fits" : l.fits === false ? " — still too big" : "";
    li.textContent = `${l.change}: ${fmtBytes(l.device_peak_bytes)}${fitText}${slow}`;
    const code = document.createElement("code");
    code.textContent = l.flags;
    li.append(" ", code);
    ul.append(li);
  }
}

// Binary units as the CLI reads them (24GiB, 24G, 512MiB, bytes).
function parseBytes(text) {
  const m = /^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$/.exec(text || "");
  if (!m) return null;
  const mult = { "": 1, b: 1, k: 2 ** 10, kib: 2 ** 10, kb: 2 ** 10, m: 2 ** 20, mib: 2 ** 20, mb: 2 ** 20,
    g: 2 ** 30, gib: 2 ** 30, gb: 2 ** 30, t: 2 ** 40, tib: 2 ** 40, tb: 2 ** 40 }[m[2].toLowerCase()];
  return mult ? Math.round(Number(m[1]) * mult) : null;
}

function el(name, attrs, text) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

// The step's live bytes, stacked by category, over the simulated events; the card's line.
function drawTimeline(j, limit, limitName) {
  const box = $("timeline");
  box.replaceChildren();
  const ev = j.timeline.events;
  if (!ev.length) return;
  const W = 640, H = 240, L = 56, R = 8, T = 10, B = 28;
  const sums = ev.map((e) => CATS.reduce((s, [k]) => s + (e.live[k] || 0), 0));
  const top = Math.max(...sums, limit || 0) * 1.05;
  const x = (i) => L + ((W - L - R) * i) / Math.max(1, ev.length - 1);
  const y = (b) => T + (H - T - B) * (1 - b / top);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "live bytes over the step" });
  for (let g = 0; g <= 4; g++) {
    const b = (top * g) / 4;
    svg.append(el("line", { x1: L, x2: W - R, y1: y(b), y2: y(b), class: "grid" }));
    svg.append(el("text", { x: L - 4, y: y(b) + 4, "text-anchor": "end", class: "tick" }, fmtBytes(Math.round(b))));
  }
  const base = ev.map(() => 0);
  for (const [k, name, colour] of CATS) {
    if (!ev.some((e) => e.live[k] > 0)) continue;
    const upper = ev.map((e, i) => base[i] + (e.live[k] || 0));
    let pts = upper.map((b, i) => `${x(i).toFixed(1)},${y(b).toFixed(1)}`);
    for (let i = ev.length - 1; i >= 0; i--) pts.push(`${x(i).toFixed(1)},${y(base[i]).toFixed(1)}`);
    const poly = el("polygon", { points: pts.join(" "), fill: colour, "fill-opacity": 0.85 });
    poly.append(el("title", {}, name));
    svg.append(poly);
    upper.forEach((b, i) => (base[i] = b));
  }
  // Phase labels along the bottom.
  // Phase boundaries, and their names where there is room (a short phase's name is dropped).
  const starts = [];
  ev.forEach((e, i) => {
    if (!starts.length || ev[starts[starts.length - 1]].phase !== e.phase) starts.push(i);
  });
  starts.forEach((i, n) => {
    svg.append(el("line", { x1: x(i), x2: x(i), y1: T, y2: H - B, class: "phase" }));
    const end = n + 1 < starts.length ? x(starts[n + 1]) : W - R;
    const name = ev[i].phase;
    if (end - x(i) >= name.length * 6 + 6) {
      svg.append(el("text", { x: (x(i) + end) / 2, y: H - B + 14, "text-anchor": "middle", class: "tick" }, name));
    }
  });
  const pk = j.timeline.peak_index;
  if (pk !== undefined && pk !== null && pk < ev.length) {
    svg.append(el("circle", { cx: x(pk), cy: y(sums[pk]), r: 4, class: "peak" }));
  }
  if (limit) {
    svg.append(el("line", { x1: L, x2: W - R, y1: y(limit), y2: y(limit), class: "limit" }));
    svg.append(el("text", { x: W - R - 4, y: y(limit) - 4, "text-anchor": "end", class: "limit-label" },
      `${limitName} ${fmtBytes(limit)}`));
  }
  box.append(svg);
  const cap = document.createElement("p");
  cap.className = "conditions";
  cap.textContent = `Allocated bytes at each of the ${ev.length} simulated events (predicted), stacked by category; ` +
    `the line is the ${limitName}, which also holds the CUDA context and cached segments.`;
  box.append(cap);
}

async function plan() {
  const built = estimateArgs();
  if (built.error) {
    showError(built.error);
    return;
  }
  const args = { ...built.args };
  if (!args.gpu) {
    const b = $("budget").value.trim();
    if (!b) {
      showError("invalid input: --budget: required: a size such as 24GiB, or a GPU");
      return;
    }
    args.budget = b;
  }
  const allow = [...$("allow").querySelectorAll("input:checked")].map((i) => i.value);
  if (allow.length) args.allow = allow;
  args.emit = $("emit").value;
  args.emit_family = family();
  // The launcher constrains the search (plan --launcher): empty = the export's own script.
  if ($("launcher").value) args.launcher = $("launcher").value;
  const seq = ++state.planSeq;
  $("plan").hidden = false;
  $("plan").dataset.state = "loading";
  $("plan-verdict").textContent = "searching…";
  $("plan-reason").textContent = "";
  const r = await api("/api/plan", args);
  if (seq !== state.planSeq) return;
  const j = r.ok ? r.body : r.body.json;
  if (!j || typeof j !== "object") {
    $("plan-verdict").textContent = r.body.message || `error ${r.status}`;
    $("plan-verdict").className = "verdict no";
    $("plan").dataset.state = "error";
    $("export").hidden = true;
    $("pareto").replaceChildren();
    return;
  }
  renderPlan(j, r.ok ? null : r.body.message);
  $("plan").dataset.state = "ready";
}

function renderPlan(j, message) {
  const v = $("plan-verdict");
  v.dataset.feasible = String(j.feasible);
  v.className = "verdict " + (j.feasible ? "yes" : "no");
  v.textContent = j.feasible
    ? `Fits: ${fmtBytes(j.predicted_peak_bytes)} of ${fmtBytes(j.usable_bytes)} usable; step ${j.predicted_step_time_s.toFixed(2)} s predicted (as given ${fmtBytes(j.base_peak_bytes)}, ${j.base_step_time_s.toFixed(2)} s)`
    : message || "nothing fits";
  $("plan-reason").textContent = `Why: ${j.reason}`;
  $("plan-flags").textContent = j.changes && j.changes.length ? `Changes: ${j.changes.join(" · ")}` : "Changes: none";
  drawPareto(j);
  $("plan-conditions").textContent = `Predicted, not measured: peaks by ditmem's budget for ${j.plan.runtime}` +
    (j.plan.cuda && j.plan.cuda.gpu ? ` on ${j.plan.cuda.gpu} with the CUDA caching allocator replayed` : "") +
    `; step times by the time model "${j.profile.name}"; ${j.evaluated} recipes evaluated in ${Math.round(j.search_ms)} ms` +
    (j.not_searched ? "; the search stopped at this server's time limit before searching everything" : "") + ".";
  const e = j.export;
  $("export").hidden = !e;
  if (e) {
    $("export-name").textContent = e.file_name || e.target;
    $("export-text").textContent = e.text;
    const c = e.command;
    $("launch").textContent = c ? [...c.launcher, c.script, ...c.script_args].map(shellQuote).join(" ") : "";
    const notes = $("export-notes");
    notes.replaceChildren();
    for (const n of [...(e.notes || []), ...(e.cannot || []).map((x) => `the script cannot: ${x}`)]) {
      const li = document.createElement("li");
      li.textContent = n;
      notes.append(li);
    }
  }
}

function shellQuote(s) {
  return /^[A-Za-z0-9_./:=,+-]+$/.test(s) ? s : `'${s.replace(/'/g, `'"'"'`)}'`;
}

// Peak against predicted step time: every recipe on the front, the chosen one ringed.
function drawPareto(j) {
  const box = $("pareto");
  box.replaceChildren();
  const pts = (j.pareto || []).map((p, i) => ({ i, peak: p.peak_bytes, t: p.time.total_s, changes: p.changes }));
  if (!pts.length) return;
  const W = 640, H = 260, L = 56, R = 12, T = 12, B = 34;
  const usable = j.usable_bytes;
  const maxB = Math.max(...pts.map((p) => p.peak), usable) * 1.05;
  const ts = pts.map((p) => p.t);
  const t0 = Math.min(...ts) * 0.95, t1 = Math.max(...ts) * 1.05 || 1;
  const x = (t) => L + ((W - L - R) * (t - t0)) / Math.max(1e-9, t1 - t0);
  const y = (b) => T + (H - T - B) * (1 - b / maxB);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "Pareto front: peak against step time" });
  for (let g = 0; g <= 4; g++) {
    const b = (maxB * g) / 4;
    svg.append(el("line", { x1: L, x2: W - R, y1: y(b), y2: y(b), class: "grid" }));
    svg.append(el("text", { x: L - 4, y: y(b) + 4, "text-anchor": "end", class: "tick" }, fmtBytes(Math.round(b))));
  }
  for (let g = 0; g <= 4; g++) {
    const t = t0 + ((t1 - t0) * g) / 4;
    const anchor = g === 0 ? "start" : g === 4 ? "end" : "middle";
    svg.append(el("text", { x: x(t), y: H - B + 16, "text-anchor": anchor, class: "tick" }, `${t.toFixed(2)} s`));
  }
  svg.append(el("text", { x: (W + L) / 2, y: H - 4, "text-anchor": "middle", class: "tick" }, "predicted step time"));
  svg.append(el("line", { x1: L, x2: W - R, y1: y(usable), y2: y(usable), class: "limit" }));
  svg.append(el("text", { x: W - R - 4, y: y(usable) - 4, "text-anchor": "end", class: "limit-label" }, `usable ${fmtBytes(usable)}`));
  const chosen = j.feasible ? j.predicted_peak_bytes : null;
  // A point's number goes where it overlaps no other number (right, left, above, below of the
  // point); where none is free it is left out (the list below names every point).
  const placed = [];
  const label = (cx, cy, text) => {
    const w = text.length * 6 + 2, h = 11;
    for (const [dx, dy] of [[6, -5], [-6 - w, -5], [-w / 2, -9], [-w / 2, 15]]) {
      const box = { x: cx + dx, y: cy + dy - h + 2, w, h };
      if (box.x < L || box.x + w > W || box.y < 0 || box.y + h > H - B) continue;
      if (placed.some((b) => b.x < box.x + box.w && box.x < b.x + b.w && b.y < box.y + box.h && box.y < b.y + b.h)) continue;
      placed.push(box);
      svg.append(el("text", { x: box.x, y: cy + dy, class: "pt-label" }, text));
      return;
    }
  };
  const order = pts.map((p, n) => n);
  // The plan's label first: it must not be the one left out.
  order.sort((a, b) => (pts[b].peak === chosen) - (pts[a].peak === chosen));
  const circles = [];
  pts.forEach((p, n) => {
    const fits = p.peak <= usable;
    const isChosen = chosen !== null && p.peak === chosen && Math.abs(p.t - j.predicted_step_time_s) < 1e-9;
    const c = el("circle", { cx: x(p.t), cy: y(p.peak), r: isChosen ? 7 : 4, class: `pt ${fits ? "yes" : "no"}${isChosen ? " chosen" : ""}` });
    const name = p.changes.length ? p.changes.join("; ") : "as given";
    c.append(el("title", {}, `${name}: ${fmtBytes(p.peak)}, ${p.t.toFixed(2)} s`));
    svg.append(c);
    circles[n] = isChosen;
  });
  for (const n of order) label(x(pts[n].t), y(pts[n].peak), circles[n] ? `${n + 1} (plan)` : `${n + 1}`);
  box.append(svg);
  const ol = document.createElement("ol");
  ol.className = "pareto-names";
  pts.forEach((p) => {
    const li = document.createElement("li");
    li.textContent = `${p.changes.length ? p.changes.join("; ") : "as given"} — ${fmtBytes(p.peak)}, ${p.t.toFixed(2)} s`;
    ol.append(li);
  });
  box.append(ol);
}

function download() {
  const name = $("export-name").textContent || "export.txt";
  const blob = new Blob([$("export-text").textContent], { type: "text/plain" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function copy() {
  const text = $("export-text").textContent;
  try {
    await navigator.clipboard.writeText(text);
    $("copy").textContent = "Copied";
  } catch (e) {
    const r = document.createRange();
    r.selectNodeContents($("export-text"));
    const s = window.getSelection();
    s.removeAllRanges();
    s.addRange(r);
    $("copy").textContent = "Selected — press Ctrl-C";
  }
  setTimeout(() => ($("copy").textContent = "Copy"), 2000);
}

async function init() {
  const [p, g] = await Promise.all([api("/api/presets"), api("/api/gpus", {})]);
  state.presets = p.ok ? p.body : [];
  state.gpus = g.ok ? g.body : [];
  const ps = $("preset");
  for (const x of state.presets) ps.append(new Option(x.name, x.name));
  ps.value = "flux.1-dev";
  const gs = $("gpu");
  gs.append(new Option("none — use a budget", ""));
  for (const x of state.gpus) gs.append(new Option(`${x.name} (${fmtBytes(x.capacity_bytes)})`, x.name));
  gs.value = "rtx-4090";
  $("lora_rank").value = "16";
  api("/api/args/estimate").then((r) => {
    if (r.ok) $("arg-names").textContent = r.body.map((n) => `--${n.replace(/_/g, "-")}`).join(" ");
  });
  const form = $("form");
  form.addEventListener("input", schedule);
  form.addEventListener("change", schedule);
  form.addEventListener("submit", (e) => e.preventDefault());
  $("plan-button").addEventListener("click", plan);
  $("copy").addEventListener("click", copy);
  $("download").addEventListener("click", download);
  const cfg = $("config");
  cfg.addEventListener("dragover", (e) => e.preventDefault());
  cfg.addEventListener("drop", (e) => {
    e.preventDefault();
    const f = e.dataTransfer.files[0];
    if (!f) return;
    if (f.size > 1 << 20) {
      showError("invalid input: config.json: over 1 MiB; allowed: a diffusers transformer config");
      return;
    }
    f.text().then((t) => {
      cfg.value = t;
      schedule();
    });
  });
  await estimate();
}

// For tests and scripts: the arguments the page sends now.
window.ditmem = { estimateArgs, fmtBytes, estimate, plan };
document.addEventListener("DOMContentLoaded", init);
