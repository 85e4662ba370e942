"""The real operator process against the real control plane (hack/cluster, kwok nodes)."""

from __future__ import annotations

import copy
import json
import random
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.bad_jobs import CORPUS, POD_FILESYSTEM, WEBHOOK_ONLY
from tests.e2e.operator_fixtures import (
    INPUTS_CLAIM,
    MODEL_URI,
    OPERATOR_NAMESPACE,
    OperatorProcess,
    active_pods,
    add_checkpoint_volume,
    events_of,
    job_manifest,
    pods_of,
    running_operator,
    wait_status,
)

pytestmark = pytest.mark.e2e

@pytest.fixture(scope="module")
def operator(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with running_operator(cluster, tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


def test_api_server_rejects_invalid_job_naming_the_field(cluster: Any, namespace: str, operator: Any) -> None:
    bad = job_manifest("bad", training={"maxSteps": 10, "warmupSteps": 20})
    proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False)
    assert proc.returncode != 0
    assert "warmupSteps" in proc.stderr
    typo = job_manifest("typo", resources={"placement": "random"})
    proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(typo), check=False)
    assert proc.returncode != 0 and "spec.resources.placement" in proc.stderr
    forever = {**job_manifest("forever"), "spec": {**job_manifest("forever")["spec"], "ttlSecondsAfterFinished": 3 * 10**11}}
    proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(forever), check=False)
    assert proc.returncode != 0 and "spec.ttlSecondsAfterFinished" in proc.stderr  # it overflowed the reconciler
    cluster.apply(job_manifest("ok", node="nowhere"), namespace)
    other_model = json.dumps({"spec": {"model": {"uri": f"pvc://{INPUTS_CLAIM}/other"}}})
    proc = cluster.kubectl("patch", "ftj", "ok", "-n", namespace, "--type=merge", "-p", other_model, check=False)
    assert proc.returncode != 0 and "model.uri is immutable" in proc.stderr


def test_plans_creates_children_retries_and_succeeds(
    cluster: Any,
    namespace: str,
    operator: OperatorProcess,
    make_node: Callable[..., str],
    set_pod_phase: Callable[..., Any],
) -> None:
    node = make_node("gpu-48g-nvme")
    add_checkpoint_volume(cluster)
    started = time.monotonic()
    cluster.apply(job_manifest("train", node=node, backoffLimit=2), namespace)
    job = wait_status(cluster, namespace, "train", lambda s: s.get("phase") == "Running", 30, "Running")
    print(f"apply -> Running: {time.monotonic() - started:.2f} s")
    plan = job["status"]["plan"]
    assert plan["label"].startswith("Z") and plan["gpusPerNode"] == 1
    assert job["status"]["observedGeneration"] == job["metadata"]["generation"]
    pod = cluster.get("pod", "train-a0-0", namespace)
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["spec"]["nodeName"] == node
    runtime = json.loads(cluster.get("configmap", "train-runtime", namespace)["data"]["runtime.json"])
    assert runtime["plan"]["zero_stage"] == plan["zeroStage"]  # the full plan the pods read, and its summary
    for kind, name in [
        ("pvc", "train-checkpoints"),
        ("serviceaccount", "train-runtime"),
        ("role", "train-runtime"),
        ("rolebinding", "train-runtime"),
    ]:
        obj = cluster.get(kind, name, namespace)
        assert obj is not None and obj["metadata"]["ownerReferences"][0]["kind"] == "FineTuneJob"
    can = cluster.kubectl(
        "auth",
        "can-i",
        "patch",
        "finetunejobs.spillway.dev/train",
        "--subresource=status",
        "-n",
        namespace,
        f"--as=system:serviceaccount:{namespace}:train-runtime",
        check=False,
    )
    assert can.stdout.strip() == "yes"
    cannot = cluster.kubectl(
        "auth",
        "can-i",
        "patch",
        "finetunejobs.spillway.dev/other",
        "--subresource=status",
        "-n",
        namespace,
        f"--as=system:serviceaccount:{namespace}:train-runtime",
        check=False,
    )
    assert cannot.stdout.strip() == "no"

    set_pod_phase(namespace, "train-a0-0", "Failed", exit_code=1)
    wait_status(cluster, namespace, "train", lambda s: s.get("attempt") == 1, 20, "retry after a failure")
    cluster.wait_for(lambda: active_pods(cluster, namespace, "train") == ["train-a1-0"], 20, what="retry pod")
    set_pod_phase(namespace, "train-a1-0", "Failed", exit_code=75)
    job = wait_status(cluster, namespace, "train", lambda s: s.get("attempt") == 2, 20, "preemption")
    assert job["status"]["failures"] == 1 and job["status"]["preemptions"] == 1
    cluster.wait_for(lambda: active_pods(cluster, namespace, "train") == ["train-a2-0"], 20, what="pod a2")
    set_pod_phase(namespace, "train-a2-0", "Succeeded")
    job = wait_status(cluster, namespace, "train", lambda s: s.get("phase") == "Succeeded", 20)
    assert job["status"]["cost"]["usd"] > 0
    reasons = {e["reason"] for e in events_of(cluster, namespace, "train")}
    assert {"Planned", "Running", "AttemptFailed", "Preempted", "Completed"} <= reasons
    assert "spillway_jobs" in operator.metrics()


