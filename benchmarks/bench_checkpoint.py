"""Benchmark: checkpoints at the disk's speed, while training goes on.

Trains the 211M-parameter model in-process (bf16), once under ZeRO-3 with the optimizer state
on NVMe, once under ZeRO-2 with it in CPU RAM, one process each, and for each:

- before: DeepSpeed's own `save_checkpoint` (torch.save through the page cache, and with the
  optimizer on NVMe its buffered copy of the swap files), the stall and bytes it costs;
- after: Spillway's checkpoint, begun after a step and settled inside the next one, as
  training does it (with the optimizer on NVMe the swap files are moved into it, and
  checksummed in the background): bytes per parameter and the stall (what the step waited) against the
  median step time; then written again with nothing beside it, for the write throughput
  against a direct-I/O write of a new file of the same size measured in the same run;
- load: the checkpoint read back into the engine, out of the page cache (evicted first),
  against a direct read of a file of the same size (with the optimizer on NVMe: every swap
  file read once where it is and checked, the fp32 masters cast into the 16-bit partitions
  as they are read; the moments stay there for the first step's swap-in).

Targets: write and load >= 0.7 of their baselines; stall <= 1 step; <= 14 bytes/param.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, write_job

# (ZeRO stage, offload): ZeRO-Infinity with the optimizer on NVMe, and ZeRO-Offload (ZeRO-2,
# Adam in CPU RAM: the 13B-on-one-24GB-GPU user). Parameters stay on the device (host memory
# here): ZeRO-3's steps take ~110 s on two cores either way, ZeRO-2's a few seconds.
PLACEMENTS = {"nvme": (3, {"optimizer": "nvme", "parameters": "gpu"}), "cpu": (2, {"optimizer": "cpu", "parameters": "gpu"})}


def evict(root: Path) -> None:
    """Drop a tree's files from the page cache, so that reading them measures the disk."""
    from spillway_runtime.probe import _drop_page_cache

    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            _drop_page_cache(str(path))


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def direct_baselines(directory: Path, size: int, aio) -> tuple[float, float]:
    """Seconds to write a new file of `size` bytes with direct I/O (fsynced) and to read it back."""
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    handle = AsyncIOBuilder().load().aio_handle(aio.block_size, aio.queue_depth, False, True,
                                                aio.intra_op_parallelism)
    chunk = 64 << 20
    buf = handle.new_cpu_locked_tensor(chunk, torch.empty(0, dtype=torch.uint8))
    buf.random_(0, 127)
    path = directory / f"baseline-{time.time_ns()}"
    size = size // 4096 * 4096
    try:
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        for offset in range(0, size, chunk):
            handle.sync_pwrite(buf[:min(chunk, size - offset)], str(path), offset)
        os.fsync(fd)
        os.close(fd)
        write_s = time.perf_counter() - start
        evict(path.parent)
        start = time.perf_counter()
        for offset in range(0, size, chunk):
            handle.sync_pread(buf[:min(chunk, size - offset)], str(path), offset)
        read_s = time.perf_counter() - start
    finally:
        handle.free_cpu_locked_tensor(buf)
        path.unlink(missing_ok=True)
    return write_s, read_s


