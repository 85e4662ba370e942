"""The model's config.json read from its volume before planning: a short pod, no GPU.

Where this sits: the reconciler calls `read_model_config` before it plans an attempt of a
job whose model is on a PersistentVolumeClaim (`pvc://`) and whose spec gives no
`model.config`. The pod mounts the claim read-only on the nodes the job may use (its
nodeSelector and tolerations), runs `python -m spillway_runtime.core.model_config` from the
training image and returns the config, cut to what planning reads, as its termination
message. The result (or why there is none) is kept in `status.modelConfig` with the URI it
was read from, so re-planning never reads it again unless `model.uri` changes. The planner
prefers an inline `spec.model.config`, then this, then `parameterCount`
(`placement.model_shape`).
"""

from __future__ import annotations

import json
from typing import Any

from spillway_operator import builders as b
from spillway_operator.settings import OperatorSettings
from spillway_runtime.core.param_counts import count_decoder
from spillway_runtime.core.spec import FineTuneJobSpec
from spillway_runtime.core.status import FineTuneJobStatus
from spillway_runtime.training.runconfig import PVC_MOUNT_ROOT

COMPONENT = "model-config"
CONDITION = "ModelConfigRead"


def pod_name(job: str) -> str:
    return f"{job}-model-config"


def is_reader(pod: dict[str, Any]) -> bool:
    return (pod["metadata"].get("labels") or {}).get(b.LABEL_COMPONENT) == COMPONENT


def needs_read(spec: FineTuneJobSpec, status: FineTuneJobStatus) -> bool:
    """A pvc:// model without an inline config, not yet read from this URI."""
    if spec.model.config is not None or not spec.model.uri.startswith("pvc://"):
        return False
    read = status.model_config_read
    return read is None or read.source != spec.model.uri


def claim_of(uri: str) -> str:
    return uri[len("pvc://"):].split("/", 1)[0]


def build_reader_pod(job: dict[str, Any], spec: FineTuneJobSpec, settings: OperatorSettings) -> dict[str, Any]:
    """The pod that reads config.json: training image, the model's claim read-only, no GPU,
    no API access, the same node selection as the job's pods, and a deadline."""
    name = job["metadata"]["name"]
    claim = claim_of(spec.model.uri)
    volume = f"input-{claim}"[:63]
    model_dir = PVC_MOUNT_ROOT / spec.model.uri[len("pvc://"):]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "activeDeadlineSeconds": settings.model_config_timeout_seconds,
        "terminationGracePeriodSeconds": 0,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [{
            "name": "read",
            "image": settings.runtime_image,
            "command": ["python", "-m", "spillway_runtime.core.model_config", str(model_dir)],
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
            "volumeMounts": [{"name": volume, "mountPath": str(PVC_MOUNT_ROOT / claim), "readOnly": True}],
            # A crash before the reader wrote its message (an image without it) still says why.
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}},
        }],
        "volumes": [{"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
    }
    if spec.resources.node_selector:
        pod_spec["nodeSelector"] = dict(spec.resources.node_selector)
    if spec.resources.tolerations:
        pod_spec["tolerations"] = [t.model_dump(mode="json", exclude_none=True) for t in spec.resources.tolerations]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": b.child_meta(job, pod_name(name), COMPONENT),
            "spec": pod_spec}


def outcome(pod: dict[str, Any], uri: str) -> dict[str, Any] | None:
    """status.modelConfig from a finished reader pod: `{source, config}` or `{source, error}`;
    None while it has not finished."""
    status = pod.get("status") or {}
    phase = status.get("phase")
    if phase not in ("Succeeded", "Failed"):
        return None
    terminated: dict[str, Any] = {}
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated") or {}
    message = (terminated.get("message") or "").strip()
    if phase == "Succeeded":
        try:
            config = json.loads(message)
        except json.JSONDecodeError:
            return {"source": uri, "error": f"the reader's answer is not JSON: {message[:300]!r}"}
        if not isinstance(config, dict):
            return {"source": uri, "error": f"the reader's answer is not a JSON object: {message[:300]!r}"}
        try:
            count_decoder(config)  # what planning will do with it, checked once here
        except ValueError as err:
            return {"source": uri, "error": f"config.json cannot be planned from: {err}"}
        return {"source": uri, "config": config}
    why = message.removeprefix("error: ") or status.get("message") or status.get("reason") or "the pod failed"
    return {"source": uri, "error": " ".join(why.split())[:1000]}


def pending_reason(pod: dict[str, Any]) -> str:
    """Why a reader pod has not finished: the scheduler's message, a waiting container's reason, or its phase."""
    status = pod.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("message"):
            return f"not scheduled: {c['message']}"
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            return f"{waiting['reason']}: {waiting.get('message', '')}".strip(": ")
    return f"pod {status.get('phase', 'Pending')}"
