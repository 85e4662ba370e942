"""s3:// in the cluster, on the real node: a SeaweedFS server inside the cluster's network
namespace (on the node address, where pods reach it), the model and data uploaded to it,
the credentials in a Secret, the real operator and the CPU training image.

- A tiny job whose model and dataset are s3:// and whose checkpoints are mirrored to s3://:
  the operator plans, fetches the inputs onto the node in a short pod without a GPU request
  (InputsFetched), the training pod reads them from the node's cache read-only, trains to
  Succeeded, and the mirror holds its last checkpoint; the fetch pods are gone.
- A second job on the same model and node downloads nothing (the fetch's ETag manifest),
  as its InputsFetched condition says.
- A job whose training process is killed mid-run and whose checkpoint volume is emptied
  resumes from the mirror (the runtime's mirror_restored event) and ends Succeeded.
- A job whose Secret does not exist, or holds a wrong key, fails naming it (and the
  bucket), before any training pod, with no pod left.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway_operator import s3_inputs
from spillway_operator.builders import pod_name
from spillway_operator.pod_specs import s3_cache_sub_path
from spillway_runtime.core.hardware import NVME_PATH_ANNOTATION
from spillway_runtime.core.spec import parse_job
from spillway_runtime.tiny import build_tiny_model, write_dataset
from tests.e2e.cluster import Cluster
from tests.e2e.operator_fixtures import running_operator, wait_status
from tests.e2e.realnode.real_jobs import EXAMPLE, POD_TIMEOUT_S, RealNode, kill_trainer
from tests.integration.storage_fixtures import ACCESS_KEY, SECRET_KEY, stop, weed_command

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

# Ports inside the cluster's network namespace, clear of the cluster's own (20000-31999
# on 127.0.0.1 and every address the API server listens on) and of the kubelet's.
WEED_PORTS = {"master": 15333, "master.grpc": 15334, "volume": 15080, "volume.grpc": 15081,
              "filer": 15888, "filer.grpc": 15889, "s3": 15833, "s3.grpc": 15834}
BUCKET = "models"
MIRROR_BUCKET = "ckpt"
SECRET = "s3-keys"

# Run by this machine's Python inside the namespace (only there is the node address).
_IN_NETNS = r"""
import json, os, sys, time
from pathlib import Path
import obstore
from obstore.store import S3Store

op, endpoint, bucket = sys.argv[1:4]
store = S3Store(bucket, endpoint=endpoint, access_key_id=os.environ["KEY"], secret_access_key=os.environ["SECRET"],
                region="us-east-1", client_options={"allow_http": True, "timeout": "5s"},
                retry_config={"max_retries": 0})
if op == "ready":
    deadline = time.monotonic() + 90
    while True:
        try:
            obstore.put(store, ".ready", b"ok")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
elif op == "upload":
    prefix, source = sys.argv[4], Path(sys.argv[5])
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    for file in files:
        key = prefix if source.is_file() else f"{prefix}/{file.relative_to(source).as_posix()}"
        obstore.put(store, key, file.read_bytes())
elif op == "list":
    print(json.dumps(sorted(str(m["path"]) for batch in obstore.list(store, prefix=sys.argv[4]) for m in batch)))
elif op == "get":
    sys.stdout.write(bytes(obstore.get(store, sys.argv[4]).bytes()).decode())
