"""`helm install charts/spillway` with the operator image built here, on the real node:
the operator and API Deployments run in containers and become Ready, the API answers
through `kubectl port-forward`, and the operator, under the chart's ServiceAccount in
its container, plans a FineTuneJob and makes its pod on the real node.

(The node probe and the training pods need the CPU training image, `hack/images build
runtime-cpu`, 6.5 GB; they are not run here yet: see hack/CLUSTER.md.)"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import REPO_ROOT, Cluster
from tests.e2e.operator_fixtures import free_port

pytestmark = pytest.mark.e2e

RUNTIME_UID = 1000


def test_the_chart_runs_in_containers_and_its_operator_makes_pods_on_the_real_node(
    cluster: Cluster, namespace: str, host_dir: Path
) -> None:
    images = cluster.load_images("operator")
    node = cluster.real_node
    label = cluster.settings()["NODE_LABEL"]
    # The SQLite volume: a directory the API's uid owns, as a provisioner would make it.
    db = host_dir / "db"
    db.mkdir()
    os.chown(db, RUNTIME_UID, RUNTIME_UID)
    storage_class = f"{namespace}-db"
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": storage_class},
        "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"}))
    cluster.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": storage_class},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"],
                 "persistentVolumeReclaimPolicy": "Delete", "storageClassName": storage_class,
                 "hostPath": {"path": str(db), "type": "Directory"}}}))
    checkpoints = host_dir / "checkpoints"
    checkpoints.mkdir()
    cluster.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{storage_class}-ckpt"},
        "spec": {"capacity": {"storage": "1Ti"}, "accessModes": ["ReadWriteOnce"],
                 "persistentVolumeReclaimPolicy": "Delete", "storageClassName": storage_class,
                 "hostPath": {"path": str(checkpoints), "type": "Directory"}}}))
    toleration = json.dumps([{"key": label, "operator": "Exists", "effect": "NoSchedule"}])
    operator_image = images["operator"]
    release = f"r{secrets.token_hex(3)}"
    cluster.helm(
        "install", release, str(REPO_ROOT / "charts" / "spillway"), "-n", namespace,
        "--set", f"image.repository={operator_image.rsplit(':', 1)[0]}",
        "--set", f"image.tag={operator_image.rsplit(':', 1)[1]}",
        "--set", "image.pullPolicy=Never",
        "--set", f"database.sqlite.storageClassName={storage_class}",
        "--set-json", f"operator.tolerations={toleration}",
        "--set-json", f"api.tolerations={toleration}",
        "--set", "nodeProbe.enabled=false",
        "--set", "operator.watchNamespaces={" + namespace + "}",
        timeout=300,
    )
    try:
        for deployment in ("operator", "api"):
            cluster.kubectl("rollout", "status", f"deployment/{release}-spillway-{deployment}", "-n", namespace,
                            "--timeout=300s", timeout=320)
        pods = cluster.kubectl_json("get", "pods", "-n", namespace)["items"]
        assert {p["spec"]["nodeName"] for p in pods} == {node}
        assert all(p["status"]["phase"] == "Running" for p in pods), [p["status"] for p in pods]

        # The API, from this machine, through the API server and the kubelet.
        port = free_port()
        forward = subprocess.Popen(
            ["kubectl", "--kubeconfig", str(cluster.kubeconfig), "port-forward", "-n", namespace,
             f"deployment/{release}-spillway-api", f"{port}:8080"],
            env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        try:
            def healthy() -> bool:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                        return r.status == 200 and json.load(r)["status"] == "ok"
                except OSError:
                    time.sleep(0.5)
                    return False

            cluster.wait_for(healthy, 60, what="the API's /healthz through port-forward")
        finally:
            forward.terminate()
            forward.wait(10)

        # The operator, in its container, with the chart's ServiceAccount: a job that
        # asks for the real node is planned for it and gets its pod there.
        cluster.apply({
            "apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "tiny"},
            "spec": {
                "model": {"uri": "file:///models/tiny", "parameterCount": "2M"},
                "dataset": {"uri": "file:///data/train.jsonl"},
                "offload": {"policy": "cpu"},
                "checkpoint": {"storageClassName": storage_class},
                "resources": {"gpusPerNode": 0, "nodeSelector": {label: "true"},
                              "tolerations": [{"key": label, "operator": "Exists", "effect": "NoSchedule"}]},
            },
        }, namespace)

        def trainer_pod() -> dict[str, Any] | None:
            items = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "spillway.dev/job=tiny")["items"]
            return items[0] if items and items[0]["spec"].get("nodeName") else None

        pod = cluster.wait_for(trainer_pod, 120, interval=1, what="the operator's pod for the job")
        assert pod["spec"]["nodeName"] == node
        job = cluster.get("finetunejob", "tiny", namespace) or {}
        assert job.get("status", {}).get("plan"), job.get("status")
        cluster.kubectl("delete", "ftj", "tiny", "-n", namespace, "--wait=true", timeout=120)
    finally:
        cluster.helm("uninstall", release, "-n", namespace, "--wait", timeout=300)
        cluster.kubectl("delete", "pv", storage_class, f"{storage_class}-ckpt", "--wait=false", check=False)
