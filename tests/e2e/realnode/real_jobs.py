"""Training jobs on the test cluster's real node, as the real-pod tests drive them: the
node's handle (`RealNode`: host directories, bound volumes, the example job under another
name), the example's settings, and what a job's pods did (their events, a watch of them)."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from spillway_operator.builders import checkpoint_pvc_name
from tests.e2e.cluster import REPO_ROOT, Cluster
from tests.e2e.operator_fixtures import wait_status

RUNTIME_UID = 1000
EXAMPLE = REPO_ROOT / "examples" / "tiny-cluster.yaml"
# The example, longer: room for a suspend, a resume, a rollback and a lost pod in one run.
# It checkpoints every 3 steps and keeps 5.
MAX_STEPS = 60  # room after a late rollback for the deleted-pod step (a fast run once finished first)
KEEP = 5
# A pod's first step waits for its container (a 6 GB image, already unpacked) and torch's
# import on a loaded 2-core machine: minutes, not seconds, at worst.
POD_TIMEOUT_S = 600
# Two ranks: room between the status showing step 3 (it is published every 5 s) and the end
# for the swap-file check and the suspend to reach the pod (with 12 a run ended first, exit 0,
# in two gates on 2026-12-05)
TWO_RANK_STEPS = 24
BAD_LINE = 4


@dataclass
class RealNode:
    cluster: Cluster
    root: Path  # on this machine, which is also the node: hostPath volumes live here
    label: str
    storage_class: str
    image: str  # the CPU training image, loaded into the node's containerd

    def host_dir(self, *parts: str) -> Path:
        """A directory the training uid owns, as a provisioner would hand it over."""
        path = self.root.joinpath(*parts)
        path.mkdir(parents=True, mode=0o755)
        os.chown(path, RUNTIME_UID, RUNTIME_UID)
        return path

    def pv(self, name: str, path: Path, namespace: str, claim: str, mode: str) -> None:
        """A PersistentVolume bound in advance to one claim (no provisioner here)."""
        self.cluster.kubectl("create", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": name, "labels": {"spillway.dev/e2e-real": "true"}},
            "spec": {"capacity": {"storage": "1Ti"}, "accessModes": [mode],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": self.storage_class,
                     "claimRef": {"namespace": namespace, "name": claim},
                     "hostPath": {"path": str(path), "type": "Directory"}}}))

    def inputs(self, namespace: str) -> None:
        """The model and data, read-only, as the example's claim `tiny-inputs`."""
        self.pv(f"{namespace}-inputs", self.root / "inputs", namespace, "tiny-inputs", "ReadOnlyMany")
        self.cluster.apply({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "tiny-inputs"},
            "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": self.storage_class,
                     "volumeName": f"{namespace}-inputs", "resources": {"requests": {"storage": "1Gi"}}}}, namespace)

    def job(self, namespace: str, name: str, dataset: str | None = None, max_steps: int | None = None,
            processes: int = 1, nodes: int = 1, spec_update: dict[str, Any] | None = None,
            labels: dict[str, str] | None = None, top: dict[str, Any] | None = None) -> Path:
        """`kubectl apply -f examples/tiny-cluster.yaml` under another name, with this
        fixture's storage class (its NVMe directory, jobs/NAMESPACE/NAME under the node's NVMe
        root, is the operator's choice, not the job's); returns its checkpoint
        directory on this machine. With ``nodes`` 2 it spans both real nodes. ``labels``
        go on the job, ``top`` are top-level spec fields (spec.queueName)."""
        checkpoints = self.host_dir(f"{namespace}-{name}-checkpoints")
        self.pv(f"{namespace}-{name}-ckpt", checkpoints, namespace, checkpoint_pvc_name(name),
                "ReadWriteOnce" if nodes == 1 else "ReadWriteMany")
        job = yaml.safe_load(EXAMPLE.read_text())
        job["metadata"]["name"] = name
        spec = job["spec"]
        spec["checkpoint"]["storageClassName"] = self.storage_class
        if dataset:
            spec["dataset"]["uri"] = f"pvc://tiny-inputs/data/{dataset}"
        if max_steps:
            # Longer, and slower steps (8x the tokens), so that a status update (every 5 s)
            # still finds the run going when the test acts on it.
            spec["training"].update({"maxSteps": max_steps, "microBatchSize": 8, "sequenceLength": 64})
        if processes > 1:
            spec["resources"]["cpuProcesses"] = processes
        if nodes > 1:
            spec["resources"]["nodes"] = nodes
            spec["resources"]["tolerations"].append(
                {"key": self.cluster.settings()["NODE2_TAINT"], "operator": "Exists", "effect": "NoSchedule"})
        for key, value in (spec_update or {}).items():  # a None removes the field
            spec[key] = {k: v for k, v in {**spec.get(key, {}), **value}.items() if v is not None}
        spec.update(top or {})
        if labels:
            job["metadata"]["labels"] = {**job["metadata"].get("labels", {}), **labels}
        self.cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(job))
        return checkpoints


