"""Fits the step-time model's host-work constants (`estimates.GATHER_SECONDS_PER_*`,
`estimates.GRADIENT_SECONDS_PER_*`) on this machine, and prints the probe's host rates
(`probe.measure_host_work`) they go with (`estimates.REFERENCE_HOST_*`).

On three models of different tensor counts and sizes (tiny, wide, small), each trained in
three placements on the CPU accelerator (as benchmarks/bench_offload_overhead.py does):

- ZeRO-3's gather and release: the Z3 step (optimizer on the accelerator) less the Z2 step,
  per micro-step = tensors x per-tensor + parameters x per-parameter;
- the gradients' handling: the Z2 step with the optimizer in CPU RAM less the predicted
  compute and Adam step, the same form.

Each pair is a least-squares fit over the three models; the script prints each model's fitted
over measured and the constants to put in estimates.py. The probe's host rates are measured
before and after the runs: the reference is their mean, and their spread says how steady the
machine was.

    DS_ACCELERATOR=cpu python benchmarks/fit_host_work.py [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, median_step_seconds, run_job, write_job

MODELS = ("tiny", "wide", "small")
PLACEMENTS = {"z2": (2, "gpu"), "z2_cpu": (2, "cpu"), "z3": (3, "gpu")}


def fit(tensors: list[int], params: list[int], seconds: list[float]) -> tuple[float, float, list[float]]:
    """(per tensor, per parameter, fitted / measured of each) by least squares."""
    a = np.array([tensors, params], dtype=float).T
    (per_tensor, per_param), *_ = np.linalg.lstsq(a, np.array(seconds), rcond=None)
    return float(per_tensor), float(per_param), [float(f / s) for f, s in zip(a @ (per_tensor, per_param), seconds,
                                                                                strict=True)]


def main() -> None:
    from spillway_runtime.probe import measure_host_work

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    os.environ["SPILLWAY_PROBE_REFRESH"] = "1"  # the first run measures the compute rates afresh
    before = measure_host_work()
    rows = []
    for model in MODELS:
        times = {}
        for key, (stage, optimizer) in PLACEMENTS.items():
            name = f"host-work-{model}-{key}"
            job = write_job(name, model, steps=args.steps, stage=stage,
                            offload={"optimizer": optimizer, "parameters": "gpu"})
            config, events = run_job(job, BENCH_DIR / name)
            times[key] = median_step_seconds(events)
            if key == "z2_cpu":
                step = config.plan.step
                times["compute_and_adam"] = step.compute + step.cpu_optimizer
        shape = config.plan.model
        rows.append((model, shape.parameter_tensors, shape.params, times["z3"] - times["z2"],
                     times["z2_cpu"] - times["compute_and_adam"], os.getloadavg()[0]))
    after = measure_host_work()
    print(f"probe host work before/after: {before[0]:.0f} / {after[0]:.0f} small ops/s, "
          f"{before[1]:.4g} / {after[1]:.4g} copied params/s")
    for label, column in (("gather and release", 3), ("gradients", 4)):
        per_tensor, per_param, ratios = fit([r[1] for r in rows], [r[2] for r in rows], [r[column] for r in rows])
        print(f"{label}: {per_tensor * 1e3:.3g} ms a tensor, {per_param * 1e9:.3g} ns a parameter")
        for row, ratio in zip(rows, ratios, strict=True):
            print(f"  {row[0]:5s} {row[1]:3d} tensors, {row[2] / 1e6:5.2f}M params: measured {row[column] * 1e3:6.1f} ms,"
                  f" fitted/measured {ratio:.2f} (load {row[5]:.1f})")
    print(f"REFERENCE_HOST_OPS_PER_S = {(before[0] + after[0]) / 2:.4g}")
    print(f"REFERENCE_HOST_COPY_PARAMS_PER_S = {(before[1] + after[1]) / 2:.4g}")


if __name__ == "__main__":
    main()