def test_job_that_fits_nowhere_fails_with_the_short_tier(
    cluster: Any, namespace: str, operator: Any, make_node: Callable[..., str]
) -> None:
    node = make_node("gpu-24g")
    cluster.apply(job_manifest("huge", node=node, model={"uri": MODEL_URI, "parameterCount": "400B"}), namespace)
    job = wait_status(cluster, namespace, "huge", lambda s: s.get("phase") == "Failed", 30)
    planned = next(c for c in job["status"]["conditions"] if c["type"] == "Planned")
    assert planned["status"] == "False" and planned["reason"] == "NoFit"
    assert "short by" in planned["message"] and "GiB" in planned["message"]
    assert pods_of(cluster, namespace, "huge") == []
    assert any(e["reason"] == "NoFit" for e in events_of(cluster, namespace, "huge"))


def test_deepspeed_settings_that_contradict_the_job_fail_it_by_name_without_pods(
    cluster: Any, namespace: str, operator: Any, make_node: Callable[..., str]
) -> None:
    """Found only when the operator builds what the pods read: it stayed Planned, retried
    forever, with the reason in the operator's log alone."""
    node = make_node("gpu-24g")
    cluster.apply(job_manifest("contradicts", node=node, offload={"deepspeed": {"train_batch_size": 999}}), namespace)
    job = wait_status(cluster, namespace, "contradicts", lambda s: s.get("phase") == "Failed", 30)
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidSpec", failed
    assert "offload.deepspeed.train_batch_size is 999" in failed["message"] and "training." in failed["message"]
    assert pods_of(cluster, namespace, "contradicts") == []
    assert any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in events_of(cluster, namespace, "contradicts"))


