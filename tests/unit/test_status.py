"""The status contract: one exit-code policy for the operator and a local run, the status
models' wire names, and the CRD's status schema generated from them keeping what it had."""

from __future__ import annotations

from typing import Any

import pytest

from spillway_api.service import phase_for_exit
from spillway_operator.crd import build_crd
from spillway_operator.pod_outcomes import classify_pod
from spillway_runtime.core.contract import ExitCode, exit_outcome
from spillway_runtime.core.status import CheckpointRecord, FineTuneJobStatus, Progress, read_status, step_time_fields
from spillway_runtime.training.k8s_status import StatusPublisher

# code: (what it means in a cluster, the phase a local run ends in). 3 and 130 differ on purpose
# (contract.py says why): a cluster retries 3 on other nodes and counts an unexplained 130.
EXIT_TABLE: dict[int, tuple[str, str]] = {
    ExitCode.OK: ("succeeded", "Succeeded"),
    ExitCode.FAILED: ("retryable", "Failed"),
    ExitCode.BAD_INPUT: ("permanent", "Failed"),
    ExitCode.PLAN_INFEASIBLE: ("retryable", "Failed"),
    ExitCode.DIVERGED: ("permanent", "Diverged"),
    ExitCode.PREEMPTED: ("preempted", "Preempted"),
    ExitCode.ABORTED: ("retryable", "Preempted"),
}


