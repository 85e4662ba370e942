"""Kueue: a FineTuneJob with a queue starts no pod until Kueue admits its Workload.

Where this sits: called by `reconciler` at three points of a queued job's life (before
its plan is made, before its pods are created, while they run) and when it finishes or
is suspended; reads and writes Kueue's objects through the reconciler's `Cluster`.

Kueue (kueue.x-k8s.io/v1beta2) is integrated the way its own job integrations are, from
outside its code base (Kueue's `integrations.externalFrameworks`):

- The operator owns one Workload per job and plan request, named after both
  (`<job>-kueue-<hash of the pod set>`); its one pod set `trainer` has one pod per
  planned node with the pod's requests (GPUs, CPU, memory including the planned
  CPU-RAM tier) plus the NVMe the plan spills to as `ephemeral-storage`. Kueue admits
  the whole count or nothing: a multi-node job is one gang.
- Admitted, the job is re-planned on the nodes of the assigned ResourceFlavor (its
  nodeLabels join spec.resources.nodeSelector, its tolerations the job's) and its pods
  start if that plan fits in what was admitted; if it needs more, the Workload is
  replaced by one asking for that (which Kueue queues again).
- Evicted (preempted, the queue stopped, ...), the attempt ends as a suspension does
  (SIGTERM, checkpoint, exit 75, nothing counted); once no pod of it may still write,
  the operator clears the Workload's quota reservation as Kueue's own integrations do
  (QuotaReserved False, status.admission unset, Requeued) and Kueue queues it again.
  Re-admitted, the next attempt resumes from the latest checkpoint.
- Finished, the Workload is marked Finished (Kueue releases the quota); suspended
  (spec.suspend), it is deleted once the pods are gone, and made anew on resume.
- A ResourceFlavor says which nodes, not what they hold; one annotated with
  `spillway.dev/node-shape` (the node pool fields of the chart's nodePools: GPUs, CPU,
  RAM, NVMe, price, maxNodes) is also a declared node pool (`flavour_pools`), its
  nodeLabels and nodeTaints the pool's, so a flavour whose nodes scale from zero is
  planned on like the chart's pools.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes.utils import parse_quantity
from pydantic import ValidationError

from spillway_operator import builders as b
from spillway_operator.cluster import Cluster
from spillway_operator.node_pools import NodePool
from spillway_runtime.core.spec import FineTuneJobSpec, Toleration

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
WORKLOADS = "workloads"
QUEUE_LABEL = f"{GROUP}/queue-name"
PRIORITY_LABEL = f"{GROUP}/priority-class"
POD_SET = "trainer"
CONDITION = "Admitted"  # the job's condition: whether Kueue admitted it, and why not
EPHEMERAL = "ephemeral-storage"
SHAPE_ANNOTATION = "spillway.dev/node-shape"  # on a ResourceFlavor: its nodes' shape, a declared pool


class QueueUnavailable(Exception):
    """The job asks for a queue the operator cannot use (Kueue off or not installed)."""


def queue_name(job: dict[str, Any], spec: FineTuneJobSpec) -> str | None:
    return spec.queue_name or ((job["metadata"].get("labels") or {}).get(QUEUE_LABEL)) or None


def _cond(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return b.condition(((obj or {}).get("status") or {}).get("conditions") or [], type_)


def _true(obj: dict[str, Any] | None, type_: str) -> bool:
    return (_cond(obj, type_) or {}).get("status") == "True"


def admitted(wl: dict[str, Any] | None) -> bool:
    """Admitted and not being evicted: pods may run."""
    return (wl is not None and _true(wl, "Admitted") and bool((wl.get("status") or {}).get("admission"))
            and not _true(wl, "Evicted") and not _true(wl, "Finished"))


def reserved(wl: dict[str, Any] | None) -> bool:
    return wl is not None and bool((wl.get("status") or {}).get("admission"))


def evicted(wl: dict[str, Any] | None) -> dict[str, Any] | None:
    cond = _cond(wl, "Evicted")
    return cond if cond and cond.get("status") == "True" else None


# ------------------------------------------------------------------ objects --


def pod_set(pod: dict[str, Any], count: int, nvme_bytes: int) -> dict[str, Any]:
    """Kueue's view of a training pod: its requests (the NVMe it spills to as
    ephemeral-storage), node selector and tolerations; node pinning is the operator's own."""
    container = pod["spec"]["containers"][0]
    requests = dict((container.get("resources") or {}).get("requests") or {})
    if nvme_bytes:
        requests[EPHEMERAL] = str(nvme_bytes)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{"name": container["name"], "image": container["image"], "resources": {"requests": requests}}],
    }
    for key in ("nodeSelector", "tolerations"):
        if pod["spec"].get(key):
            spec[key] = pod["spec"][key]
    return {"name": POD_SET, "count": count, "template": {"spec": spec}}


