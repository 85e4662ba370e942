"""A job's s3:// inputs fetched onto each chosen node before its training pods exist: short
pods, no GPU.

Where this sits: the reconciler calls `progress` after it has planned an attempt (so the
node or nodes are known) and before it creates the attempt's pods, for a job with any
s3:// input (model, tokenizer, dataset, validation file). On each chosen node a pod from
the training image runs `python -m spillway_runtime.s3_fetch` into the node's cache (a
hostPath, `OperatorSettings.s3_cache_host_path`), with the credentials of
`spec.storage.secretRef` and no GPU: a download of many GB never holds a GPU idle, and a
wrong key or a missing bucket fails the job before any GPU pod is even created. The
cache's ETag manifest makes a second job on the same objects and node download nothing.
The training pods then mount the cache read-only (`pod_specs.build_pod`) and read each URI
at its place there (`runconfig.resolve_uri`). `status.inputsFetched` records the attempt
and nodes done, so a restarted operator does not fetch again; fetch pods are deleted
once read, and a fetch pod left by a restart is followed (its name is deterministic) or,
when it belongs to another attempt or node, deleted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from spillway_operator import builders as b
from spillway_operator import pod_outcomes, pod_specs
from spillway_operator.model_source import pending_reason
from spillway_operator.settings import OperatorSettings
from spillway_operator.status import StatusChange
from spillway_runtime.core.spec import FineTuneJobSpec
from spillway_runtime.training.runconfig import S3_CACHE_MOUNT, s3_inputs

COMPONENT = "s3-fetch"
CONDITION = "InputsFetched"
LABEL_NODE = "spillway.dev/node-hash"
POLL_SECONDS = 5.0


def uris(spec: FineTuneJobSpec) -> list[str]:
    """The s3:// inputs, each once (a tokenizer beside the model is fetched with it)."""
    return list(dict.fromkeys(uri for _, uri in s3_inputs(spec)))


def _node_hash(node: str) -> str:
    return hashlib.sha256(node.encode()).hexdigest()[:8]


def pod_name(job: str, attempt: int, node: str) -> str:
    return b.child_name(job, f"fetch-a{attempt}-{_node_hash(node)}")


def is_fetcher(pod: dict[str, Any]) -> bool:
    return (pod["metadata"].get("labels") or {}).get(b.LABEL_COMPONENT) == COMPONENT


