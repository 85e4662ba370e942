"""Shared and elastic GPU clusters, with the real operator on kwok's simulated GPU nodes.

Under a real Kueue (built from the Go module proxy, tests/e2e/kueue_fixtures.py):
- the harness itself: a plain Workload is admitted within quota, the next once it is Finished;
- two jobs and a ClusterQueue with GPU quota for one: the second waits Queued (its queue,
  its place and Kueue's reason in its status, no pod), and runs once the first finished;
- a two-node job under quota for one node is never started in part: no pod until the
  quota holds both, then both at once.
The preemption of a running job, which checkpoints and later resumes with no lost step,
needs a real training pod: tests/e2e/realnode/pods/test_resume.py.

A node pool that scales from zero: a job submitted while no node fits is planned on the
pool's declared template and waits for its node, saying so; the node added afterwards
takes the pod (a node that comes up unlike the template is planned on again: the
operator's own decision, tests/unit/operator/test_node_pools.py). The same for a pool that is a
ResourceFlavor annotated with its node shape, under Kueue: admitted on that flavour, the job waits for the flavour's node."""

from __future__ import annotations

import datetime as dt
import json
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.kueue_fixtures import API_VERSION, GROUP, Kueue
from tests.e2e.operator_fixtures import (
    POOL,
    OperatorProcess,
    active_pods,
    add_checkpoint_volume,
    job_manifest,
    pods_of,
    pool_nodes,
    running_operator,
    wait_seconds,
    wait_status,
)

pytestmark = pytest.mark.e2e

ADMIT_TIMEOUT_S = 60
ROOMY = {"cpu": "1000", "memory": "100Ti", "ephemeral-storage": "1000Ti"}
POOL_TEMPLATE = "spillway.dev/e2e-node-pool"
# The kwok profile gpu-80g as a pool that has no node yet.
# What the provisioner brings instead: a kwok profile unlike the pool's template.
A100_POOL = {"name": "a100", "labels": {POOL_TEMPLATE: "a100"}, "gpuProduct": "NVIDIA-A100-SXM4-80GB",
             "gpuCount": 8, "gpuMemory": "80Gi", "cpu": "96", "memory": "1Ti", "maxNodes": 2,
             "nvme": {"path": "/raid", "capacity": "3600000000000", "readBytesPerSecond": 6800000000,
                      "writeBytesPerSecond": 4000000000}}


