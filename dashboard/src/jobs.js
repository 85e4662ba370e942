// Jobs table: every namespace, filtered by namespace and phase, refreshed every few seconds.
import { api } from "./api.js";
import { age, duration, errorBox, h, planLabel, usd } from "./format.js";

// spillway_runtime/core/contract.py's Phase, in its order (tests/unit/api/test_dashboard_bundle.py checks).
export const PHASES = ["Pending", "Queued", "Planning", "Planned", "Scheduled", "Running", "Suspended", "Preempted", "Succeeded",
  "Failed", "Diverged", "BudgetExceeded"];
const POLL_MS = 3000;

export function jobsPage(main, query) {
  const namespaces = new Set();
  const nsSelect = h("select", { id: "filter-namespace", name: "namespace" }, h("option", { value: "" }, "All namespaces"));
  const phaseSelect = h("select", { id: "filter-phase", name: "phase" }, h("option", { value: "" }, "All phases"),
    PHASES.map((p) => h("option", { value: p }, p)));
  const tbody = h("tbody");
  const status = h("p", { class: "muted", role: "status", "aria-live": "polite", id: "jobs-status" });
  const table = h("table", { id: "jobs-table", class: "data" },
    h("caption", {}, "Fine-tuning jobs"),
    h("thead", {}, h("tr", {}, ["Name", "Namespace", "Phase", "Plan", "Progress", "Cost", "Age"].map(
      (c) => h("th", { scope: "col" }, c)))),
    tbody);
  main.replaceChildren(
    h("h1", {}, "Jobs"),
    h("form", { class: "filters", role: "search", "aria-label": "Filter jobs", onsubmit: (e) => e.preventDefault() },
      h("label", { for: "filter-namespace" }, "Namespace"), nsSelect,
      h("label", { for: "filter-phase" }, "Phase"), phaseSelect),
    table, status);
  phaseSelect.value = query.get("phase") || "";

  let timer = null;
  let stopped = false;
  async function refresh() {
    clearTimeout(timer);
    const params = new URLSearchParams({ limit: "500" });
    if (nsSelect.value) params.set("namespace", nsSelect.value);
    if (phaseSelect.value) params.set("phase", phaseSelect.value);
    try {
      const jobs = await api(`/v1/jobs?${params}`);
      const inView = [...new Set(jobs.data.map((j) => j.namespace))];
      const costs = new Map();
      await Promise.all(inView.map(async (ns) => {
        const c = await api(`/v1/namespaces/${ns}/cost`);
        for (const j of c.jobs) costs.set(`${ns}/${j.name}`, j.usd);
      }));
      if (stopped) return;
      for (const ns of inView) addNamespace(ns);
      tbody.replaceChildren(...jobs.data.map((j) => row(j, costs.get(`${j.namespace}/${j.name}`) ?? 0)));
      if (!jobs.data.length) tbody.append(h("tr", {}, h("td", { colspan: 7, class: "muted" }, "No jobs match.")));
      status.textContent = `${jobs.count} job${jobs.count === 1 ? "" : "s"} · updated ${new Date().toLocaleTimeString()}`;
      table.dataset.count = String(jobs.data.length);
    } catch (err) {
      if (stopped) return;
      status.replaceChildren(errorBox(err));
    }
    if (!stopped) timer = setTimeout(refresh, POLL_MS);
  }

  function addNamespace(ns) {
    if (namespaces.has(ns)) return;
    namespaces.add(ns);
    const opts = [...nsSelect.options].slice(1);
    const before = opts.find((o) => o.value > ns) || null;
    nsSelect.insertBefore(h("option", { value: ns }, ns), before);
  }
  // The URL's namespace is an option before the first answer: a caller who may list only
  // there (cluster mode) never asks cluster-wide.
  if (query.get("namespace")) addNamespace(query.get("namespace"));
  nsSelect.value = query.get("namespace") || "";

  function onFilter() {
    const q = new URLSearchParams();
    if (nsSelect.value) q.set("namespace", nsSelect.value);
    if (phaseSelect.value) q.set("phase", phaseSelect.value);
    history.replaceState(null, "", `#/jobs${q.toString() ? `?${q}` : ""}`);
    refresh();
  }
  nsSelect.addEventListener("change", onFilter);
  phaseSelect.addEventListener("change", onFilter);
  refresh();
  return () => { stopped = true; clearTimeout(timer); };
}

function row(job, cost) {
  const p = job.progress || {};
  const total = p.totalSteps || job.spec?.training?.maxSteps;
  const step = p.step ?? 0;
  const pct = total ? Math.min(100, (100 * step) / total) : 0;
  const eta = job.phase === "Running" && p.etaSeconds !== null && p.etaSeconds !== undefined ? ` · ETA ${duration(p.etaSeconds)}` : "";
  return h("tr", { "data-job": `${job.namespace}/${job.name}`, "data-phase": job.phase },
    h("th", { scope: "row" }, h("a", { href: `#/jobs/${job.namespace}/${job.name}` }, job.name)),
    h("td", {}, job.namespace),
    h("td", {}, h("span", { class: `phase phase-${job.phase.toLowerCase()}` }, job.phase)),
    h("td", { class: "mono" }, planLabel(job.plan)),
    h("td", { class: "progress-cell" },
      h("progress", { max: 100, value: pct.toFixed(1), "aria-label": `${job.name} progress` }),
      h("span", {}, total ? `${step}/${total}${eta}` : `${step}`)),
    h("td", { class: "num" }, usd(cost)),
    h("td", { title: job.createdAt }, age(job.createdAt)));
}
