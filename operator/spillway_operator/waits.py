"""A job that waits on something outside it: Kueue's admission of its Workload (and Kueue
taking it back), and the nodes of a declared pool the autoscaler is to bring up (or that
never come, or come unlike their template: then it is planned again).

Where this sits: steps of `reconciler`'s state machine, each returning None when it has
nothing to decide; queue objects go through `queueing`, pool templates through
`node_pools`, the end of an attempt through `attempts`.
"""

from __future__ import annotations

import logging
from typing import Any

from kubernetes.client.exceptions import ApiException

from spillway_operator import builders as b
from spillway_operator import node_pools, pod_specs, queueing
from spillway_operator.attempts import (
    Result,
    checkpoints_block_size,
    commit_attempt_end,
    fail_before_pods,
    may_still_write,
    model_config_read,
    pricing_of,
)
from spillway_operator.placement import choose_placement
from spillway_operator.settings import OperatorSettings
from spillway_operator.status import StatusChange
from spillway_runtime.core.hardware import ANNOTATIONS, hardware_from_node
from spillway_runtime.core.spec import FineTuneJobSpec

log = logging.getLogger("spillway.operator")

QUEUE_RECHECK_SECONDS = 30.0  # a queued job's place in its queue, between its Workload's own events


def evicted_by_kueue(change: StatusChange, pods: list[dict[str, Any]], settings: OperatorSettings) -> Result | None:
    """Kueue took the running job's quota back (a preemption, a stopped queue) or its Workload
    went: the attempt ends as a suspension does (pods checkpoint on SIGTERM, nothing is
    counted) and the job waits Queued for Kueue to admit it again."""
    wl = queueing.current_workload(change.cluster, change.job)
    if queueing.admitted(wl):
        return None
    ev = queueing.evicted(wl)
    why = (f"{ev.get('reason')}: {ev.get('message')}" if ev else
           "its Workload is gone" if wl is None else "its Workload lost its admission")
    message = f"evicted by Kueue ({why}); pods checkpoint and stop, and the job waits to be admitted again"
    change.event("Warning", "Evicted", message)
    change.cond(queueing.CONDITION, False, "Evicted", message)
    change.cond(b.PHASE_RUNNING, False, "Evicted", message)
    change.phase(b.PHASE_QUEUED, "Evicted", message, warning=True)
    return commit_attempt_end(change, pods, settings, counted=None, grace=None)


def queue_gate(change: StatusChange, spec: FineTuneJobSpec, queue: str, chosen: Any,
                settings: OperatorSettings) -> Result | None:
    """A queued job's pods start only once Kueue admitted its Workload for this plan; None
    when they may, else the job waits Queued (woken by its Workload's events)."""
    plan = chosen.plan
    meta = change.job["metadata"]
    cluster = change.cluster
    pod = pod_specs.build_pod(change.job, spec, chosen, change.was.attempt, 0, settings)
    nvme = b.nvme_volume_bytes(spec, plan, settings) if plan.uses_nvme else 0
    writing = any(may_still_write(cluster, p) for p in cluster.job_pods(meta["namespace"], meta["name"]))
    try:
        gate = queueing.gate(cluster, change.job, queue, pod, plan.nodes, nvme, writing)
    except ApiException as err:
        if err.status != 404:
            raise
        fail_before_pods(change, "QueueUnavailable", (
            f"Kueue's Workload API ({queueing.API_VERSION}) is not served by this cluster: install Kueue, or "
            f"remove spec.queueName / label {queueing.QUEUE_LABEL} ({queue!r})"))
    old = b.condition(change.conditions, queueing.CONDITION) or {}
    if gate.admitted:
        change.cond(queueing.CONDITION, True, "Admitted", gate.message)
        if old.get("status") != "True":
            change.event("Normal", "Admitted", gate.message)
        return None
    change.cond(queueing.CONDITION, False, gate.reason, gate.message)
    change.cond(b.PHASE_SCHEDULED, False, "Queued", "waiting for Kueue to admit the job")
    change.phase(b.PHASE_QUEUED, gate.reason, gate.message)
    change.commit()
    return Result(requeue_after=QUEUE_RECHECK_SECONDS)