def test_no_malformed_job_of_the_corpus_sits_in_planned(cluster: Any, namespace: str, operator: Any) -> None:
    """Each job of the malformed corpus is either refused by `kubectl apply` (the CRD's schema
    and rules) naming the field, or ends Failed (InvalidSpec, with the field in its message)
    within 30 s, before any pod; none is left Pending or Planned. A hostile tenant's inputs
    on the pod's own filesystem (bad_jobs.POD_FILESYSTEM) end Failed saying what to write."""
    accepted: dict[str, str] = {}  # job -> what its Failed condition says
    corpus = [(what, job, expected, what in POD_FILESYSTEM) for what, job, expected in CORPUS if what not in WEBHOOK_ONLY]
    for i, (what, job, expected, whole) in enumerate(corpus):
        field = re.split(r"[: ]", expected, maxsplit=1)[0]
        job = {**copy.deepcopy(job), "metadata": {"name": f"bad-{i}"}}
        proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(job), check=False)
        if proc.returncode != 0:
            assert field in proc.stderr, (what, proc.stderr)
        else:
            accepted[f"bad-{i}"] = expected if whole else field
    assert accepted, "the API server refused every job: the operator's half is untested"

    def failed_all() -> dict[str, dict[str, Any]] | None:
        jobs = {name: cluster.get("finetunejob", name, namespace) or {} for name in accepted}
        done = all((j.get("status") or {}).get("phase") == "Failed" for j in jobs.values())
        return jobs if done else None

    jobs = cluster.wait_for(failed_all, 30, interval=1, what=f"{sorted(accepted)} Failed")
    for name, says in accepted.items():
        failed = next(c for c in jobs[name]["status"]["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "InvalidSpec" and says in failed["message"], (name, failed)
        assert pods_of(cluster, namespace, name) == []


@pytest.mark.pod_security("restricted")
def test_a_restricted_namespace_runs_nvme_on_a_storage_class_volume_and_names_why_not_on_the_nodes_root(
    cluster: Any, namespace: str, operator: Any, make_node: Callable[..., str]
) -> None:
    """Pod Security `restricted` enforced by the API server on the job's namespace. A job
    whose NVMe tier is its directory under the node's NVMe root (a hostPath) gets no pod: its
    condition says the namespace refuses it and names storageClassName. The same job with a
    StorageClass volume (a generic ephemeral claim, fsGroup, nothing of the node) runs."""
    node = make_node("gpu-48g-nvme")
    nvme = {"policy": "nvme", "optimizer": "nvme"}
    add_checkpoint_volume(cluster)
    cluster.apply(job_manifest("on-root", node=node, offload=nvme), namespace)

    def refused(status: dict[str, Any]) -> bool:
        return any(c["type"] == "Authorized" and c["reason"] == "PodSecurity" for c in status.get("conditions", []))

    job = wait_status(cluster, namespace, "on-root", refused, 60, "the pod refused by Pod Security")
    message = next(c["message"] for c in job["status"]["conditions"] if c["type"] == "Authorized")
    assert 'violates PodSecurity "restricted' in message and "spec.offload.nvme.storageClassName" in message, message
    assert job["status"]["plan"]["optimizer"] == "nvme" and pods_of(cluster, namespace, "on-root") == []

    local_class = f"e2e-local-nvme-{namespace}"[:63]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": local_class},
        "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"}))
    volume = f"{local_class}-pv"[:63]
    cluster.kubectl("create", "-f", "-", input=json.dumps({  # what a local-volume provisioner would make
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
        "spec": {"capacity": {"storage": "1Pi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": local_class,
                 "persistentVolumeReclaimPolicy": "Delete", "hostPath": {"path": f"/tmp/{volume}"}}}))
    try:
        add_checkpoint_volume(cluster)
        cluster.apply(job_manifest("on-class", node=node, offload={**nvme, "nvme": {"storageClassName": local_class}}),
                      namespace)
        wait_status(cluster, namespace, "on-class", lambda s: s.get("phase") == "Running", 60, "Running under restricted")
        [pod] = pods_of(cluster, namespace, "on-class")
        [claim] = [v for v in pod["spec"]["volumes"] if v["name"] == "nvme"]
        assert claim["ephemeral"]["volumeClaimTemplate"]["spec"]["storageClassName"] == local_class
        assert not [v for v in pod["spec"]["volumes"] if "hostPath" in v] and "initContainers" not in pod["spec"]
    finally:
        cluster.kubectl("delete", "ftj", "--all", "-n", namespace, "--wait=true", timeout=60, check=False)
        cluster.kubectl("delete", "pv", volume, "--wait=false", check=False)
        cluster.kubectl("delete", "storageclass", local_class, check=False)


def test_suspend_resume_and_rollback(cluster: Any, namespace: str, operator: Any, make_node: Callable[..., str]) -> None:
    node = make_node("gpu-48g-nvme")
    add_checkpoint_volume(cluster)
    cluster.apply(job_manifest("roll", node=node), namespace)
    wait_status(cluster, namespace, "roll", lambda s: s.get("phase") == "Running", 30)
    cluster.kubectl("patch", "ftj", "roll", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_status(cluster, namespace, "roll", lambda s: s.get("phase") == "Suspended", 20)
    cluster.wait_for(lambda: active_pods(cluster, namespace, "roll") == [], 20, what="pods gone when suspended")
    cluster.kubectl("patch", "ftj", "roll", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    wait_status(cluster, namespace, "roll", lambda s: s.get("phase") == "Running", 30, "resumed")
    before = active_pods(cluster, namespace, "roll")
    assert len(before) == 1

    # The runtime reports checkpoints with server-side apply under its own field manager.
    checkpoint = {
        "apiVersion": "spillway.dev/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": "roll", "namespace": namespace},
        "status": {"checkpoints": [{"name": "step-00010", "step": 10, "loss": 2.5}]},
    }
    cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager=spillway-runtime",
        "--subresource=status",
        "-f",
        "-",
        input=json.dumps(checkpoint),
    )
    cluster.kubectl("patch", "ftj", "roll", "-n", namespace, "--type=merge", "-p", '{"spec":{"resumeFrom":"nope"}}')
    job = wait_status(
        cluster,
        namespace,
        "roll",
        lambda s: any(c["type"] == "Rollback" and c["reason"] == "UnknownCheckpoint" for c in s.get("conditions", [])),
        20,
    )
    assert active_pods(cluster, namespace, "roll") == before
    cluster.kubectl("patch", "ftj", "roll", "-n", namespace, "--type=merge", "-p", '{"spec":{"resumeFrom":"step-00010"}}')
    job = wait_status(cluster, namespace, "roll", lambda s: s.get("appliedResumeFrom") == "step-00010", 20)
    cluster.wait_for(lambda: (p := active_pods(cluster, namespace, "roll")) and p != before, 20, what="new pod")
    runtime = json.loads(cluster.get("configmap", "roll-runtime", namespace)["data"]["runtime.json"])
    assert runtime["job"]["spec"]["resumeFrom"] == "step-00010"
    assert job["status"]["checkpoints"][0]["name"] == "step-00010"  # operator never overwrote it
    assert any(e["reason"] == "UnknownCheckpoint" for e in events_of(cluster, namespace, "roll"))


def test_budget_ttl_and_node_loss(
    cluster: Any, namespace: str, operator: Any, make_node: Callable[..., str], delete_node: Callable[[str], None]
) -> None:
    node = make_node("gpu-48g-nvme")
    add_checkpoint_volume(cluster)
    add_checkpoint_volume(cluster)
    # $36000 per GPU-hour: $10 per second, so a $5 budget runs out at once.
    cluster.kubectl(
        "create", "configmap", "spillway-pricing", "-n", OPERATOR_NAMESPACE, "--from-literal=NVIDIA-L40S=36000", check=False
    )
    try:
        cluster.apply(job_manifest("pricey", node=node, budget={"maxCostUSD": 5}, ttlSecondsAfterFinished=3), namespace)
        job = wait_status(cluster, namespace, "pricey", lambda s: s.get("phase") == "BudgetExceeded", 30)
        assert job["status"]["cost"]["usd"] >= 5
        cluster.wait_for(lambda: cluster.get("finetunejob", "pricey", namespace) is None, 30, what="TTL deletion")
    finally:
        cluster.kubectl("delete", "configmap", "spillway-pricing", "-n", OPERATOR_NAMESPACE, check=False)

    cluster.apply(job_manifest("lost", node=node), namespace)
    wait_status(cluster, namespace, "lost", lambda s: s.get("phase") == "Running", 30)
    delete_node(node)
    job = wait_status(cluster, namespace, "lost", lambda s: s.get("preemptions") == 1, 30, "node loss")
    assert job["status"].get("failures", 0) == 0
    # Deleted by the operator as it counts the preemption (kwok finalizes the deletion a moment later)
    cluster.wait_for(lambda: cluster.get("pod", "lost-a0-0", namespace) is None, 10, what="the lost node's pod gone")


def test_sigkill_mid_reconcile_converges_without_duplicates(
    cluster: Any, namespace: str, operator: OperatorProcess, make_node: Callable[..., str]
) -> None:
    node = make_node("gpu-80g")
    names = [f"k{i}" for i in range(6)]
    for _ in names:
        add_checkpoint_volume(cluster)
    rng = random.Random(7)
    for name in names:
        cluster.apply(job_manifest(name, node=node), namespace)
        operator.kill()  # at an arbitrary point of the reconciles in flight
        operator.start()
        time.sleep(rng.uniform(0.0, 1.5))
    for name in names:
        wait_status(cluster, namespace, name, lambda s: s.get("phase") == "Running", 60, f"{name} Running")
    for name in names:
        pods = pods_of(cluster, namespace, name)
        assert [p["metadata"]["name"] for p in pods] == [f"{name}-a0-0"], name
    operator.kill()
    operator.start()
    time.sleep(5)
    for name in names:
        assert active_pods(cluster, namespace, name) == [f"{name}-a0-0"]
        job = cluster.get("finetunejob", name, namespace)
        assert job["status"]["plan"]["label"] and job["status"].get("attempt", 0) == 0
    # A kill between the pods and the children created after them: status lacks the mark
    # that they all exist, two of them are gone. The restarted operator creates them again.
    # The operator is down while that state is made: a live one would mark the children done
    # again (it remembers creating them) before it could be killed.
    victim = names[0]
    operator.kill()
    cluster.kubectl("patch", "finetunejob", victim, "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"childrenAttempt": None}}))
    cluster.kubectl("delete", "role,rolebinding", f"{victim}-runtime", "-n", namespace)
    operator.start()
    cluster.wait_for(lambda: cluster.get("rolebinding", f"{victim}-runtime", namespace) is not None, 90,
                     what="children re-created after a kill between pods and children")
    assert cluster.get("role", f"{victim}-runtime", namespace) is not None
    assert wait_status(cluster, namespace, victim, lambda s: s.get("childrenAttempt") == 0)
    for name in names:
        assert cluster.get("pvc", f"{name}-checkpoints", namespace) is not None
        assert cluster.get("rolebinding", f"{name}-runtime", namespace) is not None
