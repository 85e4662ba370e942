"""Benchmark: the step with the optimizer on NVMe beside the step with it in CPU RAM (#39 item 3),
on one model, side by side in one run, at several gradient accumulations.

The optimizer's NVMe traffic is fixed per optimizer step (16 B read and 16 B written per
swapped parameter) while the compute grows with the micro-batches in it, so the ratio
NVMe / CPU-offload falls towards 1 as a step holds more tokens. Each placement runs in a
process of its own (ZeRO-3, parameters on the accelerator, the optimizer in CPU RAM or on
NVMe with nothing kept in RAM), in alternation, and times its parts in place:

- forward and backward: every micro-step's time outside `engine.step` (the gradients' swap-out
  to NVMe runs in the last backward);
- the optimizer phase: `engine.step` at the accumulation boundary (the Adam step, and on NVMe
  the sub-groups' reads and writes);
- the bytes the process read and wrote (/proc/self/io).

The accumulations are 1, 4 and the one the first NVMe plan names (`OffloadPlan.amortizing_accumulation`:
the smallest at which the optimizer's NVMe I/O adds at most 30% to the step). Per accumulation
it prints RATIO nvme / cpu measured, the same ratio predicted by the planner,
measured / predicted of each placement's step and of its two phases, and the bound
max(compute, NVMe bytes at the probe's bandwidths) / the CPU-offload step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, RESULT, proc_io, result_of, write_job

# The ZeRO-3 optimizer's own methods that make up its step, timed in place on the instance
# (DeepSpeed 0.19.8's stage3.py calls each through self): what each part of the optimizer
# phase costs against the plan's terms. The gradients' swap-out runs in the last backward.
PARTS = {
    "_prepare_sub_group": "read wait",  # a sub-group's state and gradient in (the pipeline's prefetch waited on)
    "unscale_and_clip_grads": "unscale",
    "_optimizer_step": "adam",  # the CPU Adam on the sub-group, fp32 to 16-bit included
    "_reassign_or_swap_out_partitioned_parameters": "16-bit copy",
    "_release_sub_group": "write wait",  # its state out (the previous sub-group's write waited on)
    "_swap_out_offload_fp32_gradients": "gradient write",
}


def timed_parts(instance: Any, methods: dict[str, str]) -> dict[str, list[float]]:
    """Wraps `methods` (name: label) on the instance; returns [seconds, calls] per label, added
    up until the caller resets them."""
    parts: dict[str, list[float]] = {label: [0.0, 0] for label in methods.values()}
    for method, label in methods.items():
        plain = getattr(instance, method)

        def timed(*a: Any, _plain: Any = plain, _label: str = label, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return _plain(*a, **k)
            finally:
                parts[_label][0] += time.perf_counter() - start
                parts[_label][1] += 1

        setattr(instance, method, timed)
    return parts


def run_once(model: str, steps: int, accumulation: int, optimizer: str) -> dict[str, Any]:
    """One placement trained in this process; the median of its steps after the first two."""
    from spillway_runtime.local import prepare_local_run
    from spillway_runtime.training.recipe import FineTuneRecipe

    name = f"nvme-step-{model}-{optimizer}-{accumulation}"
    job = write_job(name, model, steps=steps, stage=3, accumulation=accumulation,
                    offload={"optimizer": optimizer, "parameters": "gpu", "cpuResidentFraction": 0.0,
                             "nvme": {"path": str(BENCH_DIR / "nvme" / name)}} if optimizer == "nvme"
                    else {"optimizer": optimizer, "parameters": "gpu"})
    run_dir = BENCH_DIR / name
    shutil.rmtree(run_dir, ignore_errors=True)
    config = prepare_local_run(job, run_dir=run_dir)
    recipe = FineTuneRecipe(config)
    recipe.setup()
    engine = recipe.engine
    in_step = timed_parts(engine, {"step": "optimizer"})["optimizer"]
    parts = timed_parts(engine.optimizer, PARTS)
    rows = []
    try:
        for _ in range(steps):
            in_step[:] = [0.0, 0]
            for part in parts.values():
                part[:] = [0.0, 0]
            read, written = proc_io()
            start = time.perf_counter()
            recipe.train_step()
            total = time.perf_counter() - start
            read_after, written_after = proc_io()
            rows.append({"total": total, "optimizer": in_step[0],
                         "bytes": read_after - read + written_after - written,
                         "parts": {label: tuple(part) for label, part in parts.items()}})
    finally:
        recipe.cleanup()
        for done in (run_dir, BENCH_DIR / "nvme" / name):
            shutil.rmtree(done, ignore_errors=True)
    rows = rows[2:]
    plan = config.plan
    return {
        "total": statistics.median(r["total"] for r in rows),
        "optimizer": statistics.median(r["optimizer"] for r in rows),
        "bytes": statistics.median(r["bytes"] for r in rows),
        "predicted": plan.predicted_step_seconds, "predicted_optimizer": plan.step.optimizer_phase,
        "predicted_bytes": plan.step.nvme_bytes, "compute": plan.step.compute,
        "disk_s_per_byte": ((plan.step.optimizer_nvme + plan.step.gradient_nvme) / plan.step.nvme_bytes
                            if plan.step.nvme_bytes else None),
        "params": plan.model.trainable, "label": plan.label, "load": os.getloadavg()[0],
        "named": plan.amortizing_accumulation,
        "parts": {label: [statistics.median(r["parts"][label][0] for r in rows), rows[-1]["parts"][label][1]]
                  for label in PARTS.values()},
        "predicted_adam": plan.step.cpu_optimizer, "predicted_optimizer_nvme": plan.step.optimizer_nvme,
        "swapped_sub_groups": plan.step.swapped_sub_groups, "pipelined": plan.step.pipelined,
    }


def measure(args: argparse.Namespace, accumulation: int, optimizer: str, fresh_probe: bool) -> dict[str, Any]:
    command = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
               "--one", f"{accumulation}:{optimizer}"]
    env = {**os.environ, **({"SPILLWAY_PROBE_REFRESH": "1"} if fresh_probe else {})}
    return result_of(command, f"{optimizer} at accumulation {accumulation}", env)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="large", choices=["small", "large"])
    parser.add_argument("--steps", type=int, default=5, help="Optimizer steps per run; the first two are skipped")
    parser.add_argument("--accumulation", default="1,4,plan",
                        help="Gradient accumulations, comma-separated; 'plan': the one the first NVMe plan names")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one run, ACCUMULATION:OPTIMIZER
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps: at least 3 (the first two are skipped)")
    if args.one:
        accumulation, optimizer = args.one.split(":")
        print(RESULT + json.dumps(run_once(args.model, args.steps, int(accumulation), optimizer)), flush=True)
        return
    probed: set[str] = set()  # the first run of each placement measures this machine's rates (and disk) afresh
    results: dict[int, dict[str, dict[str, Any]]] = {}
    named = None
    for i, asked in enumerate(args.accumulation.split(",")):
        if asked == "plan" and named is None:
            continue  # no NVMe plan has named one (its I/O already adds less than 30%)
        accumulation = named if asked == "plan" else int(asked)
        if accumulation in results:
            continue  # the plan named one measured already
        order = ("cpu", "nvme") if i % 2 == 0 else ("nvme", "cpu")
        results[accumulation] = {}
        for optimizer in order:
            results[accumulation][optimizer] = measure(args, accumulation, optimizer, optimizer not in probed)
            probed.add(optimizer)
        named = named or results[accumulation]["nvme"]["named"]
    first = next(iter(results.values()))["nvme"]
    per_byte = first["disk_s_per_byte"] or 0.0  # none: everything under DeepSpeed's minimum swap size
    disk = f"{1 / per_byte / 1e6:.0f} MB/s" if per_byte else "nothing swapped"
    print(f"model {args.model}: {first['params'] / 1e6:.1f}M parameters, {first['label']} beside Z3 opt:cpu par:gpu; "
          f"{args.steps} steps each, median of steps 3+; the probe's disk: {disk} "
          "(read, write and the cost per transfer averaged as the planner counts them)")
    for accumulation, pair in results.items():
        cpu, nvme = pair["cpu"], pair["nvme"]
        bound = max(cpu["total"], nvme["bytes"] * per_byte)
        print(f"  accumulation {accumulation:3d}{' (the plan names it)' if accumulation == named else ''}:"
              f" RATIO nvme / cpu = {nvme['total'] / cpu['total']:.2f}"
              f" (predicted {nvme['predicted'] / cpu['predicted']:.2f}; bound {bound / cpu['total']:.2f})")
        for label, r in (("cpu ", cpu), ("nvme", nvme)):
            fb, fb_predicted = r["total"] - r["optimizer"], r["predicted"] - r["predicted_optimizer"]
            print(f"    {label}: step {r['total'] * 1000:8.1f} ms (measured/predicted {r['total'] / r['predicted']:.2f})"
                  f" = forward+backward {fb * 1000:8.1f} ({fb / fb_predicted:.2f}) + optimizer phase"
                  f" {r['optimizer'] * 1000:7.1f} ({r['optimizer'] / r['predicted_optimizer']:.2f});"
                  f" disk {r['bytes'] / 2**20:7.1f} MiB/step"
                  + (f" ({r['bytes'] / r['predicted_bytes']:.2f} of the plan)" if r["predicted_bytes"] else "")
                  + f"; load {r['load']:.1f} on {os.cpu_count()} CPUs")
        for label, r in (("cpu ", cpu), ("nvme", nvme)):
            parts = ", ".join(f"{name} {seconds * 1000:.1f}" + (f" ({calls}x)" if calls != 1 else "")
                              for name, (seconds, calls) in r["parts"].items() if calls)
            rest = r["optimizer"] - sum(seconds for name, (seconds, _) in r["parts"].items() if name != "gradient write")
            print(f"    {label} parts, ms a step: {parts}; the step's other work {rest * 1000:.1f}. Planned: adam"
                  f" {r['predicted_adam'] * 1000:.1f} ({r['parts']['adam'][0] / r['predicted_adam']:.2f}), NVMe"
                  f" {r['predicted_optimizer_nvme'] * 1000:.1f} over {r['swapped_sub_groups']} sub-groups"
                  f"{', pipelined' if r['pipelined'] else ''}")
    in_ram = sorted((a, pair["cpu"]["total"] - pair["cpu"]["optimizer"]) for a, pair in results.items())
    if len(in_ram) >= 2:
        (a1, f1), (a2, f2) = in_ram[0], in_ram[-1]
        per_micro_batch = (f2 - f1) / (a2 - a1)
        print(f"  CPU RAM's forward and backward: {per_micro_batch * 1000:.1f} ms a micro-batch (from accumulations {a1}"
              f" and {a2}), and {(f1 - a1 * per_micro_batch) * 1000:.1f} ms once a step (the boundary's own work)")


if __name__ == "__main__":
    main()
