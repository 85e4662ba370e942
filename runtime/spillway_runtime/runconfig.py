"""What the training process is told: the job, its plan and resolved local paths.

The operator writes a `RuntimeConfig` into the pod's ConfigMap; `spillway run`
writes one into the run directory. `python -m spillway_runtime --config FILE`
reads it. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from spillway_runtime.planner import OffloadPlan
from spillway_runtime.probe_cache import ProbeRecord
from spillway_runtime.spec import FineTuneJob

PVC_MOUNT_ROOT = Path("/mnt/pvc")


class FaultInjection(BaseModel):
    """Test hooks, never set by users: make chosen micro-batches produce a NaN loss."""

    nan_micro_batches: list[int] = Field(default_factory=list)
    spike_micro_batches: list[int] = Field(default_factory=list)
    step_sleep_seconds: float = Field(0.0, description="Slow each step so a test can signal mid-run")


class RuntimeConfig(BaseModel):
    job: FineTuneJob
    plan: OffloadPlan
    model_dir: str
    tokenizer_dir: str
    dataset_path: str
    validation_path: str | None = None  # dataset.validation.uri, resolved
    run_dir: str
    checkpoint_dir: str
    nvme_dir: str | None = None
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


def resolve_uri(uri: str, base_dir: Path) -> Path:
    """Map a spec URI to a local path: file://PATH, pvc://CLAIM/PATH (mounted under /mnt/pvc), or a path
    relative to the job file's directory. s3:// is refused here: local mode fetches it first."""
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    if uri.startswith("pvc://"):
        return PVC_MOUNT_ROOT / uri[len("pvc://") :]
    if uri.startswith("s3://"):
        # `spillway run` downloads these itself (objectstore, before it calls this); a pod cannot yet
        raise ValueError(
            f"unsupported URI scheme 's3' in {uri!r} here: s3:// is read by `spillway run` on its own machine "
            "only (model.uri, model.tokenizerUri, dataset.uri, dataset.validation.uri) and is not supported "
            "in a cluster yet: copy the objects to a PersistentVolumeClaim and use pvc://CLAIM/PATH"
        )
    if "://" in uri:
        scheme = uri.split("://", 1)[0]
        raise ValueError(
            f"unsupported URI scheme {scheme!r} in {uri!r}: use a local path, file://, pvc:// or "
            "(with `spillway run`) s3://"
        )
    path = Path(uri).expanduser()
    return path if path.is_absolute() else (base_dir / path).resolve()