def replan_unschedulable(
    change: StatusChange,
    spec: FineTuneJobSpec,
    pods: list[dict[str, Any]],
    unscheduled: str,
    settings: OperatorSettings,
) -> Result | None:
    """Pods pinned to a node set the scheduler refuses, while a plan on today's nodes would
    pin them elsewhere (nodes that were NotReady at planning time are back, new nodes came):
    replace them with a new attempt, counted as neither a failure nor a preemption. The
    same node set again (every node of the shape is simply busy) changes nothing."""
    created = [b.parse_time(p["metadata"].get("creationTimestamp")) for p in pods]
    oldest = min((t for t in created if t is not None), default=None)
    if oldest is None or (change.now - oldest).total_seconds() < settings.replan_pending_seconds:
        return None
    placement = choose_placement(spec, change.cluster.nodes(), pricing_of(change.cluster, settings), settings,
                                 model_config_read(change, spec), checkpoints_block_size(change))
    old_plan = change.was.plan
    chosen = placement.chosen
    if chosen is None or chosen.plan is None or (old_plan and sorted(chosen.nodes) == old_plan.node_names):
        return None
    message = (
        f"pods unschedulable for {(change.now - oldest).total_seconds():.0f} s on {old_plan and old_plan.shape} "
        f"({unscheduled[:300]}); re-planning onto {chosen.shape} ({len(chosen.nodes)} node(s))"
    )
    change.event("Normal", "Replanned", message)
    change.cond(b.PHASE_SCHEDULED, False, "Replanned", message)
    change.phase(b.PHASE_PENDING, "Replanned", message)
    return commit_attempt_end(change, pods, settings, counted="replans", grace=0)


def check_arrived_node(change: StatusChange, spec: FineTuneJobSpec, pods: list[dict[str, Any]],
                        settings: OperatorSettings) -> Result | None:
    """Pods planned on a declared pool's template are on a real node now: once the node probe
    has measured it, its hardware must be the template's. If it is not (another GPU, less
    RAM or NVMe), the job is planned again on the nodes there are, and a different plan
    replaces the attempt (the pods checkpoint first), counted as a re-plan."""
    nodes = {n["metadata"]["name"]: n for n in change.cluster.nodes()}
    arrived = [nodes[p["spec"]["nodeName"]] for p in pods if p["spec"].get("nodeName") in nodes]
    probed = [n for n in arrived if any(k in (n["metadata"].get("annotations") or {}) for k in ANNOTATIONS)]
    if not probed:
        return None  # the node probe has not measured the node yet
    pool = node_pools.find(settings.node_pools, node_pools.pool_of(pods[0]))
    if pool is None:  # a ResourceFlavor's
        settings, _ = with_flavour_pools(change, settings)
        pool = node_pools.find(settings.node_pools, node_pools.pool_of(pods[0]))
    if pool is None:
        return None  # the pool is no longer declared
    declared = hardware_from_node(node_pools.template_nodes([pool])[0]).shape_key()
    differs = {n["metadata"]["name"]: hardware_from_node(n).shape_key() for n in probed}
    differs = {name: shape for name, shape in differs.items() if shape != declared}
    if not differs:
        return None
    placement = choose_placement(spec, change.cluster.nodes(), pricing_of(change.cluster, settings), settings,
                                 model_config_read(change, spec), checkpoints_block_size(change))
    old_plan = change.was.plan
    chosen = placement.chosen
    if chosen is not None and chosen.plan is not None and old_plan is not None and \
            chosen.plan.label == old_plan.label and set(differs) <= set(chosen.nodes):
        return None  # the same plan on the node that came: nothing to change
    found = ", ".join(f"{name} is {shape}" for name, shape in sorted(differs.items()))
    message = (f"node(s) of declared pool {pool.name} came up unlike its template {declared} ({found}): "
               f"re-planning on the nodes there are")
    change.event("Normal", "Replanned", message)
    change.cond(b.PHASE_SCHEDULED, False, "Replanned", message)
    change.phase(b.PHASE_PENDING, "Replanned", message)
    return commit_attempt_end(change, pods, settings, counted="replans", grace=None)


def with_flavour_pools(change: StatusChange, settings: OperatorSettings) -> tuple[OperatorSettings, list[str]]:
    """The settings with the node pools Kueue's ResourceFlavors declare (annotated with
    their node shape) after the chart's, and why an annotated flavour was left out."""
    if not settings.kueue:
        return settings, []
    try:
        pools, problems = queueing.flavour_pools(change.cluster, settings.node_pools)
    except ApiException as err:
        if err.status in (403, 404):  # Kueue not installed, or no RBAC to list flavours
            return settings, []
        raise
    for problem in problems:
        log.warning("%s", problem)
    if not pools:
        return settings, problems
    return settings.model_copy(update={"node_pools": [*settings.node_pools, *pools]}), problems


def unschedulable_message(pods: list[dict[str, Any]]) -> str:
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("message"):
                return str(c["message"])
    return ""
