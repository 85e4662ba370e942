"""Shared set-up for the benchmarks: locally built models, job files and runs.

Every benchmark prints ratios against a baseline measured in the same run, because
these machines are shared and noisy; absolute figures are printed for context only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(os.environ.get("SPILLWAY_BENCH_DIR", ROOT / "runs" / "bench"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# name -> (hidden size, layers, heads): parameter counts 0.75M, 6.5M, 26M, 211M
MODELS = {"tiny": (128, 4, 4), "wide": (768, 1, 6), "small": (512, 8, 8), "large": (1024, 20, 16)}


def model_arguments(default: str, choices: list[str], steps: int, repeats: int | None = None) -> argparse.Namespace:
    """--model and --steps (and --repeats where given a default); and the first run of this
    benchmark measures this machine's rates afresh (`run_job`) instead of planning with a cached
    probe (one measured under load a day earlier had put the predictions 2x off)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=default, choices=choices)
    parser.add_argument("--steps", type=int, default=steps)
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats,
                            help="Rounds of every run, each round in another order; medians and ranges reported")
    os.environ["SPILLWAY_PROBE_REFRESH"] = "1"
    return parser.parse_args()


def model_dir(name: str) -> Path:
    from spillway_runtime.tiny import build_tiny_model

    path = BENCH_DIR / "models" / name
    if not (path / "config.json").exists():
        hidden, layers, heads = MODELS[name]
        build_tiny_model(path, hidden_size=hidden, layers=layers, heads=heads)
    return path


def dataset() -> Path:
    from spillway_runtime.tiny import write_dataset

    path = BENCH_DIR / "data" / "train.jsonl"
    if not path.exists():
        write_dataset(path, count=2000)
    return path


def write_job(name: str, model: str, *, steps: int, offload: dict[str, Any], stage: int | None = None,
              micro_batch: int = 4, sequence: int = 64, method: dict[str, Any] | None = None,
              accumulation: int = 1) -> Path:
    deepspeed = dict(offload.pop("deepspeed", {}))
    if stage is not None:
        deepspeed.setdefault("zero_optimization", {})["stage"] = stage
    doc = {
        "apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": name},
        "spec": {
            "model": {"uri": str(model_dir(model)), "dtype": "bf16"},
            "dataset": {"uri": str(dataset())},
            "training": {"maxSteps": steps, "microBatchSize": micro_batch, "gradientAccumulation": accumulation,
                         "sequenceLength": sequence, "learningRate": 1e-3},
            "offload": {**offload, "deepspeed": deepspeed},
            "checkpoint": {"everySteps": 10_000, "keep": 1},
            **({"method": method} if method else {}),
        },
    }
    path = BENCH_DIR / "jobs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


def run_job(job: Path, run_dir: Path, reprobe: bool = False) -> tuple[Any, list[dict[str, Any]]]:
    """Run the job as `spillway run` would; returns (RuntimeConfig, events). `reprobe`: planned
    with the machine's rates measured afresh for this run (in a process of its own: the probe
    cache measures again at most once a process)."""
    import shutil

    from spillway_runtime.local import prepare_local_run, runtime_command, runtime_env
    from spillway_runtime.training.reporting import read_events
    from spillway_runtime.training.runconfig import RuntimeConfig

    shutil.rmtree(run_dir, ignore_errors=True)
    if reprobe:
        plan = ("import sys; from pathlib import Path; from spillway_runtime.local import prepare_local_run; "
                "prepare_local_run(Path(sys.argv[1]), run_dir=Path(sys.argv[2]))")
        subprocess.run([sys.executable, "-c", plan, str(job), str(run_dir)], check=True,
                       env={**os.environ, "SPILLWAY_PROBE_REFRESH": "1"})
        config = RuntimeConfig.read(run_dir / "runtime.json")
    else:
        config = prepare_local_run(job, run_dir=run_dir)
    os.environ.pop("SPILLWAY_PROBE_REFRESH", None)  # measured afresh at most once (`model_arguments`)
    result = subprocess.run(runtime_command(run_dir / "runtime.json", 1), env=runtime_env(config),
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{job.name} failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return config, read_events(run_dir / "events.jsonl")


RESULT = "RESULT "  # the line a benchmark's child process prints its result on, as JSON


def result_of(command: list[str], what: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a benchmark's child process (one measurement in a process of its own) and return the
    JSON it printed on its RESULT line; `what` names the measurement if it failed."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def proc_io() -> tuple[int, int]:
    """Bytes (read, written) this process has moved to and from block devices (DeepSpeed's
    async I/O runs in it)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def median_step_seconds(events: list[dict[str, Any]], skip: int = 2) -> float:
    times = [e["step_seconds"] for e in events if e["event"] == "step"][skip:]
    return statistics.median(times)
