"""s3:// inputs in the cluster: the fetch pod the reconciler starts on each chosen node before
the training pods (no GPU, the storage Secret's keys, the node's cache), what it does with
each outcome, and the AWS variables every pod that touches S3 gets. The pods running
against a real S3 server on real nodes are tests/e2e/realnode/test_real_pods_s3.py."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from spillway_operator import builders as b
from spillway_operator import pod_specs, s3_inputs
from spillway_operator.reconciler import PermanentFailure, reconcile
from spillway_operator.settings import OperatorSettings
from spillway_runtime.core.spec import parse_job
from spillway_runtime.training.runconfig import RuntimeConfig

from .fake_cluster import FakeCluster
from .test_reconciler import NS, SETTINGS, reasons, status, world

S3 = {"model": {"uri": "s3://models/tiny", "parameterCount": "7B"}, "dataset": {"uri": "s3://data/train.jsonl"},
      "storage": {"secretRef": {"name": "s3-keys"}, "endpointUrl": "http://10.200.0.1:8333"}}
CACHE = "/var/cache/spillway/s3"
FETCHER = s3_inputs.pod_name("j", 0, "gpu-80g")


def step(cluster: FakeCluster, settings: OperatorSettings = SETTINGS) -> Any:
    return reconcile(NS, "j", settings, cluster)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


def fetched(cluster: FakeCluster, downloaded: int) -> None:
    lines = [json.dumps({"uri": uri, "objects": 3, "bytes": 300, "downloaded": downloaded,
                         "bytes_downloaded": 100 * downloaded, "cached": 3 - downloaded, "removed": 0,
                         "seconds": 0.5}) for uri in ("s3://models/tiny", "s3://data/train.jsonl")]
    cluster.run(NS, FETCHER, "gpu-80g")
    cluster.exit(NS, FETCHER, 0, "\n".join(lines))


def conditions(cluster: FakeCluster) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status(cluster).get("conditions") or []}


def test_the_fetch_pod_is_pinned_to_the_chosen_node_holds_no_gpu_and_reads_the_secret() -> None:
    cluster = world(**S3, resources={"gpusPerNode": 1, "tolerations": [{"key": "gpu", "operator": "Exists"}]})
    result = step(cluster)
    assert cluster.names("Pod") == [FETCHER] and result.requeue_after  # no training pod yet
    fetching = conditions(cluster)["InputsFetched"]
    assert fetching["status"] == "False" and fetching["reason"] == "Fetching"
    assert "s3://models/tiny, s3://data/train.jsonl" in fetching["message"] and "gpu-80g" in fetching["message"]
    assert status(cluster)["plan"]["nodeNames"] == ["gpu-80g"]  # planned before it fetched
    pod = cluster.get("Pod", NS, FETCHER)
    assert pod is not None
    spec = pod["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-80g"]}]}]
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    (container,) = spec["containers"]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert container["command"] == ["python", "-m", "spillway_runtime.s3_fetch", "--root", "/mnt/s3-cache",
                                    "--endpoint", "http://10.200.0.1:8333", "--secret", "s3-keys",
                                    "s3://models/tiny", "s3://data/train.jsonl"]
    env = env_of(container)
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "s3-keys", "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "s3-keys", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert env["AWS_SESSION_TOKEN"] == {"secretKeyRef": {"name": "s3-keys", "key": "AWS_SESSION_TOKEN",
                                                         "optional": True}}
    assert env["AWS_REGION"]["secretKeyRef"]["optional"] is True
    assert env["AWS_ENDPOINT_URL"] == "http://10.200.0.1:8333"
    assert {"name": "s3-cache", "hostPath": {"path": CACHE, "type": "DirectoryOrCreate"}} in spec["volumes"]
    # Only this namespace's part of the cache, for this endpoint: never another tenant's entries
    part = pod_specs.s3_cache_sub_path(NS, parse_job(cluster.get("FineTuneJob", NS, "j")).spec)
    assert part.startswith(f"{NS}/") and part != pod_specs.s3_cache_sub_path("other", parse_job(
        cluster.get("FineTuneJob", NS, "j")).spec)
    assert {"name": "s3-cache", "mountPath": "/mnt/s3-cache", "subPath": part} in container["volumeMounts"]
    # nothing as root: the kubelet makes that part with the root's mode (the probe's 1777)
    assert "initContainers" not in spec and container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]) == (1000, 1000)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
    assert spec["activeDeadlineSeconds"] == SETTINGS.s3_fetch_timeout_seconds
    assert "FetchingInputs" in reasons(cluster)
    step(cluster)  # followed, not created twice
    assert cluster.names("Pod") == [FETCHER]


def test_once_fetched_the_training_pod_reads_the_cache_read_only_and_the_fetch_pod_goes() -> None:
    cluster = world(**S3, checkpoint={"mirror": "s3://ckpt/j"})
    step(cluster)
    fetched(cluster, downloaded=0)
    step(cluster)
    trainer = b.pod_name("j", 0, 0)
    assert trainer in cluster.names("Pod")
    done = conditions(cluster)["InputsFetched"]
    assert done["status"] == "True" and "s3://models/tiny: 3 objects (300 B), 0 downloaded (0 B), 3 already cached" \
        in done["message"] and done["message"].startswith("gpu-80g: ")
    assert status(cluster)["inputsFetched"] == {"attempt": 0, "nodes": ["gpu-80g"],
                                                "uris": ["s3://models/tiny", "s3://data/train.jsonl"]}
    assert any(reason == "InputsFetched" and "0 downloaded" in text for _, reason, text in cluster.events)
    pod = cluster.get("Pod", NS, trainer)
    assert pod is not None
    (container,) = pod["spec"]["containers"]
    part = pod_specs.s3_cache_sub_path(NS, parse_job(cluster.get("FineTuneJob", NS, "j")).spec)
    assert {"name": "s3-cache", "mountPath": "/mnt/s3-cache", "readOnly": True, "subPath": part} in (
        container["volumeMounts"])
    assert {"name": "s3-cache", "hostPath": {"path": CACHE, "type": "DirectoryOrCreate"}} in pod["spec"]["volumes"]
    assert "nvidia.com/gpu" in container["resources"]["limits"]
    env = env_of(container)
    assert env["AWS_ACCESS_KEY_ID"]["secretKeyRef"]["name"] == "s3-keys"  # for checkpoint.mirror
    assert env["AWS_ENDPOINT_URL"] == "http://10.200.0.1:8333"
    assert env["SPILLWAY_STOP_GRACE_SECONDS"] == str(pod["spec"]["terminationGracePeriodSeconds"])
    data = cluster.configmap_data(NS, b.configmap_name("j"))
    assert data is not None
    config = RuntimeConfig.model_validate_json(data[b.CONFIG_FILE])
    assert config.model_dir == "/mnt/s3-cache/models/tiny" and config.tokenizer_dir == config.model_dir
    assert config.dataset_path == "/mnt/s3-cache/data/train.jsonl"
    step(cluster)
    assert cluster.names("Pod") == [trainer]  # the fetch pod is deleted once the training pod exists


@pytest.mark.parametrize(("message", "expected"), [
    ("error: cannot read s3://models/tiny: bucket 'models' does not exist at endpoint http://10.200.0.1:8333; "
     "check the bucket name and spec.storage.endpointUrl", "bucket 'models' does not exist"),
    ("error: cannot read s3://models/tiny: the object store at endpoint http://10.200.0.1:8333 refused the "
     "credentials for bucket 'models'; check the Secret 's3-keys' (spec.storage.secretRef: ...)",
     "check the Secret 's3-keys'"),
])
def test_a_failed_fetch_fails_the_job_with_its_message_and_leaves_no_pod(message: str, expected: str) -> None:
    cluster = world(**S3)
    step(cluster)
    cluster.run(NS, FETCHER, "gpu-80g")
    cluster.exit(NS, FETCHER, 2, message)
    with pytest.raises(PermanentFailure):
        step(cluster)
    st = status(cluster)
    failed = conditions(cluster)["Failed"]
    assert st["phase"] == "Failed" and failed["reason"] == "InputsUnreadable"
    assert expected in failed["message"] and "on node gpu-80g" in failed["message"]
    assert conditions(cluster)["InputsFetched"]["reason"] == "FetchFailed"
    assert cluster.names("Pod") == [] and cluster.events[-1][0] == "Warning"


def test_a_missing_secret_fails_the_job_naming_the_secret() -> None:
    cluster = world(**S3)
    step(cluster)
    cluster.set_pod(NS, FETCHER, {"phase": "Pending", "containerStatuses": [
        {"name": "fetch", "image": "rt", "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                                "message": 'secret "s3-keys" not found'}}}]},
        node_name="gpu-80g")
    with pytest.raises(PermanentFailure):
        step(cluster)
    failed = conditions(cluster)["Failed"]
    assert status(cluster)["phase"] == "Failed"
    assert 'secret "s3-keys" not found' in failed["message"]
    assert "the Secret 's3-keys' (spec.storage.secretRef)" in failed["message"]
    assert cluster.names("Pod") == []


def test_a_missing_secret_of_a_training_pod_names_the_secret_not_the_image() -> None:
    cluster = world(checkpoint={"mirror": "s3://ckpt/j"}, storage={"secretRef": {"name": "s3-keys"}})
    step(cluster)
    trainer = b.pod_name("j", 0, 0)
    assert cluster.names("Pod") == [trainer]  # pvc:// inputs: nothing to fetch
    cluster.set_pod(NS, trainer, {"phase": "Pending", "containerStatuses": [
        {"name": "trainer", "image": "rt", "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                                  "message": 'secret "s3-keys" not found'}}}]},
        node_name="gpu-80g")
    step(cluster)
    failed = conditions(cluster)["Failed"]
    assert status(cluster)["phase"] == "Failed" and "Secret 's3-keys'" in failed["message"]
    assert "SPILLWAY_OPERATOR_RUNTIME_IMAGE" not in failed["message"] and cluster.names("Pod") == []


def test_without_a_secret_ref_no_keys_are_set_and_the_nodes_credentials_apply() -> None:
    cluster = world(model={"uri": "s3://models/tiny", "parameterCount": "7B"},
                    storage={"region": "eu-west-1"})
    step(cluster)
    pod = cluster.get("Pod", NS, FETCHER)
    assert pod is not None
    env = env_of(pod["spec"]["containers"][0])
    assert "AWS_ACCESS_KEY_ID" not in env and env["AWS_REGION"] == "eu-west-1" and "AWS_ENDPOINT_URL" not in env
    assert pod["spec"]["containers"][0]["command"][-1] == "s3://models/tiny"  # the pvc:// dataset is mounted


def test_a_fetch_pod_left_by_a_restart_is_followed_and_another_attempts_is_deleted() -> None:
    cluster = world(**S3)
    job = cluster.get("FineTuneJob", NS, "j")
    assert job is not None
    parsed = parse_job(job, "j").spec
    cluster.add(s3_inputs.build_fetch_pod(job, parsed, "gpu-80g", 0, SETTINGS))  # this attempt's: adopted
    stale = s3_inputs.build_fetch_pod(job, parsed, "gpu-80g", 7, SETTINGS)  # an old attempt's
    cluster.add(stale)
    step(cluster)
    assert cluster.names("Pod") == [FETCHER]
    fetched(cluster, downloaded=3)
    step(cluster)
    assert b.pod_name("j", 0, 0) in cluster.names("Pod")


def test_a_fetch_pod_that_never_finishes_fails_the_job_after_the_timeout() -> None:
    cluster = world(**S3)
    settings = OperatorSettings(**{**SETTINGS.model_dump(), "s3_fetch_timeout_seconds": 60})
    step(cluster, settings)
    old = datetime.now(UTC) - timedelta(seconds=600)
    cluster.objects[("Pod", NS, FETCHER)]["metadata"]["creationTimestamp"] = b.rfc3339(old)
    cluster.set_pod(NS, FETCHER, {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "message": "0/1 nodes are available"}]})
    with pytest.raises(PermanentFailure):
        step(cluster, settings)
    assert "not fetched within 60 s (not scheduled: 0/1 nodes are available)" in conditions(cluster)["Failed"]["message"]
    assert cluster.names("Pod") == []


def test_a_mixtures_inputs_are_fetched_and_mounted_like_the_dataset() -> None:
    """dataset.mixture: an s3:// source is fetched with the other inputs, a pvc:// one's claim is
    mounted, and the runtime is told where each is, in order."""
    mixture = [{"uri": "s3://data/extra.jsonl", "weight": 0.5}, {"uri": "pvc://more/chat", "weight": 2}]
    cluster = world(**{**S3, "dataset": {"uri": "s3://data/train.jsonl", "mixture": mixture}})
    cluster.add({"kind": "PersistentVolumeClaim", "metadata": {"name": "more", "namespace": NS}})
    step(cluster)
    fetcher = cluster.get("Pod", NS, FETCHER)
    assert fetcher is not None
    assert fetcher["spec"]["containers"][0]["command"][-3:] == [
        "s3://models/tiny", "s3://data/train.jsonl", "s3://data/extra.jsonl"]
    lines = [json.dumps({"uri": uri, "objects": 1, "bytes": 100, "downloaded": 1, "bytes_downloaded": 100,
                         "cached": 0, "removed": 0, "seconds": 0.1})
             for uri in ("s3://models/tiny", "s3://data/train.jsonl", "s3://data/extra.jsonl")]
    cluster.run(NS, FETCHER, "gpu-80g")
    cluster.exit(NS, FETCHER, 0, "\n".join(lines))
    step(cluster)
    trainer = cluster.get("Pod", NS, b.pod_name("j", 0, 0))
    assert trainer is not None
    claims = {v["persistentVolumeClaim"]["claimName"] for v in trainer["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert "more" in claims
    data = cluster.configmap_data(NS, b.configmap_name("j"))
    assert data is not None
    config = RuntimeConfig.model_validate_json(data[b.CONFIG_FILE])
    assert config.mixture_paths[0] == "/mnt/s3-cache/data/extra.jsonl" and config.mixture_paths[1].endswith("/more/chat")
