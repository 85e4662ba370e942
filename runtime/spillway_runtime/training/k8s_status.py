"""Publish training progress and checkpoints into the FineTuneJob's status (in-cluster only).

Where this sits: a Reporter sink of the training process (rank 0). The operator
owns every other status field; this module owns `status.progress`,
`status.checkpoints` and `status.mirror` (the `status` models' `Progress`,
`CheckpointRecord` and `Mirror`) through server-side apply under the field manager
``spillway-runtime``, so neither side overwrites the other. The pod's
environment names the job (SPILLWAY_JOB_NAME / SPILLWAY_JOB_NAMESPACE, set by
the operator); outside a cluster `sink_from_env()` returns None. The kubernetes
client is imported lazily: the runtime image does not need it for local runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spillway_runtime.core.contract import JOB_NAME_ENV, JOB_NAMESPACE_ENV, PREFERENCE_METRICS
from spillway_runtime.core.status import CheckpointRecord, Mirror, Progress, step_time_fields

FIELD_MANAGER = "spillway-runtime"
GROUP, VERSION, PLURAL = "spillway.dev", "v1alpha1", "finetunejobs"
# Step events arrive every optimizer step; the API server needs no more than this.
MIN_PROGRESS_INTERVAL_S = 5.0
MAX_CHECKPOINTS_LISTED = 50

log = logging.getLogger("spillway.runtime.status")


class StatusPublisher:
    def __init__(self, name: str, namespace: str, total_steps: int, patch: Callable[[dict[str, Any]], None],
                 read: Callable[[], dict[str, Any]] | None = None):
        self.name = name
        self.namespace = namespace
        self.total_steps = total_steps
        self._patch = patch
        self._read = read
        self._checkpoints: list[dict[str, Any]] = []
        self._progress: dict[str, Any] = {}
        self._mirror: dict[str, Any] = {}
        self._last_sent = 0.0

    def body(self) -> dict[str, Any]:
        status: dict[str, Any] = {}
        if self._progress:
            status["progress"] = self._progress
        if self._checkpoints:
            status["checkpoints"] = self._checkpoints[-MAX_CHECKPOINTS_LISTED:]
        if self._mirror:
            lag = None
            if self._progress and self._mirror.get("step") is not None:
                lag = max(0, int(self._progress.get("step", 0)) - int(self._mirror["step"]))
            status["mirror"] = {**self._mirror, **Mirror(lag_steps=lag).model_dump(exclude_unset=True)}
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "FineTuneJob",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "status": status,
        }

    def known(self, checkpoints: list[dict[str, Any]]) -> None:
        """The good checkpoints already on the volume (earlier attempts'), listed from the
        next publish on: server-side apply removes what this manager no longer lists."""
        self._checkpoints = [self._entry(c) for c in checkpoints]

    def requested_rollback(self) -> str | None:
        """The checkpoint the job's spec.resumeFrom names now, read from the API server (a
        user may have asked for a rollback since this pod started); None if unreadable."""
        if self._read is None:
            return None
        try:
            job = self._read()
        except Exception as err:  # best effort, like publishing
            log.warning("reading the job's spec.resumeFrom failed: %s", err)
            return None
        value = (job.get("spec") or {}).get("resumeFrom")
        return str(value) if value else None

    @staticmethod
    def _entry(record: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint event (or manifest) as the status lists it."""
        held_out = {"eval_loss": _num(record.get("evalLoss"))} if record.get("evalLoss") is not None else {}
        return CheckpointRecord(
            name=str(record.get("name")),
            step=int(record.get("step", 0)),
            loss=_num(record.get("loss")),
            time=_iso(record.get("time")),
            size_bytes=int(record.get("sizeBytes") or 0),
            sha256=str(record.get("sha256") or ""),
            **held_out,
        ).model_dump(exclude_unset=True)

    def __call__(self, record: dict[str, Any]) -> None:
        kind = record.get("event")
        force = False
        if kind == "step":
            step, loss = int(record.get("step", 0)), _num(record.get("loss"))
            self._progress = {
                **Progress(
                    step=step,
                    total_steps=self.total_steps,
                    loss=loss,
                    # What `kubectl get ftj` prints (full precision stays in `loss` and the events)
                    step_display=f"{step}/{self.total_steps}",
                    loss_display="" if loss is None else f"{loss:.4g}",
                    learning_rate=_num(record.get("lr")),
                    tokens_per_second=_num(record.get("tokens_per_s")),
                    **step_time_fields(record),
                    eta_seconds=_num(record.get("eta_seconds")),
                    bytes=record.get("bytes") or {},
                    updated_at=_iso(record.get("time")),
                    **_preference(record, "", self._progress),
                ).model_dump(exclude_unset=True),
                # the last evaluation's, until the next one
                **{k: v for k, v in self._progress.items() if k in ("evalLoss", "evalStep")},
            }
        elif kind == "eval":
            held_out = Progress(eval_loss=_num(record.get("eval_loss")), eval_step=int(record.get("step", 0)),
                                **_preference(record, "eval_", self._progress))
            self._progress = {**self._progress, **held_out.model_dump(exclude_unset=True)}
            force = True
        elif kind == "checkpoint":
            entry = self._entry(record)
            self._checkpoints = [c for c in self._checkpoints if c["name"] != entry["name"]] + [entry]
            force = True
        elif kind in ("mirror", "mirror_restored"):
            self._mirror = Mirror(
                uri=str(record.get("uri")), checkpoint=str(record.get("checkpoint")),
                step=int(record.get("step") or str(record.get("checkpoint", "0")).rpartition("-")[2] or 0),
                bytes_per_second=_num(record.get("bytes_per_s")), updated_at=_iso(record.get("time")),
            ).model_dump(exclude_unset=True)
            force = True
        elif kind in ("mirror_failed", "mirror_behind"):
            failed = Mirror(uri=str(record.get("uri")), last_error=str(record.get("reason")),
                            failures=int(record.get("failures") or 0), updated_at=_iso(record.get("time")))
            self._mirror = {**self._mirror, **failed.model_dump(exclude_unset=True)}
            force = True
        elif kind in ("finished", "failed", "preempted", "rollback", "resumed"):
            force = True
        else:
            return
        now = time.monotonic()
        if not force and now - self._last_sent < MIN_PROGRESS_INTERVAL_S:
            return
        self._last_sent = now
        try:
            self._patch(self.body())
        except Exception as err:  # progress is best effort; training must go on without the API
            log.warning("status publish failed: %s", err)


