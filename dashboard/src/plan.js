// Plan explorer: one model size against several node shapes, side by side, from POST /v1/plan.
import { api } from "./api.js";
import { bytes, duration, errorBox, h, stepSeconds, usd } from "./format.js";

const GiB = 1024 ** 3;
// Editable starting points; what is sent is what the form holds.
export const SHAPES = [
  { name: "24gb-nvme", title: "24 GB GPU + NVMe", gpuProduct: "NVIDIA-L4", gpuGiB: 24, gpus: 1, cpuCores: 16, cpuGiB: 64,
    nvmeGiB: 1800, price: 0.8 },
  { name: "48gb-nvme", title: "48 GB GPU + NVMe", gpuProduct: "NVIDIA-L40S", gpuGiB: 48, gpus: 1, cpuCores: 32, cpuGiB: 128,
    nvmeGiB: 3600, price: 1.6 },
  { name: "80gb", title: "80 GB GPU, no NVMe", gpuProduct: "NVIDIA-A100-SXM4-80GB", gpuGiB: 80, gpus: 1, cpuCores: 32,
    cpuGiB: 256, nvmeGiB: 0, price: 3.0 },
];

export function hardware(s) {
  const hw = { name: s.name, gpu_count: s.gpus, gpu_product: s.gpuProduct, gpu_memory_bytes: Math.round(s.gpuGiB * GiB),
    cpu_cores: s.cpuCores, cpu_memory_bytes: Math.round(s.cpuGiB * GiB) };
  if (s.nvmeGiB > 0) {
    Object.assign(hw, { nvme_path: "/nvme", nvme_capacity_bytes: Math.round(s.nvmeGiB * GiB),
      nvme_free_bytes: Math.round(s.nvmeGiB * GiB), nvme_read_bytes_per_s: 3e9, nvme_write_bytes_per_s: 2e9 });
  }
  return hw;
}

function field(id, label, value, attrs = {}) {
  return h("div", { class: "field" }, h("label", { for: id }, label),
    h("input", { id, name: id, value, inputmode: "decimal", ...attrs }));
}

export function planPage(main) {
  const shapeBoxes = SHAPES.map((s, i) => h("fieldset", { class: "shape", "data-shape": i },
    h("legend", {}, h("label", {}, h("input", { type: "checkbox", name: `use-${i}`, checked: true }), ` ${s.title}`)),
    field(`s${i}-name`, "Node name", s.name),
    field(`s${i}-gpu`, "GPU memory (GiB)", s.gpuGiB, { type: "number", min: 0, step: "any" }),
    field(`s${i}-gpus`, "GPUs", s.gpus, { type: "number", min: 0, step: 1 }),
    field(`s${i}-cpu`, "CPU RAM (GiB)", s.cpuGiB, { type: "number", min: 1, step: "any" }),
    field(`s${i}-nvme`, "NVMe (GiB, 0 = none)", s.nvmeGiB, { type: "number", min: 0, step: "any" }),
    field(`s${i}-price`, "USD per hour", s.price, { type: "number", min: 0, step: "any" })));
  const results = h("div", { id: "plan-results", "aria-live": "polite" });
  const form = h("form", { id: "plan-form", onsubmit: (e) => { e.preventDefault(); compare(); } },
    h("div", { class: "row" },
      field("plan-params", "Model size (parameters)", "7B", { list: "param-presets", required: true,
        "aria-describedby": "params-help" }),
      h("datalist", { id: "param-presets" }, ["125M", "1.3B", "7B", "13B", "34B", "70B"].map((v) => h("option", { value: v }))),
      field("plan-steps", "Training steps", 1000, { type: "number", min: 1, step: 1 }),
      field("plan-seq", "Sequence length", 2048, { type: "number", min: 1, step: 1 }),
      field("plan-mbs", "Micro-batch size", 1, { type: "number", min: 1, step: 1 })),
    h("p", { id: "params-help", class: "muted" }, "e.g. 7B, 13B or 350M; the planner derives the layer shapes from it."),
    h("div", { class: "row" },
      field("plan-namespace", "Namespace (for the cluster's nodes)", new URLSearchParams(location.search).get("namespace") || "",
        { inputmode: "text", "aria-describedby": "namespace-help" })),
    h("p", { id: "namespace-help", class: "muted" },
      "One you may create FineTuneJobs in; empty asks with cluster-wide rights."),
    h("div", { class: "shapes" }, shapeBoxes),
    h("div", { class: "actions" },
      h("button", { type: "submit", id: "plan-compare" }, "Compare node shapes"),
      h("button", { type: "button", class: "secondary", id: "plan-cluster", onclick: () => compare(true) },
        "Use the cluster's nodes"),
      h("button", { type: "button", class: "secondary", id: "plan-largest", onclick: () => compare(false, true) },
        "Largest model per shape")));
  main.replaceChildren(h("h1", {}, "Plan explorer"),
    h("p", {}, "Where the training state would live on each node shape, how long a step takes and what the run costs — before anything runs."),
    form, results);
  document.title = "Plan explorer · Spillway";

  function val(id) { return form.querySelector(`#${id}`).value.trim(); }

  async function compare(cluster = false, largest = false) {
    const common = {
      ...(largest ? {} : { parameterCount: val("plan-params") }),
      training: { maxSteps: Number(val("plan-steps")), sequenceLength: Number(val("plan-seq")),
        microBatchSize: Number(val("plan-mbs")) },
    };
    const requests = cluster ? [{ ...common }] : SHAPES.map((_, i) => i)
      .filter((i) => form.querySelector(`input[name=use-${i}]`).checked)
      .map((i) => ({ ...common, pricePerHour: Number(val(`s${i}-price`)), hardware: hardware({
        ...SHAPES[i], name: val(`s${i}-name`), gpuGiB: Number(val(`s${i}-gpu`)), gpus: Number(val(`s${i}-gpus`)),
        cpuGiB: Number(val(`s${i}-cpu`)), nvmeGiB: Number(val(`s${i}-nvme`)) }) }));
    if (!requests.length) { results.replaceChildren(errorBox("Pick at least one node shape.")); return; }
    results.replaceChildren(h("p", { class: "muted" }, "Planning…"));
    try {
      // Planning on the cluster's nodes is allowed to whoever may create jobs in the namespace asked about.
      const ns = cluster ? val("plan-namespace") : "";
      const url = ns ? `/v1/plan?namespace=${encodeURIComponent(ns)}` : "/v1/plan";
      const answers = await Promise.all(requests.map((r) => api(url, { method: "POST", body: r })));
      if (largest) {
        results.replaceChildren(largestTable(answers.flatMap((a) => a.largest)));
        return;
      }
      const cols = answers.flatMap((a, i) => a.data.map((p) => ({ ...p, request: requests[i] })));
      results.replaceChildren(table(cols));
    } catch (err) {
      results.replaceChildren(errorBox(err));
    }
  }
  return () => {};
}

