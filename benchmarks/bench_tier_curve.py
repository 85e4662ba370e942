"""Benchmark: the curve of a tiered optimizer (#39), step time and NVMe traffic against the
share of the optimizer state kept in CPU RAM.

One model, ZeRO-3 with the optimizer state on NVMe and `offload.cpuResidentFraction` pinned
at 0, 25, 50, 75 and 100% (the sub-groups kept in RAM never touch the disk), each run in its
own process, in turns, in the same session. Per share it prints:

- the median step time and the bytes the training process read and wrote per step (its
  block-device counters, /proc/self/io, differenced between step events: DeepSpeed's async
  I/O runs in it), each beside the planner's prediction (measured / predicted);
- the bound max(compute, NVMe time): compute is the 100% share's step (nothing on disk), the
  NVMe time the measured bytes at the bandwidths the probe measured on this disk (the rates
  the planner used);
- RATIO step / step at 100%, and measured / bound.

Each share is planned with the machine's rates measured just before its run (the probe is
run afresh for each: about 30 s), since on a shared VM they drift within minutes: DeepSpeed's
host work read 1.92x, 1.81x and 1.57x the step-time model's constants in three probes within
ten minutes on 2026-12-06.

The model's optimizer state (12 B/param: fp32 master weights and two moments) is printed
with the RAM a 2x budget would give it: at 50% the run holds what such a machine holds.
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, median_step_seconds, model_arguments, run_job, write_job

SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)


def io_per_step(events: list[dict[str, Any]], skip: int = 2) -> tuple[float, float]:
    """Median bytes (read, written) per step from the cumulative counters of the step events."""
    disks = [e["disk"] for e in events if e["event"] == "step" and e.get("disk")][skip:]
    if len(disks) < 2:
        return 0.0, 0.0
    deltas = [(b["read"] - a["read"], b["written"] - a["written"]) for a, b in itertools.pairwise(disks)]
    return statistics.median(d[0] for d in deltas), statistics.median(d[1] for d in deltas)


def main() -> None:
    args = model_arguments("small", ["wide", "small", "large"], steps=10)
    rows = []
    for share in SHARES:
        name = f"curve-{args.model}-{int(share * 100)}"
        offload: dict[str, Any] = {"optimizer": "nvme", "parameters": "gpu", "cpuResidentFraction": share,
                                   "nvme": {"path": str(BENCH_DIR / "nvme" / name)}}
        job = write_job(name, args.model, steps=args.steps, stage=3, offload=offload)
        config, events = run_job(job, BENCH_DIR / name, reprobe=True)
        plan = config.plan
        read, written = io_per_step(events)
        rows.append({"share": share, "seconds": median_step_seconds(events), "read": read, "written": written,
                     "predicted": plan.predicted_step_seconds, "predicted_bytes": plan.step.nvme_bytes,
                     "kept": plan.swap.cpu_resident_fraction, "sub_groups": plan.swap.sub_group_size,
                     "disk_s_per_byte": ((plan.step.optimizer_nvme + plan.step.gradient_nvme) / plan.step.nvme_bytes)
                     if plan.step.nvme_bytes else None, "load": os.getloadavg()[0], "params": plan.model.trainable,
                     "host_work": plan.step.host_work_scale})
        for done in (BENCH_DIR / name, BENCH_DIR / "nvme" / name):  # GBs of checkpoints and swap files each
            shutil.rmtree(done, ignore_errors=True)
    per_byte = next(r["disk_s_per_byte"] for r in rows if r["disk_s_per_byte"])
    compute = rows[-1]["seconds"]
    state = 12 * rows[0]["params"]
    print(f"model {args.model}: {rows[0]['params'] / 1e6:.1f}M trainable parameters, optimizer state "
          f"{state / 2**20:.0f} MiB (a RAM budget of half of it: {state / 2 / 2**20:.0f} MiB); {args.steps} steps "
          f"each, median of steps 3+; disk time at each share's probe figures (the first: {1 / per_byte / 1e6:.0f} "
          "MB/s, read and write and the cost per transfer averaged as the planner counts them); each share planned with "
          "the rates measured just before it, DeepSpeed's host work as a multiple of the step-time model's constants "
          "(`engine_probe`) on each row")
    for r in rows:
        moved = r["read"] + r["written"]
        bound = max(compute, moved * (r["disk_s_per_byte"] or per_byte))  # at the disk's rates of this share's probe
        predicted_bytes = f"{r['predicted_bytes'] / 2**20:7.1f}"
        bytes_ratio = f"{moved / r['predicted_bytes']:.2f}" if r["predicted_bytes"] else "  - "
        print(f"  resident {r['share']:4.0%}: step {r['seconds'] * 1000:7.1f} ms (predicted {r['predicted'] * 1000:7.1f},"
              f" measured/predicted {r['seconds'] / r['predicted']:.2f})   NVMe {moved / 2**20:7.1f} MiB/step"
              f" (predicted {predicted_bytes}, measured/predicted {bytes_ratio})   bound {bound * 1000:7.1f} ms"
              f"   RATIO vs 100% = {r['seconds'] / compute:.2f}   measured/bound = {r['seconds'] / bound:.2f}"
              f"   (host work {r['host_work']:.2f}x, load {r['load']:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
