"""A FineTuneJob under Kueue, against the in-memory cluster: the Workload the operator owns,
the job waiting Queued (with its place in the queue), admission on a flavour, eviction
as a suspension with the quota handed back, and Finished. Kueue itself is played here by
writing what it writes (status.admission and the conditions); tests/e2e/test_kueue.py
runs the same against a real Kueue."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from spillway_operator import builders as b
from spillway_operator import queueing
from spillway_operator.reconciler import PermanentFailure, reconcile
from spillway_operator.settings import OperatorSettings

from .fake_cluster import FakeCluster
from .test_reconciler import NS, reasons, status, world

KUEUE = OperatorSettings(backoff_base_seconds=10, backoff_max_seconds=60, read_model_config=False, kueue=True)


def step(cluster: FakeCluster, name: str = "j") -> Any:
    return reconcile(NS, name, KUEUE, cluster)


def workloads(cluster: FakeCluster) -> list[dict[str, Any]]:
    return cluster.kueue_list(queueing.WORKLOADS, NS, None)


def the_workload(cluster: FakeCluster) -> dict[str, Any]:
    [wl] = [w for w in workloads(cluster) if not queueing._true(w, "Finished")]
    return wl


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def _set(wl: dict[str, Any], conds: list[tuple[str, bool, str, str]]) -> list[dict[str, Any]]:
    out = list((wl.get("status") or {}).get("conditions") or [])
    for type_, value, reason, message in conds:
        out = b.set_condition(out, type_, value, reason, message, 1, datetime.now(UTC))
    return out


def admit(cluster: FakeCluster, flavor: str = "default", cq: str = "gpus") -> None:
    """What Kueue's scheduler writes when it admits the Workload."""
    wl = the_workload(cluster)
    resources = wl["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    admission = {"clusterQueue": cq, "podSetAssignments": [
        {"name": "trainer", "count": wl["spec"]["podSets"][0]["count"], "flavors": dict.fromkeys(resources, flavor)}]}
    cluster.patch_kueue("workloads", NS, wl["metadata"]["name"], {"status": {
        "admission": admission,
        "conditions": _set(wl, [("QuotaReserved", True, "QuotaReserved", f"Quota reserved in ClusterQueue {cq}"),
                                ("Admitted", True, "Admitted", "The workload is admitted"),
                                ("Evicted", False, "QuotaReserved", "")])}}, status=True)


def evict(cluster: FakeCluster, reason: str = "Preempted") -> None:
    wl = the_workload(cluster)
    cluster.patch_kueue("workloads", NS, wl["metadata"]["name"], {"status": {
        "conditions": _set(wl, [("Evicted", True, reason, "Preempted to accommodate a workload (UID: x) due to "
                                                          "prioritization in the ClusterQueue")])}}, status=True)


def pending(cluster: FakeCluster, message: str) -> None:
    """Kueue looked at the Workload and could not reserve quota for it."""
    wl = the_workload(cluster)
    cluster.patch_kueue("workloads", NS, wl["metadata"]["name"], {"status": {
        "conditions": _set(wl, [("QuotaReserved", False, "Pending", message)])}}, status=True)


def queued_world(*profiles: str, **spec: Any) -> FakeCluster:
    cluster = world(*profiles, queueName="team-q", **spec)
    cluster.add({"kind": "LocalQueue", "metadata": {"name": "team-q", "namespace": NS},
                 "spec": {"clusterQueue": "gpus"}})
    cluster.add({"kind": "ResourceFlavor", "metadata": {"name": "default", "namespace": ""}, "spec": {}})
    return cluster


