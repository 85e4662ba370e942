"""Starting an attempt: plan it (not before retryAfter, not past the budget, from the model's
real shape), wait for what it needs (its claims and StorageClasses, Kueue's admission, the
s3:// inputs on its nodes), then store the plan and create its children.

Where this sits: a step of `reconciler`'s state machine, called when a job has no live pods
for its attempt; the model's config.json is read by `model_source`'s pod, placements come
from `placement`, the children from `children`, the waits on Kueue from `waits`.
"""

from __future__ import annotations

from typing import Any, NoReturn

from spillway_operator import builders as b
from spillway_operator import children, metrics, model_source, node_pools, queueing, s3_inputs
from spillway_operator.attempts import (
    PermanentFailure,
    Result,
    checkpoints_block_size,
    cost_so_far,
    fail_before_pods,
    finish,
    model_config_read,
    pricing_of,
)
from spillway_operator.placement import Placement, ShapeChoice, choose_placement, plan_status
from spillway_operator.settings import OperatorSettings
from spillway_operator.status import StatusChange
from spillway_operator.waits import queue_gate, with_flavour_pools
from spillway_runtime.core.spec import FineTuneJobSpec

INPUT_RETRY_SECONDS = 15.0
# (namespace, job, attempt) whose children this process created, not yet in status.
children_done: set[tuple[str, str, int]] = set()


def start_pods(change: StatusChange, spec: FineTuneJobSpec, settings: OperatorSettings) -> Result:
    """Plan the attempt: not before retryAfter, not past the budget, on the cheapest or
    fastest node shape that fits, with settings the runtime accepts."""
    held = _held(change, spec)
    if held is not None:
        return held
    if settings.read_model_config and model_source.needs_read(spec, change.was):
        decided = _read_model_config(change, spec, settings)
        if decided is not None:
            return decided
    read = model_config_read(change, spec)
    if spec.model.config is None and spec.model.parameter_count is None and "config" not in read:
        message = ("the operator plans from spec.model.config (the model's config.json) or "
                   "spec.model.parameterCount (e.g. 7B): give one")
        if "error" in read:
            message = (f"config.json could not be read from {read['source']}: {read['error']}; "
                       "give spec.model.config (the model's config.json) or spec.model.parameterCount (e.g. 7B)")
        _fail_planning(change, "ModelShapeRequired", message, finished=False)
    # Planned as admitted (a queued job: on its flavour's nodes) and with the flavours' pools
    spec, settings, placement, flavour_problems = _place(change, spec, settings, read)
    change.status["plan"] = plan_status(placement)
    chosen = placement.chosen
    if chosen is None or chosen.plan is None:
        metrics.PLANNING_FAILURES.inc()
        _fail_planning(change, "NoFit", "; ".join([placement.failure, *flavour_problems]))
    attempt = change.was.attempt
    resume = spec.resume_from if change.was.resume_attempt == attempt else None
    try:
        # What the pods would read, built once before anything is created: DeepSpeed settings
        # that contradict the plan or the training settings end the job here, by name, rather
        # than in a pod (or in a retry loop).
        config = b.build_runtime_config(change.job, spec, chosen.plan, resume)
    except ValueError as err:
        _fail_planning(change, "InvalidSpec", str(err))
    return _create_attempt(change, spec, settings, chosen, config)


def _held(change: StatusChange, spec: FineTuneJobSpec) -> Result | None:
    """Not yet (a retry's backoff runs until retryAfter), or never (the settled cost reached
    the budget: the job ends BudgetExceeded); None: plan now."""
    retry_at = b.parse_time(change.was.retry_after)
    if retry_at is not None and retry_at > change.now:
        change.commit()
        return Result(requeue_after=(retry_at - change.now).total_seconds())
    budget = spec.budget.max_cost_usd
    settled = (change.was.cost.settled_usd if change.was.cost else None) or 0.0
    if budget is not None and settled >= budget:
        finish(change, b.PHASE_BUDGET_EXCEEDED, "BudgetExceeded", f"settled cost ${settled:.2f} >= budget", [])
        change.commit()
        return Result()
    return None


