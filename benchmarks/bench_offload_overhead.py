"""Benchmark 4: offload overhead (report only).

Median step time of each placement on the same model, as a ratio to ZeRO-2 and to
ZeRO-3 with everything on the accelerator, measured in the same run, each placement run
--repeats times in turn (this shared machine's step times move by up to 2x between runs
minutes apart on the 0.75M model: one run of each is not a figure); and the planner's
predicted step time beside it (measured / predicted), to show how far its step-time
model is from this machine. The prediction uses the rates `spillway run` measured and
cached for this machine (SPILLWAY_PROBE_CACHE_DIR; see `probe_cache`), and the load
average beside each placement says how much of the machine the run had.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, median_step_seconds, model_arguments, run_job, write_job

PLACEMENTS = [(2, "gpu", "gpu"), (2, "cpu", "gpu"), (3, "gpu", "gpu"), (3, "cpu", "gpu"), (3, "cpu", "cpu"),
              (3, "nvme", "gpu"), (3, "nvme", "cpu"), (3, "nvme", "nvme")]


HOST_OPS = 20_000


def host_rates() -> tuple[float, float]:
    """(small in-place tensor additions a second from Python, parameters a second of a 16-bit to
    fp32 host copy): printed beside ZeRO-3's time over ZeRO-2 (its per-tensor hooks and host
    copies), so that runs on different days show whether a probe of these would follow that
    host work (the step-time model's host constants are fixed figures)."""
    import torch

    from spillway_runtime.probe import _time_best

    small = torch.zeros(16)
    src, dst = torch.ones(8 << 20, dtype=torch.bfloat16), torch.empty(8 << 20)

    def ops() -> None:
        for _ in range(HOST_OPS):
            small.add_(1.0)

    def copy() -> None:
        dst.copy_(src)

    ops()
    copy()
    return HOST_OPS / _time_best(ops, 3), (8 << 20) / _time_best(copy, 3)


def main() -> None:
    args = model_arguments("wide", ["tiny", "wide", "small"], steps=12, repeats=3)
    before = host_rates()
    runs: dict[str, list[tuple[float, float, float]]] = {}  # label -> (median step, predicted, load) a round
    for round_ in range(args.repeats):
        shift = round_ % len(PLACEMENTS)  # each round starts elsewhere: no placement always runs first
        for stage, optimizer, parameters in PLACEMENTS[shift:] + PLACEMENTS[:shift]:
            name = f"overhead-{args.model}-z{stage}-{optimizer}-{parameters}"
            job = write_job(name, args.model, steps=args.steps, stage=stage,
                            offload={"optimizer": optimizer, "parameters": parameters,
                                     "nvme": {"path": str(BENCH_DIR / "nvme" / name)}})
            config, events = run_job(job, BENCH_DIR / name)
            runs.setdefault(config.plan.label, []).append(
                (median_step_seconds(events), config.plan.predicted_step_seconds, os.getloadavg()[0]))
    after = host_rates()
    print(f"compute rate: {config.plan.step.compute_rate()}; DeepSpeed's host work measured at "
          f"{config.plan.step.host_work_scale:.2f}x the step-time model's constants (`engine_probe`)")
    measured = {label: statistics.median(m for m, _, _ in rows) for label, rows in runs.items()}
    z2, z3 = measured["Z2 opt:gpu par:gpu"], measured["Z3 opt:gpu par:gpu"]
    print(f"model {args.model}, {args.steps} steps a run, {args.repeats} runs of each placement in turn; a run's step"
          " time is the median of its steps after the first 2, a placement's the median of its runs")
    for label, rows in runs.items():
        ratios = sorted(m / p for m, p, _ in rows)
        loads = sorted(load for _, _, load in rows)
        predicted = statistics.median(p for _, p, _ in rows)
        print(f"  {label:22s} {measured[label] * 1000:8.1f} ms (runs {min(m for m, _, _ in rows) * 1000:.1f}-"
              f"{max(m for m, _, _ in rows) * 1000:.1f})   RATIO vs Z2 no offload = {measured[label] / z2:.2f}"
              f"   vs Z3 no offload = {measured[label] / z3:.2f}   predicted {predicted * 1000:7.1f} ms"
              f" (measured/predicted {measured[label] / predicted:.2f}, runs {ratios[0]:.2f}-{ratios[-1]:.2f};"
              f" load {loads[0]:.1f}-{loads[-1]:.1f} on {os.cpu_count()} CPUs)")
    print(f"ZeRO-3's time over ZeRO-2 (its hooks and host copies): {(z3 - z2) * 1000:.1f} ms; this machine's host"
          f" work before/after the runs: {before[0] / 1e3:.0f}k/{after[0] / 1e3:.0f}k small tensor ops a second,"
          f" a 16-bit to fp32 copy {before[1] / 1e9:.2f}/{after[1] / 1e9:.2f} G params a second")


if __name__ == "__main__":
    main()
