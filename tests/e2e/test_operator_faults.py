"""Operator bad-input and fault cases against the real control plane: missing PVCs and
StorageClasses give a truthful condition and event and no pod until they appear; an API
server that stops answering for a while is survived without losing or duplicating pods."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.operator_fixtures import (
    CHECKPOINT_CLASS,
    CRD,
    OPERATOR_NAMESPACE,
    OperatorProcess,
    active_pods,
    add_checkpoint_volume,
    events_of,
    job_manifest,
    wait_status,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def operator(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/finetunejobs.spillway.dev", "--timeout=30s")
    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    op = OperatorProcess(cluster.env, tmp_path_factory.mktemp("operator-faults") / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()


def _condition(job: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in job.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def test_missing_pvc_and_storage_class_hold_the_job_until_they_exist(
    cluster: Any, namespace: str, operator: OperatorProcess, make_node: Callable[..., str]
) -> None:
    node = make_node("gpu-48g-nvme")
    add_checkpoint_volume(cluster)
    body = job_manifest("inputs", node=node, model={"uri": "pvc://base-models/llama", "parameterCount": "7B"},
                        checkpoint={"storageClassName": "fast-ckpt"})
    cluster.apply(body, namespace)
    job = wait_status(cluster, namespace, "inputs",
                      lambda s: any(c["type"] == "InputsReady" and c["status"] == "False"
                                    for c in s.get("conditions", [])), timeout=60)
    message = _condition(job, "InputsReady")["message"]
    assert "PersistentVolumeClaim 'base-models'" in message and "StorageClass 'fast-ckpt'" in message
    assert any(e["reason"] == "InputsMissing" and e["type"] == "Warning" for e in events_of(cluster, namespace, "inputs"))
    time.sleep(3)
    assert active_pods(cluster, namespace, "inputs") == []  # nothing half-provisioned

    # the admin fixes both; the job proceeds on its own (retried, not failed)
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "fast-ckpt"},
        "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"}))
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "base-models"},
                   "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": CHECKPOINT_CLASS,
                            "resources": {"requests": {"storage": "1Gi"}}}}, namespace)
    job = wait_status(cluster, namespace, "inputs", lambda s: bool(s.get("plan", {}).get("attempt") is not None
                                                                      and _condition({"status": s}, "InputsReady")
                                                                      .get("status") == "True"), timeout=90)
    cluster.wait_for(lambda: active_pods(cluster, namespace, "inputs"), 60, what="pod after inputs appear")
    assert len(active_pods(cluster, namespace, "inputs")) == 1


def test_api_server_pause_is_survived_without_duplicates(
    cluster: Any, namespace: str, operator: OperatorProcess, make_node: Callable[..., str]
) -> None:
    node = make_node("gpu-48g-nvme")
    for _ in range(2):
        add_checkpoint_volume(cluster)
    cluster.apply(job_manifest("before", node=node), namespace)
    wait_status(cluster, namespace, "before", lambda s: s.get("phase") == "Running", timeout=60)
    if cluster.state_dir is None:
        pytest.skip("an existing cluster's API server (SPILLWAY_E2E_USE_EXISTING) is not ours to pause")
    pid = int((cluster.state_dir / "run" / "kube-apiserver.pid").read_text())
    os.kill(pid, signal.SIGSTOP)  # the API server stops answering: requests and watches hang
    try:
        time.sleep(40)
        assert operator.proc is not None and operator.proc.poll() is None  # the operator rode it out
    finally:
        os.kill(pid, signal.SIGCONT)
    cluster.wait_for(lambda: cluster.kubectl("get", "--raw", "/readyz", check=False).returncode == 0, 60,
                     what="API server back")
    cluster.apply(job_manifest("after", node=node), namespace)
    wait_status(cluster, namespace, "after", lambda s: s.get("phase") == "Running", timeout=120)
    time.sleep(3)
    assert len(active_pods(cluster, namespace, "before")) == 1
    assert len(active_pods(cluster, namespace, "after")) == 1


def test_rbac_forbidding_pod_creation_is_reported_and_retried(
    cluster: Any, namespace: str, make_node: Callable[..., str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The operator runs as a service account with the chart's operator roles minus `create pods`:
    the job says which permission is missing, creates nothing, and proceeds once it is granted."""
    import yaml

    from tests.e2e.test_chart import CHART, service_account_kubeconfig

    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    node = make_node("gpu-48g-nvme")
    add_checkpoint_volume(cluster)
    rendered = cluster.helm("template", "spillway-limited", str(CHART), "-n", OPERATOR_NAMESPACE,
                            "--set", "operator.leaderElection=false").stdout
    roles = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in ("ClusterRole", "Role")
             and d["metadata"]["name"].startswith("spillway-limited-operator")]
    assert roles, "the chart renders operator roles"
    account = "limited-operator"
    cluster.kubectl("create", "serviceaccount", account, "-n", OPERATOR_NAMESPACE, check=False)
    for role in roles:
        for rule in role["rules"]:
            if "pods" in rule.get("resources", []):
                rule["verbs"] = [v for v in rule["verbs"] if v != "create"]
        cluster.apply(role)
        binding_kind = "ClusterRoleBinding" if role["kind"] == "ClusterRole" else "RoleBinding"
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": binding_kind,
                   "metadata": {"name": role["metadata"]["name"], **({"namespace": OPERATOR_NAMESPACE}
                                                                     if binding_kind == "RoleBinding" else {})},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role["kind"],
                               "name": role["metadata"]["name"]},
                   "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": OPERATOR_NAMESPACE}]}
        cluster.apply(binding)
    work = tmp_path_factory.mktemp("limited-operator")
    env = dict(cluster.env)
    env["KUBECONFIG"] = str(service_account_kubeconfig(cluster, OPERATOR_NAMESPACE, account, work / "kubeconfig"))
    op = OperatorProcess(env, work / "operator.log")
    op.env["SPILLWAY_OPERATOR_PRICING_CONFIGMAP"] = "spillway-limited-pricing"
    op.start()
    try:
        cluster.apply(job_manifest("denied", node=node), namespace)
        job = wait_status(cluster, namespace, "denied",
                          lambda s: _condition({"status": s}, "Authorized").get("status") == "False", timeout=90)
        message = _condition(job, "Authorized")["message"]
        assert "forbidden" in message.lower() and "pods" in message
        assert any(e["reason"] == "Forbidden" for e in events_of(cluster, namespace, "denied"))
        assert active_pods(cluster, namespace, "denied") == []

        cluster.kubectl("create", "clusterrole", "limited-operator-pods", "--verb=create", "--resource=pods")
        cluster.kubectl("create", "clusterrolebinding", "limited-operator-pods", "--clusterrole=limited-operator-pods",
                        f"--serviceaccount={OPERATOR_NAMESPACE}:{account}")
        wait_status(cluster, namespace, "denied",
                    lambda s: _condition({"status": s}, "Authorized").get("status") == "True", timeout=120)
        assert len(active_pods(cluster, namespace, "denied")) == 1
    finally:
        op.stop()
        cluster.kubectl("delete", "clusterrolebinding", "limited-operator-pods", check=False)
        cluster.kubectl("delete", "clusterrole", "limited-operator-pods", check=False)
        for role in roles:
            cluster.kubectl("delete", role["kind"].lower(), role["metadata"]["name"],
                            *(["-n", OPERATOR_NAMESPACE] if role["kind"] == "Role" else []), check=False)
