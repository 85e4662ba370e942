"""Training in real containers: the CPU flavour of the training image on the test
cluster's real node, driven by the real operator, as a user drives it with kubectl.

- A tiny job with its Adam state on the node's NVMe (its own directory under the node's
  NVMe root, made by the kubelet as a subPath: no root init container) trains to
  Succeeded. status.progress and status.checkpoints are written by the pod under its own
  ServiceAccount; the exported model loads with transformers.
- The same job suspended (SIGTERM: the step finishes, a checkpoint, exit 75, phase
  Suspended), resumed (earlier checkpoints still listed in status), rolled back through
  the REST API (the old pod exits before the new one is created, and spares the named
  checkpoint from its pruning), its pod deleted mid-run and its training process
  SIGKILLed, ends Succeeded with every step's loss, every checkpoint's and the exported
  weights bit-equal to the uninterrupted run's.
- A bad dataset line: the job ends Failed with the runtime's own message (file and line)
  in its condition and in `kubectl describe`.
- Two ranks in one pod, and two ranks on two real nodes (rank 1 finds rank 0 by its
  headless-Service name through the cluster's DNS): suspended and resumed, both end with
  the losses of an uninterrupted two-rank run, to the bit.
- Under a real Kueue, a job preempted by a higher-priority one checkpoints (exit 75, no
  failure counted), waits Queued while the other runs, and resumes with the uninterrupted
  run's losses, to the bit.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from kubernetes.utils import parse_quantity

from spillway_operator.builders import checkpoint_pvc_name
from spillway_runtime.core.hardware import MEMLOCK_ANNOTATION, NVME_PATH_ANNOTATION
from spillway_runtime.meta_shape import shape_from_config
from spillway_runtime.tiny import build_tiny_model, write_chat_dataset, write_dataset
from tests.e2e.cluster import REPO_ROOT, Cluster
from tests.e2e.local_volumes import LocalStorage
from tests.e2e.operator_fixtures import active_pods, running_operator, wait_status
from tests.e2e.test_api_cluster import ApiServer

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

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
        module's storage class (its NVMe directory, jobs/NAMESPACE/NAME under the node's NVMe
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


def _why(*jobs: dict[str, Any]) -> str:
    """What a failed job says: its phase, message, conditions and attempts, not the plan."""
    keys = ("phase", "message", "conditions", "attempt", "failures", "replans")
    return json.dumps([{k: j.get("status", {}).get(k) for k in keys} for j in jobs])[-4000:]


@pytest.fixture(scope="module")
def real(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    image = cluster.load_images("runtime-cpu")["runtime-cpu"]
    settings = cluster.settings()
    node, label = settings["NODE_NAME"], settings["NODE_LABEL"]
    root = Path("/tmp") / f"spillway-e2e-pods-{secrets.token_hex(4)}"
    root.mkdir(mode=0o755)
    model = build_tiny_model(root / "inputs" / "model")
    data = write_dataset(root / "inputs" / "data" / "arithmetic.jsonl", count=400)
    write_chat_dataset(root / "inputs" / "data" / "arithmetic-chat.jsonl", count=400)
    _preferences_as_parquet(root / "inputs" / "data" / "arithmetic-preferences.parquet")
    lines = data.read_text().splitlines(keepends=True)
    (data.parent / "bad.jsonl").write_text("".join(lines[: BAD_LINE - 1]) + '{"text": "cut off\n' + "".join(lines[BAD_LINE:]))
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (root / "nvme").mkdir()
    (root / "nvme").chmod(0o1777)  # as the chart's node probe leaves its directory
    # What the node probe (its own test) would have written: the NVMe the plan may spill to, and
    # what a pod may lock there (this machine's containers: 8 MiB), under which the plan fits the swap.
    usage = shutil.disk_usage(root)
    annotations = {NVME_PATH_ANNOTATION: str(root / "nvme"), "spillway.dev/nvme-capacity-bytes": str(usage.total),
                   "spillway.dev/nvme-free-bytes": str(usage.free), MEMLOCK_ANNOTATION: str(8 << 20)}
    cluster.kubectl("annotate", "node", node, "--overwrite", *[f"{k}={v}" for k, v in annotations.items()])
    storage_class = f"spillway-e2e-real-{secrets.token_hex(3)}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": storage_class},
        "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"}))
    log = tmp_path_factory.mktemp("operator-real") / "operator.log"
    try:
        with running_operator(cluster, log, SPILLWAY_OPERATOR_RUNTIME_IMAGE=image,
                              SPILLWAY_OPERATOR_READ_MODEL_CONFIG="true", SPILLWAY_OPERATOR_KUEUE="true"):
            example = yaml.safe_load(EXAMPLE.read_text())["spec"]
            # The example is written for this cluster's real node and `spillway make-tiny`'s model.
            assert example["resources"]["nodeSelector"] == {label: "true"}
            assert example["model"]["parameterCount"] == str(shape_from_config(model).params)
            yield RealNode(cluster, root, label, storage_class, image)
    finally:
        cluster.kubectl("delete", "pv", "-l", "spillway.dev/e2e-real=true", "--wait=false", check=False)
        cluster.kubectl("delete", "storageclass", storage_class, check=False)
        cluster.kubectl("annotate", "node", node, *[f"{k}-" for k in annotations], check=False)
        shutil.rmtree(root, ignore_errors=True)


def _condition(job: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in job.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def _preferences_as_parquet(path: Path) -> None:
    """What examples/dpo-lora.yaml's comment says to put on the claim: the example's preference
    pairs whose prompt is text, as one Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (REPO_ROOT / "examples" / "data" / "arithmetic-preferences.jsonl").open()]
    pq.write_table(pa.Table.from_pylist([r for r in rows if isinstance(r["prompt"], str)]), path)


