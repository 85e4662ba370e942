"""The runtime's start: DeepSpeed is imported without pulling in mlflow (its autotuner's
optional import, 1-2 s of every rank's start), and mlflow still imports for a job that tracks;
DeepSpeed's CPU accelerator asks `numactl` for its devices once, not at every call; and
py-cpuinfo's answer (a Python subprocess, ~1 s) is asked once per machine. Before any of
that, `spillway run` plans the job without importing torch, transformers or DeepSpeed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHECK = """
import sys
from spillway_runtime.training.startup import import_deepspeed
import_deepspeed()
import deepspeed.autotuning.autotuner as autotuner
assert "deepspeed" in sys.modules and "mlflow" not in sys.modules, sorted(m for m in sys.modules if "mlflow" in m)
assert autotuner.has_mlflow is False
import mlflow  # a job with spec.tracking.mlflow imports it later, as usual
assert mlflow.__version__
"""


def test_deepspeed_is_imported_without_mlflow_which_still_imports_later() -> None:
    child = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=False,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert child.returncode == 0, child.stderr[-2000:]


COUNT = """
import os
from spillway_runtime.training.startup import ask_numa_once, import_deepspeed
import_deepspeed()
from deepspeed.accelerator import get_accelerator
accelerator = get_accelerator()
before = accelerator.device_count()
ask_numa_once()
ask_numa_once()
print(before, [accelerator.device_count() for _ in range(50)].count(before), "LOCAL_SIZE" in os.environ)
"""


def test_the_cpu_accelerator_asks_numactl_once_for_its_devices(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    numactl = tmp_path / "bin" / "numactl"  # answers as on a two-node machine, and counts its calls
    numactl.parent.mkdir()
    numactl.write_text(f"#!/bin/sh\necho call >> {calls}\necho 'available: 2 nodes (0-1)'\n"
                       "echo 'node 0 cpus: 0 1'\necho 'node 1 cpus: 2 3'\n")
    numactl.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_SIZE"}
    env.update(DS_ACCELERATOR="cpu", PATH=f"{numactl.parent}:{env['PATH']}")
    child = subprocess.run([sys.executable, "-c", COUNT], capture_output=True, text=True, timeout=120, check=False, env=env)
    assert child.returncode == 0, child.stderr[-2000:]
    # DeepSpeed's own answer (two NUMA nodes: two devices) fifty times more, from two calls
    # of numactl: the one before and the one cached. LOCAL_SIZE stays unset (it would turn
    # on DeepSpeed's shared-memory all-reduce and its files in /dev/shm).
    assert child.stdout.split()[-3:] == ["2", "50", "False"], child.stdout
    assert calls.read_text().splitlines() == ["call", "call"]


CPUINFO = """
import cpuinfo
from spillway_runtime.training.startup import ask_cpuinfo_once
ask_cpuinfo_once()
ask_cpuinfo_once()
print(cpuinfo.get_cpu_info()["vendor_id_raw"])
"""


def test_the_cpus_answer_is_asked_once_per_machine_and_kept_beside_the_probe_cache(tmp_path: Path) -> None:
    def vendor(**extra: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "SPILLWAY_PROBE_REFRESH"}
        env.update(SPILLWAY_PROBE_CACHE_DIR=str(tmp_path), **extra)
        child = subprocess.run([sys.executable, "-c", CPUINFO], capture_output=True, text=True, timeout=120,
                               check=False, env=env)
        assert child.returncode == 0, child.stderr[-2000:]
        return child.stdout.strip()

    asked = vendor()
    [entry] = tmp_path.glob("cpuinfo-*.json")
    assert json.loads(entry.read_text())["vendor_id_raw"] == asked != ""
    # The next process reads the entry instead of asking: shown by an entry that says otherwise
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "vendor_id_raw": "KeptVendor"}))
    assert vendor() == "KeptVendor"
    # A refresh asks again and keeps the new answer; a broken entry is asked again too
    assert vendor(SPILLWAY_PROBE_REFRESH="1") == asked
    assert json.loads(entry.read_text())["vendor_id_raw"] == asked
    entry.write_text("{not json")
    assert vendor() == asked and json.loads(entry.read_text())["vendor_id_raw"] == asked


PLAN_ONLY = """
import json, sys
from pathlib import Path
import spillway_runtime.probe as probe
probe._no_gpu_driver = lambda: True  # as on this CPU machine; with a GPU's driver torch counts the GPUs
from spillway_runtime.local import prepare_local_run
job, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
config = prepare_local_run(job, run_dir=run_dir)
print(config.plan.label, config.plan.model.params)
print(json.dumps(sorted(m for m in ("torch", "transformers", "deepspeed") if m in sys.modules)))
"""


def test_spillway_runs_planning_imports_no_torch_transformers_or_deepspeed(tmp_path: Path) -> None:
    """What `spillway run` does before the runtime starts (the shape by arithmetic, the plan,
    the DeepSpeed config, runtime.json) imports none of them. They were most of the 5.5 s the
    command spent before the runtime's own imports began (benchmarks/bench_startup.py, 2026-12-07:
    `spillway run` to its first step 9.8 s before, 5.5 s after, the runtime alone 4.4-4.7 s).
    A job that sets DeepSpeed keys of its own still has them
    parsed by DeepSpeed before anything runs (tests/integration/test_run_bad_input.py)."""
    import yaml

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4}))
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "one plus one is two"}\n')
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob",
                                   "metadata": {"name": "plan-only"},
                                   "spec": {"model": {"uri": str(model)}, "dataset": {"uri": str(data)},
                                            "offload": {"optimizer": "cpu"}}}))
    child = subprocess.run([sys.executable, "-c", PLAN_ONLY, str(job), str(tmp_path / "run")], capture_output=True,
                           text=True, timeout=120, check=False, env={**os.environ, "SPILLWAY_PROBE_SWEEP": "0"})
    assert child.returncode == 0, child.stderr[-2000:]
    planned, imported = child.stdout.splitlines()[-2:]
    # the embedding and the head, two layers of attention, MLP and norms, the final norm
    assert planned.endswith(f" {2 * 512 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64}"), planned
    assert "opt:cpu" in planned, planned
    assert json.loads(imported) == []
    assert (tmp_path / "run" / "runtime.json").is_file()


def test_a_machine_without_a_gpu_driver_is_counted_no_gpus_without_asking_torch(tmp_path: Path, monkeypatch) -> None:
    import shutil

    import spillway_runtime.probe as probe

    monkeypatch.setattr(probe, "GPU_DRIVER_SIGNS", (str(tmp_path / "no-driver"),))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert probe._no_gpu_driver() and probe.probe_gpus() == (0, None, 0)
    (tmp_path / "no-driver").mkdir()  # the driver's /proc entry: torch is asked
    assert not probe._no_gpu_driver()
