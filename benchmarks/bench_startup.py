"""Benchmark: how long the runtime takes from its process start to the first training step.

Every pod start and every `spillway run` pays it, and so does each of the test suite's
DeepSpeed runs. The tiny model's step is milliseconds, so the time to its first step is the
start-up: Python, torch, transformers and DeepSpeed imports, the tokenizer and data, the
model and DeepSpeed's engine. Printed against a bare `python -c "import torch"` measured in
the same run (the floor any torch program pays), as a ratio, for two placements: the
optimizer on the CPU (ZeRO-2) and on NVMe (ZeRO-3, DeepSpeed's async I/O op loaded); and
the NVMe one again through the command a user types, `spillway run` (its planning, then the
runtime it starts), to show what the command adds before the runtime begins.

    python benchmarks/bench_startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from common import BENCH_DIR, write_job

from spillway_runtime.local import prepare_local_run, runtime_command, runtime_env
from spillway_runtime.training.reporting import read_events

PLACEMENTS = {
    "opt:cpu (ZeRO-2)": {"policy": "cpu", "optimizer": "cpu", "parameters": "gpu"},
    "opt:nvme (ZeRO-3)": {"policy": "nvme", "optimizer": "nvme", "parameters": "cpu"},
}


def import_torch_seconds() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def first_step_seconds(name: str, offload: dict[str, str]) -> tuple[float, float]:
    """(seconds to the `started` event, seconds to the first step's event) from the launch."""
    job = write_job(f"startup-{name.split()[0].replace(':', '-')}", "tiny", steps=2, offload=dict(offload))
    run_dir = BENCH_DIR / "runs" / job.stem
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    config = prepare_local_run(job, run_dir=run_dir)
    launched = time.time()
    result = subprocess.run(runtime_command(run_dir / "runtime.json", 1), env=runtime_env(config),
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    events = read_events(run_dir / "events.jsonl")
    started = next(e["time"] for e in events if e["event"] == "started")
    step = next(e["time"] for e in events if e["event"] == "step")
    return started - launched, step - launched


def command_first_step_seconds(offload: dict[str, str]) -> float:
    """Seconds from launching `spillway run JOB` to the first step's event."""
    job = write_job("startup-command", "tiny", steps=2, offload=dict(offload))
    run_dir = BENCH_DIR / "runs" / job.stem
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "SPILLWAY_DATABASE_URL": f"sqlite:///{BENCH_DIR / 'spillway.db'}",
           "SPILLWAY_DATA_DIR": str(BENCH_DIR / "api-data")}
    launched = time.time()
    result = subprocess.run([sys.executable, "-m", "spillway_api.cli", "run", str(job), "--run-dir", str(run_dir)],
                            env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"spillway run failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return next(e["time"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "step") - launched


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import_torch_seconds()  # warm the page cache for both sides
    baseline = statistics.median(import_torch_seconds() for _ in range(args.repeats))
    print(f"bare `import torch`: {baseline:.2f} s (median of {args.repeats})")
    for name, offload in PLACEMENTS.items():
        first_step_seconds(name, offload)  # the same warm-up
        runs = [first_step_seconds(name, offload) for _ in range(args.repeats)]
        started = statistics.median(r[0] for r in runs)
        step = statistics.median(r[1] for r in runs)
        print(f"{name:<18} to `started` {started:5.2f} s, to the first step {step:5.2f} s "
              f"= {step / baseline:4.1f}x a bare `import torch`")
    nvme = PLACEMENTS["opt:nvme (ZeRO-3)"]
    command_first_step_seconds(nvme)
    step = statistics.median(command_first_step_seconds(nvme) for _ in range(args.repeats))
    print(f"{'spillway run':<18} {'':24} to the first step {step:5.2f} s = {step / baseline:4.1f}x a bare "
          "`import torch` (opt:nvme, the command's planning before the runtime included)")


if __name__ == "__main__":
    main()
