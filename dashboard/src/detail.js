// Job detail: loss curve with checkpoint/rollback/restart markers, tokens/s, where the state
// lives (plan bytes against the node's capacity per tier), the plan's reasons and rejected
// alternatives, checkpoints with a rollback action, and cost accrued and projected.
import { api } from "./api.js";
import { lossChart, MARKER_COLORS, rewardsChart, throughputChart } from "./charts.js";
import { bytes, duration, errorBox, h, num, planLabel, stepSeconds, time, usd } from "./format.js";

const POLL_MS = 2500;

/** Split the progress series into runs: a step not after the previous one starts a new run (a restart). */
export function splitRuns(progress) {
  const runs = [];
  let prev = null;
  for (const p of progress) {
    if (prev === null || p.step <= prev) runs.push({ points: [], firstStep: p.step });
    runs[runs.length - 1].points.push(p);
    prev = p.step;
  }
  runs.forEach((r, i) => { r.label = i === 0 ? "run 1" : `run ${i + 1} (restart at step ${r.firstStep - 1})`; });
  return runs;
}

export function detailPage(main, ns, name) {
  const base = `/v1/namespaces/${ns}/jobs/${name}`;
  const els = {
    title: h("h1", {}, name, " ", h("span", { class: "muted ns" }, `in ${ns}`)),
    summary: h("div", { class: "cards", id: "summary" }),
    notice: h("div", { id: "notice", role: "status", "aria-live": "polite" }),
    loss: h("div", { class: "chart", id: "loss-chart", role: "img", "aria-label": "Loss over steps" }),
    markers: h("ul", { class: "markers", id: "marker-list" }),
    tput: h("div", { class: "chart", id: "tput-chart", role: "img", "aria-label": "Tokens per second over time" }),
    rewards: h("div", { class: "chart", id: "rewards-chart", role: "img",
      "aria-label": "Preference tuning: reward margin and accuracy over steps" }),
    rewardsSection: null,
    tiers: h("div", { id: "tiers" }),
    reasons: h("div", { id: "reasons" }),
    checkpoints: h("div", { id: "checkpoints" }),
    attempts: h("div", { id: "attempts" }),
    history: h("div", { id: "history" }),
    error: h("div", {}),
  };
  main.replaceChildren(
    h("p", {}, h("a", { href: "#/jobs" }, "← All jobs")),
    els.title, els.error, els.notice, els.summary,
    h("section", { "aria-labelledby": "h-loss" }, h("h2", { id: "h-loss" }, "Loss"), els.loss,
      legend(), els.markers),
    els.rewardsSection = h("section", { "aria-labelledby": "h-rewards", hidden: true },
      h("h2", { id: "h-rewards" }, "Rewards (DPO)"), els.rewards),
    h("section", { "aria-labelledby": "h-tput" }, h("h2", { id: "h-tput" }, "Throughput"), els.tput),
    h("div", { class: "two" },
      h("section", { "aria-labelledby": "h-tiers" }, h("h2", { id: "h-tiers" }, "Where the training state lives"),
        els.tiers),
      h("section", { "aria-labelledby": "h-reasons" }, h("h2", { id: "h-reasons" }, "Plan"), els.reasons)),
    h("section", { "aria-labelledby": "h-ckpt" }, h("h2", { id: "h-ckpt" }, "Checkpoints"), els.checkpoints),
    h("section", { "aria-labelledby": "h-attempts" }, h("h2", { id: "h-attempts" }, "Attempts"), els.attempts),
    h("section", { "aria-labelledby": "h-hist" }, h("h2", { id: "h-hist" }, "History"), els.history),
  );
  document.title = `${name} · Spillway`;

  let charts = [];
  let chartKey = "";
  let ckptKey = "";
  let timer = null;
  let stopped = false;
  let pending = null; // the rollback this page asked for, until the restart shows

  async function refresh() {
    clearTimeout(timer);
    try {
      const [job, hist, ckpts, cost, attempts] = await Promise.all([
        api(base), api(`${base}/history?limit=10000`), api(`${base}/checkpoints`), api(`${base}/cost`),
        api(`${base}/attempts`)]);
      if (stopped) return;
      els.error.replaceChildren();
      render(job, hist, ckpts.data, cost);
      els.attempts.replaceChildren(attemptTable(attempts.data));
    } catch (err) {
      if (stopped) return;
      els.error.replaceChildren(errorBox(err));
    }
    if (!stopped) timer = setTimeout(refresh, POLL_MS);
  }

  // LoRA jobs say so beside the plan: the state it sizes is the adapters'
  function methodText(method) {
    return method?.type === "lora" ? `LoRA rank ${method.rank ?? 16}` : null;
  }

  function render(job, hist, ckpts, cost) {
    const plan = job.plan || {};
    const p = job.progress || {};
    const total = p.totalSteps || job.spec?.training?.maxSteps;
    const runs = splitRuns(hist.progress);
    const restarts = runs.slice(1).map((r) => ({ kind: "restart", x: r.firstStep - 1,
      text: `restarted at step ${r.firstStep - 1}` }));
    const markers = [
      ...ckpts.map((c) => ({ kind: "checkpoint", x: c.step, text: `checkpoint ${c.name} at step ${c.step}` })),
      ...hist.rollbacks.filter((r) => r.fromStep !== null).map((r) => ({ kind: "rollback", x: r.fromStep,
        text: `rollback at step ${r.fromStep} to ${r.checkpoint ?? "last checkpoint"} (${r.origin}): ${r.reason}` })),
      ...restarts,
    ];

    // summary cards
    const perStep = cost.entries ? cost.usd / cost.entries : null;
    const remaining = total ? Math.max(0, total - (p.step ?? 0)) : null;
    const projected = perStep !== null && remaining !== null ? cost.usd + perStep * remaining : plan.predictedCostUsd;
    els.summary.replaceChildren(
      card("Phase", h("span", { class: `phase phase-${job.phase.toLowerCase()}`, id: "job-phase" }, job.phase),
        job.message),
      card("Progress", `${p.step ?? 0}${total ? ` / ${total}` : ""} steps`,
        job.phase === "Running" && p.etaSeconds != null ? `ETA ${duration(p.etaSeconds)}` : null),
      card("Loss", num(p.loss), [p.evalLoss != null ? `held-out ${num(p.evalLoss)} at step ${p.evalStep}` : null,
        p.tokensPerSecond != null ? `${num(p.tokensPerSecond, 3)} tokens/s` : null].filter(Boolean).join(" · ") || null),
      card("Plan", h("span", { class: "mono" }, planLabel(plan)),
        [plan.node ? `on ${planNodes(plan)}` : null, methodText(job.spec?.method)].filter(Boolean).join(" · ") || null),
      card("Cost accrued", h("span", { id: "cost-accrued" }, usd(cost.usd)), `${num(cost.gpuHours, 3)} GPU-hours`),
      card("Cost projected", h("span", { id: "cost-projected" }, usd(projected)),
        plan.predictedCostUsd != null ? `plan predicted ${usd(plan.predictedCostUsd)}` : "to finish at this rate"),
    );

    // rollback / restart notice
    const lastApi = [...hist.rollbacks].reverse().find((r) => r.origin === "api");
    if (pending && lastApi && lastApi.completedAt && lastApi.checkpoint === pending) pending = null;
    if (lastApi) {
      els.notice.replaceChildren(h("p", {
        class: lastApi.completedAt ? "banner ok" : "banner wait", id: "restart-banner",
        "data-state": lastApi.completedAt ? "restarted" : "pending", "data-checkpoint": lastApi.checkpoint,
      }, lastApi.completedAt
        ? `Restarted from ${lastApi.checkpoint} (step ${lastApi.toStep}) at ${time(lastApi.completedAt)}; `
          + `rolled back by ${lastApi.requestedBy}: ${lastApi.reason}`
        : `Rollback to ${lastApi.checkpoint} requested by ${lastApi.requestedBy}; waiting for the job to restart…`));
    }

    // charts: rebuilt only when their data changed
    const key = `${hist.progressCount}|${hist.progress.length}|${ckpts.length}|${hist.rollbacks.length}|`
      + `${hist.evaluations.length}`;
    if (key !== chartKey) {
      chartKey = key;
      charts.forEach((c) => c.destroy());
      charts = [];
      const plotted = hist.progress.filter((x) => x.loss !== null).length;
      Object.assign(els.loss.dataset, { points: String(plotted), runs: String(runs.length),
        checkpoints: String(ckpts.length), rollbacks: String(hist.rollbacks.length), restarts: String(restarts.length),
        evaluations: String(hist.evaluations.length) });
      els.loss.setAttribute("aria-label", `Loss over steps: ${plotted} points in ${runs.length} run(s)`);
      els.loss.replaceChildren();
      els.tput.replaceChildren();
      els.rewards.replaceChildren();
      const rewarded = hist.progress.filter((x) => x.preference).length;
      els.rewardsSection.hidden = rewarded === 0; // preference tuning only
      els.rewards.dataset.points = String(rewarded);
      if (hist.progress.length) {
        charts.push(lossChart(els.loss, runs, markers, hist.evaluations), throughputChart(els.tput, hist.progress));
        if (rewarded) charts.push(rewardsChart(els.rewards, hist.progress, hist.evaluations));
      } else {
        els.loss.append(h("p", { class: "muted" }, "No steps recorded yet."));
      }
      if (hist.progressCount > hist.progress.length) {
        els.loss.append(h("p", { class: "muted" }, `Showing the first ${hist.progress.length} of ${hist.progressCount} points.`));
      }
      els.markers.replaceChildren(...markers.sort((a, b) => a.x - b.x).map((m) =>
        h("li", { "data-kind": m.kind }, h("span", { class: "swatch", style: `background:${MARKER_COLORS[m.kind]}` }),
          m.text)));
    }

    els.tiers.replaceChildren(tierBars(plan));
    els.reasons.replaceChildren(reasons(plan, p));
    const ck = `${ckpts.map((c) => c.name).join(",")}|${job.phase}|${pending}`;
    if (ck !== ckptKey) {
      ckptKey = ck;
      els.checkpoints.replaceChildren(checkpointTable(ckpts, job));
    }
    els.history.replaceChildren(historyTable(hist));
  }

  function attemptTable(attempts) {
    if (!attempts.length) return h("p", { class: "muted" }, "Not started yet.");
    const steps = (a) => (a.firstStep === null ? "–" : `${a.firstStep}–${a.lastStep}`);
    return h("table", { class: "data", id: "attempt-table" },
      h("caption", { class: "sr-only" }, "Attempts: each run of the job with its own outcome, steps and cost"),
      h("thead", {}, h("tr", {}, ["#", "Origin", "Phase", "Steps", "Last loss", "Started", "Ended", "Cost", "Reason"]
        .map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, attempts.map((a) => h("tr", { "data-attempt": a.number, "data-phase": a.phase },
        h("th", { scope: "row", class: "num" }, a.number), h("td", {}, a.origin),
        h("td", {}, h("span", { class: `phase phase-${a.phase.toLowerCase()}` }, a.phase)),
        h("td", { class: "num" }, steps(a)), h("td", { class: "num" }, num(a.lastLoss)),
        h("td", {}, time(a.startedAt)), h("td", {}, time(a.endedAt)), h("td", { class: "num" }, usd(a.usd)),
        h("td", {}, a.reason ?? "")))));
  }

  function checkpointTable(ckpts, job) {
    if (!ckpts.length) return h("p", { class: "muted" }, "No checkpoints yet.");
    return h("table", { class: "data", id: "checkpoint-table" },
      h("caption", { class: "sr-only" }, "Checkpoints"),
      h("thead", {}, h("tr", {}, ["Name", "Step", "Loss", "Saved", "Size", ""].map((c) =>
        h("th", { scope: "col" }, c || h("span", { class: "sr-only" }, "Action"))))),
      h("tbody", {}, ckpts.map((c) => h("tr", { "data-checkpoint": c.name },
        h("th", { scope: "row", class: "mono" }, c.name), h("td", { class: "num" }, c.step),
        h("td", { class: "num" }, num(c.loss)), h("td", {}, time(c.time)), h("td", { class: "num" }, bytes(c.sizeBytes)),
        h("td", {}, h("button", { type: "button", class: "danger", "aria-label": `Roll back to ${c.name}`,
          disabled: pending !== null, onclick: (e) => confirmRollback(c, job, e.currentTarget) }, "Roll back…"))))));
  }

  function confirmRollback(ckpt, job, opener) {
    const reason = h("textarea", { id: "rollback-reason", name: "reason", required: true, rows: 3, maxlength: 2000 });
    const err = h("div", {});
    const submit = h("button", { type: "submit", class: "danger", id: "rollback-confirm" }, `Roll back to ${ckpt.name}`);
    const dialog = h("dialog", { id: "rollback-dialog", "aria-labelledby": "rollback-title",
      "aria-describedby": "rollback-desc" },
      h("form", { method: "dialog", onsubmit: onSubmit },
        h("h2", { id: "rollback-title" }, `Roll back ${job.name}?`),
        h("p", { id: "rollback-desc" }, `The job restarts from checkpoint ${ckpt.name} at step ${ckpt.step}; `
          + `the steps after it (now at ${job.progress?.step ?? "?"}) are trained again. The reason is kept in the job's history.`),
        h("label", { for: "rollback-reason" }, "Reason (required)"), reason, err,
        h("div", { class: "actions" },
          h("button", { type: "button", class: "secondary", onclick: () => dialog.close() }, "Cancel"), submit)));
    dialog.addEventListener("close", () => { dialog.remove(); if (opener.isConnected) opener.focus(); });
    document.body.append(dialog);
    dialog.showModal();
    reason.focus();

    async function onSubmit(ev) {
      ev.preventDefault();
      if (!reason.value.trim()) {
        err.replaceChildren(errorBox("Say why you roll back: the reason is kept in the history."));
        reason.focus();
        return;
      }
      submit.disabled = true;
      try {
        await api(`${base}/rollback`, { method: "POST", body: { checkpoint: ckpt.name, reason: reason.value.trim() } });
        pending = ckpt.name;
        dialog.close();
        els.notice.replaceChildren(h("p", { class: "banner wait", id: "restart-banner", "data-state": "pending",
          "data-checkpoint": ckpt.name }, `Rollback to ${ckpt.name} requested; waiting for the job to restart…`));
        refresh();
      } catch (e) {
        submit.disabled = false;
        err.replaceChildren(errorBox(e));
      }
    }
  }

  refresh();
  return () => { stopped = true; clearTimeout(timer); charts.forEach((c) => c.destroy()); };
}

function card(label, value, sub) {
  return h("div", { class: "card" }, h("div", { class: "card-label" }, label), h("div", { class: "card-value" }, value),
    sub ? h("div", { class: "card-sub" }, sub) : null);
}

function legend() {
  return h("p", { class: "legend" }, Object.entries(MARKER_COLORS).map(([k, c]) =>
    h("span", {}, h("span", { class: `swatch ${k}`, style: `background:${c}` }), k)));
}

export function tierBars(plan) {
  if (!plan.bytes) return h("p", { class: "muted" }, "No plan yet.");
  const tiers = [["gpu", "GPU", "per GPU"], ["cpu", "CPU RAM", "per node"], ["nvme", "NVMe", "per node"]];
  return h("div", { class: "tiers" }, tiers.map(([k, label, per]) => {
    const used = plan.bytes[k] || 0;
    const cap = plan.capacity?.[k] || 0;
    const pct = cap ? (100 * used) / cap : used ? 100 : 0;
    const text = cap ? `${bytes(used)} of ${bytes(cap)} (${pct.toFixed(0)}%)` : used ? `${bytes(used)}, no capacity` : "not used, none on node";
    return h("div", { class: "tier", "data-tier": k, "data-bytes": used, "data-capacity": cap },
      h("div", { class: "tier-label" }, h("strong", {}, label), ` ${per}`),
      h("div", { class: "bar", role: "meter", "aria-label": `${label} ${text}`, "aria-valuemin": 0,
        "aria-valuemax": 100, "aria-valuenow": Math.min(100, pct).toFixed(0) },
        h("div", { class: `fill${pct > 100 ? " over" : ""}`, style: `width:${Math.min(100, pct)}%` })),
      h("div", { class: "tier-text" }, text));
  }));
}

/** The plan's reasons; `progress` adds the steps' measured time beside the prediction. */
export function reasons(plan, progress = {}) {
  if (!plan.reasons) return h("p", { class: "muted" }, "No plan yet.");
  const measured = progress.stepSeconds != null
    ? h("span", { id: "step-measured", "data-seconds": progress.stepSeconds, "data-vs-plan": progress.stepTimeVsPlan ?? "" },
      ` · measured ${stepSeconds(progress.stepSeconds)}/step`,
      progress.stepTimeVsPlan != null ? ` (${num(progress.stepTimeVsPlan, 3)}x)` : "")
    : null;
  return h("div", {},
    h("p", {}, h("span", { class: "mono" }, planLabel(plan)), ` · predicted ${stepSeconds(plan.predictedStepSeconds)}/step`,
      measured),
    h("h3", {}, "Why"), h("ul", { id: "plan-reasons" }, plan.reasons.map((r) => h("li", {}, r))),
    h("h3", {}, "Rejected alternatives"),
    plan.rejected?.length
      ? h("ul", { id: "plan-rejected" }, plan.rejected.map((r) => h("li", {}, h("span", { class: "mono" }, r.placement), ": ", r.why)))
      : h("p", { class: "muted" }, "None."),
    plan.rejectedShapes?.length
      ? [h("h3", {}, "Other node shapes"), h("ul", { id: "plan-rejected-shapes" }, plan.rejectedShapes.map((r) =>
        h("li", {}, h("span", { class: "mono" }, r.shape), ` (${r.nodes} node${r.nodes === 1 ? "" : "s"}): `, r.why)))]
      : null);
}

/** Where a plan runs: a cluster job's nodes, or the machine a local job plans for. */
function planNodes(plan) {
  return plan.nodeNames?.length ? plan.nodeNames.join(", ") : plan.node;
}

function historyTable(hist) {
  const rows = [
    ...hist.transitions.map((t) => ({ at: t.at, what: `${t.fromPhase ?? "–"} → ${t.toPhase}`, why: t.reason })),
    ...hist.rollbacks.map((r) => ({ at: r.at, what: `rollback to ${r.checkpoint ?? "last checkpoint"} (${r.origin}, by ${r.requestedBy})`,
      why: `${r.reason}${r.completedAt ? "" : " — pending"}` })),
  ].sort((a, b) => Date.parse(a.at) - Date.parse(b.at));
  return h("table", { class: "data" }, h("caption", { class: "sr-only" }, "History"),
    h("thead", {}, h("tr", {}, ["When", "What", "Why"].map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, h("td", {}, time(r.at)), h("td", {}, r.what), h("td", {}, r.why ?? "")))));
}
