"""The reconciler's state machine against an in-memory cluster (fake_cluster.FakeCluster):
every phase transition and every pod outcome, one reconcile at a time, asserted on what
the cluster then holds (the job's status, its pods, the Events). What needs a real API
server (watches, RBAC, kubelets, kwok) stays in tests/e2e."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from spillway_operator import builders as b
from spillway_operator.reconciler import PermanentFailure, Result, reconcile
from spillway_operator.settings import OperatorSettings
from spillway_operator.status import StatusChange
from spillway_runtime.core.contract import ExitCode
from spillway_runtime.core.plan_summary import PlanSummary
from spillway_runtime.core.spec_types import MAX_SECONDS
from spillway_runtime.training.runconfig import RuntimeConfig

from .fake_cluster import FakeCluster, node

NS = "team"
# Reading a pvc:// model's config.json before planning has its own tests (test_model_source.py).
SETTINGS = OperatorSettings(backoff_base_seconds=10, backoff_max_seconds=60, read_model_config=False)


def job(name: str = "j", **spec: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": {"uri": "pvc://models/llama", "parameterCount": "7B"},
        "dataset": {"uri": "pvc://data/train.jsonl"},
        "training": {"maxSteps": 100},
        "resources": {"gpusPerNode": 1},
    }
    doc.update(spec)
    return {"apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": name, "namespace": NS}, "spec": doc}


def world(*profiles: str, **spec: Any) -> FakeCluster:
    """A cluster with nodes of these profiles, the job's input claims, and the job."""
    cluster = FakeCluster(*(node(p) for p in profiles or ("gpu-80g",)))
    for claim in ("models", "data"):
        cluster.add({"kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": NS}})
    cluster.add(job(**spec))
    return cluster


def step(cluster: FakeCluster, name: str = "j") -> Result:
    return reconcile(NS, name, SETTINGS, cluster)


def status(cluster: FakeCluster, name: str = "j") -> dict[str, Any]:
    found = cluster.get("FineTuneJob", NS, name)
    assert found is not None
    return dict(found.get("status") or {})


def reasons(cluster: FakeCluster) -> list[str]:
    return [reason for _, reason, _ in cluster.events]


def running(cluster: FakeCluster, attempt: int = 0) -> str:
    """Plan, create and run attempt `attempt`'s pod; returns its name."""
    step(cluster)
    pod = b.pod_name("j", attempt, 0)
    assert cluster.names("Pod") == [pod], cluster.names("Pod")
    cluster.run(NS, pod, status(cluster)["plan"]["nodeNames"][0])
    step(cluster)
    assert status(cluster)["phase"] == "Running"
    return pod


def test_a_new_job_is_planned_and_gets_its_children_before_any_runs() -> None:
    cluster = world("gpu-80g", "gpu-24g")
    assert step(cluster) == Result()
    st = status(cluster)
    assert st["phase"] == "Planned" and st.get("attempt", 0) == 0
    plan = PlanSummary.model_validate(st["plan"])
    assert plan.feasible and plan.attempt == 0 and plan.rejected_shapes
    assert cluster.names("Pod") == ["j-a0-0"]
    assert cluster.names("ConfigMap") == [b.configmap_name("j")]
    assert "j-checkpoints" in cluster.names("PersistentVolumeClaim")
    assert reasons(cluster) == ["Planned"] and "created j-a0-0" in cluster.events[0][2]
    assert st["cost"]["usd"] == 0 and st["observedGeneration"] == 1
    # Reconciling again changes nothing: the same children, no new Event.
    step(cluster)
    assert cluster.names("Pod") == ["j-a0-0"] and reasons(cluster) == ["Planned"]