@pytest.fixture(scope="module")
def operator(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with running_operator(cluster, tmp_path_factory.mktemp("operator-kueue") / "operator.log",
                          SPILLWAY_OPERATOR_KUEUE="true", SPILLWAY_OPERATOR_NODE_POOLS=json.dumps([A100_POOL])) as op:
        yield op


def plain_workload(name: str, queue: str, cpu: str) -> dict[str, Any]:
    container = {"name": "main", "image": "registry.invalid/none", "resources": {"requests": {"cpu": cpu}}}
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {
            "queueName": queue,
            "podSets": [{"name": "main", "count": 1,
                         "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}],
        },
    }


def wait_admitted(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    def admitted() -> dict[str, Any] | None:
        wl = cluster.get(f"workloads.{GROUP}", name, namespace)
        return wl if condition(wl, "Admitted").get("status") == "True" else None

    result: dict[str, Any] = cluster.wait_for(admitted, ADMIT_TIMEOUT_S, what=f"Kueue to admit Workload {name}")
    return result


def test_the_harness_kueue_admits_a_plain_workload_and_the_next_once_the_first_finished(
    cluster: Any, namespace: str, kueue: Kueue
) -> None:
    """Kueue itself, before any Spillway code is involved: a plain Workload within a
    ClusterQueue's quota is admitted on its flavour, one beyond what is left waits with
    Kueue's reason, and is admitted once the first reports Finished (as the operator does)."""
    suffix = namespace.rsplit("-", 1)[-1]
    flavor = kueue.flavor(f"e2e-harness-{suffix}")
    cq = kueue.cluster_queue(f"e2e-harness-{suffix}", {flavor: {"cpu": "2", "memory": "4Gi"}})
    kueue.local_queue(namespace, "team", cq)

    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(plain_workload("first", "team", "1")))
    first = wait_admitted(cluster, namespace, "first")
    assert condition(first, "QuotaReserved")["status"] == "True"
    admission = first["status"]["admission"]
    assert admission["clusterQueue"] == cq
    assert [(a["name"], a["flavors"]["cpu"], a["count"]) for a in admission["podSetAssignments"]] == [
        ("main", flavor, 1)
    ]

    # 2 CPUs do not fit next to the first's 1 of 2: pending, with Kueue's reason.
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(plain_workload("second", "team", "2")))

    def pending() -> dict[str, Any] | None:
        wl = cluster.get(f"workloads.{GROUP}", "second", namespace)
        reserved = condition(wl, "QuotaReserved")
        return wl if reserved.get("status") == "False" and reserved.get("message") else None

    second = cluster.wait_for(pending, ADMIT_TIMEOUT_S, what="Kueue to say why Workload second waits")
    reserved = condition(second, "QuotaReserved")
    assert reserved["reason"] == "Pending", reserved
    assert "insufficient unused quota for cpu" in reserved["message"], reserved
    assert condition(second, "Admitted").get("status") != "True"
    assert not (second.get("status") or {}).get("admission")

    # The owner reports the end of the first: its quota goes back, the second fits.
    finished = {"type": "Finished", "status": "True", "reason": "Succeeded", "message": "done",
                "lastTransitionTime": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    cluster.kubectl("patch", f"workloads.{GROUP}", "first", "-n", namespace, "--subresource=status",
                    "--type=json", "-p", json.dumps([{"op": "add", "path": "/status/conditions/-", "value": finished}]))
    second = wait_admitted(cluster, namespace, "second")
    assert second["status"]["admission"]["clusterQueue"] == cq
    assert [w["metadata"]["name"] for w in kueue.workloads(namespace)] == ["first", "second"]
    # The owner ends the second too: Kueue lets an admitted Workload go only once it is finished,
    # and its ClusterQueue only once its Workloads are gone (the fixture deletes both).
    cluster.kubectl("patch", f"workloads.{GROUP}", "second", "-n", namespace, "--subresource=status",
                    "--type=json", "-p", json.dumps([{"op": "add", "path": "/status/conditions/-", "value": finished}]))


def queued_job(cluster: Any, name: str, pool: str, queue: str, **spec: Any) -> dict[str, Any]:
    add_checkpoint_volume(cluster, "ReadWriteMany" if (spec.get("resources") or {}).get("nodes", 1) > 1
                          else "ReadWriteOnce")
    job = job_manifest(name, queueName=queue, **spec)
    job["spec"]["resources"]["nodeSelector"] = {POOL: pool}
    return job


def workloads_of(cluster: Any, namespace: str, job: str) -> list[dict[str, Any]]:
    data = cluster.kubectl_json("get", "workloads.kueue.x-k8s.io", "-n", namespace, "-l", f"spillway.dev/job={job}")
    return list(data.get("items", []))


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def test_the_second_job_waits_queued_until_the_first_finishes(
    cluster: Any, namespace: str, operator: OperatorProcess, kueue: Any, make_node: Callable[..., str],
    set_pod_phase: Callable[..., Any],
) -> None:
    pool, _ = pool_nodes(cluster, make_node, "gpu-80g", "gpu-80g")
    flavor = kueue.flavor(f"e2e-{pool}", node_labels={POOL: pool})
    cq = kueue.cluster_queue(f"e2e-{pool}", {flavor: {**ROOMY, "nvidia.com/gpu": "1"}})
    kueue.local_queue(namespace, "team", cq)
    cluster.apply(queued_job(cluster, "first", pool, "team"), namespace)
    wait_status(cluster, namespace, "first", lambda s: s.get("phase") == "Running", 120, "first Running")
    cluster.apply(queued_job(cluster, "second", pool, "team"), namespace)
    second = wait_status(cluster, namespace, "second", lambda s: s.get("phase") == "Queued"
                         and "insufficient" in (s.get("message") or ""), 120, "second Queued by Kueue's quota")
    message = second["status"]["message"]
    assert f"LocalQueue team (ClusterQueue {cq}), position 1 of 1 pending there" in message, message
    assert condition(second, "Admitted")["status"] == "False"
    [first_wl] = workloads_of(cluster, namespace, "first")
    assert condition(first_wl, "Admitted")["status"] == "True"
    assert first_wl["status"]["admission"]["clusterQueue"] == cq
    [podset] = first_wl["spec"]["podSets"]
    assert podset["count"] == 1 and podset["template"]["spec"]["containers"][0]["resources"]["requests"][
        "nvidia.com/gpu"] == "1"
    # Waiting is waiting: a few seconds on, still no pod for the second job.
    wait_seconds(5)
    assert pods_of(cluster, namespace, "second") == []

    set_pod_phase(namespace, "first-a0-0", "Succeeded")
    wait_status(cluster, namespace, "first", lambda s: s.get("phase") == "Succeeded", 60, "first Succeeded")
    cluster.wait_for(lambda: condition(workloads_of(cluster, namespace, "first")[0], "Finished").get("status") == "True",
                     60, what="first's Workload Finished")
    second = wait_status(cluster, namespace, "second", lambda s: s.get("phase") == "Running", 120, "second Running")
    assert condition(second, "Admitted")["status"] == "True"
    assert active_pods(cluster, namespace, "second") == ["second-a0-0"]


def test_a_two_node_job_is_admitted_whole_or_not_at_all(
    cluster: Any, namespace: str, operator: OperatorProcess, kueue: Any, make_node: Callable[..., str],
) -> None:
    pool, _ = pool_nodes(cluster, make_node, "gpu-80g", "gpu-80g")
    flavor = kueue.flavor(f"e2e-{pool}", node_labels={POOL: pool})
    cq = kueue.cluster_queue(f"e2e-{pool}", {flavor: {**ROOMY, "nvidia.com/gpu": "1"}})
    kueue.local_queue(namespace, "team", cq)
    cluster.apply(queued_job(cluster, "gang", pool, "team", resources={"gpusPerNode": 1, "nodes": 2}), namespace)
    wait_status(cluster, namespace, "gang", lambda s: s.get("phase") == "Queued"
                and "insufficient" in (s.get("message") or ""), 120, "gang Queued by Kueue's quota")
    [wl] = workloads_of(cluster, namespace, "gang")
    assert wl["spec"]["podSets"][0]["count"] == 2
    wait_seconds(5)
    assert pods_of(cluster, namespace, "gang") == []  # never one of the two

    # Quota for both: both pods, in one attempt.
    cluster.kubectl("patch", "clusterqueue", cq, "--type=json", "-p", json.dumps([
        {"op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources",
         # in coveredResources' order (the fixture sorts them)
         "value": [{"name": k, "nominalQuota": v} for k, v in sorted({**ROOMY, "nvidia.com/gpu": "2"}.items())]}]))
    job = wait_status(cluster, namespace, "gang", lambda s: s.get("phase") == "Running", 120, "gang Running")
    assert active_pods(cluster, namespace, "gang") == ["gang-a0-0", "gang-a0-1"]
    assert job["status"].get("attempt", 0) == 0 and job["status"].get("replans", 0) == 0


def test_a_job_waits_for_a_node_of_a_declared_pool_and_runs_on_it_when_it_comes(
    cluster: Any, namespace: str, operator: OperatorProcess, make_node: Callable[..., str],
) -> None:
    add_checkpoint_volume(cluster)
    job = job_manifest("elastic")
    job["spec"]["resources"]["nodeSelector"] = {POOL_TEMPLATE: "a100"}  # no node has it yet
    cluster.apply(job, namespace)
    waiting = wait_status(cluster, namespace, "elastic", lambda s: condition(
        {"status": s}, "Scheduled").get("reason") == "WaitingForNode", 120, "elastic WaitingForNode")
    message = condition(waiting, "Scheduled")["message"]
    assert "waiting for 1 node(s) of declared pool a100 (8xNVIDIA-A100-SXM4-80GB" in message, message
    assert "declared pool a100" in waiting["status"]["plan"]["shape"]
    [pod] = pods_of(cluster, namespace, "elastic")
    assert pod["spec"]["nodeSelector"][POOL_TEMPLATE] == "a100" and "affinity" not in pod["spec"]
    assert not pod["spec"].get("nodeName")

    # The autoscaler's node: the scheduler binds the waiting pod to it, kwok runs it.
    node = make_node("gpu-80g")
    cluster.kubectl("label", "node", node, f"{POOL_TEMPLATE}=a100")
    running = wait_status(cluster, namespace, "elastic", lambda s: s.get("phase") == "Running", 120, "elastic Running")
    assert running["status"].get("replans", 0) == 0 and running["status"].get("attempt", 0) == 0
    assert cluster.get("pod", "elastic-a0-0", namespace)["spec"]["nodeName"] == node


def test_a_flavour_annotated_with_a_node_shape_is_a_pool_its_admitted_job_waits_for(
    cluster: Any, namespace: str, operator: OperatorProcess, kueue: Any, make_node: Callable[..., str],
) -> None:
    value = f"flavour-{secrets.token_hex(3)}"  # no node has it yet
    shape = {k: v for k, v in A100_POOL.items() if k not in ("name", "labels")}
    flavor = kueue.flavor(f"e2e-{value}", node_labels={POOL_TEMPLATE: value},
                          annotations={"spillway.dev/node-shape": json.dumps(shape)})
    kueue.local_queue(namespace, "team", kueue.cluster_queue(f"e2e-{value}", {flavor: {**ROOMY, "nvidia.com/gpu": "8"}}))
    add_checkpoint_volume(cluster)
    job = job_manifest("flavoured", queueName="team")
    job["spec"]["resources"]["nodeSelector"] = {POOL_TEMPLATE: value}
    cluster.apply(job, namespace)
    waiting = wait_status(cluster, namespace, "flavoured", lambda s: condition(
        {"status": s}, "Scheduled").get("reason") == "WaitingForNode", 120, "flavoured WaitingForNode")
    assert condition(waiting, "Admitted")["status"] == "True", waiting["status"]
    message = condition(waiting, "Scheduled")["message"]
    assert f"waiting for 1 node(s) of declared pool {flavor} (8xNVIDIA-A100-SXM4-80GB" in message, message
    [pod] = pods_of(cluster, namespace, "flavoured")
    assert pod["spec"]["nodeSelector"][POOL_TEMPLATE] == value and not pod["spec"].get("nodeName")

    node = make_node("gpu-80g")
    cluster.kubectl("label", "node", node, f"{POOL_TEMPLATE}={value}")
    running = wait_status(cluster, namespace, "flavoured", lambda s: s.get("phase") == "Running", 120,
                          "flavoured Running")
    assert running["status"].get("replans", 0) == 0 and running["status"].get("attempt", 0) == 0
    assert cluster.get("pod", "flavoured-a0-0", namespace)["spec"]["nodeName"] == node
