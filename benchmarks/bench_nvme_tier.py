"""Benchmark 1: NVMe tier efficiency during real training, tuned async I/O against DeepSpeed's defaults.

The probe's sweep finds the best async-I/O settings on the NVMe directory (what a run
plans with, from the node's annotations or `spillway run`'s cached probe). Then, on the
same disk in the same run:

- raw async I/O: the tuned settings and DeepSpeed's defaults (block 1 MiB, queue depth 8,
  intra-op parallelism 1: `deepspeed/runtime/swap_tensor/constants.py`) measured in
  alternation, so that neither gets the quieter moment and the sweep's lucky draw does
  not count;
- training: a small model with the optimizer state on NVMe (ZeRO-3, DeepSpeed's
  optimizer swapper), once per setting and round, each in its own process. It counts the
  bytes the process really moved (/proc/self/io) and the time inside the swapper's calls:

    swapper throughput = (read_bytes + write_bytes) / time_in_swapper
    RATIO swapper tuned / defaults  (> 1: tuning pays)
    RATIO nvme_tier / best_aio = (read_bytes / best_read + write_bytes / best_write) / time_in_swapper
      for the tuned run (target >= 0.8: swapping runs at >= 80% of what the disk can do)
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, RESULT, proc_io, result_of, write_job


def deepspeed_defaults() -> Any:
    from deepspeed.runtime.swap_tensor import constants as c

    from spillway_runtime.core.hardware import AioSettings

    return AioSettings(block_size=c.AIO_BLOCK_SIZE_DEFAULT, queue_depth=c.AIO_QUEUE_DEPTH_DEFAULT,
                       intra_op_parallelism=c.AIO_INTRA_OP_PARALLELISM_DEFAULT,
                       single_submit=c.AIO_SINGLE_SUBMIT_DEFAULT, overlap_events=c.AIO_OVERLAP_EVENTS_DEFAULT)


def describe(aio: Any) -> str:
    return f"block {aio.block_size >> 10} KiB, depth {aio.queue_depth}, parallel {aio.intra_op_parallelism}"


def raw_io(nvme: Path, tuned: Any, defaults: Any, io_bytes: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Median (read, write) B/s per setting, measured in alternation on one scratch file."""
    import os

    from deepspeed.ops.op_builder import AsyncIOBuilder

    from spillway_runtime.probe import aio_io_bytes, measure_aio_setting

    aio = AsyncIOBuilder().load()
    io_bytes = aio_io_bytes(io_bytes)
    path = str(nvme / f".bench-aio-{os.getpid()}")
    got: dict[str, list[tuple[float, float]]] = {"tuned": [], "defaults": []}
    try:
        for i in range(rounds):
            order = [("tuned", tuned), ("defaults", defaults)]
            for label, settings in order if i % 2 == 0 else order[::-1]:
                got[label].append(measure_aio_setting(aio, path, settings, io_bytes))
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {k: (statistics.median(r for r, _ in v), statistics.median(w for _, w in v)) for k, v in got.items()}


def train_once(args: argparse.Namespace) -> dict[str, Any]:
    """One training run with the given aio settings (in a process of its own)."""
    from spillway_runtime.core.hardware import AioSettings
    from spillway_runtime.local import prepare_local_run
    from spillway_runtime.probe import probe_basic
    from spillway_runtime.training.recipe import FineTuneRecipe

    job = write_job("bench-nvme", args.model, steps=args.steps,
                    offload={"optimizer": "nvme", "parameters": "gpu", "nvme": {"path": str(args.nvme_path)},
                             # time each swap call on its own: the pipelined swapper would hide I/O in compute
                             "deepspeed": {"zero_optimization": {"offload_optimizer": {
                                 "pipeline_read": False, "pipeline_write": False}}}},
                    stage=3)
    hw = probe_basic(args.nvme_path)
    hw.aio = AioSettings.model_validate_json(args.train_with)
    shutil.rmtree(BENCH_DIR / "run-nvme", ignore_errors=True)  # nothing to resume from the other setting's run
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
    return {"read": r1 - r0, "written": w1 - w0, "swapper_s": spent["seconds"], "wall_s": wall,
            "params": config.plan.model.params, "label": config.plan.label,
            "sub_group": config.plan.swap.sub_group_size, "aio": config.deepspeed["aio"]}