def test_a_jobs_pods_get_their_network_policy_before_they_exist() -> None:
    """Ingress to a job's pods: any port from the same job's pods, `metrics` from the admin's
    namespaces only; made before the first pod, so no pod of the job is ever open."""
    cluster = world()
    settings = SETTINGS.model_copy(update={"metrics_namespaces": ["monitoring"]})
    reconcile(NS, "j", settings, cluster)
    kinds = [kind for kind, _, _ in cluster.objects]
    assert kinds.index("NetworkPolicy") < kinds.index("Pod")
    policy = cluster.get("NetworkPolicy", NS, "j-ingress")
    assert policy is not None and policy["metadata"]["ownerReferences"][0]["name"] == "j"
    own = {b.LABEL_JOB: "j", b.LABEL_MANAGED_BY: b.MANAGER}
    pod_labels = cluster.objects[("Pod", NS, "j-a0-0")]["metadata"]["labels"]
    assert own.items() <= pod_labels.items()
    assert policy["spec"] == {
        "podSelector": {"matchLabels": own},
        "policyTypes": ["Ingress"],
        "ingress": [
            {"from": [{"podSelector": {"matchLabels": own}}]},
            {"ports": [{"port": "metrics", "protocol": "TCP"}],
             "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
        ],
    }
    # Without metrics namespaces nobody else may connect; with the policy off none is made.
    other = world()
    reconcile(NS, "j", SETTINGS, other)
    assert other.objects[("NetworkPolicy", NS, "j-ingress")]["spec"]["ingress"] == \
        [{"from": [{"podSelector": {"matchLabels": own}}]}]
    off = world()
    reconcile(NS, "j", SETTINGS.model_copy(update={"network_policy": False}), off)
    assert off.names("Pod") == ["j-a0-0"] and off.names("NetworkPolicy") == []


def test_scheduled_then_running_then_succeeded() -> None:
    cluster = world()
    step(cluster)
    cluster.set_pod(NS, "j-a0-0", {"phase": "Pending"}, node_name="gpu-80g")
    step(cluster)
    assert status(cluster)["phase"] == "Scheduled"
    cluster.run(NS, "j-a0-0", "gpu-80g")
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Running" and st["childrenAttempt"] == 0
    assert {c["type"]: c["status"] for c in st["conditions"]}["Running"] == "True"
    cluster.exit(NS, "j-a0-0", 0)
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Succeeded" and st["finishedAt"]
    assert st["cost"]["settledUSD"] == st["cost"]["usd"] >= 0
    assert reasons(cluster)[-1] == "Completed"


def test_a_run_that_says_why_it_succeeded_is_quoted_in_the_status() -> None:
    # training.earlyStopping: the runtime writes its reason as the pod's termination message
    said = ("stopped early at step 40 of 100 (training.earlyStopping): the held-out loss has not improved on 1.2 "
            "(step 20) for 2 evaluation(s); best checkpoint step-00000020 is kept")
    cluster = world()
    cluster.exit(NS, running(cluster), 0, said)
    step(cluster)
    st = status(cluster)
    assert (st["phase"], st["message"]) == ("Succeeded", said)
    assert {c["type"]: c for c in st["conditions"]}["Succeeded"]["message"] == said
    plain = world()
    plain.exit(NS, running(plain), 0)
    step(plain)
    assert status(plain)["message"] == "training finished"


def test_a_retryable_failure_backs_off_then_starts_the_next_attempt() -> None:
    cluster = world()
    pod = running(cluster)
    cluster.exit(NS, pod, 1, "CUDA error: an illegal memory access")
    result = step(cluster)
    st = status(cluster)
    assert (st["phase"], st["failures"], st["attempt"]) == ("Pending", 1, 1)
    assert st["retryAfter"] and result.requeue_after == pytest.approx(10, abs=1)
    assert "illegal memory access" in st["message"] and reasons(cluster)[-2:] == ["AttemptFailed", "BackingOff"]
    assert cluster.names("Pod") == [pod]  # a Failed pod is not deleted: its logs stay
    # Before retryAfter nothing starts; after it, attempt 1's pod.
    assert step(cluster).requeue_after is not None and cluster.names("Pod") == [pod]
    cluster.patch_job_status(NS, "j", {"status": {"retryAfter": "2000-01-01T00:00:00Z"}})
    step(cluster)
    assert "j-a1-0" in cluster.names("Pod") and status(cluster)["plan"]["attempt"] == 1


def test_a_status_field_another_version_wrote_in_a_shape_this_one_cannot_read_reads_as_absent() -> None:
    # Decisions read the stored status through FineTuneJobStatus (StatusChange.was): a count
    # or a time of another type is what it would be unset, where int() and the time parser
    # used to stop every reconcile of the job.
    cluster = world()
    pod = running(cluster)
    cluster.patch_job_status(NS, "j", {"status": {"failures": "many", "retryAfter": 12}})
    cluster.exit(NS, pod, 1)
    step(cluster)
    st = status(cluster)
    assert (st["phase"], st["failures"], st["attempt"]) == ("Pending", 1, 1)
    assert reasons(cluster)[-2:] == ["AttemptFailed", "BackingOff"]


def test_the_backoff_limit_ends_the_job_failed() -> None:
    cluster = world(backoffLimit=0)
    pod = running(cluster)
    cluster.exit(NS, pod, 1)
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Failed" and st["failures"] == 1
    assert "backoffLimit 0 reached" in st["message"] and reasons(cluster)[-1] == "BackoffLimitExceeded"


@pytest.mark.parametrize(("code", "reason"), [(ExitCode.BAD_INPUT, "BadInput"), (ExitCode.DIVERGED, "Diverged")])
def test_a_permanent_exit_code_fails_the_job_without_a_retry(code: int, reason: str) -> None:
    cluster = world()
    pod = running(cluster)
    cluster.exit(NS, pod, code, "dataset line 3 is not JSON")
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Failed" and st.get("failures", 0) == 0 and st.get("attempt", 0) == 0
    conditions = {c["type"]: c for c in st["conditions"]}
    assert conditions["Failed"]["reason"] == reason
    assert ("Diverged" in conditions) == (code == ExitCode.DIVERGED)


def test_exit_75_is_a_preemption_not_a_failure_and_restarts_at_once() -> None:
    cluster = world()
    pod = running(cluster)
    cluster.exit(NS, pod, ExitCode.PREEMPTED)
    step(cluster)
    st = status(cluster)
    assert (st["preemptions"], st.get("failures", 0), st["attempt"]) == (1, 0, 1)
    assert "j-a1-0" in cluster.names("Pod") and reasons(cluster).count("Preempted") == 1


def test_a_lost_node_preempts_the_attempt_and_its_pod_goes_at_once() -> None:
    cluster = world("gpu-80g")
    pod = running(cluster)
    cluster.add(node("gpu-48g-nvme"))
    cluster.remove_node("gpu-80g")
    step(cluster)
    st = status(cluster)
    assert st["preemptions"] == 1 and st.get("failures", 0) == 0
    assert (pod, 0) in cluster.deleted  # no grace: the node that would honour it is gone
    assert cluster.names("Pod") == ["j-a1-0"] and st["plan"]["nodeNames"] == ["gpu-48g-nvme"]


def test_suspend_stops_the_pods_and_resume_starts_a_new_attempt() -> None:
    cluster = world()
    pod = running(cluster)
    cluster.set_spec(NS, "j", suspend=True)
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "Suspended" and st["attempt"] == 1 and (pod, None) in cluster.deleted
    assert st.get("failures", 0) == 0 and st.get("preemptions", 0) == 0
    step(cluster)
    assert cluster.names("Pod") == [] and status(cluster)["phase"] == "Suspended"
    cluster.set_spec(NS, "j", suspend=False)
    step(cluster)
    assert cluster.names("Pod") == ["j-a1-0"] and status(cluster)["phase"] == "Planned"


def test_a_rollback_to_a_known_checkpoint_restarts_and_an_unknown_one_is_refused() -> None:
    cluster = world()
    pod = running(cluster)
    cluster.set_spec(NS, "j", resumeFrom="step-00000009")
    step(cluster)
    rollback = {c["type"]: c for c in status(cluster)["conditions"]}["Rollback"]
    assert rollback["status"] == "False" and rollback["reason"] == "UnknownCheckpoint"
    assert cluster.names("Pod") == [pod] and status(cluster)["phase"] == "Running"
    cluster.patch_job_status(NS, "j", {"status": {"checkpoints": [{"name": "step-00000009", "step": 9}]}})
    step(cluster)
    st = status(cluster)
    assert st["appliedResumeFrom"] == "step-00000009" and st["resumeAttempt"] == 1 == st["attempt"]
    assert "j-a1-0" in cluster.names("Pod") and "RollingBack" in reasons(cluster)
    config = cluster.configmap_data(NS, b.configmap_name("j"))
    assert config is not None and "step-00000009" in config[b.CONFIG_FILE]


def test_a_job_that_fits_nowhere_fails_with_the_closest_plan() -> None:
    cluster = world("gpu-24g", model={"uri": "pvc://models/llama", "parameterCount": "400B"})
    with pytest.raises(PermanentFailure, match="short by"):
        step(cluster)
    st = status(cluster)
    assert st["phase"] == "Failed" and st["plan"]["feasible"] is False and st["plan"]["shortfalls"]
    assert cluster.names("Pod") == [] and reasons(cluster) == ["NoFit"]


def test_deepspeed_settings_no_plan_accepts_fail_the_job_before_any_pod() -> None:
    cluster = world(offload={"deepspeed": {"train_batch_size": 7}})
    with pytest.raises(PermanentFailure, match="train_batch_size"):
        step(cluster)
    assert status(cluster)["phase"] == "Failed" and cluster.names("Pod") == []
    assert {c["type"]: c for c in status(cluster)["conditions"]}["Failed"]["reason"] == "InvalidSpec"


def test_a_missing_input_claim_holds_the_job_until_it_exists() -> None:
    cluster = world()
    del cluster.objects[("PersistentVolumeClaim", NS, "data")]
    assert step(cluster).requeue_after is not None
    assert cluster.names("Pod") == [] and reasons(cluster) == ["InputsMissing"]
    # `kubectl get` shows a phase and `status.message` why, not an empty row
    assert status(cluster)["phase"] == "Pending"
    assert status(cluster)["message"].startswith("waiting for inputs: PersistentVolumeClaim 'data'")
    cluster.add({"kind": "PersistentVolumeClaim", "metadata": {"name": "data", "namespace": NS}})
    step(cluster)
    assert cluster.names("Pod") == ["j-a0-0"]
    assert {c["type"]: c for c in status(cluster)["conditions"]}["InputsReady"]["status"] == "True"


def test_a_spent_budget_stops_the_job() -> None:
    cluster = world(budget={"maxCostUSD": 0.5})
    running(cluster)
    cluster.patch_job_status(NS, "j", {"status": {"cost": {"settledUSD": 0.0, "usd": 0.0, "asOf": "2000-01-01T00:00:00Z"}}})
    # An hour of the pod at the plan's price is far beyond $0.50.
    cluster.set_pod(NS, "j-a0-0", {"startTime": "2000-01-01T00:00:00Z"})
    step(cluster)
    st = status(cluster)
    assert st["phase"] == "BudgetExceeded" and st["cost"]["usd"] >= 0.5 and cluster.names("Pod") == []


def test_a_finished_job_is_deleted_after_its_ttl() -> None:
    cluster = world(ttlSecondsAfterFinished=0)
    pod = running(cluster)
    cluster.exit(NS, pod, 0)
    step(cluster)
    step(cluster)
    assert cluster.get("FineTuneJob", NS, "j") is None and reasons(cluster)[-1] == "Expired"


def test_the_longest_ttl_admitted_keeps_a_finished_job_without_overflowing() -> None:
    """A TTL of 3e11 s overflowed the finish time's datetime; the spec's bound keeps one in range."""
    cluster = world(ttlSecondsAfterFinished=MAX_SECONDS)
    pod = running(cluster)
    cluster.exit(NS, pod, 0)
    step(cluster)
    step(cluster)
    job = cluster.get("FineTuneJob", NS, "j")
    assert job is not None and job["status"]["phase"] == "Succeeded"


def test_a_status_write_decided_on_a_stale_job_is_refused_not_applied() -> None:
    """Moving to a new attempt is a conditional patch: a job changed since it was read
    (another operator replica, a user's patch) answers 409 and nothing is counted twice."""
    cluster = world()
    running(cluster)
    stale = cluster.get("FineTuneJob", NS, "j")
    assert stale is not None
    cluster.patch_job_status(NS, "j", {"status": {"message": "someone else wrote"}})
    change = StatusChange(stale, datetime.now(UTC), cluster)
    change.status["attempt"] = 1
    change.conditional = True
    with pytest.raises(ApiException) as err:
        change.commit()
    assert err.value.status == 409 and status(cluster).get("attempt", 0) == 0


@pytest.mark.parametrize(("reason", "age_seconds", "fails"), [
    ("InvalidImageName", 0, True),
    ("CreateContainerConfigError", 0, True),
    ("ErrImagePull", 0, False),  # within the pull grace: may be a registry hiccup
    ("ImagePullBackOff", 400, True),
])
def test_a_container_that_cannot_start_fails_the_job_naming_the_image(reason: str, age_seconds: int,
                                                                       fails: bool) -> None:
    cluster = world()
    step(cluster)
    pod = cluster.get("Pod", NS, "j-a0-0")
    assert pod is not None
    container = pod["spec"]["containers"][0]
    created = datetime.now(UTC) - timedelta(seconds=age_seconds)
    cluster.objects[("Pod", NS, "j-a0-0")]["metadata"]["creationTimestamp"] = b.rfc3339(created)
    cluster.set_pod(NS, "j-a0-0", {"phase": "Pending", "containerStatuses": [
        {"name": container["name"], "image": container["image"],
         "state": {"waiting": {"reason": reason, "message": "no such image"}}}]}, node_name="gpu-80g")
    step(cluster)
    st = status(cluster)
    if not fails:
        assert st["phase"] == "Scheduled"
        return
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert st["phase"] == "Failed" and failed["reason"] == reason and st.get("attempt", 0) == 0
    assert container["image"] in failed["message"] and "SPILLWAY_OPERATOR_RUNTIME_IMAGE" in failed["message"]
    assert cluster.events[-1][0] == "Warning" and cluster.names("Pod") == []


def _block_size_of_attempt(cluster: FakeCluster) -> int:
    data = cluster.configmap_data(NS, b.configmap_name("j"))
    assert data is not None
    return RuntimeConfig.model_validate_json(data[b.CONFIG_FILE]).plan.aio.block_size


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_new_attempt_keeps_the_aio_block_size_its_checkpoints_were_written_under(checkpointed: bool) -> None:
    """The block size decides which small optimizer sub-groups DeepSpeed swaps: a node probed
    again between attempts must not move one out of the checkpoint's swap files."""
    probed = {"spillway.dev/aio-block-size": str(1 << 20), "spillway.dev/aio-queue-depth": "32",
              "spillway.dev/aio-intra-op-parallelism": "1"}
    cluster = FakeCluster(node("gpu-24g"))
    cluster.objects[("Node", "", "gpu-24g")]["metadata"].setdefault("annotations", {}).update(probed)
    for claim in ("models", "data"):
        cluster.add({"kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": NS}})
    cluster.add(job(model={"uri": "pvc://models/llama", "parameterCount": "13B"}))
    pod = running(cluster)
    assert status(cluster)["plan"]["optimizer"] == "nvme" and _block_size_of_attempt(cluster) == 1 << 20
    if checkpointed:
        cluster.patch_job_status(NS, "j", {"status": {"checkpoints": [{"name": "step-00000010", "step": 10}]}})
    # The node's probe runs again and finds another best block size; the attempt fails.
    cluster.objects[("Node", "", "gpu-24g")]["metadata"]["annotations"]["spillway.dev/aio-block-size"] = str(8 << 20)
    cluster.exit(NS, pod, 1)
    step(cluster)
    cluster.patch_job_status(NS, "j", {"status": {"retryAfter": "2000-01-01T00:00:00Z"}})
    step(cluster)
    assert "j-a1-0" in cluster.names("Pod")
    kept = "async-I/O block size 1024 KiB kept from the job's checkpoints"
    if checkpointed:
        assert _block_size_of_attempt(cluster) == 1 << 20 and kept in status(cluster)["plan"]["reasons"]
    else:
        assert _block_size_of_attempt(cluster) == 8 << 20 and kept not in status(cluster)["plan"]["reasons"]