def build_fetch_pod(job: dict[str, Any], spec: FineTuneJobSpec, node: str, attempt: int,
                    settings: OperatorSettings) -> dict[str, Any]:
    """The pod that fills `node`'s cache: training image, pinned to the node, no GPU, no API
    access, the storage Secret's keys, nothing run as root. The kubelet makes the job's part
    of the cache (a subPath) with the mode of the cache's root, which the chart's node probe
    leaves at 1777 (so 0777: the sticky bit is not copied), as it does the NVMe root; on a
    node whose root it did not prepare the fetch fails naming that (`s3_fetch`)."""
    storage = spec.storage
    command = ["python", "-m", "spillway_runtime.s3_fetch", "--root", str(S3_CACHE_MOUNT)]
    if storage.endpoint_url:
        command += ["--endpoint", storage.endpoint_url]
    if storage.region:
        command += ["--region", storage.region]
    if storage.secret_ref is not None:
        command += ["--secret", storage.secret_ref.name]
    mounts = [{"name": pod_specs.S3_CACHE_VOLUME, "mountPath": str(S3_CACHE_MOUNT),
               "subPath": pod_specs.s3_cache_sub_path(job["metadata"]["namespace"], spec)},
              {"name": "tmp", "mountPath": "/tmp"}]
    hardened = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    uid = settings.run_as_user
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "activeDeadlineSeconds": settings.s3_fetch_timeout_seconds,
        "terminationGracePeriodSeconds": 5,
        "securityContext": {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
        "containers": [{
            "name": "fetch",
            "image": settings.runtime_image,
            "command": [*command, *uris(spec)],
            "env": [{"name": "HOME", "value": "/tmp"}, *pod_specs.storage_env(spec)],
            # Parallel ranged GETs of 8 MiB chunks: a few hundred MB of buffers at most
            "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
            "volumeMounts": mounts,
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": hardened,
        }],
        "volumes": [pod_specs.s3_cache_volume(settings), {"name": "tmp", "emptyDir": {}}],
    }
    if spec.resources.node_selector:
        pod_spec["nodeSelector"] = dict(spec.resources.node_selector)
    if spec.resources.tolerations:
        pod_spec["tolerations"] = [t.model_dump(mode="json", exclude_none=True) for t in spec.resources.tolerations]
    meta = b.child_meta(job, pod_name(job["metadata"]["name"], attempt, node), COMPONENT,
                        {b.LABEL_ATTEMPT: str(attempt), LABEL_NODE: _node_hash(node)})
    meta["annotations"] = {"spillway.dev/node": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


@dataclass(frozen=True)
class Fetch:
    """Where the inputs stand for this attempt: done, waiting (poll again), or failed (why)."""

    done: bool = False
    failure: str | None = None
    requeue_after: float = POLL_SECONDS


def _summary(message: str) -> str:
    """The fetch pod's JSON lines as one readable line per URI."""
    parts = []
    for line in message.splitlines():
        try:
            r = json.loads(line)
            parts.append(f"{r['uri']}: {r['objects']} objects ({r['bytes']} B), {r['downloaded']} downloaded "
                         f"({r['bytes_downloaded']} B), {r['cached']} already cached, {r['seconds']} s")
        except (ValueError, KeyError, TypeError):
            parts.append(line.strip())
    return "; ".join(p for p in parts if p)


def _failure(pod: dict[str, Any], change: StatusChange, settings: OperatorSettings) -> str | None:
    """Why a fetch pod will never succeed, or None while it may."""
    stuck = pod_outcomes.container_never_starts(pod, change.now, settings.image_pull_grace_seconds)
    if stuck is not None:
        return stuck.message
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        message = ""
        for container in status.get("containerStatuses") or []:
            message = ((container.get("state") or {}).get("terminated") or {}).get("message") or message
        why = message.strip().removeprefix("error: ") or status.get("message") or status.get("reason") or "failed"
        return " ".join(why.split())[:1500]
    created = b.parse_time(pod["metadata"].get("creationTimestamp")) or change.now
    if (change.now - created).total_seconds() > settings.s3_fetch_timeout_seconds + 60:
        return f"not fetched within {settings.s3_fetch_timeout_seconds} s ({pending_reason(pod)})"
    return None


def progress(change: StatusChange, spec: FineTuneJobSpec, nodes: list[str], attempt: int,
             settings: OperatorSettings) -> Fetch:
    """Create, follow and collect this attempt's fetch pods on `nodes`; conditions and
    events say what happens. Nothing is committed here: the caller commits."""
    wanted = uris(spec)
    nodes = sorted(nodes)
    record = {"attempt": attempt, "nodes": nodes, "uris": wanted}
    fetched = change.was.inputs_fetched
    if not wanted or (fetched is not None and fetched.model_dump(exclude_unset=True) == record):
        return Fetch(done=True)
    meta = change.job["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    names = {pod_name(name, attempt, node): node for node in nodes}
    pods = {p["metadata"]["name"]: p for p in change.cluster.job_pods(namespace, name)
            if is_fetcher(p) and any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])}
    for pod_id, pod in pods.items():  # another attempt's or node's, left by a re-plan or a restart
        if pod_id not in names and not pod["metadata"].get("deletionTimestamp"):
            change.cluster.delete_pod(namespace, pod_id, grace_seconds=0)
    created: list[str] = []
    waiting: list[str] = []
    results: list[str] = []
    for pod_id, node in names.items():
        found = pods.get(pod_id)
        if found is None:
            if change.cluster.create(build_fetch_pod(change.job, spec, node, attempt, settings)) is not None:
                created.append(pod_id)
            waiting.append(f"{node} (pod {pod_id})")
            continue
        pod = found
        failure = _failure(pod, change, settings)
        if failure is not None:
            message = f"fetching {', '.join(wanted)} on node {node} failed: {failure}"
            change.cond(CONDITION, False, "FetchFailed", message)
            cleanup(change, namespace, list(pods))
            return Fetch(failure=message)
        if (pod.get("status") or {}).get("phase") != "Succeeded":
            waiting.append(f"{node} (pod {pod_id}: {pending_reason(pod)})")
            continue
        terminated: dict[str, Any] = {}
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (container.get("state") or {}).get("terminated") or terminated
        results.append(f"{node}: {_summary(terminated.get('message') or '')}")
    if waiting:
        message = f"fetching {', '.join(wanted)} before the training pods start, on {', '.join(waiting)}"
        change.cond(CONDITION, False, "Fetching", message)
        if created:
            change.event("Normal", "FetchingInputs", message)
        return Fetch()
    message = "; ".join(results)
    change.status["inputsFetched"] = record
    change.cond(CONDITION, True, "Fetched", message[:2000])
    change.event("Normal", "InputsFetched", message[:1000])
    return Fetch(done=True)


def cleanup(change: StatusChange, namespace: str, pod_names: list[str]) -> None:
    for pod_id in pod_names:
        change.cluster.delete_pod(namespace, pod_id, grace_seconds=0)


def leftovers(pods: list[dict[str, Any]], attempt: int, training: bool) -> list[str]:
    """Fetch pods to delete: another attempt's, or any once the attempt's training pods exist."""
    return [p["metadata"]["name"] for p in pods if is_fetcher(p) and not p["metadata"].get("deletionTimestamp")
            and (training or p["metadata"].get("labels", {}).get(b.LABEL_ATTEMPT) != str(attempt))]
