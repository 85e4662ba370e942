"""What the training process is told: the job, its plan and resolved local paths.

The operator writes a `RuntimeConfig` into the pod's ConfigMap; `spillway run`
writes one into the run directory. `python -m spillway_runtime --config FILE`
reads it. Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field

from spillway_runtime.core.planner import OffloadPlan
from spillway_runtime.core.spec import FineTuneJob, FineTuneJobSpec
from spillway_runtime.probe_cache import ProbeRecord

PVC_MOUNT_ROOT = Path("/mnt/pvc")
# Where a training pod mounts its node's s3:// cache (read-only), which the operator's fetch
# pods filled before the pod was created.
S3_CACHE_MOUNT = Path("/mnt/s3-cache")


class FaultInjection(BaseModel):
    """Test hooks, never set by users: make chosen micro-batches produce a NaN loss, slow steps,
    wait for uploads, build DeepSpeed's reference."""

    nan_micro_batches: list[int] = Field(default_factory=list)
    spike_micro_batches: list[int] = Field(default_factory=list)
    step_sleep_seconds: float = Field(0.0, description="Slow each step so a test can signal mid-run")
    mirror_every_checkpoint: bool = Field(
        False, description="Wait for each checkpoint's upload before training on: the mirror uploads the newest "
        "checkpoint and drops one still waiting, so under load a test's count of uploads would vary")
    whole_gradient_buffer: bool = Field(
        False, description="Build ZeRO-3 as DeepSpeed does, with its whole-model 16-bit gradient buffer in RAM "
        "(`deepspeed_fixes.hold_one_steps_gradient_partitions_only` left out): the reference a test compares with")


class RuntimeConfig(BaseModel):
    job: FineTuneJob
    plan: OffloadPlan
    model_dir: str
    tokenizer_dir: str
    dataset_path: str
    validation_path: str | None = None  # dataset.validation.uri, resolved
    mixture_paths: list[str] = Field(default_factory=list)  # dataset.mixture's URIs, resolved, in order
    run_dir: str
    checkpoint_dir: str
    nvme_dir: str | None = None
    remove_swap_at_exit: bool = Field(
        False, description="Remove this rank's swap files under nvme_dir when the process ends: a pod's NVMe "
        "directory sits on a node other jobs share, and a resume reads checkpoints, never swap files")
    export_dir: str
    events_path: str
    deepspeed: dict[str, object] = Field(default_factory=dict, description="Generated DeepSpeed config")
    faults: FaultInjection = Field(default_factory=FaultInjection)
    probe: ProbeRecord | None = Field(None, description="Where a local run's aio settings came from")

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: Path) -> RuntimeConfig:
        return cls.model_validate_json(Path(path).read_text())


def input_uris(spec: FineTuneJobSpec) -> list[tuple[str, str]]:
    """(field, URI) of every input a job reads: model, tokenizer, dataset, mixture, held-out
    data. What admission checks, the operator fetches (s3://) or mounts (pvc://)."""
    uris = [("spec.model.uri", spec.model.uri), ("spec.model.tokenizerUri", spec.model.tokenizer_uri),
            ("spec.dataset.uri", spec.dataset.uri),
            *((f"spec.dataset.mixture[{i}].uri", m.uri) for i, m in enumerate(spec.dataset.mixture)),
            ("spec.dataset.validation.uri", spec.dataset.validation.uri if spec.dataset.validation else None)]
    return [(field, uri) for field, uri in uris if uri]


def s3_inputs(spec: FineTuneJobSpec) -> list[tuple[str, str]]:
    """(field, URI) of every s3:// input of a spec: what is fetched before training reads it."""
    return [(field, uri) for field, uri in input_uris(spec) if uri.startswith("s3://")]


def check_cached_inputs(config: RuntimeConfig, root: Path = S3_CACHE_MOUNT) -> None:
    """In a pod: every s3:// input is in the node's cache (objectstore.cached), or ValueError
    naming the field, before anything heavy starts."""
    from spillway_runtime.objectstore import ObjectStoreError, cached

    for field, uri in s3_inputs(config.job.spec):
        try:
            cached(uri, root)
        except ObjectStoreError as err:
            raise ValueError(f"{field}: {err}") from None


def nvme_problem(config: RuntimeConfig) -> str | None:
    """In a pod: why the NVMe directory cannot take swap files, naming what the cluster admin
    changes, or None. (The operator mounts a job's own directory under the node's NVMe root;
    the kubelet makes it with the root's mode, so a root that is not 1777 gives the training
    uid a directory it cannot write: found here, not by DeepSpeed at its first swap.)"""
    from spillway_runtime.checkpoints.store import write_problem

    if not config.nvme_dir:
        return None
    problem = write_problem(Path(config.nvme_dir))
    if problem is None:
        return None
    return (f"spec.offload.nvme: the job's NVMe directory is not writable by uid {os.getuid()} ({problem}): "
            "the cluster admin makes the node's NVMe root mode 1777 (the chart's node probe does so for "
            "nodeProbe.nvmeHostPath) or sets operator.nvme.storageClassName to a local-volume StorageClass")


def resolve_uri(uri: str, base_dir: Path, s3_cache: Path | None = None) -> Path:
    """Map a spec URI to a local path: file://PATH, pvc://CLAIM/PATH (mounted under /mnt/pvc), a path
    relative to the job file's directory, or (given `s3_cache`, in a cluster) s3://BUCKET/KEY to its
    place in the node's s3 cache. Without `s3_cache` s3:// is refused: local mode fetches it first."""
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    if uri.startswith("pvc://"):
        return PVC_MOUNT_ROOT / uri[len("pvc://") :]
    if uri.startswith("s3://"):
        from spillway_runtime.objectstore import ObjectStoreError, cache_path

        if s3_cache is not None:
            try:
                return cache_path(uri, s3_cache)
            except ObjectStoreError as err:
                raise ValueError(str(err)) from None
        # `spillway run` downloads these itself (objectstore, before it calls this)
        raise ValueError(
            f"unsupported URI scheme 's3' in {uri!r} here: s3:// is read by `spillway run` (which downloads "
            "it first) and in a cluster (where the operator's fetch pods do)"
        )
    if "://" in uri:
        scheme = uri.split("://", 1)[0]
        raise ValueError(
            f"unsupported URI scheme {scheme!r} in {uri!r}: use a local path, file://, pvc:// or "
            "(with `spillway run`) s3://"
        )
    path = Path(uri).expanduser()
    return path if path.is_absolute() else (base_dir / path).resolve()