def _finished(real: RealNode, namespace: str, name: str) -> dict[str, Any]:
    return wait_status(real.cluster, namespace, name, lambda s: s.get("phase") in ("Succeeded", "Failed"),
                       POD_TIMEOUT_S, f"{name} finished")


@pytest.fixture(scope="module")
def uninterrupted(real: RealNode, cluster: Cluster) -> Iterator[tuple[dict[str, Any], Path]]:
    """The reference: the tiny job run start to end in one pod (longer than the example, so
    that a suspend, a rollback and a lost pod fit in the interrupted run below)."""
    namespace = f"e2e-real-ref-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        real.inputs(namespace)
        checkpoints = real.job(namespace, "tiny", max_steps=MAX_STEPS)
        job = _finished(real, namespace, "tiny")
        yield job, checkpoints
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_a_tiny_job_trains_in_a_pod_with_adam_state_on_the_nodes_nvme(
    real: RealNode, uninterrupted: tuple[dict[str, Any], Path]
) -> None:
    job, checkpoints = uninterrupted
    status = job["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-3000:]
    # Written by the pod, under the job's own ServiceAccount (the operator writes neither).
    assert status["progress"]["step"] == MAX_STEPS and status["progress"]["loss"] > 0
    assert status["progress"]["bytes"].get("nvme", 0) > 0, status["progress"]  # the Adam state went to NVMe
    # ... into the job's own directory under the node's root, the only part of it the pod saw
    namespace = job["metadata"]["namespace"]
    assert [p.name for p in (real.root / "nvme" / "jobs" / namespace).iterdir()] == ["tiny"]
    own = real.root / "nvme" / "jobs" / namespace / "tiny"
    assert own.stat().st_mode & 0o777 == 0o777 and own.stat().st_uid == 0, oct(own.stat().st_mode)
    # The swap files were there while it trained (progress.bytes.nvme above is what the pod
    # measured in this directory) and went with the pod: nothing is left on the node's drive.
    assert [p for p in own.rglob("*") if p.is_file()] == []
    # Planned from the model's own config.json, read from the claim by a short pod that is gone.
    assert status["modelConfig"]["source"] == "pvc://tiny-inputs/model"
    assert status["modelConfig"]["config"]["model_type"] == "llama", status["modelConfig"]
    assert any(r.startswith("model shape from config.json on pvc://tiny-inputs/model (llama")
               for r in status["plan"]["reasons"]), status["plan"]["reasons"]
    assert _condition(job, "ModelConfigRead")["status"] == "True"
    kept = sorted({*range(3, MAX_STEPS + 1, 3), MAX_STEPS})[-KEEP:]  # every 3 steps, and the last
    assert [c["step"] for c in status["checkpoints"]] == kept  # the pruned ones are gone from status too
    assert sorted(p.name for p in checkpoints.glob("step-*")) == [f"step-{s:08d}" for s in kept]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints / "export")
    assert model.num_parameters() == int(yaml.safe_load(EXAMPLE.read_text())["spec"]["model"]["parameterCount"])


