"""Benchmark 4: offload overhead (report only).

Median step time of each placement on the same model, as a ratio to ZeRO-2 and to
ZeRO-3 with everything on the accelerator, measured in the same run; and the planner's
predicted step time beside it (measured / predicted), to show how far its step-time
model is from this machine. The prediction uses the rates `spillway run` measured and
cached for this machine (SPILLWAY_PROBE_CACHE_DIR; see `probe_cache`), and the load
average beside each placement says how much of the machine the run had.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, median_step_seconds, model_arguments, run_job, write_job

PLACEMENTS = [(2, "gpu", "gpu"), (2, "cpu", "gpu"), (3, "gpu", "gpu"), (3, "cpu", "gpu"), (3, "cpu", "cpu"),
              (3, "nvme", "gpu"), (3, "nvme", "cpu"), (3, "nvme", "nvme")]


def main() -> None:
    args = model_arguments("wide", ["tiny", "wide", "small"], steps=12)
    results = []
    for stage, optimizer, parameters in PLACEMENTS:
        name = f"overhead-{args.model}-z{stage}-{optimizer}-{parameters}"
        job = write_job(name, args.model, steps=args.steps, stage=stage,
                        offload={"optimizer": optimizer, "parameters": parameters,
                                 "nvme": {"path": str(BENCH_DIR / "nvme" / name)}})
        config, events = run_job(job, BENCH_DIR / name)
        results.append((config.plan.label, median_step_seconds(events), config.plan.predicted_step_seconds,
                        os.getloadavg()[0]))
    print(f"compute rate: {config.plan.step.compute_rate()}")
    z2 = results[0][1]
    z3 = next(seconds for label, seconds, _, _ in results if label == "Z3 opt:gpu par:gpu")
    print(f"model {args.model}, {args.steps} steps each, median step time (first 2 steps skipped)")
    for label, seconds, predicted, load in results:
        print(f"  {label:22s} {seconds * 1000:8.1f} ms   RATIO vs Z2 no offload = {seconds / z2:.2f}"
              f"   vs Z3 no offload = {seconds / z3:.2f}   predicted {predicted * 1000:7.1f} ms"
              f" (measured/predicted {seconds / predicted:.2f}; load {load:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