"""


@dataclass
class S3InCluster:
    cluster: Cluster
    netns: str
    endpoint: str  # as pods (and the namespace) reach it

    def call(self, *args: str) -> str:
        proc = subprocess.run(["nsenter", f"--net=/run/netns/{self.netns}", "--", sys.executable, "-c", _IN_NETNS,
                               args[0], self.endpoint, *args[1:]], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "KEY": ACCESS_KEY, "SECRET": SECRET_KEY})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    def listing(self, bucket: str, prefix: str) -> list[str]:
        return list(json.loads(self.call("list", bucket, prefix)))

    def secret(self, namespace: str, secret_key: str = SECRET_KEY) -> None:
        self.cluster.kubectl("create", "secret", "generic", SECRET, "-n", namespace,
                             f"--from-literal=AWS_ACCESS_KEY_ID={ACCESS_KEY}",
                             f"--from-literal=AWS_SECRET_ACCESS_KEY={secret_key}")


@pytest.fixture(scope="module")
def s3_real(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RealNode, S3InCluster, Path]]:
    image = cluster.load_images("runtime-cpu")["runtime-cpu"]
    settings = cluster.settings()
    netns, node_ip, label = settings["NETNS"], settings["NODE_IP"], settings["NODE_LABEL"]
    root = Path("/tmp") / f"spillway-e2e-s3-{secrets.token_hex(4)}"
    root.mkdir(mode=0o755)
    inputs = root / "inputs"
    build_tiny_model(inputs / "model")
    write_dataset(inputs / "data" / "arithmetic.jsonl", count=400)
    (root / "nvme").mkdir()
    # What the node probe would have written: the NVMe the plan may spill to (pods/conftest.py does the same)
    usage = shutil.disk_usage(root)
    annotations = {NVME_PATH_ANNOTATION: str(root / "nvme"), "spillway.dev/nvme-capacity-bytes": str(usage.total),
                   "spillway.dev/nvme-free-bytes": str(usage.free)}
    cluster.kubectl("annotate", "node", settings["NODE_NAME"], "--overwrite",
                    *[f"{k}={v}" for k, v in annotations.items()])
    weed = root / "weed"
    command = ["nsenter", f"--net=/run/netns/{netns}", "--",
               *weed_command(weed, node_ip, tuple(WEED_PORTS.values()))]
    with (weed / "weed.log").open("ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=weed, start_new_session=True)
    s3 = S3InCluster(cluster, netns, f"http://{node_ip}:{WEED_PORTS['s3']}")
    storage_class = f"spillway-e2e-s3-{secrets.token_hex(3)}"
    try:
        s3.call("ready", BUCKET)
        s3.call("ready", MIRROR_BUCKET)
        s3.call("upload", BUCKET, "tiny", str(inputs / "model"))
        s3.call("upload", BUCKET, "data/arithmetic.jsonl", str(inputs / "data" / "arithmetic.jsonl"))
        for path in [root, *root.rglob("*")]:
            if path.is_relative_to(weed):
                continue
            path.chmod(0o755 if path.is_dir() else 0o644)
        (root / "nvme").chmod(0o1777)  # as the chart's node probe leaves its directory
        cluster.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": storage_class},
            "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"}))
        log = tmp_path_factory.mktemp("operator-s3") / "operator.log"
        cache = root / "s3-cache"  # the node's cache, as the chart's node probe leaves it
        cache.mkdir()
        cache.chmod(0o1777)
        with running_operator(cluster, log, SPILLWAY_OPERATOR_RUNTIME_IMAGE=image,
                              SPILLWAY_OPERATOR_S3_CACHE_HOST_PATH=str(cache)):
            yield RealNode(cluster, root, label, storage_class, image), s3, cache
    finally:
        stop(proc, grace=5)
        cluster.kubectl("delete", "pv", "-l", "spillway.dev/e2e-real=true", "--wait=false", check=False)
        cluster.kubectl("delete", "storageclass", storage_class, check=False)
        cluster.kubectl("annotate", "node", settings["NODE_NAME"], *[f"{k}-" for k in annotations], check=False)
        shutil.rmtree(root, ignore_errors=True)


def _s3_job(real: RealNode, s3: S3InCluster, namespace: str, name: str, **update: dict[str, Any]) -> Path:
    spec_update: dict[str, Any] = {
        "model": {"uri": f"s3://{BUCKET}/tiny"},
        "dataset": {"uri": f"s3://{BUCKET}/data/arithmetic.jsonl"},
        "storage": {"secretRef": {"name": SECRET}, "endpointUrl": s3.endpoint},
        "checkpoint": {"mirror": f"s3://{MIRROR_BUCKET}/{namespace}/{name}"},
    }
    for key, value in update.items():
        spec_update[key] = {**spec_update.get(key, {}), **value}
    return real.job(namespace, name, spec_update=spec_update)


def _finished(real: RealNode, namespace: str, name: str) -> dict[str, Any]:
    return wait_status(real.cluster, namespace, name, lambda s: s.get("phase") in ("Succeeded", "Failed"),
                       POD_TIMEOUT_S, f"{name} finished")


def _condition(job: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in job.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def _fetch_pods(cluster: Cluster, namespace: str) -> list[str]:
    pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l",
                                f"app.kubernetes.io/component={s3_inputs.COMPONENT}")["items"]
    return [p["metadata"]["name"] for p in pods]


def test_a_job_trains_from_s3_mirrors_there_and_a_second_job_downloads_nothing(
        s3_real: tuple[RealNode, S3InCluster, Path], namespace: str) -> None:
    real, s3, cache = s3_real
    cluster = real.cluster
    s3.secret(namespace)
    _s3_job(real, s3, namespace, "first")
    job = _finished(real, namespace, "first")
    status = job["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-3000:]
    steps = int(yaml.safe_load(EXAMPLE.read_text())["spec"]["training"]["maxSteps"])
    assert status["progress"]["step"] == steps
    fetched = _condition(job, "InputsFetched")
    model_files = sum(1 for f in (real.root / "inputs" / "model").rglob("*") if f.is_file())
    assert fetched["status"] == "True", fetched
    assert f"s3://{BUCKET}/tiny: {model_files} objects" in fetched["message"], fetched
    assert f"{model_files} downloaded" in fetched["message"] and fetched["message"].startswith(cluster.real_node)
    # In the job's part of the node's cache (its namespace's, for its endpoint): all it mounted
    entry = cache / s3_cache_sub_path(namespace, parse_job(job).spec)
    # made by the kubelet with the root's mode, 1777 (no root container): the fetch pod's uid wrote in it
    assert entry.parent.parent == cache and (cache.stat().st_mode & 0o7777) == 0o1777
    assert (entry.stat().st_uid, entry.stat().st_mode & 0o7777) == (0, 0o1777)
    assert (entry / BUCKET / "tiny").stat().st_uid == 1000
    assert sorted(p.name for p in (entry / BUCKET / "tiny").iterdir()) == sorted(
        p.name for p in (real.root / "inputs" / "model").iterdir())
    assert _fetch_pods(cluster, namespace) == []
    # The mirror holds the last checkpoint, complete (its manifest went up last)
    mirrored = s3.listing(MIRROR_BUCKET, f"{namespace}/first")
    last = f"step-{steps:08d}"
    assert f"{namespace}/first/{last}/manifest.json" in mirrored, mirrored
    assert s3.call("get", MIRROR_BUCKET, f"{namespace}/first/latest").strip() == last
    assert status["mirror"]["step"] == steps, status.get("mirror")

    _s3_job(real, s3, namespace, "second")
    job = _finished(real, namespace, "second")
    assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"], indent=1)[-3000:]
    fetched = _condition(job, "InputsFetched")["message"]
    assert f"s3://{BUCKET}/tiny: {model_files} objects" in fetched and "0 downloaded (0 B)" in fetched, fetched
    assert f"{model_files} already cached" in fetched, fetched
    assert f"s3://{BUCKET}/data/arithmetic.jsonl: 1 objects" in fetched and "1 already cached" in fetched, fetched


def _failed_unreadable(real: RealNode, namespace: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job ended Failed (InputsUnreadable) with no pod left: the job and that condition."""
    job = _finished(real, namespace, name)
    failed = _condition(job, "Failed")
    assert job["status"]["phase"] == "Failed" and failed["reason"] == "InputsUnreadable", failed
    real.cluster.wait_for(lambda: not real.cluster.kubectl_json("get", "pods", "-n", namespace)["items"], 60,
                          what="no pod left")
    return job, failed


