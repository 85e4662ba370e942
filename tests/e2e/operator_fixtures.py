"""Helpers for the operator's e2e tests: the real operator as a subprocess, checkpoint
volumes, and FineTuneJob manifests. Used by tests/e2e/test_operator*.py."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "finetunejobs.spillway.dev.yaml"
CHECKPOINT_CLASS = "spillway-e2e-checkpoints"
OPERATOR_NAMESPACE = "spillway-system"
# The read-only claim the `namespace` fixture (conftest.py) makes and binds in every kwok
# test's namespace: job_manifest's inputs are on it, as a cluster job's must be on a claim
# (pvc://) or in a bucket (s3://), never a path of the pod's own filesystem.
INPUTS_CLAIM = "inputs"
MODEL_URI = f"pvc://{INPUTS_CLAIM}/models/llama"
DATASET_URI = f"pvc://{INPUTS_CLAIM}/data/train.jsonl"
# A node label a test gives its own nodes, so that other tests' nodes never match its nodeSelector.
POOL = "spillway.dev/e2e-pool"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OperatorProcess:
    """`python -m spillway_operator.cli operator -A` with fast resync and backoff for tests."""

    def __init__(self, env: dict[str, str], log_path: Path):
        self.metrics_port = free_port()
        # What the caller passes wins over these.
        self.env = {
            **{
                "SPILLWAY_OPERATOR_RESYNC_SECONDS": "2",
                "SPILLWAY_OPERATOR_STRICT_PHASES": "true",  # an illegal phase transition raises (phases.py)
                "SPILLWAY_OPERATOR_BACKOFF_BASE_SECONDS": "1",
                "SPILLWAY_OPERATOR_REPLAN_PENDING_SECONDS": "3",
                # Tests change the pricing ConfigMap and expect the next job to see it.
                "SPILLWAY_OPERATOR_PRICING_CACHE_SECONDS": "0",
                "SPILLWAY_OPERATOR_METRICS_PORT": str(self.metrics_port),
                "SPILLWAY_OPERATOR_LIVENESS_PORT": "0",
                "SPILLWAY_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE,
                # kwok's nodes run no container, so no pod there could read a model's
                # config.json; the real node's tests turn it on.
                "SPILLWAY_OPERATOR_READ_MODEL_CONFIG": "false",
            },
            **env,
        }
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spillway_operator.cli", "operator", "--all-namespaces"],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())


def add_checkpoint_volume(cluster: Any, access_mode: str = "ReadWriteOnce") -> str:
    """A PersistentVolume of the e2e checkpoint class (no provisioner here); one per claim.
    Multi-node jobs claim ReadWriteMany (every rank writes its shards into one checkpoint)."""
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "storage.k8s.io/v1",
                "kind": "StorageClass",
                "metadata": {"name": CHECKPOINT_CLASS},
                "provisioner": "kubernetes.io/no-provisioner",
                "volumeBindingMode": "Immediate",
            }
        ),
    )
    name = f"e2e-ckpt-{secrets.token_hex(4)}"
    cluster.kubectl(
        "create",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": name, "labels": {"spillway.dev/e2e-checkpoint": "true"}},
                "spec": {
                    "capacity": {"storage": "1Pi"},
                    "accessModes": [access_mode],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": CHECKPOINT_CLASS,
                    "hostPath": {"path": f"/tmp/{name}"},
                },
            }
        ),
    )
    return name


def job_manifest(name: str, node: str | None = None, **spec: Any) -> dict[str, Any]:
    """A 7B FineTuneJob reading its inputs from the claim `inputs` of the test's namespace
    (pinned to ``node`` when given); ``spec`` replaces whole top-level fields."""
    body: dict[str, Any] = {
        "model": {"uri": MODEL_URI, "parameterCount": "7B"},
        "dataset": {"uri": DATASET_URI},
        "checkpoint": {"storageClassName": CHECKPOINT_CLASS},
        "resources": {"gpusPerNode": 1},
    }
    if node:
        body["resources"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    body.update(spec)
    return {"apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": name}, "spec": body}


def wait_status(cluster: Any, ns: str, name: str, pred: Any, timeout: float = 30, what: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}

    def check() -> bool:
        job = cluster.get("finetunejob", name, ns)
        if job is None:
            return False
        out.clear()
        out.update(job)
        return bool(pred(job.get("status") or {}))

    try:
        cluster.wait_for(check, timeout, what=what or f"{ns}/{name} status")
    except AssertionError as timed_out:
        raise AssertionError(f"{timed_out}\n{describe_job(cluster, ns, name)}") from None
    return out


def describe_job(cluster: Any, ns: str, name: str) -> str:
    """What a timed-out wait on a job shows: its status, each pod's node, phase and
    container states with its last log lines, and the namespace's latest events."""
    job = cluster.get("finetunejob", name, ns)
    lines = [f"job {ns}/{name} status: {json.dumps((job or {}).get('status'))[-3000:]}"]
    for pod in pods_of(cluster, ns, name):
        meta, status = pod["metadata"], pod.get("status") or {}
        states = {c["name"]: c.get("state") for c in status.get("containerStatuses") or []}
        lines.append(f"pod {meta['name']} on {pod['spec'].get('nodeName')}: {status.get('phase')} "
                     f"{status.get('reason') or ''} {status.get('message') or ''} {json.dumps(states)}")
        logs = cluster.kubectl("logs", "-n", ns, meta["name"], "--all-containers", "--tail=15", check=False)
        lines.extend(f"  | {line}" for line in (logs.stdout + logs.stderr).splitlines())
    events = cluster.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False)
    lines.extend(events.stdout.splitlines()[-20:])
    return "\n".join(lines)


def pool_nodes(cluster: Any, make_node: Any, *profiles: str) -> tuple[str, list[str]]:
    """Nodes of the given profiles sharing a fresh pool label (other tests' nodes never match)."""
    pool = secrets.token_hex(3)
    nodes = [make_node(profile) for profile in profiles]
    for node in nodes:
        cluster.kubectl("label", "node", node, f"{POOL}={pool}")
    return pool, nodes


def pods_of(cluster: Any, ns: str, job: str) -> list[dict[str, Any]]:
    data = cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"spillway.dev/job={job}")
    return list(data.get("items", []))


def active_pods(cluster: Any, ns: str, job: str) -> list[str]:
    return sorted(
        p["metadata"]["name"]
        for p in pods_of(cluster, ns, job)
        if p["status"].get("phase") not in ("Succeeded", "Failed") and not p["metadata"].get("deletionTimestamp")
    )


def events_of(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    data = cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")
    return list(data.get("items", []))


def wait_seconds(seconds: float) -> None:
    time.sleep(seconds)


def install_crd(cluster: Any) -> None:
    """The FineTuneJob CRD, established, and the operator's namespace."""
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/finetunejobs.spillway.dev", "--timeout=30s")
    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)


@contextlib.contextmanager
def running_operator(cluster: Any, log: Path, **env: str) -> Iterator[OperatorProcess]:
    """The real operator (admin credentials) for the duration of a `with` block, with
    ``env`` on top of the cluster's; the e2e checkpoint volumes made meanwhile
    (add_checkpoint_volume) go with it."""
    install_crd(cluster)
    op = OperatorProcess({**cluster.env, **env}, log)
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(f"operator log: {log}")
        cluster.kubectl("delete", "pv", "-l", "spillway.dev/e2e-checkpoint=true", "--wait=false", check=False)