def train(args: argparse.Namespace, aio: Any) -> dict[str, Any]:
    command = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
               "--nvme-path", str(args.nvme_path), "--train-with", aio.model_dump_json()]
    return result_of(command, f"training with {describe(aio)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="small", choices=["tiny", "wide", "small"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nvme-path", type=Path, default=BENCH_DIR / "nvme")
    parser.add_argument("--aio-seconds", type=float, default=20, help="Budget of the sweep")
    parser.add_argument("--io-mib", type=int, default=256, help="MiB per raw async I/O measurement")
    parser.add_argument("--rounds", type=int, default=2, help="Training runs per setting, in alternation")
    parser.add_argument("--train-with", help=argparse.SUPPRESS)  # internal: one training run, these aio settings
    args = parser.parse_args()
    if args.train_with:
        print(RESULT + json.dumps(train_once(args)), flush=True)
        return

    from spillway_runtime.probe import measure_aio

    started = time.monotonic()
    swept = measure_aio(args.nvme_path, args.aio_seconds, io_bytes=args.io_mib << 20)
    tuned, defaults = swept.settings, deepspeed_defaults()
    cost = "" if swept.transfer_seconds is None else f", {swept.transfer_seconds * 1e3:.1f} ms a transfer"
    print(f"sweep on {args.nvme_path} in {time.monotonic() - started:.1f} s: best {describe(tuned)}, "
          f"read {swept.read_bps / 1e9:.2f} GB/s, write {swept.write_bps / 1e9:.2f} GB/s{cost}")
    print(f"DeepSpeed's defaults: {describe(defaults)}"
          + ("  (the sweep chose them: the ratios below measure noise)" if tuned == defaults else ""))

    raw = raw_io(args.nvme_path, tuned, defaults, args.io_mib << 20, rounds=3)
    for label, (r, w) in raw.items():
        print(f"raw async I/O {label:8s}: read {r / 1e9:.2f} GB/s, write {w / 1e9:.2f} GB/s (median of 3)")

    def mix(read: float, write: float) -> float:
        return 2 / (1 / read + 1 / write)

    runs: dict[str, list[dict[str, Any]]] = {"tuned": [], "defaults": []}
    for i in range(args.rounds):
        order = [("tuned", tuned), ("defaults", defaults)]
        for label, aio in order if i % 2 == 0 else order[::-1]:
            runs[label].append(train(args, aio))
    throughput: dict[str, float] = {}
    for label, results in runs.items():
        rates = [(r["read"] + r["written"]) / r["swapper_s"] for r in results]
        throughput[label] = statistics.median(rates)
        first = results[0]
        print(f"training {label:8s} ({describe(tuned if label == 'tuned' else defaults)}): "
              f"model {args.model} {first['params']:,} parameters, {first['label']}, sub-group {first['sub_group']:,}; "
              f"moved {(first['read'] + first['written']) / 1e6:.1f} MB per {args.steps} steps, swapper "
              + ", ".join(f"{r['swapper_s']:.2f} s of {r['wall_s']:.2f} s" for r in results)
              + f"; {throughput[label] / 1e9:.2f} GB/s (median)")
    tuned_run = runs["tuned"][0]
    ideal = tuned_run["read"] / swept.read_bps + tuned_run["written"] / swept.write_bps
    print(f"RATIO async I/O tuned / defaults = {mix(*raw['tuned']) / mix(*raw['defaults']):.2f}  "
          "(harmonic mean of read and write)")
    print(f"RATIO swapper tuned / defaults = {throughput['tuned'] / throughput['defaults']:.2f}  (> 1: tuning pays)")
    print(f"RATIO nvme_tier / best_aio = {ideal / tuned_run['swapper_s']:.2f}  (target >= 0.8)")


if __name__ == "__main__":
    main()