def test_a_spec_that_stops_parsing_under_a_running_attempt_stops_its_pods_and_fails_the_job() -> None:
    """A stored spec the spec model now refuses (a stricter operator, a field the webhook does
    not check): the attempt ends as a permanent pod failure ends it, not left running."""
    cluster = world()
    pod = running(cluster)
    cluster.set_spec(NS, "j", training={"maxSteps": -1})  # stored as is: no admission here
    with pytest.raises(PermanentFailure, match="maxSteps"):
        step(cluster)
    st = status(cluster)
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert st["phase"] == "Failed" and "maxSteps" in st["message"] and st["finishedAt"]
    assert failed["reason"] == "InvalidSpec" and "maxSteps" in failed["message"]
    assert cluster.names("Pod") == [] and (pod, None) in cluster.deleted  # with the pod's own grace
    assert st["cost"]["settledUSD"] == st["cost"]["usd"] and st.get("attempt", 0) == 0
    assert reasons(cluster) == ["Planned", "Running", "InvalidSpec"] and cluster.events[-1][0] == "Warning"
    # Reconciling again changes nothing: no patch, no Event.
    version = (cluster.get("FineTuneJob", NS, "j") or {})["metadata"]["resourceVersion"]
    with pytest.raises(PermanentFailure, match="maxSteps"):
        step(cluster)
    assert (cluster.get("FineTuneJob", NS, "j") or {})["metadata"]["resourceVersion"] == version
    assert reasons(cluster) == ["Planned", "Running", "InvalidSpec"] and cluster.names("Pod") == []


