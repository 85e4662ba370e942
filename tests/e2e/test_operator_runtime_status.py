"""The runtime's side of status (server-side apply) and the node probe's annotations,
against the real API server."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spillway_runtime import node_probe
from spillway_runtime.checkpoints.store import CheckpointStore, pending_rollback
from spillway_runtime.core.hardware import NodeHardware, hardware_from_node
from spillway_runtime.training import k8s_status
from tests.e2e.operator_fixtures import CRD, job_manifest

pytestmark = pytest.mark.e2e


def test_runtime_publishes_progress_and_checkpoints_beside_operator_fields(cluster: Any, namespace: str) -> None:
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/finetunejobs.spillway.dev", "--timeout=30s")
    cluster.apply(job_manifest("pub", node="nowhere"), namespace)
    # The operator's merge patch of its own fields.
    cluster.kubectl(
        "patch", "ftj", "pub", "-n", namespace, "--subresource=status", "--type=merge", "-p", '{"status":{"phase":"Running"}}'
    )
    sink = k8s_status.StatusPublisher("pub", namespace, 100, k8s_status._server_side_apply("pub", namespace))
    sink({"event": "step", "step": 7, "loss": 3.7709308862686157, "lr": 1e-5, "tokens_per_s": 900.0, "time": 1.7e9,
          "step_seconds": 2.5, "step_seconds_mean": 2.25, "step_time_vs_plan": 1.125})
    sink({"event": "checkpoint", "name": "step-00007", "step": 7, "loss": 2.5, "sizeBytes": 10, "sha256": "ab"})
    job = cluster.get("finetunejob", "pub", namespace)
    assert job["status"]["phase"] == "Running"
    assert job["status"]["progress"]["step"] == 7
    # the step time beside the plan's, kept by the CRD's schema
    assert (job["status"]["progress"]["stepSeconds"], job["status"]["progress"]["stepTimeVsPlan"]) == (2.25, 1.125)
    assert job["status"]["checkpoints"][0]["name"] == "step-00007"
    full = cluster.kubectl_json("get", "ftj", "pub", "-n", namespace, "--show-managed-fields")
    managers = {m["manager"] for m in full["metadata"]["managedFields"]}
    assert "spillway-runtime" in managers
    assert job["status"]["progress"]["loss"] == 3.7709308862686157  # full precision in status
    printed = cluster.kubectl("get", "ftj", "pub", "-n", namespace).stdout
    assert "Running" in printed and " 7/100 " in printed and " 3.771 " in printed and "3.7709" not in printed, printed


def test_the_mirror_s_progress_and_its_lag_are_in_status(cluster: Any, namespace: str) -> None:
    """spec.checkpoint.mirror: the last checkpoint uploaded, how many steps training is ahead
    of it, and the last upload's failure until the next success."""
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/finetunejobs.spillway.dev", "--timeout=30s")
    cluster.apply(job_manifest("mirrored", node="nowhere"), namespace)
    sink = k8s_status.StatusPublisher("mirrored", namespace, 100, k8s_status._server_side_apply("mirrored", namespace))
    uri = "s3://ckpt/mirrored"
    sink({"event": "mirror", "uri": uri, "checkpoint": "step-00000010", "step": 10, "bytes_per_s": 5e7, "time": 1.7e9})
    sink({"event": "step", "step": 14, "loss": 2.5, "time": 1.7e9})
    sink({"event": "mirror_failed", "uri": uri, "checkpoint": "step-00000012", "reason": "connection refused",
          "failures": 2, "retry_in_seconds": 2.0, "time": 1.7e9})
    mirror = cluster.get("finetunejob", "mirrored", namespace)["status"]["mirror"]
    assert mirror["uri"] == uri and mirror["checkpoint"] == "step-00000010" and mirror["step"] == 10
    assert mirror["lagSteps"] == 4
    assert mirror["lastError"] == "connection refused" and mirror["failures"] == 2
    sink({"event": "mirror", "uri": uri, "checkpoint": "step-00000014", "step": 14, "bytes_per_s": 5e7, "time": 1.7e9})
    mirror = cluster.get("finetunejob", "mirrored", namespace)["status"]["mirror"]
    assert mirror["lagSteps"] == 0 and "lastError" not in mirror


