"""`helm install charts/spillway` with the operator image built here, on the real node:
the operator and API Deployments run in containers and become Ready, the API answers
through `kubectl port-forward`, and the operator, under the chart's ServiceAccount in
its container, plans a FineTuneJob and makes its pod on the real node.

(The node probe and the training pods need the CPU training image, `hack/images build
runtime-cpu`, 6.5 GB; they are not run here yet: see hack/CLUSTER.md.)"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import os
import re
import secrets
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from spillway_operator.certs import CERT_KEY, KEY_KEY, make_cert, service_dns_names
from tests.bad_jobs import CORPUS, with_
from tests.e2e.cluster import REPO_ROOT, Cluster
from tests.e2e.operator_fixtures import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

RUNTIME_UID = 1000
CERT_CHECK_SECONDS = 2
WEBHOOK = "finetunejobs.validation.spillway.dev"


TENANT = "tenant@example.org"  # a namespace editor: the built-in `edit` role, nothing more


def _apply(cluster: Cluster, namespace: str, job: dict[str, Any], *as_: str) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", *as_, input=json.dumps(job), check=False)


def _pods_told(cluster: Cluster, namespace: str) -> str:
    """What a failed rollout leaves to read: the pods, their events and their logs."""
    described = cluster.kubectl("describe", "pods", "-n", namespace, check=False).stdout[-6000:]
    logs = cluster.kubectl("logs", "-n", namespace, "-l", "app.kubernetes.io/component=operator", "--tail=60",
                           "--all-containers", check=False)
    return f"{described}\n--- operator logs ---\n{logs.stdout[-6000:]}{logs.stderr[-2000:]}"


def _the_webhook_refuses_the_corpus_and_renews_its_certificate(cluster: Cluster, namespace: str, release: str) -> None:
    """`kubectl apply` of each malformed job, by a namespace editor (a real `edit` RoleBinding,
    into which the chart folds FineTuneJobs), is refused, by the CRD's schema or by the
    operator's webhook, with the field named; the webhook's certificate, found past two
    thirds of its life, is renewed by the operator and the webhook goes on answering."""
    cluster.kubectl("create", "rolebinding", "tenant-edit", "--clusterrole=edit", f"--user={TENANT}", "-n", namespace)
    tenant = f"--as={TENANT}"
    assert cluster.kubectl("auth", "can-i", "create", "finetunejobs.spillway.dev", "-n", namespace, tenant,
                           check=False).stdout.strip() == "yes"
    by_webhook = []
    for i, (what, job, expected) in enumerate(CORPUS):
        proc = _apply(cluster, namespace, {**copy.deepcopy(job), "metadata": {"name": f"bad-{i}"}}, tenant)
        assert proc.returncode != 0, f"{what}: admitted"
        field = re.split(r"[: ]", expected, maxsplit=1)[0]
        assert field in proc.stderr, (what, proc.stderr)
        if f'admission webhook "{WEBHOOK}" denied the request' in proc.stderr:
            by_webhook.append(what)
            assert expected in proc.stderr, (what, proc.stderr)
    # The CRD's schema catches what it can; the rest only the webhook could.
    assert {"gs model uri", "ZeRO stage as a word", "resumeFrom on a new job", "batch contradicts training",
            "NVMe on the node's static-pod folder", "NVMe on the kubelet's pods"} <= set(by_webhook), by_webhook
    assert cluster.kubectl_json("get", "ftj", "-n", namespace)["items"] == []

    configuration = f"{release}-spillway-{namespace}-finetunejobs"
    secret = f"{release}-spillway-webhook-tls"
    aging = make_cert(service_dns_names(f"{release}-spillway-operator-webhook", namespace), 365,
                      dt.datetime.now(dt.UTC) - dt.timedelta(days=250))
    cluster.kubectl("patch", "secret", secret, "-n", namespace, "--type=merge", "-p", json.dumps(
        {"data": {CERT_KEY: base64.b64encode(aging.cert_pem).decode(),
                  KEY_KEY: base64.b64encode(aging.key_pem).decode()}}))

    def renewed() -> bytes | None:
        held = base64.b64decode(cluster.kubectl_json("get", "secret", secret, "-n", namespace)["data"][CERT_KEY])
        return held if held != aging.cert_pem else None

    new = cluster.wait_for(renewed, 30 + 3 * CERT_CHECK_SECONDS, interval=1, what="the certificate renewed")
    webhooks = cluster.kubectl_json("get", "validatingwebhookconfiguration", configuration)["webhooks"]
    trusted = base64.b64decode(webhooks[0]["clientConfig"]["caBundle"])
    assert new.strip() in trusted and aging.cert_pem.strip() in trusted
    bad = {**with_("model.uri", "gs://bucket/llama"), "metadata": {"name": "after-renewal"}}

    def refused_by_the_webhook() -> bool:
        # Each replica serves the new certificate from its next check on (a TLS error here
        # would be failurePolicy Ignore admitting the job: deleted, and asked again).
        proc = _apply(cluster, namespace, bad)
        if proc.returncode == 0:
            cluster.kubectl("delete", "ftj", "after-renewal", "-n", namespace, "--wait=true", timeout=60)
            time.sleep(CERT_CHECK_SECONDS)
            return False
        return f'admission webhook "{WEBHOOK}" denied the request' in proc.stderr

    cluster.wait_for(refused_by_the_webhook, 30, what="the webhook answering with its renewed certificate")


def _with_the_webhook_down_a_bad_job_is_admitted_and_failed_by_the_operator(
    cluster: Cluster, namespace: str, release: str
) -> None:
    """failurePolicy Ignore (the chart's default): with no replica to answer, the API server
    admits the job, and the operator, once back, fails it by name before any pod."""
    deployment = f"deployment/{release}-spillway-operator"
    cluster.kubectl("scale", deployment, "-n", namespace, "--replicas=0")
    cluster.wait_for(lambda: not cluster.kubectl_json(
        "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=operator")["items"], 120,
        interval=1, what="the operator's pods gone")
    bad = {**with_("offload.deepspeed", {"zero_optimization": {"stage": "three"}}), "metadata": {"name": "unchecked"}}
    proc = _apply(cluster, namespace, bad)
    assert proc.returncode == 0, proc.stderr
    cluster.kubectl("scale", deployment, "-n", namespace, "--replicas=1")

    def failed() -> dict[str, Any] | None:
        job = cluster.get("finetunejob", "unchecked", namespace) or {}
        return job if (job.get("status") or {}).get("phase") == "Failed" else None

    job = cluster.wait_for(failed, 180, interval=1, what="the unchecked job Failed by the operator")
    condition = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert condition["reason"] == "InvalidSpec"
    assert "spec.offload.deepspeed.zero_optimization.stage is 'three'" in condition["message"], condition
    assert cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "spillway.dev/job=unchecked")["items"] == []


def _host_volume(cluster: Cluster, name: str, path: Path, storage_class: str, size: str, access: str,
                 claim: dict[str, str] | None = None) -> None:
    """A PersistentVolume on a directory of the real node, as a provisioner would make it (for
    ``claim`` only, when given)."""
    spec: dict[str, Any] = {"capacity": {"storage": size}, "accessModes": [access],
                            "persistentVolumeReclaimPolicy": "Delete", "storageClassName": storage_class,
                            "hostPath": {"path": str(path), "type": "Directory"}}
    if claim:
        spec["claimRef"] = claim
    cluster.kubectl("create", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name}, "spec": spec}))


TINY_CONFIG = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 4, "intermediate_size": 344, "vocab_size": 512}


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
    _host_volume(cluster, storage_class, db, storage_class, "10Gi", "ReadWriteOnce")
    checkpoints = host_dir / "checkpoints"
    checkpoints.mkdir()
    _host_volume(cluster, f"{storage_class}-ckpt", checkpoints, storage_class, "1Ti", "ReadWriteOnce")
    # The job's inputs: a claim in its namespace (in a cluster a job names no path of the pod's own)
    inputs = host_dir / "inputs"
    inputs.mkdir()
    _host_volume(cluster, f"{storage_class}-inputs", inputs, storage_class, "1Gi", "ReadOnlyMany",
                 claim={"namespace": namespace, "name": "tiny-inputs"})
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "tiny-inputs"},
                   "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": storage_class,
                            "resources": {"requests": {"storage": "1Gi"}}}}, namespace)
    toleration = json.dumps([{"key": label, "operator": "Exists", "effect": "NoSchedule"}])
    operator_image = images["operator"]
    release = f"r{secrets.token_hex(3)}"
    cluster.helm(
        "install", release, str(REPO_ROOT / "charts" / "spillway"), "-n", namespace,
        "--set", f"image.repository={operator_image.rsplit(':', 1)[0]}",
        "--set-string", f"image.tag={operator_image.rsplit(':', 1)[1]}",
        "--set", "image.pullPolicy=Never",
        "--set", f"database.sqlite.storageClassName={storage_class}",
        "--set-json", f"operator.tolerations={toleration}",
        "--set-json", f"api.tolerations={toleration}",
        "--set", "nodeProbe.enabled=false",
        "--set", "operator.watchNamespaces={" + namespace + "}",
        "--set", f"operator.webhook.certCheckSeconds={CERT_CHECK_SECONDS}",
        timeout=300,
    )
    try:
        for deployment in ("operator", "api"):
            rollout = cluster.kubectl("rollout", "status", f"deployment/{release}-spillway-{deployment}", "-n",
                                      namespace, "--timeout=300s", timeout=320, check=False)
            assert rollout.returncode == 0, f"{deployment} not rolled out:\n{_pods_told(cluster, namespace)}"
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
                # its shape inline: planned at once, without a pod that reads config.json first
                "model": {"uri": "pvc://tiny-inputs/models/tiny", "config": TINY_CONFIG},
                "dataset": {"uri": "pvc://tiny-inputs/data/train.jsonl"},
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

        _the_webhook_refuses_the_corpus_and_renews_its_certificate(cluster, namespace, release)
        _with_the_webhook_down_a_bad_job_is_admitted_and_failed_by_the_operator(cluster, namespace, release)
    finally:
        cluster.helm("uninstall", release, "-n", namespace, "--wait", timeout=300)
        cluster.kubectl("delete", "pv", storage_class, f"{storage_class}-ckpt", f"{storage_class}-inputs",
                        "--wait=false", check=False)
    # The operator's certificate Secret goes with the chart's webhook configuration, its owner.
    cluster.wait_for(lambda: cluster.get("secret", f"{release}-spillway-webhook-tls", namespace) is None, 60,
                     interval=1, what="the webhook's Secret garbage-collected")
