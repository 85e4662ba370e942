"""Fixtures for real DeepSpeed training on the CPU: a tiny model built locally, job files,
and a launcher that runs the runtime as the pod would (a child process), with a way to
SIGKILL or SIGTERM it at a chosen step."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway_runtime.local import prepare_local_run, runtime_command, runtime_env
from spillway_runtime.training.reporting import read_events
from spillway_runtime.training.runconfig import FaultInjection, RuntimeConfig

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> dict[str, Path]:
    from spillway_runtime.tiny import build_tiny_model, write_dataset

    root = tmp_path_factory.mktemp("tiny")
    model = build_tiny_model(root / "model")
    # Wide enough that every matrix (>= 589,824 elements) is above DeepSpeed's 1 MiB minimum
    # swap size, so parameters and gradients really go through NVMe.
    wide = build_tiny_model(root / "wide", hidden_size=768, layers=1, heads=6)
    data = write_dataset(root / "data" / "train.jsonl", count=600)
    return {"model": model, "wide": wide, "data": data}


def job_document(name: str, model: Path, data: Path, *, training: dict[str, Any] | None = None,
                 offload: dict[str, Any] | None = None, checkpoint: dict[str, Any] | None = None,
                 rollback: dict[str, Any] | None = None, dtype: str = "bf16",
                 method: dict[str, Any] | None = None, export: dict[str, Any] | None = None) -> dict[str, Any]:
    train = {"maxSteps": 8, "microBatchSize": 2, "gradientAccumulation": 2, "sequenceLength": 32,
             "learningRate": 3e-3, "warmupSteps": 2}
    train.update(training or {})
    spec: dict[str, Any] = {
        "model": {"uri": str(model), "dtype": dtype},
        "dataset": {"uri": str(data)},
        "training": train,
        "offload": offload or {},
        "checkpoint": {"everySteps": 3, "keep": 5, **(checkpoint or {})},
    }
    if rollback:
        spec["rollback"] = rollback
    if method:
        spec["method"] = method
    if export:
        spec["export"] = export
    return {"apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": name}, "spec": spec}


@pytest.fixture
def make_job(tmp_path, tiny_model):
    def make(name: str = "job", model: str = "model", **kwargs: Any) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(job_document(name, tiny_model[model], tiny_model["data"], **kwargs)))
        return path
    return make


@dataclass
class Run:
    config: RuntimeConfig
    returncode: int
    log: str

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)

    @property
    def events(self) -> list[dict[str, Any]]:
        path = self.run_dir / "events.jsonl"
        return read_events(path) if path.exists() else []

    def losses(self) -> dict[int, float]:
        """Per-step loss; a step logged twice (after a resume) keeps its last value."""
        return {e["step"]: e["loss"] for e in self.events if e["event"] == "step"}

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (the supervisor and every rank it started)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        procs = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    # the root is our Popen child: Popen.wait() reaps it and keeps its exit status
    psutil.wait_procs(procs[:-1], timeout=30)


def _new_events(events_path: Path, offset: int) -> list[dict[str, Any]]:
    """The complete events written after `offset` bytes of the events file (this launch only)."""
    if not events_path.exists():
        return []
    with events_path.open("rb") as fh:
        fh.seek(offset)
        lines = fh.read().decode(errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _last_step(events_path: Path, offset: int) -> int:
    """The newest step reported after `offset` bytes of the events file (this launch only)."""
    return max((e["step"] for e in _new_events(events_path, offset) if e["event"] == "step"), default=0)


def _limited(memlock: int, command: list[str]) -> tuple[list[str], Callable[[], None]]:
    """`command` as in a pod run as a non-root uid: RLIMIT_MEMLOCK `memlock` and no CAP_IPC_LOCK
    (root's, which ignores the limit); with the function that sets the limit in the child."""
    if os.geteuid() == 0:  # a non-root uid has no CAP_IPC_LOCK to drop
        command = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", *command]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (memlock, memlock))
    return command, limit


_PREPARE = """
import sys
from pathlib import Path
from spillway_runtime.core.planner import PlanningError
from spillway_runtime.local import prepare_local_run
from spillway_runtime.training.runconfig import FaultInjection
try:
    prepare_local_run(Path(sys.argv[1]), run_dir=Path(sys.argv[2]), processes=int(sys.argv[3]),
                      faults=FaultInjection.model_validate_json(sys.argv[4]) if sys.argv[4] else None)
except PlanningError as err:
    print(err)
    sys.exit(3)
"""


def _prepare_under(memlock: int, job_path: Path, run_dir: Path, processes: int,
                   faults: FaultInjection | None) -> subprocess.CompletedProcess[str]:
    """`prepare_local_run` in a child under the limit: the plan sees the limit `spillway run` would."""
    command, limit = _limited(memlock, [sys.executable, "-c", _PREPARE, str(job_path), str(run_dir), str(processes),
                                        faults.model_dump_json() if faults else ""])
    return subprocess.run(command, capture_output=True, text=True, timeout=300, preexec_fn=limit,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})


def run_job(job_path: Path, run_dir: Path, *, processes: int = 1, faults: FaultInjection | None = None,
            signal_at_step: int | None = None, sig: int = signal.SIGKILL, timeout: float = 600,
            signal_when: Callable[[list[dict[str, Any]]], bool] | None = None, memlock: int | None = None,
            planned_unlimited: bool = False) -> Run:
    """Run the runtime to completion, or send `sig` once the events show `signal_at_step`
    (or `signal_when` holds for this launch's events). `memlock`: as in a pod run as a non-root
    uid, RLIMIT_MEMLOCK of that many bytes and no CAP_IPC_LOCK (root's, which ignores it), planned
    under it too, unless `planned_unlimited` (as on a node the probe never measured)."""
    if memlock is None or planned_unlimited:
        config = prepare_local_run(job_path, run_dir=run_dir, processes=processes, faults=faults)
    else:  # planned under the limit too, as `spillway run` plans where it runs
        prepared = _prepare_under(memlock, job_path, run_dir, processes, faults)
        if prepared.returncode:
            return Run(RuntimeConfig.model_construct(run_dir=str(run_dir)), prepared.returncode,
                       prepared.stdout + prepared.stderr)
        config = RuntimeConfig.read(run_dir / "runtime.json")
    log_path = run_dir / f"runtime-{int(time.time() * 1000)}.log"
    events = run_dir / "events.jsonl"
    offset = events.stat().st_size if events.exists() else 0
    command = runtime_command(run_dir / "runtime.json", processes)
    limit: Callable[[], None] | None = None
    if memlock is not None:
        command, limit = _limited(memlock, command)
    with log_path.open("w") as log:
        child = subprocess.Popen(command, env=runtime_env(config), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, preexec_fn=limit)
        deadline = time.monotonic() + timeout
        try:
            while child.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"runtime did not finish in {timeout} s; log: {log_path}")
                due = signal_at_step is not None and _last_step(events, offset) >= signal_at_step
                if signal_when is not None and signal_when(_new_events(events, offset)):
                    due, signal_when = True, None
                if due:
                    if sig == signal.SIGKILL:
                        _kill_tree(child.pid)  # the supervisor and its ranks at once, as a node loss would
                    else:
                        child.send_signal(sig)
                    signal_at_step = None
                time.sleep(0.05)
        finally:
            if child.poll() is None:
                _kill_tree(child.pid)
            child.wait()
    return Run(config, child.returncode, log_path.read_text())