def test_a_pod_left_running_by_a_kill_after_an_invalid_spec_failed_the_job_goes_on_the_next_pass() -> None:
    cluster = world()
    pod = running(cluster)
    left = cluster.get("Pod", NS, pod)
    assert left is not None
    cluster.set_spec(NS, "j", training={"maxSteps": -1})
    with pytest.raises(PermanentFailure):
        step(cluster)
    cluster.add(left)  # as if the operator was killed between the Failed status and the delete
    with pytest.raises(PermanentFailure, match="maxSteps"):
        step(cluster)
    assert cluster.names("Pod") == [] and status(cluster)["phase"] == "Failed"
    assert reasons(cluster).count("InvalidSpec") == 1


def test_an_invalid_spec_of_a_finished_job_fails_it_as_before_and_touches_nothing_else() -> None:
    cluster = world()
    pod = running(cluster)
    cluster.exit(NS, pod, 0)
    step(cluster)
    succeeded = status(cluster)
    cluster.set_spec(NS, "j", training={"maxSteps": -1})
    with pytest.raises(PermanentFailure, match="maxSteps"):
        step(cluster)
    st = status(cluster)
    assert st["phase"] == "Failed" and "maxSteps" in st["message"]
    assert (st["cost"], st["finishedAt"]) == (succeeded["cost"], succeeded["finishedAt"])
    assert cluster.names("Pod") == [pod] and reasons(cluster)[-2:] == ["Completed", "InvalidSpec"]