def workload_name(job: str, podset: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(podset, sort_keys=True).encode()).hexdigest()[:8]
    return b.child_name(job, f"kueue-{digest}")


def build_workload(job: dict[str, Any], queue: str, podset: dict[str, Any],
                   priority: tuple[str, int] | None) -> dict[str, Any]:
    name = job["metadata"]["name"]
    wl: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": b.child_meta(job, workload_name(name, podset), "workload"),
        "spec": {"queueName": queue, "podSets": [podset]},
    }
    if priority is not None:
        wl["spec"]["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": priority[0]}
        wl["spec"]["priority"] = priority[1]
    return wl


def fits_within(podset: dict[str, Any], wl: dict[str, Any]) -> bool:
    """The pod set asks for no more pods and no more of any resource per pod than `wl` holds."""
    held = next((p for p in wl["spec"]["podSets"] if p["name"] == POD_SET), None)
    if held is None or int(held["count"]) != int(podset["count"]):
        return False
    have = held["template"]["spec"]["containers"][0]["resources"].get("requests") or {}
    want = podset["template"]["spec"]["containers"][0]["resources"].get("requests") or {}
    return all(k in have and parse_quantity(v) <= parse_quantity(have[k]) for k, v in want.items())


def owned_workloads(cluster: Cluster, job: dict[str, Any]) -> list[dict[str, Any]]:
    meta = job["metadata"]
    return [w for w in cluster.kueue_list(WORKLOADS, meta["namespace"], f"{b.LABEL_JOB}={meta['name']}")
            if any(o.get("uid") == meta["uid"] for o in w["metadata"].get("ownerReferences") or [])]


def current_workload(cluster: Cluster, job: dict[str, Any]) -> dict[str, Any] | None:
    """The job's Workload that holds (or last held) quota, else its newest."""
    live = [w for w in owned_workloads(cluster, job) if not w["metadata"].get("deletionTimestamp")
            and not _true(w, "Finished")]
    live.sort(key=lambda w: (reserved(w), w["metadata"].get("creationTimestamp") or ""))
    return live[-1] if live else None


# ---------------------------------------------------------------- admission --


def flavor_constraints(cluster: Cluster, wl: dict[str, Any]) -> tuple[dict[str, str], list[dict[str, Any]], list[str]]:
    """The node labels and tolerations of the ResourceFlavors Kueue assigned, and their names."""
    labels: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    names: list[str] = []
    for assignment in (wl["status"]["admission"].get("podSetAssignments") or []):
        for flavor_name in sorted(set((assignment.get("flavors") or {}).values())):
            flavor = cluster.kueue_get("resourceflavors", flavor_name) or {}
            names.append(flavor_name)
            labels.update((flavor.get("spec") or {}).get("nodeLabels") or {})
            tolerations.extend((flavor.get("spec") or {}).get("tolerations") or [])
    return labels, tolerations, names


def admitted_spec(cluster: Cluster, job: dict[str, Any], spec: FineTuneJobSpec) -> FineTuneJobSpec:
    """`spec` restricted to the nodes of the flavour Kueue admitted the job's Workload on
    (none admitted: `spec` as it is)."""
    wl = current_workload(cluster, job)
    if not admitted(wl):
        return spec
    assert wl is not None
    labels, tolerations, _ = flavor_constraints(cluster, wl)
    if not labels and not tolerations:
        return spec
    resources = spec.resources.model_copy(update={
        "node_selector": {**spec.resources.node_selector, **labels},
        "tolerations": [*spec.resources.tolerations, *(Toleration.model_validate(t) for t in tolerations)],
    })
    return spec.model_copy(update={"resources": resources})