def test_a_missing_secret_fails_the_job_naming_it_and_leaves_no_pod(
        s3_real: tuple[RealNode, S3InCluster, Path], namespace: str) -> None:
    real, s3, _ = s3_real
    _s3_job(real, s3, namespace, "no-secret")
    _job, failed = _failed_unreadable(real, namespace, "no-secret")
    assert f"Secret '{SECRET}' (spec.storage.secretRef)" in failed["message"], failed
    assert f'"{SECRET}" not found' in failed["message"], failed


def test_a_job_whose_volume_and_pod_are_lost_resumes_from_the_mirror(
        s3_real: tuple[RealNode, S3InCluster, Path], namespace: str) -> None:
    real, s3, _ = s3_real
    cluster = real.cluster
    s3.secret(namespace)
    steps = 40
    checkpoints = _s3_job(real, s3, namespace, "lost", training={"maxSteps": steps, "microBatchSize": 8,
                                                                  "sequenceLength": 64})
    wait_status(cluster, namespace, "lost", lambda s: int((s.get("mirror") or {}).get("step") or 0) >= 9,
                POD_TIMEOUT_S, "a checkpoint in the mirror")
    # The training process dies (SIGKILL: no stop checkpoint) and the volume is emptied while
    # the next attempt waits out its backoff, as when the node and its disk are lost
    assert kill_trainer(namespace, "lost") >= 1
    wait_status(cluster, namespace, "lost", lambda s: int(s.get("attempt") or 0) >= 1, POD_TIMEOUT_S,
                "the attempt counted")
    for entry in checkpoints.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()

    def restored() -> str | None:
        for attempt in (1, 2, 3):
            out = cluster.kubectl("logs", pod_name("lost", attempt, 0), "-n", namespace, "-c", "trainer",
                                  check=False).stdout
            for line in out.splitlines():
                if line.startswith("{") and '"mirror_restored"' in line:
                    return line
        return None

    line = cluster.wait_for(restored, POD_TIMEOUT_S, interval=2, what="the next attempt restored from the mirror")
    event = json.loads(line)
    assert int(event["checkpoint"].removeprefix("step-")) >= 9, event
    job = _finished(real, namespace, "lost")
    assert job["status"]["phase"] == "Succeeded", json.dumps(job["status"], indent=1)[-3000:]
    assert job["status"]["progress"]["step"] == steps
    assert (checkpoints / f"step-{steps:08d}").is_dir()


def test_a_wrong_secret_fails_the_job_at_the_fetch_naming_the_secret_and_bucket(
        s3_real: tuple[RealNode, S3InCluster, Path], namespace: str) -> None:
    real, s3, _ = s3_real
    s3.secret(namespace, secret_key="not-the-key")
    _s3_job(real, s3, namespace, "wrong-key")
    job, failed = _failed_unreadable(real, namespace, "wrong-key")
    assert f"refused the credentials for bucket '{BUCKET}'" in failed["message"], failed
    assert f"check the Secret '{SECRET}'" in failed["message"], failed
    assert "progress" not in job["status"]  # no training pod ever ran