def test_a_queued_job_gets_a_workload_and_no_pod_until_kueue_admits_it() -> None:
    cluster = queued_world("gpu-80g")
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Queued" and cluster.names("Pod") == []
    wl = the_workload(cluster)
    assert wl["spec"]["queueName"] == "team-q"
    assert wl["metadata"]["labels"][b.LABEL_JOB] == "j"
    assert wl["metadata"]["ownerReferences"][0]["kind"] == "FineTuneJob"
    [podset] = wl["spec"]["podSets"]
    requests = podset["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert podset["name"] == "trainer" and podset["count"] == 1
    assert requests["nvidia.com/gpu"] == "1" and int(requests["cpu"]) >= 1 and requests["memory"]
    assert conditions(cluster.get("FineTuneJob", NS, "j") or {})["Admitted"]["status"] == "False"

    pending(cluster, "couldn't assign flavors to pod set trainer: insufficient unused quota for nvidia.com/gpu "
                     "in flavor default, 1 more needed")
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Queued" and cluster.names("Pod") == []
    assert "LocalQueue team-q (ClusterQueue gpus), position 1 of 1 pending there" in st["message"]
    assert "insufficient unused quota for nvidia.com/gpu" in st["message"]

    admit(cluster)
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Planned" and cluster.names("Pod") == ["j-a0-0"]
    admitted = conditions(cluster.get("FineTuneJob", NS, "j") or {})["Admitted"]
    assert admitted["status"] == "True" and "ClusterQueue gpus on flavor default" in admitted["message"]
    assert "Admitted" in reasons(cluster)
    assert len(workloads(cluster)) == 1  # the same Workload: the plan did not change


def test_the_queue_position_follows_kueues_order_priority_then_time() -> None:
    cluster = queued_world("gpu-80g")
    cluster.add({"kind": "WorkloadPriorityClass", "metadata": {"name": "urgent", "namespace": ""}, "value": 1000})
    step(cluster)
    urgent = dict(queueing.build_workload(
        {"metadata": {"name": "k", "namespace": NS, "uid": "uid-k"}}, "team-q",
        the_workload(cluster)["spec"]["podSets"][0], ("urgent", 1000)))
    cluster.add(urgent)
    step(cluster)
    assert "position 2 of 2 pending there" in status(cluster)["message"]
    cluster.delete_kueue("workloads", NS, urgent["metadata"]["name"])
    step(cluster)
    assert "position 1 of 1 pending there" in status(cluster)["message"]


def test_a_priority_class_label_sets_the_workloads_priority_and_a_missing_class_is_named() -> None:
    cluster = queued_world("gpu-80g")
    job = cluster.objects[("FineTuneJob", NS, "j")]
    job["metadata"]["labels"] = {queueing.PRIORITY_LABEL: "urgent"}
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Queued" and workloads(cluster) == []
    assert "WorkloadPriorityClass 'urgent'" in st["message"] and "create it or remove the label" in st["message"]
    cluster.add({"kind": "WorkloadPriorityClass", "metadata": {"name": "urgent", "namespace": ""}, "value": 500})
    step(cluster)
    spec = the_workload(cluster)["spec"]
    assert spec["priority"] == 500
    assert spec["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "urgent"}


def test_admitted_on_a_flavour_the_job_is_planned_on_that_flavours_nodes() -> None:
    cluster = queued_world("gpu-80g", "gpu-24g")
    cluster.add({"kind": "ResourceFlavor", "metadata": {"name": "rtx4090", "namespace": ""},
                 "spec": {"nodeLabels": {"spillway.dev/node-profile": "gpu-24g"},
                          "tolerations": [{"key": "gpu-pool", "operator": "Exists", "effect": "NoSchedule"}]}})
    step(cluster)
    first = the_workload(cluster)
    admit(cluster, flavor="rtx4090")
    step(cluster)
    st = status(cluster)
    # The Workload was made from the plan on the 80 GB node (the cheapest); the 24 GB node's
    # plan offloads to NVMe and needs more CPU than was admitted: the Workload is replaced by
    # one asking for that, and the job waits again.
    wl = the_workload(cluster)
    assert wl["metadata"]["name"] != first["metadata"]["name"] and len(workloads(cluster)) == 1
    assert first["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"].keys() \
        == {"cpu", "memory", "nvidia.com/gpu"}
    assert int(wl["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"][
        "ephemeral-storage"]) > 0
    assert st["phase"] == "Queued" and cluster.names("Pod") == []
    admit(cluster, flavor="rtx4090")
    step(cluster)
    st = status(cluster)
    assert the_workload(cluster)["metadata"]["name"] == wl["metadata"]["name"]
    assert st["phase"] == "Planned" and st["plan"]["nodeNames"] == ["gpu-24g"]
    pod = cluster.get("Pod", NS, "j-a0-0")
    assert pod is not None
    assert pod["spec"]["nodeSelector"]["spillway.dev/node-profile"] == "gpu-24g"
    assert {"key": "gpu-pool", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    assert queueing.fits_within(queueing.pod_set(pod, 1, 0), the_workload(cluster))


def admitted_and_running() -> FakeCluster:
    """A queued job, admitted by Kueue, its attempt's pod running."""
    cluster = queued_world("gpu-80g")
    step(cluster)
    admit(cluster)
    step(cluster)
    cluster.run(NS, "j-a0-0", "gpu-80g")
    step(cluster)
    assert status(cluster)["phase"] == "Running"
    return cluster


def test_an_eviction_suspends_the_attempt_hands_the_quota_back_and_readmission_resumes() -> None:
    cluster = admitted_and_running()

    evict(cluster)
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Queued" and st["attempt"] == 1
    assert ("j-a0-0", None) in cluster.deleted  # SIGTERM with the pod's grace: it checkpoints
    assert st.get("failures", 0) == 0 and st.get("preemptions", 0) == 0
    assert reasons(cluster).count("Evicted") == 1 and "Preempted" in st["message"]  # one Event, not two
    # The pod is gone (deleted above): the quota goes back and Kueue queues the Workload again.
    step(cluster)
    wl = the_workload(cluster)
    assert "admission" not in wl["status"]
    conds = conditions(wl)
    assert conds["QuotaReserved"]["status"] == "False" and conds["Requeued"]["status"] == "True"
    assert conds["Admitted"]["status"] == "False"
    assert status(cluster)["phase"] == "Queued" and cluster.names("Pod") == []

    admit(cluster)
    step(cluster)
    assert cluster.names("Pod") == ["j-a1-0"] and status(cluster)["phase"] == "Planned"


def test_an_evicted_attempt_keeps_its_quota_while_a_pod_may_still_write() -> None:
    cluster = queued_world("gpu-80g")
    step(cluster)
    admit(cluster)
    step(cluster)
    cluster.run(NS, "j-a0-0", "gpu-80g")
    step(cluster)
    evict(cluster)
    # The pod's deletion takes its grace period: it stays, Running, while it checkpoints.
    cluster.delete_pod = lambda namespace, name, grace_seconds=None: None  # type: ignore[method-assign]
    step(cluster)
    step(cluster)
    wl = the_workload(cluster)
    assert wl["status"].get("admission"), "the quota went back while the pod could still write"
    assert status(cluster)["phase"] == "Queued" and cluster.names("Pod") == ["j-a0-0"]
    cluster.exit(NS, "j-a0-0", 75)
    step(cluster)
    assert "admission" not in the_workload(cluster)["status"]


def test_a_finished_job_marks_its_workload_finished() -> None:
    cluster = queued_world("gpu-80g")
    step(cluster)
    admit(cluster)
    step(cluster)
    cluster.run(NS, "j-a0-0", "gpu-80g")
    cluster.exit(NS, "j-a0-0", 0)
    step(cluster)
    assert status(cluster)["phase"] == "Succeeded"
    [wl] = workloads(cluster)
    finished = conditions(wl)["Finished"]
    assert finished["status"] == "True" and finished["reason"] == "Succeeded"


def test_a_suspended_job_gives_its_workload_up_and_queues_again_on_resume() -> None:
    cluster = queued_world("gpu-80g")
    step(cluster)
    admit(cluster)
    step(cluster)
    cluster.run(NS, "j-a0-0", "gpu-80g")
    step(cluster)
    cluster.set_spec(NS, "j", suspend=True)
    step(cluster)
    step(cluster)
    assert status(cluster)["phase"] == "Suspended" and workloads(cluster) == []
    cluster.set_spec(NS, "j", suspend=False)
    step(cluster)
    assert status(cluster)["phase"] == "Queued" and cluster.names("Pod") == [] and len(workloads(cluster)) == 1


def test_a_multi_node_job_is_one_pod_set_of_all_its_pods() -> None:
    cluster = queued_world("gpu-80g", resources={"gpusPerNode": 1, "nodes": 2})
    cluster.add({**cluster.nodes()[0], "metadata": {**cluster.nodes()[0]["metadata"], "name": "gpu-80g-b",
                                                    "uid": "uid-b", "labels": {
                                                        **cluster.nodes()[0]["metadata"]["labels"],
                                                        "kubernetes.io/hostname": "gpu-80g-b"}}})
    step(cluster)
    assert the_workload(cluster)["spec"]["podSets"][0]["count"] == 2
    admit(cluster)
    step(cluster)
    assert cluster.names("Pod") == ["j-a0-0", "j-a0-1"]


@pytest.mark.parametrize("by", ["spec", "label"])
def test_a_queue_without_kueue_enabled_fails_the_job_naming_the_setting(by: str) -> None:
    cluster = world("gpu-80g", **({"queueName": "team-q"} if by == "spec" else {}))
    if by == "label":
        cluster.objects[("FineTuneJob", NS, "j")]["metadata"]["labels"] = {queueing.QUEUE_LABEL: "team-q"}
    with pytest.raises(PermanentFailure):
        reconcile(NS, "j", OperatorSettings(read_model_config=False), cluster)
    st = status(cluster)
    assert st["phase"] == "Failed" and "kueue.enabled=true" in st["message"] and "'team-q'" in st["message"]
    assert cluster.names("Pod") == []


def flavour_shape(cluster: FakeCluster, name: str, shape: str, labels: dict[str, str]) -> None:
    cluster.add({"kind": "ResourceFlavor", "metadata": {"name": name, "namespace": "", "annotations": {
        queueing.SHAPE_ANNOTATION: shape}}, "spec": {"nodeLabels": labels}})


def test_a_flavour_annotated_with_a_node_shape_is_a_declared_pool_its_admitted_job_waits_for() -> None:
    from spillway_operator import node_pools

    from .fake_cluster import node
    from .test_node_pools import RTX

    cluster = queued_world("cpu-only")  # no node that exists has a GPU
    shape = RTX.model_dump_json(by_alias=True, exclude={"name", "labels", "taints"})
    flavour_shape(cluster, "l4", shape, {"cloud.example.com/pool": "l4"})
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Queued" and "declared pool l4" in st["plan"]["shape"], st
    admit(cluster, flavor="l4")
    step(cluster)
    pod = cluster.get("Pod", NS, "j-a0-0")
    assert pod is not None and pod["spec"]["nodeSelector"]["cloud.example.com/pool"] == "l4"
    assert pod["metadata"]["annotations"][node_pools.POOL_ANNOTATION] == "l4"
    assert status(cluster)["plan"]["pricePerHourUsd"] == pytest.approx(0.4)  # the annotation's price

    # The autoscaler brings up another machine than the annotation says: planned again, as
    # for the chart's pools (the flavour's pool is found to compare with).
    arrived = node("gpu-48g-nvme", "l4-odd")
    arrived["metadata"]["labels"]["cloud.example.com/pool"] = "l4"
    cluster.add(arrived)
    cluster.run(NS, "j-a0-0", "l4-odd")
    step(cluster)
    st = status(cluster)
    assert st["replans"] == 1 and ("j-a0-0", None) in cluster.deleted, st
    replanned = [m for _, r, m in cluster.events if r == "Replanned"]
    assert "declared pool l4 came up unlike its template" in replanned[0]


def test_a_flavour_whose_node_shape_is_wrong_is_named_when_the_job_fits_nowhere() -> None:
    cluster = queued_world("cpu-only")
    flavour_shape(cluster, "broken", '{"gpuCount": "many", "cpu": 8, "memory": "32Gi"}', {"pool": "b"})
    flavour_shape(cluster, "unlabelled", '{"cpu": 8, "memory": "32Gi"}', {})
    flavour_shape(cluster, "named", '{"name": "x", "cpu": 8, "memory": "32Gi"}', {"pool": "n"})
    with pytest.raises(PermanentFailure):
        step(cluster)
    message = status(cluster)["message"]
    assert "ResourceFlavor broken's annotation spillway.dev/node-shape is not a node shape (gpuCount:" in message
    assert "ResourceFlavor unlabelled's" in message and "needs spec.nodeLabels" in message, message
    assert "'name' comes from the flavour" in message
    assert workloads(cluster) == []


def test_chart_pools_and_flavour_pools_are_planned_on_together_and_a_chart_pool_wins_its_name() -> None:
    """The chart's pools and the annotated flavours compete on price like any shapes; a flavour
    named as a chart pool is that pool (its annotation is not read: the chart says what the
    pool's machines are)."""
    from .test_node_pools import RTX

    settings = KUEUE.model_copy(update={"node_pools": [RTX]})  # the chart's rtx: $0.40/h
    cluster = queued_world("cpu-only")
    shape = RTX.model_dump(by_alias=True, mode="json", exclude={"name", "labels", "taints"})
    flavour_shape(cluster, "rtx", json.dumps({**shape, "gpuHourUSD": 0.1}), {"karpenter.sh/nodepool": "rtx"})
    flavour_shape(cluster, "rtx-spot", json.dumps({**shape, "gpuHourUSD": 0.3}), {"cloud.example.com/spot": "rtx"})
    pools, problems = queueing.flavour_pools(cluster, settings.node_pools)
    assert [p.name for p in pools] == ["rtx-spot"] and problems == []
    reconcile(NS, "j", settings, cluster)
    st = status(cluster)
    assert st["phase"] == "Queued" and "declared pool rtx-spot" in st["plan"]["shape"], st
    assert st["plan"]["pricePerHourUsd"] == pytest.approx(0.3)  # cheaper than the chart's 0.4; rtx's 0.1 unread
    admit(cluster, flavor="rtx-spot")
    reconcile(NS, "j", settings, cluster)
    pod = cluster.get("Pod", NS, "j-a0-0")
    assert pod is not None and pod["spec"]["nodeSelector"].get("cloud.example.com/spot") == "rtx", pod["spec"]

    # Without the spot flavour the chart's pool is the cheapest declared shape, at the chart's price.
    cluster = queued_world("cpu-only")
    flavour_shape(cluster, "rtx", json.dumps({**shape, "gpuHourUSD": 0.1}), {"karpenter.sh/nodepool": "rtx"})
    reconcile(NS, "j", settings, cluster)
    st = status(cluster)
    assert "declared pool rtx" in st["plan"]["shape"] and st["plan"]["pricePerHourUsd"] == pytest.approx(0.4), st


def test_a_spec_that_stops_parsing_fails_a_queued_job_as_before_and_finishes_its_workload() -> None:
    """No pods to stop: Failed naming the field, as before; its Workload, which Kueue could
    still admit (holding quota for a job that will never start), is Finished."""
    cluster = queued_world("gpu-80g")
    step(cluster)
    assert status(cluster)["phase"] == "Queued" and cluster.names("Pod") == []
    cluster.set_spec(NS, "j", training={"maxSteps": -1})
    with pytest.raises(PermanentFailure, match="maxSteps"):
        step(cluster)
    st = status(cluster)
    failed = conditions(cluster.get("FineTuneJob", NS, "j") or {})["Failed"]
    assert st["phase"] == "Failed" and "maxSteps" in st["message"] and "finishedAt" not in st
    assert failed["reason"] == "InvalidSpec" and cluster.names("Pod") == []
    assert reasons(cluster) == ["Queued", "InvalidSpec"] and cluster.events[-1][0] == "Warning"
    [wl] = workloads(cluster)
    assert conditions(wl)["Finished"]["status"] == "True" and conditions(wl)["Finished"]["reason"] == "Failed"
    with pytest.raises(PermanentFailure, match="maxSteps"):
        step(cluster)
    assert reasons(cluster) == ["Queued", "InvalidSpec"] and status(cluster) == st


def test_a_spec_that_stops_parsing_under_an_admitted_attempt_stops_its_pods_and_finishes_its_workload() -> None:
    cluster = admitted_and_running()
    cluster.set_spec(NS, "j", training={"maxSteps": -1})
    with pytest.raises(PermanentFailure, match="maxSteps"):
        step(cluster)
    assert status(cluster)["phase"] == "Failed" and cluster.names("Pod") == []
    [wl] = workloads(cluster)
    assert conditions(wl)["Finished"]["status"] == "True" and "maxSteps" in conditions(wl)["Finished"]["message"]
