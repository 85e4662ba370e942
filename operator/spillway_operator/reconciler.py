"""Level-triggered reconcile of one FineTuneJob: read everything, decide, act, write status.

Where this sits: called by `handlers` (the work queue's workers); reads jobs, pods
and nodes and acts through a `cluster.Cluster` (the watch caches and the API server,
or an in-memory cluster in the unit tests), writes status through
`status.StatusChange`, makes children through `children`, and calls `builders` for
every decision's shape. Starting an attempt (planning it, waiting for its inputs,
creating its children) is `starting`; the steps of a job that waits on Kueue or on a
declared pool's node are in `waits`; what every step shares (ending an attempt, settling
its cost) is in `attempts`. It keeps no state between calls but a per-job lock and a hint of which
attempts' children it created, so a restarted operator converges from whatever it
finds: child names are deterministic (`<job>-a<attempt>-<rank>`), and every decision
that moves the job to a new attempt (counting a failure or a preemption, applying a
rollback, suspending) is first committed to status with a resourceVersion
precondition and only then acted on. Killed between the two, the operator redoes
nothing it had committed and commits nothing twice.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

from spillway_operator import (
    admission,
    children,
    job_cost,
    metrics,
    model_source,
    node_pools,
    pod_outcomes,
    queueing,
    s3_inputs,
    starting,
)
from spillway_operator import builders as b
from spillway_operator.attempts import (
    PermanentFailure,
    Result,
    attempt_of,
    commit_attempt_end,
    cost_so_far,
    fail_before_pods,
    finish,
    is_active,
    may_still_write,
)
from spillway_operator.cluster import KUBE, Cluster
from spillway_operator.settings import OperatorSettings
from spillway_operator.status import StatusChange
from spillway_operator.waits import (
    check_arrived_node,
    evicted_by_kueue,
    replan_unschedulable,
    unschedulable_message,
)
from spillway_runtime.core.contract import ExitCode
from spillway_runtime.core.spec import FineTuneJobSpec, SpecError, parse_job

__all__ = ["PermanentFailure", "Result", "reconcile", "report_forbidden"]

log = logging.getLogger("spillway.operator")

MAX_PASSES = 4  # decisions chained in one call (e.g. count a failure, then start the retry)

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _job_lock(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def report_forbidden(namespace: str, name: str, err: Exception, cluster: Cluster = KUBE) -> str:
    """The operator's own RBAC refused a call. Retrying alone cannot help, so the job says
    which permission is missing (condition `Authorized=False` and a Warning Event) while the
    handler keeps retrying for when an admin grants it. Returns the message."""
    body = getattr(err, "body", None) or ""
    try:
        detail = json.loads(body).get("message", "") if body else ""
    except ValueError:
        detail = str(body)
    reason, message = "Forbidden", f"the operator is not allowed to act for this job: {detail or err} (check its RBAC)"
    if "violates PodSecurity" in detail:
        # Not RBAC: the namespace's Pod Security level refuses the pod the job needs
        reason, message = "PodSecurity", (
            f"the namespace's Pod Security level refuses this job's pod: {detail}. A job whose NVMe tier is a "
            "directory under the node's NVMe root mounts a hostPath, which only 'privileged' allows: set "
            "spec.offload.nvme.storageClassName (or the chart's operator.nvme.storageClassName) to a "
            "local-volume StorageClass, which 'restricted' allows")
    job = cluster.job(namespace, name, fresh=True)
    if job is None:
        return message
    change = StatusChange(job, datetime.now(UTC), cluster)
    old = b.condition(change.conditions, "Authorized") or {}
    change.cond("Authorized", False, reason, message)
    if old.get("message") != message:
        change.event("Warning", reason, message)
    change.commit()
    return message


def reconcile(namespace: str, name: str, settings: OperatorSettings, cluster: Cluster = KUBE) -> Result:
    """Bring one job one step closer to its spec; returns when to look again."""
    started = time.monotonic()
    try:
        with _job_lock(namespace, name):
            result = Result()
            for _ in range(MAX_PASSES):
                result = _reconcile_once(cluster, namespace, name, settings)
                if not result.again:
                    break
            return result
    except PermanentFailure:
        metrics.RECONCILE_ERRORS.labels(kind="permanent").inc()
        raise
    except Exception:
        metrics.RECONCILE_ERRORS.labels(kind="temporary").inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


def _tail_of(message: str, limit: int = 1500) -> str:
    """The end of a pod's termination message (a traceback's last lines say the most)."""
    text = " ".join(message.split())
    return text if len(text) <= limit else "..." + text[-limit:]


def _invalid(change: StatusChange, problems: list[str]) -> NoReturn:
    message = "; ".join(problems)
    change.cond(b.PHASE_FAILED, True, "InvalidSpec", message)
    change.phase(b.PHASE_FAILED, "InvalidSpec", message, warning=True)
    change.commit()
    raise PermanentFailure(message) from None


def _spec_refused(change: StatusChange, problems: list[str], current: list[dict[str, Any]],
                  settings: OperatorSettings) -> NoReturn:
    """The stored spec does not parse (an upgrade's stricter validation, a field the webhook
    does not check, a webhook that was down): Failed, naming the fields. An attempt whose pods
    live ends as a permanent pod failure ends it (cost settled in the same patch, then its
    pods stopped and its Workload finished); what is left of it, after a kill between the two,
    goes on a later pass as it does for any finished job."""
    message = "; ".join(problems)
    if change.was.phase not in b.FINISHED_PHASES and any(is_active(p) for p in current):
        finish(change, b.PHASE_FAILED, "InvalidSpec", message, current)
    else:
        change.cond(b.PHASE_FAILED, True, "InvalidSpec", message)
        change.phase(b.PHASE_FAILED, "InvalidSpec", message, warning=True)
    change.commit()
    # The queue name is in the spec that does not parse; every attempt queued in Kueue left
    # the job its Admitted condition.
    _stop(change, current, queued=settings.kueue and b.condition(change.conditions, queueing.CONDITION) is not None)
    raise PermanentFailure(message) from None


def _reconcile_once(cluster: Cluster, namespace: str, name: str, settings: OperatorSettings) -> Result:
    """One pass of the state machine: each transition below decides or passes."""
    job = cluster.job(namespace, name)
    if job is None:
        metrics.record_phase(namespace, name, None)
        return Result()
    if job["metadata"].get("deletionTimestamp"):
        return Result()
    change = StatusChange(job, datetime.now(UTC), cluster, strict=settings.strict_phases)
    # Parsed first, refused only once the pods are known: a spec that stops parsing under a
    # live attempt ends it rather than leave its pods running until someone fixes the spec.
    try:
        spec: FineTuneJobSpec | None = parse_job(job, f"{namespace}/{name}").spec
        refused: list[str] = []
    except SpecError as err:
        spec, refused = None, err.problems
    was = change.was
    phase: str = was.phase or b.PHASE_PENDING
    attempt = was.attempt
    uid = job["metadata"]["uid"]
    owned = [p for p in cluster.job_pods(namespace, name)
             if any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])]
    pods = [p for p in owned if not model_source.is_reader(p) and not s3_inputs.is_fetcher(p)]
    unstarted = phase in (b.PHASE_PENDING, b.PHASE_QUEUED, b.PHASE_PLANNED)
    if not unstarted:
        # A config reader left by a kill between its result and its deletion.
        for pod in owned:
            if model_source.is_reader(pod) and not pod["metadata"].get("deletionTimestamp"):
                cluster.delete_pod(namespace, pod["metadata"]["name"], grace_seconds=0)
    current = [p for p in pods if attempt_of(p) == attempt]
    # Fetch pods are done once their attempt's training pods exist (or the job is over)
    for fetcher in s3_inputs.leftovers(owned, attempt, bool(current) or phase in b.FINISHED_PHASES):
        cluster.delete_pod(namespace, fetcher, grace_seconds=0)
    for pod in pods:
        # Older attempts' pods that still run (a kill between commit and delete) go now.
        if attempt_of(pod) != attempt and is_active(pod) and not pod["metadata"].get("deletionTimestamp"):
            cluster.delete_pod(namespace, pod["metadata"]["name"])
    if spec is None:
        _spec_refused(change, refused, current, settings)
    if unstarted and not current and (problems := admission.spec_problems(spec, cluster=True)):
        # What the admission webhook refuses, found here for a job it did not see (created
        # while no webhook was registered): Failed with the reason before any pod, never retried.
        _invalid(change, problems)
    queue = queueing.queue_name(job, spec)
    if queue and not settings.kueue and phase in (b.PHASE_PENDING, b.PHASE_QUEUED) and not current:
        fail_before_pods(change, "QueueUnavailable", (
            f"the job asks for Kueue LocalQueue {queue!r} (spec.queueName or label {queueing.QUEUE_LABEL}) but this "
            "operator runs without Kueue: install Kueue and enable it (chart value kueue.enabled=true), or remove "
            "the queue name"))
    decided = _rollback(change, spec, current, settings)
    if decided is not None:
        return decided
    if phase in b.FINISHED_PHASES:
        return _finished(change, spec, current)
    decided = _suspend_or_resume(change, spec, phase, current, settings)
    if decided is not None:
        return decided
    return _follow_attempt(change, spec, pods, current, settings)


def _rollback(change: StatusChange, spec: FineTuneJobSpec, current: list[dict[str, Any]],
              settings: OperatorSettings) -> Result | None:
    """spec.resumeFrom names a checkpoint the runtime reported: a new attempt from it. One it
    did not report is refused by a condition and a Warning, and nothing restarts."""
    was = change.was
    if not spec.resume_from or spec.resume_from == was.applied_resume_from:
        return None
    known = [c.name for c in was.checkpoints]
    if spec.resume_from in known:
        return _start_new_attempt(
            change, spec, current, settings, reason="RollingBack",
            message=f"restarting from checkpoint {spec.resume_from}",
            extra={"appliedResumeFrom": spec.resume_from, "resumeAttempt": was.attempt + 1},
            rollback=True,
        )
    message = (
        f"spec.resumeFrom {spec.resume_from!r} is not in status.checkpoints "
        f"({', '.join(str(k) for k in known[-5:]) or 'none yet'}); nothing was restarted"
    )
    old = b.condition(change.conditions, "Rollback") or {}
    if old.get("message") != message:
        change.event("Warning", "UnknownCheckpoint", message)
    change.cond("Rollback", False, "UnknownCheckpoint", message)
    return None


def _suspend_or_resume(change: StatusChange, spec: FineTuneJobSpec, phase: str, current: list[dict[str, Any]],
                       settings: OperatorSettings) -> Result | None:
    """spec.suspend: the attempt ends (pods checkpoint on SIGTERM), counted as nothing.
    Unsuspended: Pending again, and the rest of this pass starts the next attempt."""
    if spec.suspend:
        if phase == b.PHASE_SUSPENDED and not any(is_active(p) for p in current):
            if queueing.queue_name(change.job, spec):
                queueing.release(change.cluster, change.job)  # its quota goes back until it resumes
            change.commit()
            return Result()
        change.cond(b.PHASE_SUSPENDED, True, "Suspended", "spec.suspend is true: pods stopped after checkpointing")
        change.cond(b.PHASE_RUNNING, False, "Suspended", "suspended")
        change.phase(b.PHASE_SUSPENDED, "Suspended", "spec.suspend is true; pods checkpoint on SIGTERM and stop")
        return commit_attempt_end(change, current, settings, counted=None, grace=None)
    if phase == b.PHASE_SUSPENDED:
        change.cond(b.PHASE_SUSPENDED, False, "Resumed", "spec.suspend is false: resuming from the latest checkpoint")
        change.phase(b.PHASE_PENDING, "Resumed", "resuming from the latest checkpoint")
    return None


def _follow_attempt(change: StatusChange, spec: FineTuneJobSpec, pods: list[dict[str, Any]],
                    current: list[dict[str, Any]], settings: OperatorSettings) -> Result:
    """The current attempt: judge its pods by their worst outcome, or start them once the
    previous attempt's pods have stopped writing."""
    cluster, was = change.cluster, change.was
    meta = change.job["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    attempt = was.attempt
    planned = was.plan
    ranks = planned.node_count if planned is not None else spec.resources.nodes
    if current and was.children_attempt != attempt:
        if (namespace, name, attempt) in starting.children_done:
            change.piggyback["childrenAttempt"] = attempt
        elif children.ensure_later_children(cluster, change.job, spec, settings):
            change.status["childrenAttempt"] = attempt
    else:
        starting.children_done.discard((namespace, name, attempt))
    if current:
        outcomes = [pod_outcomes.container_never_starts(p, change.now, settings.image_pull_grace_seconds)
                    or pod_outcomes.classify_pod(
                        p, cluster.node_exists(p["spec"]["nodeName"]) if p["spec"].get("nodeName") else True)
                    for p in current]
        if len(current) < ranks:
            outcomes.append(pod_outcomes.PodOutcome(pod_outcomes.OUTCOME_PENDING))
        worst = pod_outcomes.worst_outcome(outcomes)
        ended = _attempt_ended(change, spec, current, worst, settings)
        if ended is not None:
            return ended
        if queueing.queue_name(change.job, spec) and any(is_active(p) for p in current):
            ended = evicted_by_kueue(change, current, settings)
            if ended is not None:
                return ended
        live = sum(job_cost.pod_run_seconds(p, change.now) for p in current)
        return _attempt_live(change, spec, current, worst, live, ranks, settings)
    stopping = [p for p in pods if attempt_of(p) != attempt and may_still_write(cluster, p)]
    if stopping:
        # The previous attempt's pods are in their grace period, writing the stop checkpoint
        # to the volumes a new pod would mount: a rolled-back attempt started now could
        # resume from the wrong checkpoint, or see the old one's land after its own. Their
        # pod events (the exit, the deletion) wake this job again.
        log.info("%s/%s: attempt %d waits for %s to exit", namespace, name, attempt,
                 ", ".join(p["metadata"]["name"] for p in stopping))
        change.commit()
        return Result(requeue_after=settings.resync_seconds)
    return starting.start_pods(change, spec, settings)


def _start_new_attempt(
    change: StatusChange,
    spec: FineTuneJobSpec,
    pods: list[dict[str, Any]],
    settings: OperatorSettings,
    reason: str,
    message: str,
    extra: dict[str, Any],
    rollback: bool = False,
) -> Result:
    change.status.update(extra)
    change.event("Normal", reason, message)
    if rollback:
        change.cond("Rollback", True, "Applied", message)
        for type_ in (b.PHASE_SUCCEEDED, b.PHASE_FAILED, "BudgetExceeded", "Diverged"):
            if b.condition(change.conditions, type_):
                change.cond(type_, False, "RollingBack", message)
        if change.was.phase in b.FINISHED_PHASES:
            change.enter(b.PHASE_PENDING)
            change.status["finishedAt"] = None
            change.status["failures"] = 0
    return commit_attempt_end(change, pods, settings, counted=None, grace=None)


def _finished(change: StatusChange, spec: FineTuneJobSpec, pods: list[dict[str, Any]]) -> Result:
    _stop(change, pods, queued=bool(queueing.queue_name(change.job, spec)))
    meta = change.job["metadata"]
    ttl = spec.ttl_seconds_after_finished
    finished = b.parse_time(change.was.finished_at)
    if ttl is None or finished is None:
        return Result()
    remaining = (finished + timedelta(seconds=ttl) - change.now).total_seconds()
    if remaining > 0:
        return Result(requeue_after=remaining)
    change.job = change.cluster.job(meta["namespace"], meta["name"], fresh=True) or change.job
    change.cluster.post_event(
        change.job,
        "Normal",
        "Expired",
        f"ttlSecondsAfterFinished={ttl} elapsed: deleting the job",
        change.now,
    )
    change.cluster.delete_job(meta["namespace"], meta["name"])
    metrics.record_phase(meta["namespace"], meta["name"], None)
    return Result()


def _stop(change: StatusChange, pods: list[dict[str, Any]], queued: bool) -> None:
    """A finished job's attempt stops: its pods that still run go (with their grace), and its
    Workloads are Finished. On every pass, so that a kill after the job's status converges."""
    meta = change.job["metadata"]
    for pod in pods:
        if is_active(pod) and not pod["metadata"].get("deletionTimestamp"):
            change.cluster.delete_pod(meta["namespace"], pod["metadata"]["name"])
    change.commit()
    if queued:
        # Kueue releases the quota of a Finished Workload (marked on every pass until it is)
        phase = change.status.get("phase") or change.was.phase
        queueing.finish(change.cluster, change.job, phase == b.PHASE_SUCCEEDED,
                        str(change.status.get("message") or change.was.message or phase))


def _attempt_ended(change: StatusChange, spec: FineTuneJobSpec, pods: list[dict[str, Any]], worst: pod_outcomes.PodOutcome,
                   settings: OperatorSettings) -> Result | None:
    """The attempt's pods exited or lost their node: finish the job, or count the failure
    or preemption and move to the next attempt. None while the attempt lives."""
    was = change.was
    code = f" (exit code {worst.exit_code})" if worst.exit_code is not None else ""
    # The pod's own last words (its termination message: the runtime's error, or the end of
    # its log), so that `kubectl describe ftj` says why without a trip to the pod's logs.
    said = f": {_tail_of(worst.message)}" if worst.message else ""
    if worst.kind == pod_outcomes.OUTCOME_SUCCEEDED:
        # The runtime's own words when it has some (training.earlyStopping: the step and the best checkpoint)
        said_by_runtime = next((m for p in pods if (m := pod_outcomes.termination_message(p).strip())), "")
        finish(change, b.PHASE_SUCCEEDED, "Completed", _tail_of(said_by_runtime) or "training finished", pods)
        change.commit()
        return _finished(change, spec, [])
    if worst.kind == pod_outcomes.OUTCOME_PERMANENT:
        message = f"{worst.reason}{code}: {worst.message}".strip(": ")
        if worst.exit_code == ExitCode.DIVERGED:
            change.cond("Diverged", True, "Diverged", message)
        finish(change, b.PHASE_FAILED, worst.reason, message, pods)
        change.commit()
        return _finished(change, spec, pods)
    if worst.kind == pod_outcomes.OUTCOME_RETRYABLE:
        failures = was.failures + 1
        if failures > spec.backoff_limit:
            message = f"attempt failed{code} ({worst.reason}); backoffLimit {spec.backoff_limit} reached{said}"
            change.status["failures"] = failures
            finish(change, b.PHASE_FAILED, "BackoffLimitExceeded", message, pods)
            change.commit()
            return _finished(change, spec, pods)
        delay = pod_outcomes.backoff_seconds(failures, settings)
        message = (
            f"attempt {was.attempt} failed{code} ({worst.reason}); retry {failures} of "
            f"{spec.backoff_limit} in {delay:.0f} s from the latest checkpoint{said}"
        )
        change.event("Warning", "AttemptFailed", message)
        change.cond(b.PHASE_RUNNING, False, "BackingOff", message)
        change.phase(b.PHASE_PENDING, "BackingOff", message, warning=True)
        return commit_attempt_end(change, pods, settings, counted="failures", grace=None, retry_after=delay)
    if worst.kind == pod_outcomes.OUTCOME_PREEMPTED:
        message = f"{worst.reason}{code}: {worst.message}; recreating from the latest checkpoint (not counted)"
        change.event("Warning", "Preempted", message)
        change.cond(b.PHASE_RUNNING, False, worst.reason, message)
        change.phase(b.PHASE_PENDING, "Preempted", message, warning=True)
        grace = 0 if worst.reason == "NodeLost" else None
        return commit_attempt_end(change, pods, settings, counted="preemptions", grace=grace)
    return None


def _attempt_live(change: StatusChange, spec: FineTuneJobSpec, pods: list[dict[str, Any]], worst: pod_outcomes.PodOutcome,
                  live: float, ranks: int, settings: OperatorSettings) -> Result:
    """The attempt lives: its cost so far (and the budget), and Running, Scheduled or
    waiting for the scheduler (re-planned when the scheduler keeps refusing it)."""
    cost = cost_so_far(change, live)
    # Live cost changes on every reconcile of a running job: written with the next patch,
    # or on its own once `cost_update_seconds` have passed (300 running jobs would
    # otherwise patch their status on every resync).
    written = b.parse_time(change.was.cost.as_of if change.was.cost else None)
    if written is None or (change.now - written).total_seconds() >= settings.cost_update_seconds:
        change.status["cost"] = cost
    else:
        change.piggyback["cost"] = cost
    budget = spec.budget.max_cost_usd
    if budget is not None and cost["usd"] >= budget:
        message = f"cost ${cost['usd']:.2f} reached budget.maxCostUSD ${budget:.2f}; pods stopped after checkpointing"
        finish(change, b.PHASE_BUDGET_EXCEEDED, "BudgetExceeded", message, pods)
        change.commit()
        return _finished(change, spec, pods)

    if worst.kind in (pod_outcomes.OUTCOME_RUNNING, pod_outcomes.OUTCOME_SCHEDULED) and node_pools.pool_of(pods[0]):
        replanned = check_arrived_node(change, spec, pods, settings)
        if replanned is not None:
            return replanned
    if worst.kind == pod_outcomes.OUTCOME_RUNNING:
        nodes = sorted({p["spec"].get("nodeName", "") for p in pods})
        message = f"{len(pods)} pod(s) running on {', '.join(nodes)}"
        change.cond(b.PHASE_SCHEDULED, True, "Scheduled", f"bound to {', '.join(nodes)}")
        change.cond(b.PHASE_RUNNING, True, "Running", message)
        change.phase(b.PHASE_RUNNING, "Running", message)
    elif worst.kind == pod_outcomes.OUTCOME_SCHEDULED:
        nodes = sorted({p["spec"].get("nodeName", "") for p in pods if p["spec"].get("nodeName")})
        message = f"bound to {', '.join(nodes)}; waiting for the containers"
        change.cond(b.PHASE_SCHEDULED, True, "Scheduled", message)
        change.phase(b.PHASE_SCHEDULED, "Scheduled", message)
    else:
        if len(pods) < ranks:
            return starting.start_pods(change, spec, settings)
        decided = _unscheduled(change, spec, pods, settings)
        if decided is not None:
            return decided
    change.commit()
    return Result()


def _unscheduled(change: StatusChange, spec: FineTuneJobSpec, pods: list[dict[str, Any]],
                 settings: OperatorSettings) -> Result | None:
    """Every pod exists and some wait for the scheduler: re-planned if the scheduler refuses
    them while another plan fits, else Planned with why they wait (a declared pool's node the
    autoscaler is to bring up, or the scheduler's own words). None: commit and wait."""
    unscheduled = unschedulable_message(pods)
    pool = node_pools.pool_of(pods[0])
    if unscheduled and not pool:
        replanned = replan_unschedulable(change, spec, pods, unscheduled, settings)
        if replanned is not None:
            return replanned
    if pool:
        # Planned on a declared pool: the pods wait for the autoscaler to add its nodes.
        plan = change.was.plan
        waiting = (f"waiting for {len(pods)} node(s) of declared pool {pool} "
                   f"({plan.shape if plan else '?'}) to come up")
        change.cond(b.PHASE_SCHEDULED, False, "WaitingForNode",
                    f"{waiting}; the scheduler says: {unscheduled[:300]}" if unscheduled else waiting)
        unscheduled = waiting
    else:
        change.cond(
            b.PHASE_SCHEDULED,
            False,
            "Unschedulable" if unscheduled else "Pending",
            unscheduled or "waiting for the scheduler",
        )
    if change.was.phase != b.PHASE_PLANNED:
        change.phase(b.PHASE_PLANNED, "Planned", unscheduled or "pods created, waiting for the scheduler")
    return None