def flavour_pools(cluster: Cluster, declared: list[NodePool]) -> tuple[list[NodePool], list[str]]:
    """The ResourceFlavors annotated with `spillway.dev/node-shape` as declared node pools
    (named after the flavour, after the chart's pools of the same name), and why any
    annotated flavour could not be one."""
    pools: list[NodePool] = []
    problems: list[str] = []
    names = {p.name for p in declared}
    for flavor in cluster.kueue_list("resourceflavors", None, None):
        meta = flavor["metadata"]
        raw = (meta.get("annotations") or {}).get(SHAPE_ANNOTATION)
        if raw is None or meta["name"] in names:
            continue
        where = f"ResourceFlavor {meta['name']}'s annotation {SHAPE_ANNOTATION}"
        spec = flavor.get("spec") or {}
        try:
            shape = json.loads(raw)
            if not isinstance(shape, dict):
                raise ValueError("not a JSON object")
            for key in ("name", "labels", "taints"):
                if key in shape:
                    raise ValueError(f"{key!r} comes from the flavour (its name, nodeLabels, nodeTaints): remove it")
            pools.append(NodePool.model_validate({
                **shape, "name": meta["name"], "labels": spec.get("nodeLabels") or {},
                "taints": [{k: str(v) for k, v in t.items() if k in ("key", "value", "effect")}
                           for t in spec.get("nodeTaints") or []]}))
        except ValidationError as err:
            fields = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'value'}: {e['msg']}" for e in err.errors())
            problems.append(f"{where} is not a node shape ({fields})"
                            + (" — the flavour needs spec.nodeLabels for its pods to select" if "labels" in fields
                               else ""))
        except ValueError as err:
            problems.append(f"{where} is not a node shape: {err}")
    return pools, problems


def _priority(cluster: Cluster, job: dict[str, Any]) -> tuple[str, int] | None:
    name = (job["metadata"].get("labels") or {}).get(PRIORITY_LABEL)
    if not name:
        return None
    found = cluster.kueue_get("workloadpriorityclasses", name)
    if found is None:
        raise LookupError(f"WorkloadPriorityClass {name!r} (label {PRIORITY_LABEL}) does not exist; create it "
                          "or remove the label")
    return name, int(found.get("value") or 0)


@dataclass
class Gate:
    """What the queue says about starting pods now."""

    admitted: bool
    message: str
    reason: str = "Queued"
    flavors: tuple[str, ...] = ()
    cluster_queue: str = ""


def gate(cluster: Cluster, job: dict[str, Any], queue: str, pod: dict[str, Any], count: int, nvme_bytes: int,
         may_still_write: bool) -> Gate:
    """Make sure the job's Workload asks for this plan's pods and say whether they may start:
    admitted with room for them (start), or why not (and where in the queue it waits)."""
    podset = pod_set(pod, count, nvme_bytes)
    name = job["metadata"]["name"]
    ns = job["metadata"]["namespace"]
    mine = owned_workloads(cluster, job)
    wl = current_workload(cluster, job)
    ev = evicted(wl)
    if wl is not None and ev is not None and reserved(wl):
        # Evicted: the quota goes back once nothing of the attempt may still write.
        if may_still_write:
            return Gate(False, f"evicted by Kueue ({ev.get('reason')}: {ev.get('message')}); waiting for the pods "
                               "to checkpoint and exit", reason="Evicted")
        release_reservation(cluster, wl, ev)
        return Gate(False, f"evicted by Kueue ({ev.get('reason')}: {ev.get('message')}); queued again",
                    reason="Evicted")
    if wl is not None and not fits_within(podset, wl):
        wl = None  # asks for less than this plan needs: replaced below
    try:
        priority = _priority(cluster, job)
    except LookupError as err:
        return Gate(False, str(err), reason="PriorityClassMissing")
    for other in mine:
        if (wl is None or other["metadata"]["name"] != wl["metadata"]["name"]) and not _true(other, "Finished") \
                and not other["metadata"].get("deletionTimestamp"):
            cluster.delete_kueue(WORKLOADS, ns, other["metadata"]["name"])
    if wl is None:
        wl = build_workload(job, queue, podset, priority)
        cluster.create(wl)
        return Gate(False, f"Workload {wl['metadata']['name']} created in LocalQueue {queue}; waiting for Kueue")
    if admitted(wl):
        _, _, flavors = flavor_constraints(cluster, wl)
        cq = str(wl["status"]["admission"].get("clusterQueue", ""))
        return Gate(True, f"admitted by ClusterQueue {cq} on flavor {', '.join(flavors) or '-'}",
                    reason="Admitted", flavors=tuple(flavors), cluster_queue=cq)
    return Gate(False, _waiting_message(cluster, ns, queue, wl, name))