def why_failed(*jobs: dict[str, Any]) -> str:
    """What a failed job says: its phase, message, conditions and attempts, not the plan."""
    keys = ("phase", "message", "conditions", "attempt", "failures", "replans")
    return json.dumps([{k: j.get("status", {}).get(k) for k in keys} for j in jobs])[-4000:]


def condition(job: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in job.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def finished(real: RealNode, namespace: str, name: str) -> dict[str, Any]:
    return wait_status(real.cluster, namespace, name, lambda s: s.get("phase") in ("Succeeded", "Failed"),
                       POD_TIMEOUT_S, f"{name} finished")


def pod_events(cluster: Cluster, namespace: str, pod: str) -> list[dict[str, Any]]:
    """The runtime's events, which it prints one JSON object a line (kubectl logs)."""
    out = cluster.kubectl("logs", pod, "-n", namespace, "-c", "trainer", check=False).stdout
    events = []
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


class PodWatch:
    """Every change to a job's training pods, in the order the API server made them, from a watch
    started before the test acts: pods the operator deletes are gone from the API a moment
    after they exit, so what they were and when they left is only seen here."""

    def __init__(self, api: Any, namespace: str, job: str):
        from kubernetes import client, watch

        self.events: list[tuple[str, str, int | None]] = []  # (type, pod, trainer exit code)
        self._watch = watch.Watch()  # type: ignore[no-untyped-call]
        self._stopped = threading.Event()
        core = client.CoreV1Api(api)

        def run() -> None:
            try:
                for event in self._watch.stream(core.list_namespaced_pod, namespace,
                                                # the trainers: not the pod that read config.json
                                                label_selector=f"spillway.dev/job={job},app.kubernetes.io/component=trainer",
                                                timeout_seconds=1800):
                    pod = event["object"]
                    code = None
                    for status in pod.status.container_statuses or []:
                        if status.name == "trainer" and status.state and status.state.terminated:
                            code = status.state.terminated.exit_code
                    self.events.append((event["type"], pod.metadata.name, code))
            except Exception:
                # A stopped watch ends when its stream next wakes, which may be the API
                # server going away at the end of the session.
                if not self._stopped.is_set():
                    raise

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def names(self) -> list[str]:
        return list(dict.fromkeys(name for _, name, _ in self.events))

    def exit_code(self, pod: str) -> int | None:
        codes = [code for _, name, code in self.events if name == pod and code is not None]
        return codes[-1] if codes else None

    def exited(self, pod: str) -> int:
        """The first event that shows the pod's trainer terminated."""
        return next(i for i, (_, name, code) in enumerate(self.events) if name == pod and code is not None)

    def index(self, kind: str, pod: str) -> int:
        return next(i for i, (t, name, _) in enumerate(self.events) if t == kind and name == pod)

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()  # type: ignore[no-untyped-call]


def kill_trainer(namespace: str, job: str) -> int:
    """SIGKILL, from this machine, the training processes of a job's running pod (a real
    node's containers are this machine's processes), as the kernel's OOM killer would."""
    import psutil

    killed = 0
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "spillway_runtime" not in " ".join(proc.info["cmdline"] or []):
                continue
            env = proc.environ()
            if env.get("SPILLWAY_JOB_NAMESPACE") == namespace and env.get("SPILLWAY_JOB_NAME") == job:
                proc.kill()
                killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed
