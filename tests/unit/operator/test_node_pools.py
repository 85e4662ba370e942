"""Node pools that scale from zero, against the in-memory cluster: a job no existing node
fits is planned on a declared pool's template and waits for its node (saying which), a node
that comes up as declared takes the pods, one that comes up otherwise is planned again, and
only a job that fits neither fails."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from spillway_operator import builders as b
from spillway_operator import node_pools
from spillway_operator.reconciler import PermanentFailure, reconcile
from spillway_operator.settings import OperatorSettings

from .fake_cluster import FakeCluster, node
from .test_reconciler import NS, reasons, status, world

POOL_LABEL = "karpenter.sh/nodepool"
# The kwok profile gpu-24g (an RTX 4090 workstation) as a pool template.
RTX = node_pools.NodePool.model_validate({
    "name": "rtx", "labels": {POOL_LABEL: "rtx"}, "gpuProduct": "NVIDIA-GeForce-RTX-4090", "gpuCount": 1,
    "gpuMemory": "24564Mi", "cpu": "16", "memory": "64Gi", "gpuHourUSD": 0.4,
    "nvme": {"path": "/mnt/nvme0", "capacity": "1800000000000", "readBytesPerSecond": 3500000000,
             "writeBytesPerSecond": 3000000000}})
POOLS = OperatorSettings(read_model_config=False, node_pools=[RTX], replan_pending_seconds=1)


def step(cluster: FakeCluster) -> Any:
    return reconcile(NS, "j", POOLS, cluster)


def conditions(cluster: FakeCluster) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status(cluster).get("conditions") or []}


def arrive(cluster: FakeCluster, profile: str, name: str, product: str | None = None) -> None:
    """The autoscaler's node, as the node probe annotated it, labelled as the pool's."""
    n = node(profile, name)
    n["metadata"]["labels"][POOL_LABEL] = "rtx"
    if product:
        n["metadata"]["labels"]["nvidia.com/gpu.product"] = product
    cluster.add(n)


def test_a_job_no_node_fits_is_planned_on_a_declared_pool_and_waits_for_its_node() -> None:
    cluster = world("cpu-only")
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Planned" and "declared pool rtx" in st["plan"]["shape"], st
    pod = cluster.get("Pod", NS, "j-a0-0")
    assert pod is not None
    assert pod["spec"]["nodeSelector"][POOL_LABEL] == "rtx"
    assert "affinity" not in pod["spec"]  # not pinned to a node name: any node of the pool
    assert pod["metadata"]["annotations"][node_pools.POOL_ANNOTATION] == "rtx"
    assert st["plan"]["pricePerHourUsd"] == pytest.approx(0.4)  # the pool's own price

    # Unschedulable for longer than the re-plan delay: it still waits for the pool, saying so.
    cluster.set_pod(NS, "j-a0-0", {"conditions": [
        {"type": "PodScheduled", "status": "False", "message": "0/1 nodes are available: 1 node(s) didn't match "
                                                               "Pod's node affinity/selector."}]})
    pod = cluster.objects[("Pod", NS, "j-a0-0")]
    pod["metadata"]["creationTimestamp"] = b.rfc3339(datetime.now(UTC) - timedelta(minutes=10))
    step(cluster)
    waiting = conditions(cluster)["Scheduled"]
    assert waiting["reason"] == "WaitingForNode"
    assert "waiting for 1 node(s) of declared pool rtx (1xNVIDIA-GeForce-RTX-4090" in waiting["message"]
    assert "didn't match" in waiting["message"]
    assert cluster.names("Pod") == ["j-a0-0"] and "Replanned" not in reasons(cluster)

    # The node comes up as declared: the pod runs there, nothing is planned again.
    arrive(cluster, "gpu-24g", "rtx-abc12")
    cluster.run(NS, "j-a0-0", "rtx-abc12")
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Running" and st.get("replans", 0) == 0 and cluster.names("Pod") == ["j-a0-0"]


def test_a_pool_node_unlike_its_template_gets_the_job_planned_again() -> None:
    cluster = world("cpu-only")
    step(cluster)
    arrive(cluster, "gpu-48g-nvme", "rtx-odd")  # the pool's provisioner brought another machine
    cluster.run(NS, "j-a0-0", "rtx-odd")
    step(cluster)
    st = status(cluster)
    assert st["replans"] == 1 and st["attempt"] == 1 and ("j-a0-0", None) in cluster.deleted
    [replanned] = [m for _, r, m in cluster.events if r == "Replanned"]  # one Event, not two
    assert "rtx-odd is 4xNVIDIA-L40S" in replanned and "unlike its template" in replanned
    step(cluster)
    pod = cluster.get("Pod", NS, "j-a1-0")
    assert pod is not None and node_pools.POOL_ANNOTATION not in pod["metadata"]["annotations"]
    assert status(cluster)["plan"]["nodeNames"] == ["rtx-odd"]


def test_a_pool_node_unlike_its_template_on_which_the_plan_holds_keeps_the_job_running() -> None:
    cluster = world("cpu-only")
    step(cluster)
    planned = status(cluster)["plan"]
    # Another card than declared, planned the same: the probe's shape differs, the plan does not.
    arrive(cluster, "gpu-24g", "rtx-d", product="NVIDIA-GeForce-RTX-4090-D")
    cluster.run(NS, "j-a0-0", "rtx-d")
    step(cluster)
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Running" and st.get("replans", 0) == 0 and st.get("attempt", 0) == 0, st
    assert st["plan"]["label"] == planned["label"]
    assert cluster.names("Pod") == ["j-a0-0"] and "Replanned" not in reasons(cluster)


def test_an_existing_node_that_fits_wins_over_a_declared_pool() -> None:
    cluster = world("gpu-80g")
    step(cluster)
    assert status(cluster)["plan"]["nodeNames"] == ["gpu-80g"]
    pod = cluster.get("Pod", NS, "j-a0-0")
    assert pod is not None and node_pools.POOL_ANNOTATION not in pod["metadata"]["annotations"]


def test_a_job_that_fits_neither_a_node_nor_a_pool_fails_naming_both() -> None:
    cluster = world("cpu-only", resources={"gpusPerNode": 4})
    with pytest.raises(PermanentFailure):
        step(cluster)
    st = status(cluster)
    assert st["phase"] == "Failed"
    message = conditions(cluster)["Failed"]["message"]
    assert "declared pool rtx" in message and "gpusPerNode is 4" in message, message


def test_the_pools_come_from_the_environment_as_the_chart_writes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPILLWAY_OPERATOR_NODE_POOLS", f"[{RTX.model_dump_json(by_alias=True)}]")
    assert OperatorSettings().node_pools == [RTX]
    with pytest.raises(ValueError, match="labels"):
        node_pools.NodePool.model_validate({"name": "x", "labels": {}, "cpu": "1", "memory": "1Gi"})
