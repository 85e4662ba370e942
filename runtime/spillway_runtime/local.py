"""Local mode: plan a job against this machine and run the runtime as a child process.

`prepare_local_run` turns a finetune.yaml into a `RuntimeConfig` (paths resolved
relative to the job file, s3:// sources downloaded into the cache of `objectstore`,
hardware probed with the disk's cached async-I/O sweep (`probe_cache`), model shape read
from config.json, plan made, DeepSpeed config generated and validated) and writes it into the run directory, with a `probe` event
saying where the aio settings came from; `launch` starts `python -m spillway_runtime` (or the supervisor of several
ranks), turns SIGTERM/SIGINT into one stop request so the run checkpoints before
it stops, and returns its exit code.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spillway_runtime.checkpoints.store import LATEST, write_problem
from spillway_runtime.core.hardware import AioSettings, NodeHardware
from spillway_runtime.core.planner import OffloadPlan, PlanInputs, PlanningError, plan_placement
from spillway_runtime.core.spec import FineTuneJob, FineTuneJobSpec, SpecError, load_job
from spillway_runtime.probe_cache import ProbeRecord
from spillway_runtime.training.dsconfig import build_deepspeed_config, validate_deepspeed_config
from spillway_runtime.training.reporting import append_event
from spillway_runtime.training.runconfig import FaultInjection, RuntimeConfig, resolve_uri

if TYPE_CHECKING:
    from spillway_runtime.objectstore import FetchResult

RUNTIME_FILE = "runtime.json"  # in the run directory: the plan and settings every process reads


def _require(path: Path, field: str, what: str, source: Path) -> Path:
    if not path.exists():
        raise SpecError(str(source), [f"{field}: {path}: no such {what}"])
    return path


def _source(uri: str, base: Path, named: tuple[str, str, Path], fetched: list[tuple[str, FetchResult]],
            storage: Any = None) -> Path:
    """A spec URI as a local path: s3:// downloaded into the cache (or refused, naming the
    bucket and what to check), anything else resolved and required to exist."""
    field, what, job_path = named
    if not uri.startswith("s3://"):
        return _require(resolve_uri(uri, base), field, what, job_path)
    from spillway_runtime.objectstore import Endpoint, ObjectStoreError, fetch

    try:
        result = fetch(uri, where=Endpoint.of(storage))
    except ObjectStoreError as err:
        raise SpecError(str(job_path), [f"{field}: {err}"]) from None
    fetched.append((field, result))
    return result.path


def _check_mirror(spec: Any, job_path: Path) -> None:
    """A checkpoint mirror or an export destination that cannot be listed and written ends
    the run before it starts (the runtime checks again, for pods)."""
    from spillway_runtime.checkpoints.mirror import check_writable
    from spillway_runtime.objectstore import Endpoint, ObjectStoreError, S3Location, open_store

    where = Endpoint.of(spec.storage)
    for field, uri in (("spec.checkpoint.mirror", spec.checkpoint.mirror), ("spec.export.uri", spec.export.uri)):
        if uri is None:
            continue
        loc = S3Location.parse(uri)
        try:
            check_writable(open_store(loc.bucket, where), loc, where)
        except ObjectStoreError as err:
            raise SpecError(str(job_path), [f"{field}: {err}"]) from None


def plan_for_job(job: FineTuneJob, hw: NodeHardware, model_dir: Path, processes: int = 1,
                 price_per_hour: float | None = None) -> OffloadPlan:
    from spillway_runtime.meta_shape import model_shape

    spec = job.spec
    shape = model_shape(model_dir)
    gpus = min(hw.gpu_count, spec.resources.gpus_per_node or hw.gpu_count)
    plan = plan_placement(PlanInputs.of_spec(spec, shape, gpus_per_node=gpus, price_per_hour=price_per_hour,
                                             cpu_processes=processes), hw)
    if not plan.feasible:
        raise PlanningError(plan)
    return plan


def _checkpoints_block_size(run_dir: Path, checkpoint_dir: Path, spec: Any = None) -> int | None:
    """The async-I/O block size the job's checkpoints were written under, when it has any.
    It decides which of the optimizer's sub-groups DeepSpeed swaps (one under max(1 MiB,
    block) bytes of fp32 stays in memory, its state in the ZeRO file rather than in swap
    files), so a resume keeps it, whatever the disk's sweep says today. An empty volume
    with a checkpoint mirror: the block size of the mirrored checkpoint the run will restore."""
    if not (checkpoint_dir / LATEST).is_file():
        return _mirrored_block_size(spec) if spec is not None else None
    if not (run_dir / RUNTIME_FILE).is_file():
        return None
    try:
        return RuntimeConfig.read(run_dir / RUNTIME_FILE).plan.aio.block_size
    except (OSError, ValueError):
        return None


def _mirrored_block_size(spec: Any) -> int | None:
    """The `aioBlockSize` in the manifest of the checkpoint a restore from the mirror takes."""
    if spec.checkpoint.mirror is None:
        return None
    from spillway_runtime.checkpoints.mirror import Mirror
    from spillway_runtime.objectstore import Endpoint

    try:
        mirror = Mirror(spec.checkpoint.mirror, where=Endpoint.of(spec.storage))
        name = mirror.newest(spec.resume_from) if spec.resume_from else mirror.newest()
        value = (mirror.manifest(name) or {}).get("aioBlockSize") if name else None
    except Exception:  # the mirror was checked just before; a blip here only loses the pin
        return None
    return int(value) if isinstance(value, int) else None


def _plan_here(job: FineTuneJob, job_path: Path, dirs: tuple[Path, Path, Path], model_dir: Path, processes: int,
               reprobe: bool) -> tuple[OffloadPlan, ProbeRecord]:
    """Plan on this machine: fresh capacities with the disk's cached async-I/O sweep merged in.
    Without a usable cache entry the sweep runs only when the plan puts state on NVMe (nothing
    else reads the aio settings as often), and the plan is made again with what it found.
    A resumed job keeps the block size its checkpoints were written under."""
    from spillway_runtime.probe_cache import ProbeCacheSettings, hardware_for_run

    nvme_dir, run_dir, checkpoint_dir = dirs
    _check_writable_dir(nvme_dir, "spec.offload.nvme.path", job_path)
    settings = ProbeCacheSettings(refresh=True) if reprobe else ProbeCacheSettings()
    pinned = _checkpoints_block_size(run_dir, checkpoint_dir, job.spec)

    def measured(measure: bool) -> tuple[NodeHardware, ProbeRecord]:
        hardware, record = hardware_for_run(nvme_dir, measure=measure, settings=settings)
        aio = hardware.aio or AioSettings()
        if pinned is None or aio.block_size == pinned:
            return hardware, record
        aio = aio.model_copy(update={"block_size": pinned})
        why = f"{record.why}; block size {pinned >> 10} KiB kept from the job's checkpoints".lstrip("; ")
        return hardware.model_copy(update={"aio": aio}), record.model_copy(update={"aio": aio, "why": why})

    hardware, record = measured(False)
    plan = plan_for_job(job, hardware, model_dir, processes)
    if record.source == "unmeasured" and "nvme" in (plan.optimizer, plan.parameters):
        hardware, record = measured(True)
        plan = plan_for_job(job, hardware, model_dir, processes)
    return plan, record


def prepare_local_run(
    job_path: Path,
    *,
    run_dir: Path | None = None,
    hardware: NodeHardware | None = None,
    processes: int = 1,
    faults: FaultInjection | None = None,
    job: FineTuneJob | None = None,
    reprobe: bool = False,
) -> RuntimeConfig:
    """`hardware` given: plan on it as it is. Otherwise this machine, with the cached sweep
    (`reprobe` measures the disk again)."""
    job = job or load_job(job_path)
    spec = job.spec
    base = job_path.resolve().parent
    inputs = _inputs(spec, job_path)
    model_dir = inputs.model_dir
    _check_mirror(spec, job_path)
    run_dir = (run_dir or Path.cwd() / "runs" / job.metadata.name).resolve()
    checkpoint_dir = resolve_uri(spec.checkpoint.path, base) if spec.checkpoint.path else run_dir / "checkpoints"
    nvme_dir = resolve_uri(spec.offload.nvme.path, base) if spec.offload.nvme.path else run_dir / "nvme"
    probe: ProbeRecord | None = None
    if hardware is None:
        plan, probe = _plan_here(job, job_path, (nvme_dir, run_dir, checkpoint_dir), model_dir, processes, reprobe)
    else:
        plan = plan_for_job(job, hardware, model_dir, processes)
    if plan.uses_nvme:
        _check_writable_dir(nvme_dir, "spec.offload.nvme.path", job_path)
    ds_config = build_deepspeed_config(plan, spec, nvme_path=str(nvme_dir) if plan.uses_nvme else None,
                                       world_size=plan.world_size)
    if spec.offload.deepspeed:
        # The job's own DeepSpeed keys, refused by DeepSpeed's parser before anything runs. A
        # config of Spillway's alone is parsed by the runtime's `deepspeed.initialize`: importing
        # DeepSpeed here for it would be 2 s of every `spillway run` (bench_startup.py).
        validate_deepspeed_config(ds_config)
    config = RuntimeConfig(
        job=job,
        plan=plan,
        model_dir=str(model_dir),
        tokenizer_dir=str(inputs.tokenizer_dir),
        dataset_path=str(inputs.dataset_path),
        validation_path=str(inputs.validation_path) if inputs.validation_path else None,
        mixture_paths=[str(path) for path in inputs.mixture_paths],
        run_dir=str(run_dir),
        checkpoint_dir=str(checkpoint_dir),
        nvme_dir=str(nvme_dir) if plan.uses_nvme else None,
        export_dir=str(run_dir / "final"),
        events_path=str(run_dir / "events.jsonl"),
        deepspeed=ds_config,
        faults=faults or FaultInjection(),
        probe=probe,
    )
    config.write(run_dir / RUNTIME_FILE)
    if probe is not None:
        append_event(Path(config.events_path), "probe", **probe.model_dump(mode="json"))
    for field, result in inputs.fetched:
        append_event(Path(config.events_path), "fetch", field=field, **result.event_fields())
    return config


@dataclass
class _Inputs:
    model_dir: Path
    tokenizer_dir: Path
    dataset_path: Path
    mixture_paths: list[Path]
    validation_path: Path | None
    fetched: list[tuple[str, FetchResult]]  # the s3:// ones, as downloaded into the cache


def _inputs(spec: FineTuneJobSpec, job_path: Path) -> _Inputs:
    """The job's inputs on this machine: local paths resolved relative to the job file and
    required to exist, s3:// ones fetched into the cache, each refused by its field."""
    base = job_path.resolve().parent
    fetched: list[tuple[str, FetchResult]] = []

    def source(uri: str, field: str, what: str) -> Path:
        return _source(uri, base, (field, what, job_path), fetched, spec.storage)

    model_dir = source(spec.model.uri, "spec.model.uri", "model directory")
    tokenizer_dir = (source(spec.model.tokenizer_uri, "spec.model.tokenizerUri", "tokenizer directory")
                     if spec.model.tokenizer_uri else model_dir)
    dataset_path = source(spec.dataset.uri, "spec.dataset.uri", "dataset file or directory")
    mixture_paths = [source(m.uri, f"spec.dataset.mixture[{i}].uri", "dataset file or directory")
                     for i, m in enumerate(spec.dataset.mixture)]
    held_out = spec.dataset.validation.uri if spec.dataset.validation else None
    validation_path = (source(held_out, "spec.dataset.validation.uri", "validation file or directory")
                       if held_out else None)
    return _Inputs(model_dir, tokenizer_dir, dataset_path, mixture_paths, validation_path, fetched)


def _check_writable_dir(path: Path, field: str, source: Path) -> None:
    problem = write_problem(path)
    if problem:
        raise SpecError(str(source), [f"{field}: {path} is not writable ({problem}); choose a writable directory"])


def runtime_command(config_path: Path, processes: int) -> list[str]:
    if processes <= 1:
        return [sys.executable, "-m", "spillway_runtime", "--config", str(config_path)]
    # Not torchrun: its agent exits 1 on SIGTERM and kills the ranks 30 s later (see supervisor.py)
    return [sys.executable, "-m", "spillway_runtime.training.supervisor", "--processes", str(processes),
            "--config", str(config_path)]


def runtime_env(config: RuntimeConfig) -> dict[str, str]:
    env = dict(os.environ)
    if config.plan.accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        # Each process gets its share of the cores; oversubscription makes gloo crawl.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.plan.processes_per_node)))
    return env