def _preference(record: dict[str, Any], prefix: str, progress: dict[str, Any]) -> dict[str, Any]:
    """A DPO step's (prefix "") or evaluation's ("eval_") rewards and log-probabilities, kept
    beside the other kind's last ones; nothing for a run without them."""
    found = {f"{prefix}{n}": v for n in PREFERENCE_METRICS if (v := _num(record.get(f"{prefix}{n}"))) is not None}
    if not found:
        return {}
    kept = {k: v for k, v in (progress.get("preference") or {}).items() if k.startswith("eval_") == (prefix == "")}
    return {"preference": {**kept, **found}}


def _num(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if v == v and v not in (float("inf"), float("-inf")) else None  # JSON has no NaN


def _iso(t: Any) -> str:
    seconds = float(t) if t is not None else time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _api() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CustomObjectsApi()


def _reader(name: str, namespace: str, api: Any) -> Callable[[], dict[str, Any]]:
    def read() -> dict[str, Any]:
        return dict(api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, _request_timeout=10))

    return read


def _server_side_apply(name: str, namespace: str, api: Any = None) -> Callable[[dict[str, Any]], None]:
    api = api or _api()

    def patch(body: dict[str, Any]) -> None:
        api.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            body,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    return patch


TERMINATION_LOG = Path("/dev/termination-log")  # the kubelet's default terminationMessagePath


def termination_message(text: str, path: Path = TERMINATION_LOG) -> None:
    """In a pod: `text` as the container's termination message (the kubelet keeps at most 4 KiB),
    which the operator reads into the job's status when the pod succeeds. Nothing elsewhere."""
    if not in_pod():
        return
    with contextlib.suppress(OSError):  # no such mount (a pod spec that moved it): the events say it
        path.write_text(text[:4096])


def in_pod() -> bool:
    """Whether this process runs in a pod the operator created (its job is named in the environment)."""
    return bool(os.environ.get(JOB_NAME_ENV) and os.environ.get(JOB_NAMESPACE_ENV))


def sink_from_env(total_steps: int) -> StatusPublisher | None:
    """The Reporter sink for a pod the operator created; None anywhere else."""
    name = os.environ.get(JOB_NAME_ENV)
    namespace = os.environ.get(JOB_NAMESPACE_ENV)
    if not name or not namespace or int(os.environ.get("RANK", "0")) != 0:
        return None
    try:
        api = _api()  # one client (and one kubeconfig load) for both
        patch, read = _server_side_apply(name, namespace, api), _reader(name, namespace, api)
    except Exception as err:
        log.warning("no status publishing (kubernetes client unavailable): %s", err)
        return None
    return StatusPublisher(name, namespace, total_steps, patch, read)
