"""Benchmark 1: NVMe tier efficiency during real training.

Trains a small model in-process with the optimizer state on NVMe (ZeRO-3, DeepSpeed's
optimizer swapper, the plan's aio settings), counts the bytes the process really moved
to and from the device (/proc/self/io) and the time spent inside the swapper's calls,
and compares with the best async-I/O bandwidth `ds_io`-style on the same directory,
measured in the same run by the probe's sweep:

    ratio = (read_bytes / best_read + write_bytes / best_write) / time_in_swapper

Target >= 0.8: swapping runs at >= 80% of what the disk can do with tuned aio.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, write_job


def proc_io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small", choices=["tiny", "wide", "small"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nvme-path", type=Path, default=BENCH_DIR / "nvme")
    parser.add_argument("--aio-seconds", type=float, default=20)
    args = parser.parse_args()

    from spillway_runtime.local import prepare_local_run
    from spillway_runtime.probe import measure_aio, probe_basic
    from spillway_runtime.recipe import FineTuneRecipe

    read_bps, write_bps, aio = measure_aio(args.nvme_path, args.aio_seconds)
    print(f"baseline async I/O on {args.nvme_path}: read {read_bps / 1e9:.2f} GB/s, write {write_bps / 1e9:.2f} GB/s "
          f"(block {aio.block_size >> 20} MiB, depth {aio.queue_depth}, parallel {aio.intra_op_parallelism})")

    job = write_job("bench-nvme", args.model, steps=args.steps,
                    offload={"optimizer": "nvme", "parameters": "gpu", "nvme": {"path": str(args.nvme_path)},
                             # time each swap call on its own: the pipelined swapper would hide I/O in compute
                             "deepspeed": {"zero_optimization": {"offload_optimizer": {
                                 "pipeline_read": False, "pipeline_write": False}}}},
                    stage=3)
    hw = probe_basic(args.nvme_path)
    hw.aio = aio
    hw.nvme_read_bytes_per_s, hw.nvme_write_bytes_per_s = read_bps, write_bps
    config = prepare_local_run(job, run_dir=BENCH_DIR / "run-nvme", hardware=hw)
    recipe = FineTuneRecipe(config)
    recipe.setup()
    swapper = recipe.engine.optimizer.optimizer_swapper
    spent = {"seconds": 0.0}

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["seconds"] += time.perf_counter() - start
        return wrapper

    for name in ("swap_in_optimizer_state", "swap_out_optimizer_state", "swap_out_gradients"):
        setattr(swapper, name, timed(getattr(swapper, name)))

    recipe.train_step()  # warm-up: first touch of the swap files
    spent["seconds"] = 0.0
    r0, w0 = proc_io()
    start = time.perf_counter()
    for _ in range(args.steps):
        recipe.train_step()
    wall = time.perf_counter() - start
    r1, w1 = proc_io()
    recipe.cleanup()

    read, written = r1 - r0, w1 - w0
    ideal = read / read_bps + written / write_bps
    params = config.plan.model.params
    print(f"model {args.model}: {params:,} parameters, plan {config.plan.label}, "
          f"sub-group {config.plan.swap.sub_group_size:,}")
    print(f"{args.steps} steps in {wall:.2f} s; swapper busy {spent['seconds']:.2f} s "
          f"({spent['seconds'] / wall:.0%} of the step)")
    print(f"moved: read {read / 1e6:.1f} MB, wrote {written / 1e6:.1f} MB "
          f"({(read + written) / args.steps / params:.1f} B/param/step)")
    print(f"swapper throughput {(read + written) / spent['seconds'] / 1e9:.2f} GB/s "
          f"vs baseline mix {(read + written) / ideal / 1e9:.2f} GB/s")
    print(f"RATIO nvme_tier / best_aio = {ideal / spent['seconds']:.2f}  (target >= 0.8)")


if __name__ == "__main__":
    main()