def _ended_pod(code: int) -> dict[str, Any]:
    """A training pod whose container exited `code`, as the kubelet reports it."""
    terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
    return {"metadata": {"name": "p"}, "spec": {"nodeName": "n1"},
            "status": {"phase": "Succeeded" if code == 0 else "Failed",
                       "containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}]}}


def test_the_table_names_every_exit_code() -> None:
    assert set(EXIT_TABLE) == set(ExitCode)


@pytest.mark.parametrize("code", [*ExitCode, 137, 255])
def test_the_operator_and_a_local_run_read_an_exit_code_as_the_contract_says(code: int) -> None:
    cluster_kind, local_phase = EXIT_TABLE.get(code, ("retryable", "Failed"))
    assert classify_pod(_ended_pod(code), node_exists=True).kind == cluster_kind
    assert exit_outcome(code, "cluster").kind == cluster_kind
    assert phase_for_exit(code) == local_phase
    assert exit_outcome(code, "local").phase == local_phase


def test_exit_zero_in_a_failed_pod_is_a_failure() -> None:
    pod = _ended_pod(0)
    pod["status"]["phase"] = "Failed"
    assert classify_pod(pod, node_exists=True).kind == "retryable"


def test_progress_and_checkpoints_have_one_name_per_field() -> None:
    progress = Progress(step=3, eta_seconds=12.5, tokens_per_second=9.0).model_dump(exclude_unset=True)
    assert progress == {"step": 3, "etaSeconds": 12.5, "tokensPerSecond": 9.0}
    # a step event's step time (none on a process's first step, nor from junk)
    timed = {"event": "step", "step_seconds": 2.5, "step_seconds_mean": 2, "step_time_vs_plan": 1.125}
    assert Progress(**step_time_fields(timed)).model_dump(exclude_unset=True) == {
        "stepSeconds": 2.0, "stepTimeVsPlan": 1.125}
    assert step_time_fields({"event": "step", "step_seconds": 9.0}) == {}
    assert step_time_fields({"step_seconds_mean": True, "step_time_vs_plan": "fast"}) == {}
    record = CheckpointRecord.model_validate({"name": "c-3", "step": 3, "sizeBytes": 10, "time": 0, "x": 1})
    assert record.size_bytes == 10 and record.time == "1970-01-01T00:00:00Z"
    assert record.model_dump(exclude_unset=True) == {"name": "c-3", "step": 3, "sizeBytes": 10,
                                                       "time": "1970-01-01T00:00:00Z"}


def test_the_runtime_publishes_the_models_shapes() -> None:
    sent: list[dict[str, Any]] = []
    publisher = StatusPublisher("j", "ns", 10, sent.append)
    publisher({"event": "step", "step": 2, "loss": 1.5, "eta_seconds": 40, "bytes": {"cpu": 7}, "time": 0})
    publisher({"event": "checkpoint", "name": "c-2", "step": 2, "loss": 1.5, "time": 0, "sizeBytes": 9,
               "sha256": "ab"})
    status = FineTuneJobStatus.model_validate(sent[-1]["status"])
    assert status.progress is not None and status.progress.eta_seconds == 40.0
    assert status.progress.step_display == "2/10" and status.progress.bytes == {"cpu": 7}
    assert [(c.name, c.size_bytes) for c in status.checkpoints] == [("c-2", 9)]


def test_a_dpo_runs_rewards_reach_the_progress_beside_the_last_evaluations() -> None:
    sent: list[dict[str, Any]] = []
    publisher = StatusPublisher("j", "ns", 10, sent.append)
    rewards = {"rewards/margins": 0.5, "rewards/accuracies": 0.75, "rewards/chosen": 0.25, "logps/chosen": -9.0}
    publisher({"event": "step", "step": 2, "loss": 0.6, "time": 0, **rewards})
    publisher({"event": "eval", "step": 2, "eval_loss": 0.65, "eval_rewards/margins": 0.4, "time": 0})
    publisher({"event": "step", "step": 3, "loss": 0.55, "time": 0, **rewards, "rewards/margins": 0.7})
    assert FineTuneJobStatus.model_validate(sent[-1]["status"]).progress.preference["eval_rewards/margins"] == 0.4
    progress = Progress.model_validate(publisher._progress)  # steps are sent at most every few seconds
    assert progress.step == 3
    assert progress.preference == {**rewards, "rewards/margins": 0.7, "eval_rewards/margins": 0.4}
    publisher({"event": "step", "step": 4, "loss": 0.5, "time": 0})  # not a DPO step: nothing made up
    assert "preference" not in Progress.model_validate(publisher._progress).model_dump(exclude_unset=True)


def test_a_status_from_another_version_is_read() -> None:
    status = read_status({"phase": "Running", "attempt": 2, "someNewField": {"a": 1}, "failures": "many",
                          "cost": {"usd": 1.5, "settledUSD": 1.0, "newCostKey": 3},
                          "plan": {"label": "a plan of another shape"},
                          "checkpoints": [{"name": "c-1", "sizeBytes": 4, "unknown": True}]})
    assert status.phase == "Running" and status.attempt == 2
    assert status.failures == 0  # unreadable: read as absent
    assert status.model_extra == {"someNewField": {"a": 1}}
    assert status.cost is not None and status.cost.settled_usd == 1.0
    assert status.cost.model_extra == {"newCostKey": 3}
    assert status.plan is None
    assert status.checkpoints[0].size_bytes == 4
    assert read_status(None) == FineTuneJobStatus()


def test_an_unreadable_value_takes_only_itself_away() -> None:
    # The operator reads its decisions from this: a bad `cost.display` must not lose the settled
    # cost (the budget and the next cost patch read it), a bad condition not the others.
    status = read_status({"phase": "Running", "cost": {"settledUSD": 2.5, "display": 7},
                          "conditions": [{"type": "A", "status": "maybe"}, {"type": "B", "status": "True"},
                                         {"type": "C", "status": "nope"}, {"type": "D", "status": "False"}]})
    assert status.cost is not None and (status.cost.settled_usd, status.cost.display) == (2.5, None)
    assert [c.type for c in status.conditions] == ["B", "D"]


# The hand-written status schema this one replaced: every field it typed, with its type.
FORMER_STATUS_FIELDS = {
    ("phase",): "string", ("observedGeneration",): "integer", ("conditions",): "array",
    ("conditions", "[]", "type"): "string", ("conditions", "[]", "status"): "string",
    ("conditions", "[]", "reason"): "string", ("conditions", "[]", "message"): "string",
    ("conditions", "[]", "lastTransitionTime"): "string", ("conditions", "[]", "observedGeneration"): "integer",
    ("plan",): "object", ("plan", "accelerator"): "string", ("plan", "gpusPerNode"): "integer",
    ("plan", "nodeCount"): "integer", ("plan", "pricePerHourUsd"): "number",
    ("cost",): "object", ("cost", "usd"): "number", ("cost", "gpuHours"): "number",
    ("cost", "settledUSD"): "number", ("cost", "settledGpuHours"): "number",
    ("cost", "pricePerHourUSD"): "number", ("cost", "asOf"): "string", ("cost", "display"): "string",
    ("progress",): "object", ("progress", "step"): "integer", ("progress", "totalSteps"): "integer",
    ("progress", "loss"): "number", ("progress", "tokensPerSecond"): "number",
    ("progress", "etaSeconds"): "number", ("progress", "stepDisplay"): "string",
    ("progress", "lossDisplay"): "string", ("checkpoints",): "array",
    ("checkpoints", "[]", "name"): "string", ("checkpoints", "[]", "step"): "integer",
    ("checkpoints", "[]", "loss"): "number", ("checkpoints", "[]", "time"): "string",
    ("checkpoints", "[]", "sizeBytes"): "integer", ("checkpoints", "[]", "sha256"): "string",
}


def _status_schema() -> dict[str, Any]:
    schema: dict[str, Any] = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    return schema


def _node(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for part in path:
        schema = schema["items"] if part == "[]" else schema["properties"][part]
    return schema


def test_the_generated_status_schema_keeps_every_field_it_had() -> None:
    status = _status_schema()
    for path, kind in FORMER_STATUS_FIELDS.items():
        assert _node(status, path)["type"] == kind, path
    # open where it was open: what another version writes is kept, not pruned
    for path in [(), ("plan",), ("cost",), ("progress",)]:
        assert _node(status, path).get("x-kubernetes-preserve-unknown-fields") is True, path
    assert _node(status, ("conditions",))["x-kubernetes-list-map-keys"] == ["type"]
    assert _node(status, ("conditions", "[]"))["required"] == ["type", "status"]
    assert _node(status, ("checkpoints",))["x-kubernetes-list-map-keys"] == ["name"]
    assert _node(status, ("checkpoints", "[]"))["required"] == ["name"]
    assert _node(status, ("phase",))["enum"][0] == "Pending"


def test_the_status_schema_makes_nothing_up() -> None:
    """No defaults and no required fields but a keyed list's: the API server must not fill in
    or demand what neither the operator nor the runtime wrote."""

    def walk(node: Any, path: str) -> list[str]:
        found = []
        if isinstance(node, dict):
            if "default" in node:
                found.append(f"{path}: default")
            if "required" in node and not path.endswith(("conditions.items", "checkpoints.items")):
                found.append(f"{path}: required")
            for key, value in node.items():
                found += walk(value, f"{path}.{key}" if key not in ("properties",) else path)
        return found

    assert walk(_status_schema(), "status") == []
