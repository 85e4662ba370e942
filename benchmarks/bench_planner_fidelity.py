"""Benchmark 3: planner fidelity.

For tiny and small models with the optimizer (and parameters) on NVMe, compares the
plan's predicted bytes with what a real run used: NVMe = swap files on disk at their
largest, CPU = peak resident memory of the training process (on a CPU accelerator the
plan's CPU figure covers the whole process: model, activations, state, buffers and the
runtime's own overhead). Target: within 10%. LoRA (rank 16 on every linear layer) is
planned and measured the same way, and its median step time is set against full
fine-tuning's on the same model and placement, measured in the same run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import statistics

from common import BENCH_DIR, run_job, write_job

LORA = {"type": "lora", "rank": 16, "targetModules": ["all-linear"]}
# (model, optimizer, parameters, method)
CASES = [
    ("tiny", "nvme", "gpu", None),
    ("wide", "nvme", "gpu", None),
    ("wide", "nvme", "nvme", None),
    ("small", "nvme", "gpu", None),
    ("small", "nvme", "nvme", None),
    ("small", "cpu", "cpu", None),
    ("small", "cpu", "cpu", LORA),
    ("wide", "cpu", "nvme", LORA),
]


def main() -> None:
    rows = []
    setup: list[tuple[str, dict[str, int], int]] = []
    step_s: dict[tuple[str, str, str, bool], float] = {}
    for model, optimizer, parameters, method in CASES:
        name = f"fidelity-{model}-{optimizer}-{parameters}{'-lora' if method else ''}"
        job = write_job(name, model, steps=4, stage=3, method=method,
                        offload={"optimizer": optimizer, "parameters": parameters,
                                 "nvme": {"path": str(BENCH_DIR / "nvme" / name)}})
        config, events = run_job(job, BENCH_DIR / name)
        steps = [e for e in events if e["event"] == "step"]
        step_s[(model, optimizer, parameters, method is not None)] = statistics.median(
            e["step_seconds"] for e in steps[1:])
        nvme = max(e["bytes"].get("nvme", 0) for e in steps)
        cpu = max(e["bytes"]["cpu"] for e in steps)
        plan = config.plan
        label = plan.label + (" LoRA" if method else "")
        rows.append((model, plan.model.params, label, plan.bytes.nvme, nvme, plan.bytes.cpu, cpu))
        stages = {e["stage"]: e["bytes"]["cpu"] for e in events if e["event"] == "memory"}
        setup.append((name, stages, cpu))

    print(f"{'model':6s} {'params':>11s} {'plan':22s} {'NVMe pred':>10s} {'meas':>10s} {'ratio':>6s} "
          f"{'CPU pred':>10s} {'meas':>10s} {'ratio':>6s}")
    worst = 0.0
    for model, params, label, nvme_p, nvme_m, cpu_p, cpu_m in rows:
        nvme_ratio = nvme_m / nvme_p if nvme_p else (1.0 if nvme_m == 0 else float("inf"))
        cpu_ratio = cpu_m / cpu_p
        worst = max(worst, abs(nvme_ratio - 1), abs(cpu_ratio - 1))
        print(f"{model:6s} {params:>11,} {label:22s} {nvme_p / 2**20:9.1f}M {nvme_m / 2**20:9.1f}M {nvme_ratio:6.2f} "
              f"{cpu_p / 2**20:9.1f}M {cpu_m / 2**20:9.1f}M {cpu_ratio:6.2f}")
    print("resident memory after each set-up stage, then the peak over the steps (MiB):")
    for name, stages, peak in setup:
        print(f"  {name:28s} " + " ".join(f"{k} {v / 2**20:7.1f}" for k, v in stages.items()) + f" steps {peak / 2**20:7.1f}")
    print(f"RATIO worst |measured/predicted - 1| = {worst:.2f}  (target <= 0.10)")
    full, lora = step_s[("small", "cpu", "cpu", False)], step_s[("small", "cpu", "cpu", True)]
    print(f"RATIO small Z3 opt:cpu par:cpu step time LoRA / full = {lora / full:.2f}  ({lora:.2f} s / {full:.2f} s)")


if __name__ == "__main__":
    main()
