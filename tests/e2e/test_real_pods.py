"""Spillway's user flows in real containers, on the test cluster's real node.

The operator runs as on a user's laptop against the cluster (admin credentials);
every training pod runs the CPU flavour of the training image
(docker/runtime.Dockerfile, built by hack/images) under a real kubelet, with its
own ServiceAccount, its volumes and its security context. The test prepares
what a cluster admin would: a volume with the model and data, a checkpoint
volume, and the node's NVMe figures (the node probe's annotations). Assertions
are on what a user sees: the job's status, files on the volumes, the exported
model.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster
from tests.e2e.operator_fixtures import CHECKPOINT_CLASS, running_operator, wait_status

pytestmark = pytest.mark.e2e

RUNTIME_UID = 1000  # OperatorSettings.run_as_user's default, the image's user
MAX_STEPS = 8


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A directory on this machine (which is the real node) that a container's
    uid can reach: pytest's own tmp dirs are 0700 root."""
    path = Path("/tmp") / f"spillway-e2e-{secrets.token_hex(4)}"
    path.mkdir(mode=0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _volume(cluster: Cluster, namespace: str, claim: str, path: Path, mode: str) -> None:
    """A hostPath PersistentVolume on the real node, pre-bound to ``claim``."""
    pv = f"{namespace}-{claim}"[:63]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": CHECKPOINT_CLASS},
        "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate",
    }))
    cluster.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": pv, "labels": {"spillway.dev/e2e-checkpoint": "true"}},
        "spec": {"capacity": {"storage": "1Ti"}, "accessModes": [mode], "persistentVolumeReclaimPolicy": "Retain",
                 "storageClassName": CHECKPOINT_CLASS, "hostPath": {"path": str(path), "type": "Directory"},
                 "claimRef": {"namespace": namespace, "name": claim}},
    }))


def _tiny_inputs(directory: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "spillway_api.cli", "make-tiny", str(directory / "tiny-llama"),
         "--dataset", str(directory / "arithmetic.jsonl")],
        check=True, capture_output=True, timeout=300,
    )
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)


def test_tiny_job_trains_in_a_real_pod_with_the_optimizer_on_nvme(
    cluster: Cluster, namespace: str, host_dir: Path, tmp_path: Path
) -> None:
    image = cluster.load_images("runtime-cpu")["runtime-cpu"]
    node = cluster.real_node

    inputs = host_dir / "inputs"
    inputs.mkdir(mode=0o755)
    _tiny_inputs(inputs)
    _volume(cluster, namespace, "inputs", inputs, "ReadOnlyMany")
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "inputs"},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": CHECKPOINT_CLASS,
                 "resources": {"requests": {"storage": "1Gi"}}},
    }))
    # The checkpoint volume's directory belongs to the runtime's uid, as a provisioner
    # honouring fsGroup would make it; the NVMe directory is left to the operator and
    # the node, as on a real machine: root's, as the node's admin made it.
    checkpoints = host_dir / "checkpoints"
    checkpoints.mkdir(mode=0o750)
    os.chown(checkpoints, RUNTIME_UID, RUNTIME_UID)
    nvme = host_dir / "nvme"
    nvme.mkdir(mode=0o755)
    # The node probe's figures (tests/e2e/test_chart_flows.py runs the probe itself).
    cluster.kubectl(
        "annotate", "node", node, "--overwrite",
        f"spillway.dev/nvme-path={nvme}",
        f"spillway.dev/nvme-capacity-bytes={200 << 30}", f"spillway.dev/nvme-free-bytes={100 << 30}",
        "spillway.dev/nvme-read-bytes-per-second=2000000000",
        "spillway.dev/nvme-write-bytes-per-second=1000000000",
    )

    name = "tiny"
    job = {
        "apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": name},
        "spec": {
            "model": {"uri": "pvc://inputs/tiny-llama", "parameterCount": "2M", "dtype": "bf16"},
            "dataset": {"uri": "pvc://inputs/arithmetic.jsonl", "format": "jsonl", "textField": "text"},
            "training": {"maxSteps": MAX_STEPS, "microBatchSize": 2, "gradientAccumulation": 1,
                         "sequenceLength": 32, "learningRate": 3e-3, "warmupSteps": 1},
            "offload": {"policy": "nvme", "optimizer": "nvme"},
            "checkpoint": {"everySteps": 4, "keep": 2, "storageClassName": CHECKPOINT_CLASS},
            "resources": {
                "gpusPerNode": 0,
                "nodeSelector": {"spillway.dev/real-node": "true"},
                "tolerations": [{"key": "spillway.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}],
            },
        },
    }
    env = dict(cluster.env, SPILLWAY_OPERATOR_RUNTIME_IMAGE=image)
    with running_operator(Cluster(cluster.kubeconfig, env, cluster.state_dir), tmp_path / "operator.log"):
        cluster.apply(job, namespace)
        # The operator made the checkpoint claim; bind it to the prepared volume.
        cluster.wait_for(lambda: cluster.get("pvc", f"{name}-checkpoints", namespace), 60, what="checkpoint claim")
        _volume(cluster, namespace, f"{name}-checkpoints", checkpoints, "ReadWriteOnce")
        done = wait_status(
            cluster, namespace, name, lambda s: s.get("phase") in ("Succeeded", "Failed"), timeout=900,
            what="the job to finish",
        )
    status = done["status"]
    pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", f"spillway.dev/job={name}")["items"]
    logs = "\n".join(
        cluster.kubectl("logs", p["metadata"]["name"], "-n", namespace, "--tail=40", check=False).stdout for p in pods
    )
    assert status["phase"] == "Succeeded", f"{json.dumps(status, indent=1)}\n{logs}"
    # Ran where asked, in a real container that wrote the job's status itself.
    assert {p["spec"]["nodeName"] for p in pods} == {node}
    assert status["progress"]["step"] == MAX_STEPS
    assert [c["step"] for c in status["checkpoints"]][-1] == MAX_STEPS
    # The bytes are on the volumes: checkpoints, the exported model, and the optimizer
    # state's swap files went to the node's NVMe directory.
    on_disk = sorted(p.name for p in checkpoints.iterdir())
    assert any(n.startswith("step-") for n in on_disk), on_disk
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints / "export")
    assert sum(p.numel() for p in model.parameters()) > 0
    assert any(nvme.rglob("*")), "no swap files were written under the node's NVMe directory"