def deepspeed_save(recipe, target: Path) -> float:
    """DeepSpeed's own checkpoint of the engine's state, as Spillway saved it before: seconds."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    ours = recipe.engine.checkpoint_engine
    recipe.engine.checkpoint_engine = TorchCheckpointEngine()
    try:
        start = time.perf_counter()
        recipe.engine.save_checkpoint(str(target), tag="ds", save_latest=False)
        for path in target.rglob("*"):  # what the store's commit did: every file durable
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        return time.perf_counter() - start
    finally:
        recipe.engine.checkpoint_engine = ours


def run(placement: str, steps: int) -> dict[str, float]:
    from spillway_runtime.local import prepare_local_run
    from spillway_runtime.probe import probe_basic
    from spillway_runtime.training.recipe import FineTuneRecipe

    nvme = BENCH_DIR / "ckpt-nvme"
    shutil.rmtree(nvme, ignore_errors=True)
    stage, offload = PLACEMENTS[placement]
    job = write_job(f"bench-ckpt-{placement}", "large", steps=steps + 4, micro_batch=2, sequence=64, stage=stage,
                    offload={**offload, "nvme": {"path": str(nvme)}})
    run_dir = BENCH_DIR / f"run-ckpt-{placement}"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = prepare_local_run(job, run_dir=run_dir, hardware=probe_basic(nvme))
    recipe = FineTuneRecipe(config)
    recipe.setup()
    params = config.plan.model.params
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        recipe.train_step()
        recipe.step += 1
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[1:])
    print(f"steps: {', '.join(f'{t:.1f}' for t in times)} s", flush=True)

    before_dir = run_dir / "deepspeed-save"
    before_s = deepspeed_save(recipe, before_dir)
    before_bytes = tree_bytes(before_dir)
    shutil.rmtree(before_dir)
    print(f"DeepSpeed's save: {before_s:.1f} s, {before_bytes / 1e9:.2f} GB", flush=True)

    events: list[dict] = []
    original = recipe.reporter.event
    recipe.reporter.event = lambda kind, **fields: (events.append({"event": kind, **fields}), original(kind, **fields))
    recipe.checkpoints.save(1.0)
    start = time.perf_counter()
    recipe.train_step()  # settles the checkpoint before its optimizer step
    recipe.step += 1
    with_checkpoint_s = time.perf_counter() - start
    [saved] = [e for e in events if e["event"] == "checkpoint"]
    # the same write with nothing else running: the I/O path against the disk
    recipe.checkpoints.save(1.0)
    recipe.checkpoints.settle()
    alone = [e for e in events if e["event"] == "checkpoint"][-1]
    info = recipe.checkpoints.store.list()[-1]

    write_s, read_s = direct_baselines(Path(config.checkpoint_dir), info.size_bytes, config.plan.aio)
    evict(info.path)
    checking = {"s": 0.0}  # the load's pass over the swap files, which stay where they are
    digest = recipe.checkpoints.ckpt.io.digest

    def timed_digest(*args):
        began = time.perf_counter()
        try:
            return digest(*args)
        finally:
            checking["s"] += time.perf_counter() - began

    recipe.checkpoints.ckpt.io.digest = timed_digest
    start = time.perf_counter()
    recipe.checkpoints._load(info)
    load_s = time.perf_counter() - start
    recipe.cleanup()
    return {
        "params": params, "step_s": step_s, "before_s": before_s, "before_bytes": before_bytes,
        "bytes": info.size_bytes, "stall_s": saved["stall_seconds"], "background_s": saved["background_seconds"],
        "with_checkpoint_s": with_checkpoint_s, "write_s": write_s, "read_s": read_s, "load_s": load_s,
        "alone_s": alone["background_seconds"], "load_check_s": checking["s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--placement", choices=sorted(PLACEMENTS))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.placement is None:  # one process each: a second engine in one process inherits the first's ZeRO-3 set-up
        for placement in PLACEMENTS:
            subprocess.run([sys.executable, __file__, "--placement", placement, "--steps", str(args.steps)], check=True)
        return
    placement = args.placement
    r = run(placement, args.steps)
    gb = r["bytes"] / 1e9
    print(f"== ZeRO-{PLACEMENTS[placement][0]}, optimizer on {placement}: {r['params']:,} parameters, "
          f"step {r['step_s']:.2f} s (median)")
    print(f"before (DeepSpeed's save): {r['before_bytes'] / r['params']:.1f} B/param, "
          f"{r['before_bytes'] / 1e9:.2f} GB, training stopped {r['before_s']:.2f} s")
    print(f"after: {r['bytes'] / r['params']:.2f} B/param, {gb:.2f} GB; written in {r['alone_s']:.2f} s alone "
          f"({gb / r['alone_s']:.2f} GB/s), in {r['background_s']:.2f} s beside training "
          f"({gb / r['background_s']:.2f} GB/s), where the step with it took {r['with_checkpoint_s']:.2f} s")
    print(f"baselines: direct write {gb / r['write_s']:.2f} GB/s, direct read {gb / r['read_s']:.2f} GB/s, "
          f"load {r['load_s']:.2f} s ({gb / r['load_s']:.2f} GB/s), of which reading the swap files "
          f"{r['load_check_s']:.2f} s")
    print(f"RATIO {placement} write / direct write = {r['write_s'] / r['alone_s']:.2f}  (target >= 0.7; "
          f"beside training {r['write_s'] / r['background_s']:.2f})")
    print(f"RATIO {placement} load / direct read = {r['read_s'] / r['load_s']:.2f}  (target >= 0.7)")
    print(f"RATIO {placement} stall / step = {r['stall_s'] / r['step_s']:.2f}  (target <= 1; "
          f"before {r['before_s'] / r['step_s']:.2f})")
    print(f"RATIO {placement} bytes / param = {r['bytes'] / r['params']:.2f}  (target <= 14; "
          f"before {r['before_bytes'] / r['params']:.2f})", flush=True)


if __name__ == "__main__":
    main()
