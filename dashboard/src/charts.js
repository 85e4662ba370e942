// The line charts of the detail page (loss, throughput and, for preference tuning, rewards), drawn by uPlot. Vertical markers (checkpoints,
// rollbacks, restarts) are painted by a small draw hook; the same markers are listed as text.
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";

export const MARKER_COLORS = { checkpoint: "#1d4ed8", rollback: "#b91c1c", restart: "#047857" };
const RUN_COLORS = ["#334155", "#7c3aed", "#c2410c", "#0e7490", "#a21caf"];

function width(el) {
  return Math.max(320, el.clientWidth || 640);
}

function markerPlugin(markers) {
  return {
    hooks: {
      draw: [(u) => {
        const { ctx, bbox } = u;
        ctx.save();
        for (const m of markers) {
          const x = Math.round(u.valToPos(m.x, "x", true));
          if (x < bbox.left || x > bbox.left + bbox.width) continue;
          ctx.strokeStyle = MARKER_COLORS[m.kind];
          ctx.lineWidth = m.kind === "checkpoint" ? 1 : 2;
          ctx.setLineDash(m.kind === "checkpoint" ? [4, 4] : []);
          ctx.beginPath();
          ctx.moveTo(x, bbox.top);
          ctx.lineTo(x, bbox.top + bbox.height);
          ctx.stroke();
        }
        ctx.restore();
      }],
    },
  };
}

/** Loss over steps: one series per run (a restart begins a new one), the held-out loss as
 * one more (dashed), markers as vertical lines. */
export function lossChart(el, runs, markers, evaluations = []) {
  const evals = evaluations.filter((e) => e.loss !== null);
  const steps = [...new Set([...runs.flatMap((r) => r.points.map((p) => p.step)), ...evals.map((e) => e.step)])]
    .sort((a, b) => a - b);
  const index = new Map(steps.map((s, i) => [s, i]));
  const data = [steps];
  for (const run of runs) {
    const ys = new Array(steps.length).fill(null);
    for (const p of run.points) ys[index.get(p.step)] = p.loss;
    data.push(ys);
  }
  const series = [{ label: "step" }, ...runs.map((r, i) => ({
    label: r.label, stroke: RUN_COLORS[i % RUN_COLORS.length], width: 2,
    points: { show: true, size: 5 }, spanGaps: false,
  }))];
  if (evals.length) {
    const ys = new Array(steps.length).fill(null);
    for (const e of evals) ys[index.get(e.step)] = e.loss; // a re-evaluated step shows its latest
    data.push(ys);
    series.push({ label: "held-out", stroke: "#b45309", width: 2, dash: [6, 4], points: { show: true, size: 6 },
      spanGaps: true });
  }
  const u = new uPlot({
    width: width(el), height: 280, series,
    scales: { x: { time: false } },
    // steps are whole numbers: no 1.25 ticks
    axes: [{ label: "step", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000] },
      { label: "loss" }],
    plugins: [markerPlugin(markers)],
  }, data, el);
  el.uplot = u; // the chart's own data, for tests and the curious
  return u;
}

/** Preference tuning (DPO): the reward margin and accuracy of each recorded step (TRL's
 * rewards/margins and rewards/accuracies), and the held-out pairs' (dashed), over steps. The
 * accuracy is a share (0-1) on its own scale. */
export function rewardsChart(el, points, evaluations = []) {
  const withRewards = points.filter((p) => p.preference);
  const evals = evaluations.filter((e) => e.preference);
  const steps = [...new Set([...withRewards.map((p) => p.step), ...evals.map((e) => e.step)])].sort((a, b) => a - b);
  const index = new Map(steps.map((s, i) => [s, i]));
  const column = (rows, name) => {
    const ys = new Array(steps.length).fill(null);
    for (const r of rows) ys[index.get(r.step)] = r.preference[name] ?? null; // a repeated step shows its latest
    return ys;
  };
  const data = [steps, column(withRewards, "rewards/margins"), column(withRewards, "rewards/accuracies")];
  const series = [{ label: "step" },
    { label: "margin", stroke: "#7c3aed", width: 2, points: { show: true, size: 5 }, scale: "reward", spanGaps: true },
    { label: "accuracy", stroke: "#047857", width: 2, points: { show: true, size: 5 }, scale: "share", spanGaps: true }];
  if (evals.length) {
    data.push(column(evals, "rewards/margins"), column(evals, "rewards/accuracies"));
    series.push(
      { label: "held-out margin", stroke: "#7c3aed", width: 2, dash: [6, 4], points: { show: true, size: 6 },
        spanGaps: true, scale: "reward" },
      { label: "held-out accuracy", stroke: "#047857", width: 2, dash: [6, 4], points: { show: true, size: 6 },
        spanGaps: true, scale: "share" });
  }
  const u = new uPlot({
    width: width(el), height: 220, series,
    scales: { x: { time: false }, share: { range: [0, 1] } },
    axes: [{ label: "step", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000] },
      { label: "reward margin", scale: "reward" }, { label: "accuracy", scale: "share", side: 1 }],
  }, data, el);
  el.uplot = u;
  return u;
}

/** Tokens per second against wall-clock time. */
export function throughputChart(el, points) {
  const pts = points.filter((p) => p.tokensPerSecond !== null).map((p) => [Date.parse(p.at) / 1000, p.tokensPerSecond])
    .sort((a, b) => a[0] - b[0]);
  return new uPlot({
    width: width(el), height: 200,
    series: [{}, { label: "tokens/s", stroke: "#0e7490", width: 2, points: { show: true, size: 4 } }],
    axes: [{}, { label: "tokens/s" }],
  }, [pts.map((p) => p[0]), pts.map((p) => p[1])], el);
}