def test_a_chat_lora_job_trains_in_a_pod_with_masked_loss_evaluation_and_exports_the_adapter(
    real: RealNode, cluster: Cluster, namespace: str
) -> None:
    """examples/chat-lora.yaml's settings through the operator: chat records with the loss on
    the answers, a held-out share evaluated, LoRA adapters on the frozen base, the adapter
    exported in PEFT's layout."""
    chat = yaml.safe_load((REPO_ROOT / "examples" / "chat-lora.yaml").read_text())["spec"]
    real.inputs(namespace)
    # No parameterCount: the operator plans from config.json as read from the claim.
    checkpoints = real.job(namespace, "chat-lora", dataset="arithmetic-chat.jsonl", spec_update={
        "model": {"parameterCount": None},
        "dataset": {key: chat["dataset"][key] for key in ("format", "chatTemplate", "validation")},
        "method": chat["method"], "export": chat["export"],
        "training": {"evalEverySteps": 3, "learningRate": chat["training"]["learningRate"],
                     "sequenceLength": chat["training"]["sequenceLength"]}})
    job = _finished(real, namespace, "chat-lora")
    status = job["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-3000:]
    assert "parameterCount" not in job["spec"]["model"] and "config" in status["modelConfig"]
    assert not [p for p in real.cluster.kubectl_json("get", "pods", "-n", namespace)["items"]
                if p["metadata"]["name"].endswith("-model-config")]
    assert status["progress"]["evalLoss"] > 0 and status["progress"]["evalStep"] == status["progress"]["step"]
    export = checkpoints / "export"
    assert (export / "adapter_config.json").is_file() and (export / "adapter_model.safetensors").is_file()
    assert (export / "merged" / "model.safetensors").is_file() and not (export / "model.safetensors").exists()
    adapter = json.loads((export / "adapter_config.json").read_text())
    assert adapter["r"] == chat["method"]["rank"] and adapter["peft_type"] == "LORA"


def test_dpo_with_lora_trains_in_a_pod_from_a_parquet_file(real: RealNode, namespace: str) -> None:
    """examples/dpo-lora.yaml on the tiny model: preference pairs read from a Parquet file on
    the claim, DPO with LoRA (the reference the base with the adapters off), TRL's metrics of
    the last step and of the held-out pairs in status.progress.preference. The planner keeps the
    optimizer on the device, here the CPU: DeepSpeed's FusedAdam, compiled into the image (the
    image once lacked it, and such a pod exited 1 trying to compile it)."""
    dpo = yaml.safe_load((REPO_ROOT / "examples" / "dpo-lora.yaml").read_text())["spec"]
    real.inputs(namespace)
    real.job(namespace, "dpo-lora", dataset="arithmetic-preferences.parquet", spec_update={
        "dataset": {key: dpo["dataset"][key] for key in ("format", "validation")},
        "method": dpo["method"], "offload": {"optimizer": None, **dpo["offload"]},
        "training": {**dpo["training"], "maxSteps": 6, "evalEverySteps": 3, "evalBatches": 2},
        "checkpoint": {"everySteps": 3}})
    job = _finished(real, namespace, "dpo-lora")
    status = job["status"]
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["plan"]["label"].startswith("Z2 opt:gpu"), status["plan"]
    progress = status["progress"]
    assert progress["step"] == 6 and progress["evalStep"] == 6, progress
    metrics = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")
    assert set(progress["preference"]) == {*metrics, *(f"eval_{m}" for m in metrics)}, progress["preference"]
    assert 0 <= progress["preference"]["rewards/accuracies"] <= 1 and progress["loss"] < 0.69  # below ln 2


def _events(cluster: Cluster, namespace: str, pod: str) -> list[dict[str, Any]]:
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


def _kill_trainer(namespace: str, job: str) -> int:
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


def _weights(export: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(export / "model.safetensors"))


@pytest.fixture
def rest(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[tuple[ApiServer, str]]:
    """`spillway api --kubernetes` watching the cluster, and the token of an engineer who may
    change FineTuneJobs in the test's namespace (the REST rollback's caller)."""
    cluster.kubectl("create", "serviceaccount", "engineer", "-n", namespace)
    cluster.kubectl("create", "role", "ftj-edit", "--verb=get,list,watch,create,patch,delete",
                    "--resource=finetunejobs.spillway.dev", "-n", namespace)
    cluster.kubectl("create", "rolebinding", "engineer-ftj", "--role=ftj-edit",
                    f"--serviceaccount={namespace}:engineer", "-n", namespace)
    token = cluster.kubectl("create", "token", "engineer", "-n", namespace, "--duration=2h",
                            "--audience=spillway").stdout.strip()
    server = ApiServer(cluster.kubeconfig, tmp_path / "api.db", tmp_path / "api.log")
    server.start()
    try:
        yield server, token
    finally:
        server.stop()


def test_suspend_resume_rollback_and_a_deleted_pod_lose_no_step(
    real: RealNode, cluster: Cluster, kube_api: Any, namespace: str, uninterrupted: tuple[dict[str, Any], Path],
    rest: tuple[ApiServer, str],
) -> None:
    reference, reference_dir = uninterrupted
    api, token = rest
    jobs = f"/v1/namespaces/{namespace}/jobs"
    real.inputs(namespace)
    pods = PodWatch(kube_api, namespace, "tiny")
    checkpoints = real.job(namespace, "tiny", max_steps=MAX_STEPS)

    def step_at_least(n: int) -> Any:
        return lambda s: (s.get("progress") or {}).get("step", 0) >= n

    def one_pod() -> str:
        return str(cluster.wait_for(lambda: (a := active_pods(cluster, namespace, "tiny")) and len(a) == 1 and a[0],
                                    POD_TIMEOUT_S, what="one active pod"))

    def resumed_step(pod: str) -> int:
        return max((e["step"] for e in _events(cluster, namespace, pod) if e["event"] == "resumed"), default=1 << 30)

    def patch(spec: dict[str, Any]) -> None:
        cluster.kubectl("patch", "ftj", "tiny", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": spec}))

    try:
        # Suspend: SIGTERM, the step finishes, a checkpoint of it, exit 75, phase Suspended.
        wait_status(cluster, namespace, "tiny", step_at_least(4), POD_TIMEOUT_S, "step 4")
        first = one_pod()
        patch({"suspend": True})
        suspended = wait_status(cluster, namespace, "tiny", lambda s: s.get("phase") == "Suspended" and not
                                active_pods(cluster, namespace, "tiny"), 300, "Suspended, no pod running")
        cluster.wait_for(lambda: pods.exit_code(first) is not None, 300, what=f"{first}'s exit")
        assert pods.exit_code(first) == 75
        suspended = cluster.get("finetunejob", "tiny", namespace) or suspended  # with the stop checkpoint
        stopped = max(c["step"] for c in suspended["status"]["checkpoints"])
        assert stopped >= 4 and (checkpoints / f"step-{stopped:08d}").is_dir()

        # Resume: from that checkpoint; the new pod lists the first pod's checkpoints too.
        patch({"suspend": False})
        resumed = wait_status(cluster, namespace, "tiny", step_at_least(stopped + 3), POD_TIMEOUT_S,
                              "resumed, 3 steps on")
        assert stopped in [c["step"] for c in resumed["status"]["checkpoints"]]
        second = one_pod()
        assert second != first
        assert resumed_step(second) == stopped  # the suspend's own checkpoint, not an older one

        # Roll back to the newest checkpoint listed (an older one may be pruned by the time the
        # running pod stops: see the closing note of issue 12): the running pod checkpoints and
        # exits before the next one is even created (both would write to the same volume).
        # Through the REST API, as a user would: it sets spec.resumeFrom.
        target = max(resumed["status"]["checkpoints"], key=lambda c: c["step"])
        cluster.wait_for(lambda: target["name"] in [c["name"] for c in
                                                    api.call("GET", f"{jobs}/tiny/checkpoints", token).json()["data"]],
                         60, what="the API to record the checkpoint")
        r = api.call("POST", f"{jobs}/tiny/rollback", token, {"checkpoint": target["name"], "reason": "e2e"})
        assert r.status_code == 202, r.text
        assert r.json()["toStep"] == target["step"]
        third = cluster.wait_for(lambda: (a := active_pods(cluster, namespace, "tiny")) and a[0] != second and a[0],
                                 POD_TIMEOUT_S, what="the rolled-back attempt's pod")
        # The watch runs in its own thread and may lag the API reads above: wait until it
        # has seen the new pod; what came before it in the API server's order is then in.
        cluster.wait_for(lambda: third in pods.names(), 60, what=f"the watch to see {third}")
        assert pods.exit_code(second) == 75, pods.events
        assert pods.exited(second) < pods.index("ADDED", third), pods.events
        rolled = cluster.wait_for(
            lambda: [e for e in _events(cluster, namespace, third) if e["event"] == "rolled_back"],
            POD_TIMEOUT_S, interval=2, what="the new pod's rollback")
        assert rolled[0]["checkpoint"] == target["name"] and rolled[0]["step"] == target["step"]
        done = cluster.wait_for(lambda: [x for x in api.call("GET", f"{jobs}/tiny/history", token).json()["rollbacks"]
                                         if x["completedAt"]], 60, what="the API to record the rollback as done")
        assert [(x["checkpoint"], x["origin"], x["requestedBy"]) for x in done] == [
            (target["name"], "api", f"system:serviceaccount:{namespace}:engineer")]

        # A lost pod: the next attempt resumes from the last checkpoint.
        cluster.wait_for(lambda: any(e["event"] == "checkpoint" and e["step"] > target["step"]
                                     for e in _events(cluster, namespace, third)),
                         POD_TIMEOUT_S, interval=1, what="a checkpoint after the rollback")
        cluster.kubectl("delete", "pod", third, "-n", namespace, "--wait=false")

        # The training process SIGKILLed inside its container (as the OOM killer would): no
        # stop checkpoint, exit 137; the next attempt resumes from the last cadence checkpoint.
        fourth = cluster.wait_for(lambda: (a := active_pods(cluster, namespace, "tiny")) and a[0] not in (first, second, third)
                                  and a[0], POD_TIMEOUT_S, what="the attempt after the deleted pod")
        cluster.wait_for(lambda: any(e["event"] == "checkpoint" and e["step"] > resumed_step(fourth)
                                     for e in _events(cluster, namespace, fourth)),
                         POD_TIMEOUT_S, interval=1, what=f"a checkpoint of {fourth}")
        assert _kill_trainer(namespace, "tiny") >= 1
        job = _finished(real, namespace, "tiny")
    finally:
        pods.stop()
    status = job["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-3000:]
    assert len(pods.names()) == 5, pods.names()  # five attempts
    assert pods.exit_code(fourth) == 137, pods.events

    # No step lost or replayed differently: every step the last pod logged has the
    # uninterrupted run's loss, to the bit, and so has every kept checkpoint; the exported
    # weights are the same bytes.
    [last] = [name for name in pods.names() if name not in (first, second, third, fourth)]
    logged = [(e["step"], e["loss"]) for e in _events(cluster, namespace, last) if e["event"] == "step"]
    resumed_from = [e for e in _events(cluster, namespace, last) if e["event"] == "resumed"]
    assert resumed_from and resumed_from[0]["step"] > resumed_step(fourth), resumed_from  # the last before the kill
    reference_steps = {e["step"]: e["loss"] for e in _events(cluster, reference["metadata"]["namespace"], "tiny-a0-0")
                       if e["event"] == "step"}
    assert sorted(reference_steps) == list(range(1, MAX_STEPS + 1))
    assert [step for step, _ in logged] == list(range(resumed_from[0]["step"] + 1, MAX_STEPS + 1)), logged
    mismatches = {step: (loss, reference_steps[step]) for step, loss in logged if loss != reference_steps[step]}
    assert not mismatches, f"losses differ from the uninterrupted run's at steps {mismatches}"
    expected = {c["step"]: c["loss"] for c in reference["status"]["checkpoints"]}
    got = {c["step"]: c["loss"] for c in status["checkpoints"]}
    # As many kept as the reference's, the last at the end; a stop checkpoint off the cadence
    # may be among them, depending on when the pod was deleted
    assert len(got) == len(expected) and max(got) == MAX_STEPS, sorted(got)
    assert {step: (loss, reference_steps[step]) for step, loss in got.items() if loss != reference_steps[step]} == {}
    assert {s: got[s] for s in got if s in expected} == {s: expected[s] for s in expected if s in got}
    mine, theirs = _weights(checkpoints / "export"), _weights(reference_dir / "export")
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(mine[key].view(torch.uint8), theirs[key].view(torch.uint8)), key


def test_a_bad_dataset_line_fails_the_job_with_the_runtimes_own_message(
    real: RealNode, cluster: Cluster, namespace: str
) -> None:
    real.inputs(namespace)
    real.job(namespace, "bad", dataset="bad.jsonl")
    job = wait_status(cluster, namespace, "bad", lambda s: s.get("phase") == "Failed", POD_TIMEOUT_S, "Failed")
    message = _condition(job, "Failed").get("message", "") or job["status"].get("message", "")
    assert f"bad.jsonl:{BAD_LINE}: not valid JSON" in message, json.dumps(job["status"], indent=1)
    described = cluster.kubectl("describe", "ftj", "bad", "-n", namespace).stdout
    assert f"bad.jsonl:{BAD_LINE}: not valid JSON" in described, described[-3000:]


@pytest.mark.pod_security("restricted")
def test_a_two_rank_pod_suspends_with_75_and_resumes_to_the_same_losses(
    real: RealNode, cluster: Cluster, kube_api: Any, namespace: str, local_storage: LocalStorage
) -> None:
    """Two ranks in one pod under our supervisor (resources.cpuProcesses): a suspend reaches
    both, they checkpoint together and the pod exits 75; the resumed pod's losses equal an
    uninterrupted two-rank run's, to the bit.

    Their NVMe is what a cluster admin offers without host paths: a generic ephemeral volume
    of a local-volume provisioner's StorageClass (tests/e2e/local_volumes.py), one per pod,
    in a namespace that enforces Pod Security `restricted`. The kubelet gives the volume to
    the pod's fsGroup (the provisioner makes it root's, 0700): the ranks' swap files are
    written there, and the volume is gone with its pod."""
    real.inputs(namespace)
    pods = PodWatch(kube_api, namespace, "two")
    on_local_volume = {"offload": {"nvme": {"storageClassName": local_storage.storage_class}}}
    real.job(namespace, "two-ref", max_steps=TWO_RANK_STEPS, processes=2, spec_update=on_local_volume)
    real.job(namespace, "two", max_steps=TWO_RANK_STEPS, processes=2, spec_update=on_local_volume)
    try:
        [first], stopped, job = _suspend_then_resume(real, pods, namespace, "two", _swaps_on_local_volume(
            real, namespace, local_storage))
        reference = _finished(real, namespace, "two-ref")
    finally:
        pods.stop()
    assert job["status"]["phase"] == reference["status"]["phase"] == "Succeeded", _why(job, reference)
    [last] = [name for name in pods.names() if name != first]
    log = _events(cluster, namespace, last)
    _assert_resumed_as_reference(cluster, namespace, log, "two-ref-a0-0", stopped)
    started = [e for e in [*log, *_events(cluster, namespace, "two-ref-a0-0")] if e["event"] == "started"]
    assert [e["world_size"] for e in started] == [2, 2], started


def _swaps_on_local_volume(real: RealNode, namespace: str, storage: LocalStorage) -> Callable[[list[str]], None]:
    """While the pod runs: its NVMe volume is a provisioned `local` volume of the class, its
    directory on the node holds both ranks' swap files, and nothing else of the node is
    mounted for it."""
    def check(pods: list[str]) -> None:
        [pod] = pods
        spec = real.cluster.kubectl_json("get", "pod", pod, "-n", namespace)["spec"]
        assert not [v for v in spec["volumes"] if "hostPath" in v], spec["volumes"]
        claim = real.cluster.kubectl_json("get", "pvc", f"{pod}-nvme", "-n", namespace)
        assert claim["spec"]["storageClassName"] == storage.storage_class
        volume = real.cluster.kubectl_json("get", "pv", claim["spec"]["volumeName"])
        directory = Path(volume["spec"]["local"]["path"])
        assert directory.parent == storage.root
        assert directory.stat().st_gid == RUNTIME_UID  # the pod's fsGroup, given by the kubelet
        real.cluster.wait_for(lambda: len({p.parent for p in directory.rglob("*.swp")}) >= 2, 120,
                              what=f"both ranks' swap files under {directory}")
    return check


def _suspend_then_resume(real: RealNode, pods: PodWatch, namespace: str, name: str,
                         while_running: Callable[[list[str]], None] = lambda _: None) -> tuple[list[str], int, dict[str, Any]]:
    """From step 3, suspend the job (every pod of the attempt must exit 75), resume it and
    follow it to its end. Returns the suspended attempt's pods, the stop checkpoint's step
    and the finished job; ``while_running`` sees the pods before the suspend."""
    cluster = real.cluster
    wait_status(cluster, namespace, name, lambda s: (s.get("progress") or {}).get("step", 0) >= 3,
                POD_TIMEOUT_S, "step 3")
    first = sorted(active_pods(cluster, namespace, name))
    while_running(first)
    cluster.kubectl("patch", "ftj", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_status(cluster, namespace, name, lambda s: s.get("phase") == "Suspended" and not
                active_pods(cluster, namespace, name), 300, "Suspended, no pod running")
    cluster.wait_for(lambda: all(pods.exit_code(p) is not None for p in first), 300, what=f"{first} to exit")
    assert [pods.exit_code(p) for p in first] == [75] * len(first), pods.events
    # The phase says Suspended from the SIGTERM on; the stop checkpoint is in status
    # once the pods have exited (the runtime publishes it before it exits).
    suspended = cluster.get("finetunejob", name, namespace)
    assert suspended is not None
    stopped = max(c["step"] for c in suspended["status"]["checkpoints"])
    cluster.kubectl("patch", "ftj", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    return first, stopped, _finished(real, namespace, name)


def _assert_resumed_as_reference(cluster: Cluster, namespace: str, log: list[dict[str, Any]], reference_pod: str,
                                 stopped: int) -> None:
    """The resumed run started from the stop checkpoint, and every later step's loss equals
    the uninterrupted reference run's, to the bit."""
    # On failure, what the resumed run said instead (a checkpoint it rejected, and why).
    said = json.dumps([e for e in log if e["event"] != "step"])[:6000]
    assert [e["step"] for e in log if e["event"] == "resumed"] == [stopped], said
    expected = {e["step"]: e["loss"] for e in _events(cluster, namespace, reference_pod) if e["event"] == "step"}
    got = {e["step"]: e["loss"] for e in log if e["event"] == "step"}
    assert sorted(got) == list(range(stopped + 1, TWO_RANK_STEPS + 1))
    assert {s: (got[s], expected[s]) for s in got if got[s] != expected[s]} == {}


def test_the_node_probe_daemonset_measures_and_annotates_the_real_node(
    real: RealNode, cluster: Cluster, namespace: str
) -> None:
    """`helm install` with the probe on and the training image: its DaemonSet pod runs on
    the real node (its GPU label is the real node's label here), measures the NVMe
    directory and CPU Adam, and annotates the node with the figures and the *host* path."""
    node = cluster.real_node
    repository, tag = real.image.rsplit(":", 1)
    nvme = real.root / "nvme"  # what the module's jobs spill to: the figures stay true for them
    s3_cache = real.root / f"s3-cache-{secrets.token_hex(3)}"  # made by the kubelet, prepared by the probe
    before = cluster.kubectl_json("get", "node", node)["metadata"].get("annotations", {})
    release = f"p{secrets.token_hex(3)}"
    toleration = json.dumps([{"key": real.label, "operator": "Exists", "effect": "NoSchedule"}])
    cluster.helm(
        "install", release, str(REPO_ROOT / "charts" / "spillway"), "-n", namespace, "--skip-crds",
        "--set", "operator.enabled=false", "--set", "api.enabled=false",
        "--set", f"runtimeImage.repository={repository}", "--set-string", f"runtimeImage.tag={tag}",
        "--set", "runtimeImage.pullPolicy=Never",
        "--set", f"nodeProbe.gpuNodeLabel={real.label}", "--set", f"nodeProbe.nvmeHostPath={nvme}",
        "--set", f"operator.s3CacheHostPath={s3_cache}",
        "--set", "nodeProbe.aioSeconds=5", "--set-json", f"nodeProbe.tolerations={toleration}",
        timeout=300,
    )
    try:
        def measured() -> dict[str, str] | None:
            annotations = cluster.kubectl_json("get", "node", node)["metadata"].get("annotations", {})
            keys = ("spillway.dev/nvme-read-bytes-per-second", "spillway.dev/nvme-write-bytes-per-second",
                    "spillway.dev/cpu-adam-params-per-second")
            fresh = all(k in annotations and annotations.get(k) != before.get(k) for k in keys)
            return annotations if fresh else None

        annotations = cluster.wait_for(measured, POD_TIMEOUT_S, interval=2, what="the probe's annotations")
        pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=node-probe")
        assert [p["spec"]["nodeName"] for p in pods["items"]] == [node]
        assert annotations[NVME_PATH_ANNOTATION] == str(nvme)  # the host's path, not the container's /nvme
        for key in ("nvme-read-bytes-per-second", "nvme-write-bytes-per-second", "cpu-adam-params-per-second",
                    "nvme-capacity-bytes", "nvme-free-bytes"):
            assert float(annotations[f"spillway.dev/{key}"]) > 0, (key, annotations)
        assert int(annotations["spillway.dev/nvme-capacity-bytes"]) == shutil.disk_usage(nvme).total
        # what a training pod may lock, as the probe's container (non-root, no capability) found it:
        # this machine's containers get 8 MiB (hack/CLUSTER.md); the operator plans the swap under it
        assert annotations[MEMLOCK_ANNOTATION] == str(8 << 20), annotations
        # jobs' and fetch pods' subPaths: the kubelet makes them with these modes, no root container needed
        for root in (nvme, s3_cache):
            assert (root.stat().st_mode & 0o7777, root.stat().st_uid) == (0o1777, RUNTIME_UID), root
        # Its ServiceAccount may patch nodes (RBAC cannot say which): the chart's policy lets a
        # token of its pod (with the pod's node claim) patch its own Node's spillway.dev/* only.
        [probe_pod] = pods["items"]
        token = cluster.kubectl("create", "token", probe_pod["spec"]["serviceAccountName"], "-n", namespace,
                                "--bound-object-kind=Pod", f"--bound-object-name={probe_pod['metadata']['name']}",
                                "--duration=10m").stdout.strip()

        config = json.loads(cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
        config["users"][0]["user"] = {"token": token}
        probe_config = real.root / f"probe-{release}.kubeconfig"
        probe_config.write_text(json.dumps(config))

        def as_probe(*args: str) -> subprocess.CompletedProcess[str]:
            return cluster.kubectl("--kubeconfig", str(probe_config), *args, check=False)

        allowed = as_probe("annotate", "node", node, "--overwrite", "spillway.dev/policy-check=1")
        assert allowed.returncode == 0, allowed.stderr
        other = cluster.settings()["NODE2_NAME"]
        for args, says in (
            (("annotate", "node", other, "--overwrite", "spillway.dev/policy-check=1"), "only the Node its own pod"),
            (("label", "node", node, "--overwrite", "team=probe"), "only spillway.dev/* annotations and labels"),
            (("taint", "node", node, "spillway.dev/evict=now:NoExecute"), "only spillway.dev/* annotations and labels"),
        ):
            refused = as_probe(*args)
            assert refused.returncode != 0 and says in refused.stderr, (args, refused.stderr)
        assert "team" not in cluster.kubectl_json("get", "node", node)["metadata"].get("labels", {})
    finally:
        cluster.helm("uninstall", release, "-n", namespace, "--wait", timeout=300)
        # Put the node's figures back as the module's fixture wrote them (other tests plan on them).
        now = cluster.kubectl_json("get", "node", node)["metadata"].get("annotations", {})
        changes = [f"{k}={before[k]}" if k in before else f"{k}-"
                   for k in now if k.startswith("spillway.dev/") and now[k] != before.get(k)]
        if changes:
            cluster.kubectl("annotate", "node", node, "--overwrite", *changes)


@pytest.fixture
def second_node(real: RealNode, cluster: Cluster) -> Iterator[str]:
    """Real node 2 made like node 1 for a test that means to use it: the training image in
    its containerd, node 1's NVMe figures (the planner groups the two as one shape). The
    image is removed afterwards: a second unpacked copy costs gigabytes of disk."""
    settings = cluster.settings()
    node = settings["NODE2_NAME"]
    image = cluster.load_images("runtime-cpu", node=2)["runtime-cpu"]
    assert image == real.image
    ours = {k: v for k, v in cluster.kubectl_json("get", "node", cluster.real_node)["metadata"]["annotations"].items()
            if k.startswith("spillway.dev/")}
    cluster.kubectl("annotate", "node", node, "--overwrite", *[f"{k}={v}" for k, v in ours.items()])
    try:
        yield node
    finally:
        cluster.kubectl("annotate", "node", node, *[f"{k}-" for k in ours], check=False)
        subprocess.run(["ctr", "--address", settings["CONTAINERD2_SOCKET"], "-n", "k8s.io", "images", "rm",
                        "--sync", image], capture_output=True, timeout=300)


def test_a_two_node_job_meets_across_real_nodes_and_resumes_to_the_same_losses(
    real: RealNode, second_node: str, cluster: Cluster, kube_api: Any, namespace: str
) -> None:
    """resources.nodes 2 on two real nodes: one pod on each; rank 1 finds rank 0 by its
    headless-Service name (CoreDNS) and their gloo traffic crosses from one node's bridge to
    the other's. A suspend reaches both pods, both checkpoint and exit 75; the resumed pair
    ends with the losses of an uninterrupted two-rank run in one pod, to the bit."""
    real.inputs(namespace)
    pods = PodWatch(kube_api, namespace, "nodes")
    real.job(namespace, "nodes-ref", max_steps=TWO_RANK_STEPS, processes=2)
    real.job(namespace, "nodes", max_steps=TWO_RANK_STEPS, nodes=2)

    def one_pod_on_each_node(first: list[str]) -> None:
        placed = {p: cluster.get("pod", p, namespace)["spec"]["nodeName"] for p in first}
        assert sorted(placed.values()) == sorted([cluster.real_node, second_node]), placed

    try:
        first, stopped, job = _suspend_then_resume(real, pods, namespace, "nodes", one_pod_on_each_node)
        assert len(first) == 2
        reference = _finished(real, namespace, "nodes-ref")
    finally:
        pods.stop()
    assert job["status"]["phase"] == reference["status"]["phase"] == "Succeeded", _why(job, reference)
    [rank0] = [name for name in pods.names() if name not in first and name.endswith("-0")]
    log = _events(cluster, namespace, rank0)
    _assert_resumed_as_reference(cluster, namespace, log, "nodes-ref-a0-0", stopped)
    started = [e for e in log if e["event"] == "started"]
    assert [e["world_size"] for e in started] == [2], started


def test_a_job_preempted_by_kueue_checkpoints_and_resumes_with_no_lost_step(
    real: RealNode, cluster: Cluster, kube_api: Any, namespace: str, uninterrupted: tuple[dict[str, Any], Path],
    kueue: Any,
) -> None:
    """Under a real Kueue: a ClusterQueue with room for one tiny job on the real node and
    preemption of lower priorities. A higher-priority job arrives while the first trains;
    Kueue evicts the first, whose pod checkpoints and exits 75 (no failure counted), the
    quota goes to the second, which runs to the end; the first is admitted again and
    resumes from its stop checkpoint, every later step's loss equal to an uninterrupted
    run's, to the bit."""
    reference, _ = uninterrupted
    real.inputs(namespace)
    suffix = secrets.token_hex(3)
    low, high = kueue.priority_class(f"low-{suffix}", 10), kueue.priority_class(f"high-{suffix}", 1000)
    flavor = kueue.flavor(f"real-{suffix}", node_labels={real.label: "true"})
    cq_name = f"real-{suffix}"
    kueue.local_queue(namespace, "team", cq_name)  # its ClusterQueue follows, sized to the job
    pods = PodWatch(kube_api, namespace, "tiny")
    queued = {"queueName": "team"}
    # A checkpoint at every step (the losses do not change: exact resume) keeps the run going
    # while Kueue's preemption reaches its pod: once the runtime started faster, 40 bare steps
    # ended first in one gate (exit 0, not 75).
    real.job(namespace, "tiny", max_steps=MAX_STEPS, labels={"kueue.x-k8s.io/priority-class": low}, top=queued,
             spec_update={"checkpoint": {"everySteps": 1}})
    [wl] = cluster.wait_for(lambda: cluster.kubectl_json("get", "workloads.kueue.x-k8s.io", "-n", namespace,
                                                         "-l", "spillway.dev/job=tiny")["items"], 120,
                            what="the job's Workload")
    requests = wl["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    # Room for one such job, not two.
    kueue.cluster_queue(cq_name, {flavor: {k: str(int(parse_quantity(v) * 3 // 2)) for k, v in requests.items()}},
                        preemption={"withinClusterQueue": "LowerPriority"})
    try:
        wait_status(cluster, namespace, "tiny", lambda s: (s.get("progress") or {}).get("step", 0) >= 1,
                    POD_TIMEOUT_S, "the first step")
        [first] = active_pods(cluster, namespace, "tiny")
        real.job(namespace, "urgent", max_steps=6, labels={"kueue.x-k8s.io/priority-class": high}, top=queued)
        evicted = wait_status(cluster, namespace, "tiny", lambda s: s.get("phase") == "Queued"
                              and not active_pods(cluster, namespace, "tiny"), 300, "tiny evicted, no pod running")
        assert _condition(evicted, "Admitted")["reason"] == "Evicted"
        assert "Preempted" in _condition(evicted, "Admitted")["message"]
        cluster.wait_for(lambda: pods.exit_code(first) is not None, 300, what=f"{first}'s exit")
        assert pods.exit_code(first) == 75
        stopped = max(c["step"] for c in (cluster.get("finetunejob", "tiny", namespace) or {})["status"]["checkpoints"])
        urgent = _finished(real, namespace, "urgent")
        assert urgent["status"]["phase"] == "Succeeded"
        job = _finished(real, namespace, "tiny")
    finally:
        pods.stop()
    status = job["status"]
    assert status["phase"] == "Succeeded", json.dumps(status)[-2000:]
    assert status.get("failures", 0) == 0
    [last] = [name for name in pods.names() if name != first]
    log = _events(cluster, namespace, last)
    assert [e["step"] for e in log if e["event"] == "resumed"] == [stopped]
    expected = {e["step"]: e["loss"] for e in _events(cluster, reference["metadata"]["namespace"], "tiny-a0-0")
                if e["event"] == "step"}
    got = {e["step"]: e["loss"] for e in log if e["event"] == "step"}
    assert sorted(got) == list(range(stopped + 1, MAX_STEPS + 1))
    assert {s: (got[s], expected[s]) for s in got if got[s] != expected[s]} == {}