def _waiting_message(cluster: Cluster, namespace: str, queue: str, wl: dict[str, Any], job: str) -> str:
    """Where the Workload waits: its LocalQueue and ClusterQueue, its place among the pending
    Workloads of that LocalQueue in Kueue's order (priority, then time queued), and Kueue's reason."""
    local = cluster.kueue_get("localqueues", queue, namespace)
    where = f"LocalQueue {queue}"
    if local is None:
        where += " (which does not exist in this namespace: create it or fix spec.queueName)"
    else:
        where += f" (ClusterQueue {(local.get('spec') or {}).get('clusterQueue', '?')})"
    pending = [w for w in cluster.kueue_list(WORKLOADS, namespace, None)
               if (w.get("spec") or {}).get("queueName") == queue and not reserved(w) and not _true(w, "Finished")
               and (w.get("spec") or {}).get("active", True) is not False]

    def order(w: dict[str, Any]) -> tuple[int, str]:
        queued_at = (_cond(w, "Requeued") or {}).get("lastTransitionTime") or w["metadata"].get("creationTimestamp")
        return -int((w.get("spec") or {}).get("priority") or 0), str(queued_at or "")

    pending.sort(key=order)
    names = [w["metadata"]["name"] for w in pending]
    place = (f", position {names.index(wl['metadata']['name']) + 1} of {len(names)} pending there"
             if wl["metadata"]["name"] in names else "")
    said = (_cond(wl, "QuotaReserved") or {}).get("message") or "not yet considered by Kueue"
    return f"waiting in {where}{place}: {said}"


def release_reservation(cluster: Cluster, wl: dict[str, Any], ev: dict[str, Any]) -> None:
    """After an eviction, once the job's pods are gone: give the quota back and queue the
    Workload again, as Kueue's own job integrations do (QuotaReserved False, admission unset,
    Requeued True after a preemption)."""
    now = datetime.now(UTC)
    generation = int(wl["metadata"].get("generation") or 1)
    conditions = list((wl.get("status") or {}).get("conditions") or [])

    def put(type_: str, status: bool, reason: str, message: str) -> None:
        nonlocal conditions
        conditions = b.set_condition(conditions, type_, status, reason, message, generation, now)

    message = str(ev.get("message") or "evicted")
    put("Requeued", ev.get("reason") in ("Preempted", "NodeFailures"), str(ev.get("reason") or "Evicted"), message)
    put("QuotaReserved", False, "Pending", message)
    if _cond(wl, "Admitted"):
        put("Admitted", False, "NoReservation", "The workload has no reservation")
    cluster.patch_kueue(WORKLOADS, wl["metadata"]["namespace"], wl["metadata"]["name"], {
        "metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]},
        "status": {"admission": None, "conditions": conditions},
    }, status=True)


def finish(cluster: Cluster, job: dict[str, Any], succeeded: bool, message: str) -> None:
    """The job is over: its Workloads are Finished, and Kueue releases their quota."""
    for wl in owned_workloads(cluster, job):
        if _true(wl, "Finished"):
            continue
        conditions = b.set_condition(list((wl.get("status") or {}).get("conditions") or []), "Finished", True,
                                     "Succeeded" if succeeded else "Failed", message[:1000],
                                     int(wl["metadata"].get("generation") or 1), datetime.now(UTC))
        # The whole list (a merge patch replaces it), so only if Kueue has not changed it since
        cluster.patch_kueue(WORKLOADS, wl["metadata"]["namespace"], wl["metadata"]["name"], {
            "metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]},
            "status": {"conditions": conditions}}, status=True)


def release(cluster: Cluster, job: dict[str, Any]) -> None:
    """Suspended and stopped: the Workloads go, and their quota with them."""
    for wl in owned_workloads(cluster, job):
        if not wl["metadata"].get("deletionTimestamp"):
            cluster.delete_kueue(WORKLOADS, wl["metadata"]["namespace"], wl["metadata"]["name"])