def _place(change: StatusChange, spec: FineTuneJobSpec, settings: OperatorSettings, read: dict[str, Any],
           ) -> tuple[FineTuneJobSpec, OperatorSettings, Placement, list[str]]:
    """The placement on the nodes that exist (a fresh list before "fits nowhere", which is
    final), else on the declared pools' template nodes for the autoscaler to bring up; with
    why the queue's flavours' pools could not be used, if they could not. The attempt is made
    with the spec and settings it was planned with: a queued job's spec as Kueue admitted it
    (its flavour's node selector), the settings with the flavours' pools."""
    pricing = pricing_of(change.cluster, settings)
    block = checkpoints_block_size(change)
    if queueing.queue_name(change.job, spec):
        # Admitted: planned on the nodes of the flavour Kueue assigned
        spec = queueing.admitted_spec(change.cluster, change.job, spec)
    placement = choose_placement(spec, change.cluster.nodes(), pricing, settings, read, block)
    if placement.chosen is None or placement.chosen.plan is None:
        # The cache may not hold a node created a moment ago: "fits nowhere" is final, so
        # it is decided on a fresh LIST.
        placement = choose_placement(spec, change.cluster.nodes(fresh=True), pricing, settings, read, block)
    flavour_problems: list[str] = []
    if placement.chosen is None or placement.chosen.plan is None:
        settings, flavour_problems = with_flavour_pools(change, settings)
    if (placement.chosen is None or placement.chosen.plan is None) and settings.node_pools:
        # No node that exists fits: the declared pools' template nodes, for the autoscaler to bring up
        placement = choose_placement(spec, [*change.cluster.nodes(), *node_pools.template_nodes(settings.node_pools)],
                                     pricing, settings, read, block)
    return spec, settings, placement, flavour_problems


def _fail_planning(change: StatusChange, reason: str, message: str, finished: bool = True) -> NoReturn:
    """The attempt cannot start and no retry would help: Planned false, Failed, said once."""
    change.cond(b.PHASE_PLANNED, False, reason, message)
    change.cond(b.PHASE_FAILED, True, reason, message)
    change.phase(b.PHASE_FAILED, reason, message, warning=True)
    if finished:
        change.status["finishedAt"] = b.rfc3339(change.now)
    change.commit()
    raise PermanentFailure(message) from None


def _read_model_config(change: StatusChange, spec: FineTuneJobSpec, settings: OperatorSettings) -> Result | None:
    """Start, follow and collect the pod that reads the model's config.json from its claim.
    None once status.modelConfig holds the answer (a config or why there is none): plan on."""
    meta = change.job["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    uri = spec.model.uri
    claim = model_source.claim_of(uri)
    if not change.cluster.pvc_exists(namespace, claim):
        return _wait_for_inputs(change, f"PersistentVolumeClaim {claim!r} (from spec.model.uri) does not exist "
                                        f"in {namespace}")
    uid = meta["uid"]
    pod = next((p for p in change.cluster.job_pods(namespace, name) if model_source.is_reader(p)
                and any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])), None)
    if pod is None or pod["metadata"].get("deletionTimestamp"):
        if pod is None and change.cluster.create(model_source.build_reader_pod(change.job, spec, settings)) is not None:
            message = f"reading config.json from {uri} in pod {model_source.pod_name(name)} before planning"
            change.cond(model_source.CONDITION, False, "Reading", message)
            change.event("Normal", "ReadingModelConfig", message)
            change.commit()
        return Result(requeue_after=min(30.0, settings.model_config_timeout_seconds))
    result = model_source.outcome(pod, uri)
    if result is None:
        created = b.parse_time(pod["metadata"].get("creationTimestamp")) or change.now
        waited = (change.now - created).total_seconds()
        if waited < settings.model_config_timeout_seconds:
            return Result(requeue_after=min(30.0, settings.model_config_timeout_seconds - waited + 1))
        result = {"source": uri, "error": f"not read within {settings.model_config_timeout_seconds} s "
                                          f"({model_source.pending_reason(pod)})"}
    change.status["modelConfig"] = result
    if "config" in result:
        change.cond(model_source.CONDITION, True, "Read", f"config.json read from {uri}")
    else:
        change.cond(model_source.CONDITION, False, "Unreadable", f"{uri}: {result['error']}")
        change.event("Warning", "ModelConfigUnreadable", f"config.json from {uri}: {result['error']}")
    change.commit()
    change.cluster.delete_pod(namespace, pod["metadata"]["name"], grace_seconds=0)
    return None


