"""The user flows after `helm install`, with the operator and the API as real processes under
the chart's own service accounts: a REST submission with curl and a user's token, a rollback
through the API that restarts the pod from the checkpoint, and a job that fits nowhere."""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from .operator_fixtures import OperatorProcess
from .test_api_cluster import ApiServer
from .test_chart import (  # noqa: F401  (fixtures)
    EXAMPLE,
    release,
    service_account_kubeconfig,
    volumes,
)

pytestmark = pytest.mark.e2e


def curl(url: str, token: str, method: str = "GET", body: Any = None) -> tuple[int, dict[str, Any]]:
    args = ["curl", "-sS", "-X", method, "-H", f"Authorization: Bearer {token}", "-w", "\n%{http_code}"]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "--data", json.dumps(body)]
    out = subprocess.run([*args, url], capture_output=True, text=True, timeout=30, check=True).stdout
    text, code = out.rsplit("\n", 1)
    return int(code), (json.loads(text) if text.strip() else {})


def test_rest_submission_rollback_and_no_fit_through_the_installed_chart(
    cluster: Any, namespace: str, make_node: Callable[..., str], volumes: Callable[[], str],  # noqa: F811
    release: Callable[..., Any], tmp_path: Path,  # noqa: F811
) -> None:
    for cls in ("spillway-checkpoints",):
        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": cls},
            "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"}))
    checkpoint_pvs = []
    for _ in range(2):
        name = f"e2e-flow-ckpt-{secrets.token_hex(4)}"
        checkpoint_pvs.append(name)
        cluster.kubectl("create", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {"capacity": {"storage": "1Pi"}, "accessModes": ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "spillway-checkpoints",
                     "hostPath": {"path": f"/tmp/{name}"}}}))
    for claim in ("models", "data"):
        volumes()
        cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
                       "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "spillway-e2e-chart",
                                "resources": {"requests": {"storage": "1Ti"}}}}, namespace)
    gpu = make_node("gpu-24g", nvme_volume=True)
    # The in-cluster pods would be fakes under kwok: the chart's accounts and RBAC are what count,
    # so the operator and the API run here as those accounts.
    release("--set", "operator.replicas=0", "--set", "api.replicas=0", "--set", "nodeProbe.enabled=false")

    operator_env = dict(cluster.env, KUBECONFIG=str(service_account_kubeconfig(
        cluster, namespace, "spillway-operator", tmp_path / "operator.kubeconfig")))
    operator = OperatorProcess(operator_env, tmp_path / "operator.log")
    operator.env["SPILLWAY_OPERATOR_NAMESPACE"] = namespace
    operator.env["SPILLWAY_OPERATOR_PRICING_CONFIGMAP"] = "spillway-pricing"
    api_kubeconfig = service_account_kubeconfig(cluster, namespace, "spillway-api", tmp_path / "api.kubeconfig")
    # Its pricing settings as the chart gives them (the ConfigMap in the release namespace).
    api = ApiServer(api_kubeconfig, tmp_path / "api.db", tmp_path / "api.log", namespace)
    # An ML engineer: `edit` in the namespace, which the chart's spillway-editor aggregates into.
    cluster.kubectl("create", "serviceaccount", "engineer", "-n", namespace)
    cluster.kubectl("create", "rolebinding", "engineer-edit", "--clusterrole=edit",
                    f"--serviceaccount={namespace}:engineer", "-n", namespace)
    token = cluster.kubectl("create", "token", "engineer", "-n", namespace, "--duration=1h",
                            "--audience=spillway").stdout.strip()  # the README's command
    operator.start()
    api.start()
    try:
        # 2. The 13B example submitted over REST with curl.
        body = yaml.safe_load(EXAMPLE.read_text())
        body["metadata"] = {"name": "rest-13b"}
        # The model from a claim here (test_chart.py follows the example's S3 download): this
        # flow is about REST, the plan and a rollback.
        body["spec"]["model"]["uri"] = "pvc://models/llama-13b"
        code, created = curl(f"{api.url}/v1/namespaces/{namespace}/jobs", token, "POST", body)
        assert code == 201, created
        assert cluster.get("ftj", "rest-13b", namespace) is not None
        # The dry run as the engineer sees it: the operator's placement, priced from the chart's
        # ConfigMap (the API reads it under the chart's Role; the default price would be $2).
        code, plans = curl(f"{api.url}/v1/plan?namespace={namespace}", token, "POST", {"spec": body["spec"]})
        assert code == 200, plans
        [mine] = [d for d in plans["data"] if d["plan"] and gpu in d["plan"]["nodeNames"]]
        per_gpu = mine["plan"]["pricePerHourUsd"] / (mine["plan"]["gpusPerNode"] * mine["plan"]["nodeCount"])
        assert per_gpu == pytest.approx(0.4), mine["plan"]

        def running_pod() -> dict[str, Any] | None:
            pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "spillway.dev/job=rest-13b")["items"]
            live = [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
            return live[0] if len(live) == 1 else None

        first = cluster.wait_for(running_pod, 90, what="the REST job's pod Running")
        assert first["spec"]["nodeName"] == gpu
        code, job = curl(f"{api.url}/v1/namespaces/{namespace}/jobs/rest-13b", token)
        assert code == 200 and "opt:nvme" in json.dumps(job), job

        # 3. The runtime reports a checkpoint (its server-side apply, done here by hand); a
        #    rollback through the API sets resumeFrom and the operator restarts the pod from it.
        cluster.kubectl("patch", "ftj", "rest-13b", "-n", namespace, "--subresource=status", "--type=merge", "-p",
                        json.dumps({"status": {"checkpoints": [
                            {"name": "step-00000050", "step": 50, "loss": 2.1},
                            {"name": "step-00000100", "step": 100, "loss": 1.9}]}}))
        cluster.wait_for(lambda: curl(f"{api.url}/v1/namespaces/{namespace}/jobs/rest-13b/checkpoints", token)[1]
                         .get("count", 0) >= 2, 30, what="checkpoints recorded by the API")
        code, refused = curl(f"{api.url}/v1/namespaces/{namespace}/jobs/rest-13b/rollback", token, "POST",
                             {"checkpoint": "step-99999999", "reason": "typo"})
        assert code == 409 and "step-00000050" in json.dumps(refused)
        code, accepted = curl(f"{api.url}/v1/namespaces/{namespace}/jobs/rest-13b/rollback", token, "POST",
                              {"checkpoint": "step-00000050", "reason": "loss spike after the data refresh"})
        assert code == 202, accepted
        assert cluster.get("ftj", "rest-13b", namespace)["spec"]["resumeFrom"] == "step-00000050"

        def restarted() -> dict[str, Any] | None:
            # The new attempt's pod exists and the old one is being deleted. (Under kwok the old pod
            # keeps the node's only GPU through its 600 s grace period, so the new one may wait in
            # Pending; a real runtime checkpoints and exits within seconds of SIGTERM.)
            pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "spillway.dev/job=rest-13b")["items"]
            new = [p for p in pods if p["metadata"]["name"] != first["metadata"]["name"]]
            old_gone = all(p["metadata"].get("deletionTimestamp") for p in pods
                           if p["metadata"]["name"] == first["metadata"]["name"])
            return new[0] if new and old_gone else None

        second = cluster.wait_for(restarted, 90, what="a new pod after the rollback")
        config = cluster.kubectl_json("get", "configmap", "rest-13b-runtime", "-n", namespace)["data"]
        assert "step-00000050" in json.dumps(config)
        assert second["metadata"]["name"].startswith("rest-13b-a1-")

        # 4. A job that fits nowhere: refused with a condition naming the short tier.
        huge = yaml.safe_load(EXAMPLE.read_text())
        huge["metadata"] = {"name": "too-big"}
        huge["spec"]["model"]["parameterCount"] = "400B"
        huge["spec"]["offload"] = {"policy": "cpu"}
        code, _ = curl(f"{api.url}/v1/namespaces/{namespace}/jobs", token, "POST", huge)
        assert code == 201

        def refused_job() -> dict[str, Any] | None:
            job = cluster.get("ftj", "too-big", namespace) or {}
            conds = [c for c in (job.get("status") or {}).get("conditions", []) if c["type"] == "Planned"]
            return conds[0] if conds and conds[0]["status"] == "False" else None

        condition = cluster.wait_for(refused_job, 60, what="no-fit condition")
        assert condition["reason"] == "NoFit" and "short by" in condition["message"] and "GiB" in condition["message"]
        pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "spillway.dev/job=too-big")["items"]
        assert pods == []
        log = (tmp_path / "operator.log").read_text()
        assert "Forbidden" not in log, f"the chart's RBAC refused the operator:\n{log[-3000:]}"
    finally:
        api.stop()
        operator.stop()
        cluster.kubectl("delete", "ftj", "--all", "-n", namespace, "--wait=false", check=False)
        for pv in checkpoint_pvs:
            cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)
