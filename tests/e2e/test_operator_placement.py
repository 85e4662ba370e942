"""Where a job's pods go: multi-node jobs (one rank per node, a static rendezvous through a
headless Service) and re-planning when the nodes a job can use change under it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.operator_fixtures import (
    POOL,
    OperatorProcess,
    active_pods,
    add_checkpoint_volume,
    events_of,
    job_manifest,
    pods_of,
    pool_nodes,
    running_operator,
    wait_status,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def operator(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with running_operator(cluster, tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


def test_multi_node_job_one_rank_per_node_with_rendezvous(
    cluster: Any,
    namespace: str,
    operator: OperatorProcess,
    make_node: Callable[..., str],
    set_pod_phase: Callable[..., Any],
) -> None:
    # Two 8-GPU nodes and ranks of 1 GPU each: only the anti-affinity keeps them apart.
    pool, nodes = pool_nodes(cluster, make_node, "gpu-80g", "gpu-80g")
    add_checkpoint_volume(cluster, "ReadWriteMany")
    manifest = job_manifest("multi", resources={"gpusPerNode": 1, "nodes": 2, "nodeSelector": {POOL: pool}})
    cluster.apply(manifest, namespace)
    job = wait_status(cluster, namespace, "multi", lambda s: s.get("phase") == "Running", 40, "both ranks Running")
    assert job["status"]["plan"]["nodeCount"] == 2

    service = cluster.get("service", "multi-ranks", namespace)
    assert service is not None, [s["metadata"]["name"] for s in cluster.kubectl_json("get", "svc", "-n", namespace)["items"]]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"spillway.dev/job": "multi"}
    assert cluster.get("pvc", "multi-checkpoints", namespace)["spec"]["accessModes"] == ["ReadWriteMany"]

    pods = {p["metadata"]["name"]: p for p in pods_of(cluster, namespace, "multi")}
    assert sorted(pods) == ["multi-a0-0", "multi-a0-1"]
    assert sorted(p["spec"]["nodeName"] for p in pods.values()) == sorted(nodes)
    master = f"--master-addr=multi-a0-0.multi-ranks.{namespace}.svc"
    for rank in (0, 1):
        pod = pods[f"multi-a0-{rank}"]
        assert pod["spec"]["hostname"] == f"multi-a0-{rank}" and pod["spec"]["subdomain"] == "multi-ranks"
        command = pod["spec"]["containers"][0]["command"]
        assert command[:3] == ["python", "-m", "spillway_runtime.training.supervisor"]
        assert "--nnodes=2" in command and f"--node-rank={rank}" in command and "--processes=1" in command
        assert master in command

    # One rank failing ends the attempt for both: a new pair, on the two nodes again.
    set_pod_phase(namespace, "multi-a0-1", "Failed", exit_code=1)
    wait_status(cluster, namespace, "multi", lambda s: s.get("attempt") == 1, 30, "retry of both ranks")
    cluster.wait_for(lambda: active_pods(cluster, namespace, "multi") == ["multi-a1-0", "multi-a1-1"], 40, what="attempt 1 pods")
    job = wait_status(cluster, namespace, "multi", lambda s: s.get("phase") == "Running", 40, "attempt 1 Running")
    bound = {
        p["spec"].get("nodeName") for p in pods_of(cluster, namespace, "multi") if p["metadata"]["name"].startswith("multi-a1")
    }
    assert bound == set(nodes)
    assert job["status"]["failures"] == 1


def test_node_loss_replans_onto_another_shape(
    cluster: Any,
    namespace: str,
    operator: OperatorProcess,
    make_node: Callable[..., str],
    delete_node: Callable[[str], None],
) -> None:
    # fastest placement prefers the 80 GB shape; when that node is lost the job moves to the
    # 48 GB one with a new plan, as a preemption (not counted against backoffLimit).
    pool, (big, small) = pool_nodes(cluster, make_node, "gpu-80g", "gpu-48g-nvme")
    add_checkpoint_volume(cluster)
    manifest = job_manifest("moving", resources={"gpusPerNode": 1, "placement": "fastest", "nodeSelector": {POOL: pool}})
    cluster.apply(manifest, namespace)
    job = wait_status(cluster, namespace, "moving", lambda s: s.get("phase") == "Running", 30, "Running")
    first = job["status"]["plan"]
    assert first["nodeNames"] == [big], first
    assert cluster.get("pod", "moving-a0-0", namespace)["spec"]["nodeName"] == big

    delete_node(big)
    job = wait_status(
        cluster,
        namespace,
        "moving",
        lambda s: s.get("phase") == "Running" and (s.get("plan") or {}).get("attempt") == 1,
        60,
        "re-planned run",
    )
    second = job["status"]["plan"]
    assert second["nodeNames"] == [small] and second["shape"] != first["shape"]
    assert second["gpuProduct"] != first["gpuProduct"]
    assert job["status"]["preemptions"] == 1 and job["status"].get("failures", 0) == 0
    assert cluster.get("pod", "moving-a1-0", namespace)["spec"]["nodeName"] == small
    assert any(e["reason"] == "Preempted" for e in events_of(cluster, namespace, "moving"))


def test_unschedulable_pod_is_replanned_when_a_node_joins(
    cluster: Any, namespace: str, operator: OperatorProcess, make_node: Callable[..., str]
) -> None:
    # One 4-GPU node, two jobs of 4 GPUs: the second is pinned to that node and refused by
    # the scheduler. A second node of the pool joins: the pending pod is replaced by one
    # that may use it (the first is never pinned to a node set that excludes the newcomer).
    pool, (first_node,) = pool_nodes(cluster, make_node, "gpu-48g-nvme")
    add_checkpoint_volume(cluster)
    add_checkpoint_volume(cluster)
    resources = {"gpusPerNode": 4, "nodeSelector": {POOL: pool}}
    cluster.apply(job_manifest("holder", resources=resources), namespace)
    wait_status(cluster, namespace, "holder", lambda s: s.get("phase") == "Running", 30, "holder Running")
    cluster.apply(job_manifest("waiter", resources=resources), namespace)
    job = wait_status(
        cluster,
        namespace,
        "waiter",
        lambda s: any(c["type"] == "Scheduled" and c["reason"] == "Unschedulable" for c in s.get("conditions", [])),
        30,
        "waiter refused by the scheduler",
    )
    assert job["status"]["plan"]["nodeNames"] == [first_node]

    second_node = make_node("gpu-48g-nvme")
    cluster.kubectl("label", "node", second_node, f"{POOL}={pool}")
    job = wait_status(cluster, namespace, "waiter", lambda s: s.get("phase") == "Running", 40, "re-planned waiter")
    assert job["status"]["replans"] == 1 and job["status"].get("failures", 0) == 0
    assert job["status"].get("preemptions", 0) == 0
    assert sorted(job["status"]["plan"]["nodeNames"]) == sorted([first_node, second_node])
    assert active_pods(cluster, namespace, "waiter") == ["waiter-a1-0"]
    assert cluster.get("pod", "waiter-a1-0", namespace)["spec"]["nodeName"] == second_node
    assert any(e["reason"] == "Replanned" for e in events_of(cluster, namespace, "waiter"))
    assert wait_status(cluster, namespace, "holder", lambda s: s.get("phase") == "Running")["status"].get("attempt", 0) == 0