def test_a_new_attempt_keeps_the_earlier_attempts_checkpoints_in_status(cluster: Any, namespace: str) -> None:
    """Server-side apply removes list entries their manager stops applying: a resumed pod
    whose publisher started empty would erase every earlier checkpoint from status (and a
    rollback to one would be refused). The runtime lists what its volume holds first."""
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/finetunejobs.spillway.dev", "--timeout=30s")
    cluster.apply(job_manifest("again", node="nowhere"), namespace)

    def publisher() -> k8s_status.StatusPublisher:
        return k8s_status.StatusPublisher("again", namespace, 100, k8s_status._server_side_apply("again", namespace))

    def listed() -> list[str]:
        job = cluster.get("finetunejob", "again", namespace) or {}
        return [c["name"] for c in job.get("status", {}).get("checkpoints", [])]

    first = publisher()
    for step in (3, 6):
        first({"event": "checkpoint", "name": f"step-{step:08d}", "step": step, "loss": 2.0, "time": 1.7e9})
    assert listed() == ["step-00000003", "step-00000006"]

    unseeded = publisher()  # what a resumed pod did before: its first step's progress erased them
    unseeded({"event": "step", "step": 7, "loss": 2.0, "time": 1.7e9})
    assert listed() == []

    first({"event": "checkpoint", "name": "step-00000006", "step": 6, "loss": 2.0})  # put them back
    resumed = publisher()
    resumed.known([{"name": "step-00000003", "step": 3, "loss": 2.0, "time": 1.7e9, "sizeBytes": 1, "sha256": "a"},
                   {"name": "step-00000006", "step": 6, "loss": 2.0, "time": 1.7e9, "sizeBytes": 1, "sha256": "b"}])
    resumed({"event": "resumed", "checkpoint": "step-00000006", "step": 6})
    resumed({"event": "step", "step": 7, "loss": 2.0, "time": 1.7e9})
    assert listed() == ["step-00000003", "step-00000006"]
    resumed({"event": "checkpoint", "name": "step-00000009", "step": 9, "loss": 1.5, "time": 1.7e9})
    assert listed() == ["step-00000003", "step-00000006", "step-00000009"]


def test_a_rollback_asked_for_while_the_pod_runs_is_spared_by_its_pruning(
    cluster: Any, namespace: str, tmp_path: Path
) -> None:
    """The running pod reads spec.resumeFrom from the API server before it prunes: the
    checkpoint a user rolls back to outlives checkpoint.keep until the next attempt uses it."""
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/finetunejobs.spillway.dev", "--timeout=30s")
    cluster.apply(job_manifest("pin", node="nowhere"), namespace)
    sink = k8s_status.StatusPublisher("pin", namespace, 100, k8s_status._server_side_apply("pin", namespace),
                                      k8s_status._reader("pin", namespace, k8s_status._api()))
    store = CheckpointStore(tmp_path, keep=2, pinned=lambda: pending_rollback(sink.requested_rollback(), None, None))

    def save(step: int) -> None:
        def write(staging: Path) -> None:
            (staging / "weights").write_bytes(bytes([step]))
        store.save(step, write, {})

    def resume_from(value: str | None) -> None:
        cluster.kubectl("patch", "ftj", "pin", "-n", namespace, "--type=merge", "-p",
                        json.dumps({"spec": {"resumeFrom": value}}))

    save(1)
    save(2)
    resume_from("step-00000001")  # what `kubectl patch` or the REST rollback writes
    save(3)
    save(4)
    assert [c.name for c in store.list()] == ["step-00000001", "step-00000003", "step-00000004"]
    resume_from(None)
    save(5)
    assert [c.name for c in store.list()] == ["step-00000004", "step-00000005"]


def test_probe_annotates_its_own_node(cluster: Any, make_node: Callable[..., str], monkeypatch: Any) -> None:
    node = make_node("cpu-only")
    monkeypatch.setenv("NODE_NAME", node)
    hw = NodeHardware(
        name=node,
        cpu_memory_bytes=32 << 30,
        nvme_path="/mnt/nvme9",
        nvme_capacity_bytes=10**12,
        nvme_free_bytes=9 * 10**11,
        nvme_read_bytes_per_s=2e9,
    )
    written = node_probe.annotate_node(hw)
    got = hardware_from_node(cluster.kubectl_json("get", "node", node))
    assert written["spillway.dev/nvme-free-bytes"] == str(9 * 10**11)
    assert got.nvme_free_bytes == 9 * 10**11 and got.nvme_path == "/mnt/nvme9"
    assert json.dumps(written)