def _wait_for_inputs(change: StatusChange, message: str) -> Result:
    """A claim or StorageClass the job names does not exist (yet): an InputsReady condition and
    a Warning when that changes, and, where `kubectl get` looks, a new job's phase Pending with
    the message, rather than no phase at all. Retried until the admin makes them."""
    if (b.condition(change.conditions, "InputsReady") or {}).get("message") != message:
        change.event("Warning", "InputsMissing", message)
    change.cond("InputsReady", False, "InputsMissing", message)
    if not change.was.phase:
        change.enter(b.PHASE_PENDING)
    if change.status.get("phase") == b.PHASE_PENDING:
        change.status["message"] = f"waiting for inputs: {message}"
    change.commit()
    return Result(requeue_after=INPUT_RETRY_SECONDS)


def _create_attempt(change: StatusChange, spec: FineTuneJobSpec, settings: OperatorSettings, chosen: ShapeChoice,
                    config: Any) -> Result:
    """The plan is made: once every input exists, store it and create the attempt's children."""
    namespace = change.job["metadata"]["namespace"]
    attempt = change.was.attempt
    plan = chosen.plan
    assert plan is not None
    missing = children.missing_inputs(change.cluster, namespace, spec, plan, settings)
    if missing:
        return _wait_for_inputs(change, "; ".join(missing))
    if b.condition(change.conditions, "InputsReady"):
        change.cond("InputsReady", True, "Found", "every PVC and StorageClass the job names exists")
    queue = queueing.queue_name(change.job, spec)
    if queue:
        waiting = queue_gate(change, spec, queue, chosen, settings)
        if waiting is not None:
            return waiting
    fetch = s3_inputs.progress(change, spec, sorted(chosen.nodes), attempt, settings)
    if fetch.failure is not None:
        fail_before_pods(change, "InputsUnreadable", fetch.failure)
    if not fetch.done:
        change.commit()
        return Result(requeue_after=fetch.requeue_after)

    message = (
        f"{plan.label} on {chosen.shape} ({len(chosen.nodes)} node(s)); predicted "
        f"{plan.predicted_step_seconds:.3g} s/step, ${plan.predicted_cost_usd or 0:.2f}"
    )
    change.status["plan"]["attempt"] = attempt
    change.cond(b.PHASE_PLANNED, True, "Planned", message)
    change.cond(b.PHASE_SCHEDULED, False, "Pending", "pods created, waiting for the scheduler")
    change.status["retryAfter"] = None
    # Pending as stored, or as this reconcile just decided (a resumed job).
    if change.status.get("phase", change.was.phase) in (None, b.PHASE_PENDING, b.PHASE_QUEUED):
        change.phase(b.PHASE_PLANNED, "Planned", message)
    change.status.setdefault("cost", cost_so_far(change, 0.0))
    # The plan is stored before any child exists: killed after this line, the next
    # reconcile re-creates the same children under the same names. Its Events wait until
    # the pods exist: nothing that is not needed first stands before them.
    change.commit(post_events=False)
    try:
        created = children.create_children(change.cluster, change.job, spec, chosen, attempt, config, settings)
        if created:
            _say_created(change, f"attempt {attempt}: created {', '.join(created)}")
    finally:
        change.post_events()
    if (b.condition(change.conditions, "Authorized") or {}).get("status") == "False":
        change.cond("Authorized", True, "Allowed", "the operator's RBAC allows every call this job needs")
    # Every child exists. Status says so with the next patch that happens anyway (Scheduled,
    # Running); until then this process remembers. A restart in between re-checks them
    # (children.ensure_later_children).
    children_done.add((namespace, change.job["metadata"]["name"], attempt))
    change.piggyback["childrenAttempt"] = attempt
    change.commit()
    return Result()


def _say_created(change: StatusChange, pods: str) -> None:
    """One Event, not two, when this call also moved the job to Planned (the usual case)."""
    for i, (type_, reason, text) in enumerate(change.events):
        if reason == "Planned":
            change.events[i] = (type_, reason, f"{text}; {pods}")
            return
    change.event("Normal", "PodsCreated", pods)
