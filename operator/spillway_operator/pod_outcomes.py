"""What a training pod's state means for its job: the pod outcomes, the exit-code policy (the
contract's `exit_outcome`, in a cluster), containers that can never start, and the backoff
before the next attempt.

Where this sits: read by `reconciler` (and `s3_inputs` for its fetch pods); pure functions of
pod objects, the caller passes `now`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from spillway_operator.builders import parse_time
from spillway_operator.settings import OperatorSettings
from spillway_runtime.core.contract import ExitCode, exit_outcome

OUTCOME_PENDING = "pending"
OUTCOME_SCHEDULED = "scheduled"
OUTCOME_RUNNING = "running"
OUTCOME_SUCCEEDED = "succeeded"
OUTCOME_PREEMPTED = "preempted"  # recreate, do not count
OUTCOME_RETRYABLE = "retryable"  # count against backoffLimit
OUTCOME_PERMANENT = "permanent"  # no retry can help


@dataclass
class PodOutcome:
    kind: str
    exit_code: int | None = None
    reason: str = ""
    message: str = ""


def _exit_code(pod: dict[str, Any]) -> tuple[int | None, str, str]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term is not None:
            return term.get("exitCode"), term.get("reason") or "", term.get("message") or ""
    return None, "", ""


def termination_message(pod: dict[str, Any]) -> str:
    """What the container said as it ended (the runtime's reason for a success, such as an early
    stop; the end of its log for a failure), or ""."""
    return _exit_code(pod)[2]


def classify_pod(pod: dict[str, Any], node_exists: bool) -> PodOutcome:
    """What a training pod's state means for the job; an exit code means what the contract's
    `exit_outcome` says it means in a cluster."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    node = (pod.get("spec") or {}).get("nodeName")
    if node and not node_exists:
        return PodOutcome(OUTCOME_PREEMPTED, reason="NodeLost", message=f"node {node} is gone")
    disrupted = any(c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in status.get("conditions") or [])
    if (status.get("reason") == "Evicted" or (disrupted and phase not in ("Succeeded",))) and (
        phase in ("Failed",) or status.get("reason") == "Evicted" or (pod.get("metadata") or {}).get("deletionTimestamp")
    ):
        return PodOutcome(
            OUTCOME_PREEMPTED,
            reason=status.get("reason") or "Disrupted",
            message=status.get("message", ""),
        )
    if phase == "Succeeded":
        return PodOutcome(OUTCOME_SUCCEEDED, exit_code=0)
    if phase == "Failed":
        code, reason, message = _exit_code(pod)
        reason = reason or status.get("reason") or "Error"
        kind = exit_outcome(code, "cluster").kind if code is not None else OUTCOME_RETRYABLE
        if kind == OUTCOME_SUCCEEDED:  # exit 0 in a failed pod: another container failed it
            kind = OUTCOME_RETRYABLE
        if code == ExitCode.PREEMPTED:
            return PodOutcome(kind, code, "Preempted", "runtime checkpointed and exited 75")
        if code == ExitCode.BAD_INPUT:
            return PodOutcome(kind, code, "BadInput", message or "the runtime rejected its input")
        if code == ExitCode.DIVERGED:
            return PodOutcome(kind, code, "Diverged", message or "loss diverged after all rollbacks")
        return PodOutcome(kind, code, reason, message)
    if phase == "Running":
        return PodOutcome(OUTCOME_RUNNING)
    if node:
        return PodOutcome(OUTCOME_SCHEDULED)
    return PodOutcome(OUTCOME_PENDING)


# A container the kubelet can never start: retrying the attempt starts the same image
# with the same settings. (ErrImagePull and ImagePullBackOff may be a registry outage:
# they count only after the pull grace.)
NEVER_STARTS = {"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"}
PULL_FAILURES = {"ErrImagePull", "ImagePullBackOff"}


def container_never_starts(pod: dict[str, Any], now: datetime, pull_grace_seconds: float) -> PodOutcome | None:
    """A pod whose container cannot start (a bad image name, an image that cannot be pulled
    for `pull_grace_seconds`, a missing Secret or ConfigMap key): a permanent outcome that
    names the image, else None."""
    created = parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
    images = {c.get("name"): c.get("image") for c in (pod.get("spec") or {}).get("containers") or []}
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason") or ""
        overdue = created is not None and (now - created).total_seconds() >= pull_grace_seconds
        if reason == "CreateContainerConfigError" and (secrets := _secrets_of(pod, cs.get("name"))):
            # The kubelet's message says what is missing ('secret "x" not found', 'couldn't
            # find key K in Secret ns/x'); the check names where the Secret comes from
            message = (f"container {cs.get('name')} cannot start ({reason}): {waiting.get('message') or 'no message'}; "
                       f"check that the Secret {' or '.join(repr(n) for n in secrets)} (spec.storage.secretRef) "
                       "exists in the job's namespace with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
            return PodOutcome(OUTCOME_PERMANENT, reason=reason, message=message)
        if reason in NEVER_STARTS or (reason in PULL_FAILURES and overdue):
            image = cs.get("image") or images.get(cs.get("name")) or "?"
            message = (f"container {cs.get('name')} cannot start ({reason}) with image {image}: "
                       f"{waiting.get('message') or 'no message'}; check the operator's runtimeImage "
                       "(SPILLWAY_OPERATOR_RUNTIME_IMAGE) and the nodes' access to it")
            return PodOutcome(OUTCOME_PERMANENT, reason=reason, message=message)
    return None


def _secrets_of(pod: dict[str, Any], container: str | None) -> list[str]:
    """The Secrets a container's environment reads (secretKeyRef), in order."""
    names: list[str] = []
    spec = pod.get("spec") or {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if c.get("name") != container:
            continue
        for var in c.get("env") or []:
            name = ((var.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
            if name and name not in names:
                names.append(name)
    return names


def worst_outcome(outcomes: list[PodOutcome]) -> PodOutcome:
    """A multi-node attempt is as good as its worst rank."""
    order = [
        OUTCOME_PERMANENT,
        OUTCOME_RETRYABLE,
        OUTCOME_PREEMPTED,
        OUTCOME_PENDING,
        OUTCOME_SCHEDULED,
        OUTCOME_RUNNING,
        OUTCOME_SUCCEEDED,
    ]
    return min(outcomes, key=lambda o: order.index(o.kind))


def backoff_seconds(failures: int, settings: OperatorSettings) -> float:
    """Delay before attempt N+1 after `failures` counted failures (doubling, capped)."""
    if failures <= 0:
        return 0.0
    return float(min(settings.backoff_max_seconds, settings.backoff_base_seconds * 2 ** (failures - 1)))