/** 15200000000 -> "15.2B". */
export function count(n) {
  const units = [[1e12, "T"], [1e9, "B"], [1e6, "M"]];
  const [size, unit] = units.find(([s]) => n >= s) || [1, ""];
  return `${Number((n / size).toPrecision(3))}${unit}`;
}

/** The largest model each placement fits, per node shape: placements down, shapes across. */
function largestTable(shapes) {
  const placements = [...new Set(shapes.flatMap((s) => s.placements.map((p) => p.placement)))];
  const cell = (shape, label) => {
    const p = shape.placements.find((x) => x.placement === label);
    if (!p || p.whyNot) return h("td", { "data-node": shape.node, "data-placement": label, class: "muted" },
      p ? p.whyNot : "–");
    if (!p.parameters) return h("td", { "data-node": shape.node, "data-placement": label, "data-value": 0 }, "none");
    return h("td", { class: "num", "data-node": shape.node, "data-placement": label, "data-value": p.parameters },
      count(p.parameters), h("div", { class: "muted small" }, `${stepSeconds(p.predictedStepSeconds)} / step`));
  };
  return h("table", { class: "data compare", id: "largest-table" },
    h("caption", {}, "The largest model each placement fits, with the sequence length and batch above"),
    h("thead", {}, h("tr", {}, h("td", {}), shapes.map((s) => h("th", { scope: "col", "data-node": s.node }, s.node)))),
    h("tbody", {}, placements.map((label) => h("tr", {}, h("th", { scope: "row", class: "mono" }, label),
      shapes.map((s) => cell(s, label))))));
}

/** One figure of a plan (none when the planner could not plan for the node), and its badge. */
function figure(c, field, format, badge) {
  if (!c.plan) return h("td", { "data-field": field }, "–");
  return h("td", { class: "num", "data-field": field, "data-value": c.plan[field] },
    format(c.plan[field]), badge ? h("div", { class: "best small" }, badge) : null);
}

function table(cols) {
  const feasible = cols.filter((c) => c.feasible);
  const fastest = feasible.length ? feasible.reduce((a, b) => (a.plan.predictedStepSeconds <= b.plan.predictedStepSeconds ? a : b)) : null;
  const priced = feasible.filter((c) => c.plan.predictedCostUsd != null);
  const cheapest = priced.length ? priced.reduce((a, b) => (a.plan.predictedCostUsd <= b.plan.predictedCostUsd ? a : b)) : null;
  const tierCell = (c, k) => {
    if (!c.plan) return h("td", { "data-field": `bytes.${k}` }, "–");
    const used = c.plan.bytes[k];
    const cap = c.plan.capacity[k];
    return h("td", { class: "num", "data-field": `bytes.${k}`, "data-value": used },
      bytes(used), h("div", { class: "muted small" }, cap ? `of ${bytes(cap)}` : "none on node"));
  };
  const rows = [
    ["Fits", (c) => h("td", { "data-field": "feasible", "data-value": String(c.feasible) },
      c.feasible ? "yes" : h("span", { class: "bad" }, "no"))],
    ["Placement", (c) => h("td", { class: "mono", "data-field": "label", "data-value": c.label }, c.label)],
    ["GPU (per GPU)", (c) => tierCell(c, "gpu")],
    ["CPU RAM", (c) => tierCell(c, "cpu")],
    ["NVMe", (c) => tierCell(c, "nvme")],
    ["Step time", (c) => figure(c, "predictedStepSeconds", stepSeconds, c === fastest ? "fastest" : null)],
    ["Time to finish", (c) => figure(c, "predictedTotalSeconds", duration, null)],
    ["Cost to finish", (c) => figure(c, "predictedCostUsd", usd, c === cheapest ? "cheapest" : null)],
    ["Short of", (c) => h("td", { "data-field": "shortfalls" }, c.shortfalls.length ? h("ul", {}, c.shortfalls.map((s) => h("li", {}, s))) : "–")],
  ];
  return h("table", { class: "data compare", id: "plan-table" },
    h("caption", {}, `${cols.find((c) => c.plan)?.plan.modelName ?? ""} parameters on ${cols.length} node shape${cols.length === 1 ? "" : "s"}`),
    h("thead", {}, h("tr", {}, h("td", {}), cols.map((c) => h("th", { scope: "col", "data-node": c.node,
      "data-request": JSON.stringify(c.request) }, c.node)))),
    h("tbody", {}, rows.map(([label, cell]) => h("tr", {}, h("th", { scope: "row" }, label), cols.map(cell)))));
}
