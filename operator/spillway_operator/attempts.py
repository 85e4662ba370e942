"""What every step of the reconcile shares: its result, an attempt's pods, the move to the
next attempt (cost settled, status committed before any pod is stopped), a finished or
refused job, and the inputs a (re-)plan reads.

Where this sits: `reconciler` runs the state machine and `waits` the steps of a job that
waits on something outside it (Kueue's admission, a declared pool's node); both end
attempts and re-plan through the functions here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

from spillway_operator import builders as b
from spillway_operator import job_cost
from spillway_operator.cluster import Cluster
from spillway_operator.settings import OperatorSettings
from spillway_operator.status import StatusChange
from spillway_runtime.core.plan_summary import PlanSummary
from spillway_runtime.core.planner import plan_summary
from spillway_runtime.core.spec import FineTuneJobSpec
from spillway_runtime.training.runconfig import RuntimeConfig


@dataclass
class Result:
    """When to look at the job again: in `requeue_after` seconds (None: on its next event),
    or at once in the same call (`again`: a decision was committed, the next one follows)."""

    requeue_after: float | None = None
    again: bool = False


class PermanentFailure(Exception):
    """Written into the job's status already; retrying cannot help."""


def pricing_of(cluster: Cluster, settings: OperatorSettings) -> dict[str, str]:
    return cluster.configmap_data(settings.namespace, settings.pricing_configmap,
                                  max_age=settings.pricing_cache_seconds) or {}


def is_active(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def may_still_write(cluster: Cluster, pod: dict[str, Any]) -> bool:
    """A pod that has not exited, on a node that still exists (a lost node's pods write nothing)."""
    node = pod["spec"].get("nodeName")
    return is_active(pod) and bool(node) and cluster.node_exists(node)


def attempt_of(pod: dict[str, Any]) -> int:
    try:
        return int(pod["metadata"]["labels"][b.LABEL_ATTEMPT])
    except (KeyError, ValueError):
        return -1


def plan_of(status: dict[str, Any]) -> PlanSummary | None:
    return plan_summary(status.get("plan"))


def cost_so_far(change: StatusChange, live_seconds: float) -> dict[str, Any]:
    settled = change.was.cost
    plan = plan_of(change.status) or change.was.plan
    return job_cost.cost_status(
        change.now,
        (settled.settled_usd if settled else None) or 0.0,
        (settled.settled_gpu_hours if settled else None) or 0.0,
        live_seconds,
        (plan.price_per_hour_usd or 0.0) if plan is not None else 0.0,
        plan.gpus if plan is not None else 0,
    )


def settle(change: StatusChange, pods: list[dict[str, Any]]) -> None:
    """Fold this attempt's pod time into the settled cost (same patch as the attempt change)."""
    live = sum(job_cost.pod_run_seconds(p, change.now) for p in pods)
    cost = cost_so_far(change, live)
    cost["settledUSD"] = cost["usd"]
    cost["settledGpuHours"] = cost["gpuHours"]
    change.status["cost"] = cost


def commit_attempt_end(
    change: StatusChange,
    pods: list[dict[str, Any]],
    settings: OperatorSettings,
    counted: str | None,
    grace: int | None,
    retry_after: float = 0.0,
) -> Result:
    """Settle cost and move to the next attempt in one conditional patch; then stop the pods."""
    was = change.was
    change.status["attempt"] = was.attempt + 1
    if counted:
        change.status[counted] = int(getattr(was, counted)) + 1
    if retry_after > 0:
        change.status["retryAfter"] = b.rfc3339(change.now + timedelta(seconds=retry_after))
    settle(change, pods)
    suspended = change.status.get("phase") == b.PHASE_SUSPENDED
    change.conditional = True
    change.commit()
    meta = change.job["metadata"]
    for pod in pods:
        if is_active(pod):
            change.cluster.delete_pod(meta["namespace"], pod["metadata"]["name"], grace)
    return Result(again=retry_after <= 0 and not suspended, requeue_after=retry_after or None)


def finish(change: StatusChange, phase: str, reason: str, message: str, pods: list[dict[str, Any]]) -> None:
    warning = phase != b.PHASE_SUCCEEDED
    change.cond(phase, True, reason, message)
    change.cond(b.PHASE_RUNNING, False, reason, message)
    change.phase(phase, reason, message, warning=warning)
    change.status["finishedAt"] = b.rfc3339(change.now)
    change.status["retryAfter"] = None
    settle(change, pods)
    change.conditional = True


def fail_before_pods(change: StatusChange, reason: str, message: str) -> NoReturn:
    change.cond(b.PHASE_FAILED, True, reason, message)
    change.phase(b.PHASE_FAILED, reason, message, warning=True)
    change.status["finishedAt"] = b.rfc3339(change.now)
    change.commit()
    raise PermanentFailure(message)


def model_config_read(change: StatusChange, spec: FineTuneJobSpec) -> dict[str, Any]:
    """status.modelConfig when it was read from the model's present URI, else {}."""
    read = change.was.model_config_read
    if read is None or read.source != spec.model.uri or spec.model.config is not None:
        return {}
    return read.model_dump(by_alias=True, exclude_unset=True)


def checkpoints_block_size(change: StatusChange) -> int | None:
    """The async-I/O block size the job's checkpoints were written under, when they keep state
    in swap files: from the runtime config of the attempt that wrote them, which the job's
    ConfigMap holds until the next attempt's replaces it (every attempt since the first
    checkpoint kept the same one)."""
    if not change.was.checkpoints:
        return None
    meta = change.job["metadata"]
    data = change.cluster.configmap_data(meta["namespace"], b.configmap_name(meta["name"]))
    if not data or b.CONFIG_FILE not in data:
        return None
    try:
        plan = RuntimeConfig.model_validate_json(data[b.CONFIG_FILE]).plan
    except ValueError:
        return None
    return plan.aio.block_size if plan.uses_nvme else None
