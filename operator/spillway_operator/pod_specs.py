"""A training pod (and the pieces other pods share: the storage environment, the S3 cache and
NVMe volumes), from a FineTuneJob and the shape chosen for it.

Where this sits: beside `builders` (names, labels, the runtime config, the other children),
below `children` and `s3_inputs`, which create what these functions return. Pure: no client
calls, no clock reads.
"""

from __future__ import annotations

import hashlib
from typing import Any

from spillway_operator import node_pools
from spillway_operator.builders import (
    CHECKPOINT_DIR,
    CONFIG_DIR,
    CONFIG_FILE,
    LABEL_ATTEMPT,
    LABEL_COMPONENT,
    LABEL_JOB,
    LABEL_RANK,
    NVME_DIR,
    RENDEZVOUS_PORT,
    RUN_DIR,
    checkpoint_pvc_name,
    child_meta,
    configmap_name,
    input_claims,
    nvme_volume_bytes,
    pod_name,
    quantity,
    runtime_account_name,
    service_name,
)
from spillway_operator.placement import ShapeChoice
from spillway_operator.settings import OperatorSettings
from spillway_runtime.core.contract import (
    ATTEMPT_ENV,
    JOB_NAME_ENV,
    JOB_NAMESPACE_ENV,
    METRICS_PORT_ENV,
    POD_METRICS_PORT,
    STOP_GRACE_SECONDS_ENV,
)
from spillway_runtime.core.hardware import GPU_RESOURCE, NodeHardware
from spillway_runtime.core.planner import OffloadPlan
from spillway_runtime.core.spec import FineTuneJobSpec
from spillway_runtime.training.runconfig import PVC_MOUNT_ROOT, S3_CACHE_MOUNT, s3_inputs


def _command(job: dict[str, Any], plan: OffloadPlan, attempt: int, rank: int) -> list[str]:
    config = f"{CONFIG_DIR}/{CONFIG_FILE}"
    name = job["metadata"]["name"]
    processes = max(1, plan.processes_per_node)  # one per GPU, or resources.cpuProcesses
    if plan.nodes == 1 and processes == 1:
        return ["python", "-m", "spillway_runtime", "--config", config]
    # Our supervisor, not torchrun: torchrun's agent exits 1 on SIGTERM and SIGKILLs the ranks
    # 30 s later, so a suspended or preempted pod could never checkpoint and exit 75.
    command = ["python", "-m", "spillway_runtime.training.supervisor", f"--processes={processes}", f"--config={config}"]
    if plan.nodes == 1:
        return command
    master = f"{pod_name(name, attempt, 0)}.{service_name(name)}.{job['metadata']['namespace']}.svc"
    return [*command, f"--nnodes={plan.nodes}", f"--node-rank={rank}", f"--master-addr={master}",
            f"--master-port={RENDEZVOUS_PORT}"]


def build_pod(
    job: dict[str, Any],
    spec: FineTuneJobSpec,
    choice: ShapeChoice,
    attempt: int,
    rank: int,
    settings: OperatorSettings,
) -> dict[str, Any]:
    """One training pod: pinned by node affinity to the chosen shape's nodes; the scheduler binds."""
    plan = choice.plan
    assert plan is not None
    name = job["metadata"]["name"]
    meta = child_meta(job, pod_name(name, attempt, rank), "trainer", {LABEL_ATTEMPT: str(attempt), LABEL_RANK: str(rank)})
    meta["annotations"] = {"spillway.dev/plan": plan.label, "spillway.dev/shape": choice.shape}
    resources, cpu = _resources(plan, choice.hardware, settings)
    mounts, volumes = _volumes(job, spec, plan, choice.hardware, settings)
    trainer = {
        "name": "trainer",
        "image": settings.runtime_image,
        "command": _command(job, plan, attempt, rank),
        "env": _env(job, spec, plan, attempt, cpu, settings),
        "ports": [{"name": "metrics", "containerPort": POD_METRICS_PORT, "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": mounts,
        # The runtime's own error (a bad dataset line, with file and line) as the
        # container's termination message, which the operator copies into the job's
        # condition; where the runtime wrote none (a crash), the last lines of its log.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": runtime_account_name(name),
        "terminationGracePeriodSeconds": settings.termination_grace_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "fsGroup": settings.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "affinity": {} if choice.pool else _on_the_chosen_nodes(choice),
        "containers": [trainer],
        "volumes": volumes,
    }
    _place(pod_spec, meta, spec, choice, settings, pod_name(name, attempt, rank))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def _resources(plan: OffloadPlan, hw: NodeHardware, settings: OperatorSettings) -> tuple[dict[str, Any], int]:
    """The container's requests and limits from the plan's share of the node, and its CPUs."""
    share = plan.gpus_per_node / hw.gpu_count if hw.gpu_count else 1.0
    memory = min(plan.bytes.cpu + settings.memory_overhead_bytes, int(hw.cpu_memory_bytes * share))
    memory = max(memory, plan.bytes.cpu)
    cpu = max(1, int(hw.cpu_cores * share * 0.8))
    requests: dict[str, str] = {"cpu": str(cpu), "memory": quantity(memory)}
    if not plan.gpus_per_node:
        return {"requests": requests}, cpu
    requests[GPU_RESOURCE] = str(plan.gpus_per_node)
    return {"requests": requests, "limits": {GPU_RESOURCE: str(plan.gpus_per_node)}}, cpu


def _volumes(job: dict[str, Any], spec: FineTuneJobSpec, plan: OffloadPlan, hw: NodeHardware,
             settings: OperatorSettings) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trainer's mounts and the pod's volumes: its config, checkpoints and scratch, the
    NVMe volume when the plan swaps, the input claims read-only and the node's S3 cache."""
    name = job["metadata"]["name"]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "checkpoints", "mountPath": CHECKPOINT_DIR},
        {"name": "run", "mountPath": RUN_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": configmap_name(name)}},
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": checkpoint_pvc_name(name)}},
        {"name": "run", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    if plan.uses_nvme:
        nvme = _nvme_volume(spec, plan, hw, settings)
        volumes.append(nvme)
        mount = {"name": "nvme", "mountPath": NVME_DIR}
        if "hostPath" in nvme:  # this job's own directory under the node's NVMe root, nothing else of it
            mount["subPath"] = nvme_sub_path(job["metadata"]["namespace"], name)
        mounts.append(mount)
    for claim in input_claims(spec):
        volume = f"input-{claim}"[:63]
        mounts.append({"name": volume, "mountPath": str(PVC_MOUNT_ROOT / claim), "readOnly": True})
        volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    if s3_inputs(spec):
        # What the fetch pods put in this node's cache (spillway_operator.s3_inputs), read-only
        mounts.append({"name": S3_CACHE_VOLUME, "mountPath": str(S3_CACHE_MOUNT), "readOnly": True,
                       "subPath": s3_cache_sub_path(job["metadata"]["namespace"], spec)})
        volumes.append(s3_cache_volume(settings))
    return mounts, volumes


def _env(job: dict[str, Any], spec: FineTuneJobSpec, plan: OffloadPlan, attempt: int, cpu: int,
         settings: OperatorSettings) -> list[dict[str, Any]]:
    """The pod's side of the runtime's environment contract (contract.py), and what it needs."""
    env = [
        {"name": JOB_NAME_ENV, "value": job["metadata"]["name"]},
        {"name": JOB_NAMESPACE_ENV, "value": job["metadata"]["namespace"]},
        {"name": ATTEMPT_ENV, "value": str(attempt)},
        # Rank 0 serves /metrics here (the chart's PodMonitor scrapes the rank-0 pod's `metrics` port)
        {"name": METRICS_PORT_ENV, "value": str(POD_METRICS_PORT)},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # The root filesystem is read-only: caches that libraries keep under HOME (Hugging
        # Face, torch, Triton) go to the writable /tmp volume instead of failing.
        {"name": "HOME", "value": "/tmp"},
        # The runtime bounds its last mirror upload after SIGTERM by what is left of this
        {"name": STOP_GRACE_SECONDS_ENV, "value": str(settings.termination_grace_seconds)},
        *storage_env(spec),
    ]
    if plan.accelerator == "cpu":
        # torch sizes its thread pool by the host's cores, not the pod's CPU request: the
        # ranks of a CPU pod would oversubscribe the node without this.
        env.append({"name": "OMP_NUM_THREADS", "value": str(max(1, cpu // max(1, plan.processes_per_node)))})
    return env


def _on_the_chosen_nodes(choice: ShapeChoice) -> dict[str, Any]:
    """Node affinity to the nodes of the chosen shape (a pool's pods select its labels instead)."""
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                # One term per node (terms are ORed): the API server accepts a single value
                # for a metadata.name field selector, so a shape of several nodes needs several terms.
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    for node in sorted(choice.nodes)
                ]
            }
        }
    }


def _place(pod_spec: dict[str, Any], meta: dict[str, Any], spec: FineTuneJobSpec, choice: ShapeChoice,
           settings: OperatorSettings, hostname: str) -> None:
    """Where the pod may run, beside the affinity: the job's node selector and tolerations, a
    pool's labels, and for a multi-node plan one rank per node under a stable hostname."""
    name, attempt = meta["labels"][LABEL_JOB], meta["labels"][LABEL_ATTEMPT]
    if spec.resources.node_selector:
        pod_spec["nodeSelector"] = dict(spec.resources.node_selector)
    pool = node_pools.find(settings.node_pools, choice.pool)
    if pool is not None:
        # Planned on a pool's template: any node of the pool, once the autoscaler brings one up
        pod_spec["nodeSelector"] = {**pod_spec.get("nodeSelector", {}), **pool.labels}
        meta["annotations"][node_pools.POOL_ANNOTATION] = pool.name
    if spec.resources.tolerations:
        pod_spec["tolerations"] = [t.model_dump(mode="json", exclude_none=True) for t in spec.resources.tolerations]
    assert choice.plan is not None
    if choice.plan.nodes > 1:
        pod_spec["hostname"] = hostname
        pod_spec["subdomain"] = service_name(name)
        # The plan sized RAM and NVMe per node: two ranks must never share one, even
        # where a node has the GPUs for both.
        pod_spec.setdefault("affinity", {})["podAntiAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {LABEL_JOB: name, LABEL_ATTEMPT: attempt}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    if not pod_spec["affinity"]:
        del pod_spec["affinity"]


S3_CACHE_VOLUME = "s3-cache"
STORAGE_SECRET_KEYS = (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False), ("AWS_SESSION_TOKEN", True))


def storage_env(spec: FineTuneJobSpec) -> list[dict[str, Any]]:
    """The AWS variables a pod that reads or writes s3:// gets from spec.storage: the keys
    from its Secret (a session token and region only when the Secret has them), the endpoint
    and a region the spec gives. Without a secretRef none are set, and the client finds
    credentials where the node's environment puts them (IRSA's web identity, an instance role)."""
    storage = spec.storage
    env: list[dict[str, Any]] = []
    keys = [*STORAGE_SECRET_KEYS, *([] if storage.region else [("AWS_REGION", True)])]
    if storage.secret_ref is not None:
        for key, optional in keys:
            ref: dict[str, Any] = {"name": storage.secret_ref.name, "key": key}
            if optional:
                ref["optional"] = True
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    if storage.region:
        env.append({"name": "AWS_REGION", "value": storage.region})
    if storage.endpoint_url:
        env.append({"name": "AWS_ENDPOINT_URL", "value": storage.endpoint_url})
    return env


def s3_cache_sub_path(namespace: str, spec: FineTuneJobSpec) -> str:
    """A job's part of the node's s3:// cache: its namespace's, for its storage endpoint. The
    fetch pods and the training pods mount only this (a subPath), so a job never sees what
    another namespace fetched, and the same bucket name on another endpoint (a tenant's own
    server) is another entry; the kubelet makes it (root's, 0755 when it has to make the
    root; the fetch pod's init container hands the leaf to the training uid)."""
    endpoint = spec.storage.endpoint_url or "s3.amazonaws.com"
    return f"{namespace}/{hashlib.sha256(endpoint.encode()).hexdigest()[:16]}"


def s3_cache_volume(settings: OperatorSettings) -> dict[str, Any]:
    """The node's s3:// cache: a hostPath, so that what one job fetched serves the next job on
    the same node (the cache's ETag manifest says what is current)."""
    return {"name": S3_CACHE_VOLUME, "hostPath": {"path": settings.s3_cache_host_path, "type": "DirectoryOrCreate"}}


def nvme_storage_class(spec: FineTuneJobSpec, settings: OperatorSettings) -> str | None:
    """The StorageClass of the job's NVMe volume: the job's choice, else the cluster admin's
    default (chart: operator.nvme.storageClassName); None: the node's NVMe root (hostPath)."""
    return spec.offload.nvme.storage_class_name or settings.nvme_storage_class or None


def nvme_sub_path(namespace: str, name: str) -> str:
    """A job's directory under a node's NVMe root. The kubelet makes it (and `jobs/NAMESPACE`)
    with the root's mode, 1777 as the node probe leaves it (0777 then: the sticky bit is not
    copied), so the training uid can write it with no root init container; the pod sees
    this directory only, never another job's swap files. Both parts are DNS labels: no
    '..', no '/'."""
    return f"jobs/{namespace}/{name}"


def _nvme_volume(spec: FineTuneJobSpec, plan: OffloadPlan, hw: NodeHardware, settings: OperatorSettings) -> dict[str, Any]:
    storage_class = nvme_storage_class(spec, settings)
    if storage_class:
        return {
            "name": "nvme",
            "ephemeral": {
                "volumeClaimTemplate": {
                    "metadata": {"labels": {LABEL_COMPONENT: "nvme-swap"}},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "storageClassName": storage_class,
                        "resources": {"requests": {"storage": quantity(nvme_volume_bytes(spec, plan, settings))}},
                    },
                }
            },
        }
    # The root is what the cluster admin declared, never the job: the node probe's measured
    # directory (its spillway.dev/nvme-path annotation), a node pool's nvme.path, or the
    # operator's default. A root the kubelet has to make is root's 0755: the runtime then
    # fails before training, naming the mode the root needs (spillway_runtime.__main__).
    root = (hw.nvme_path or settings.nvme_host_root).rstrip("/") or "/"
    return {"name": "nvme", "hostPath": {"path": root, "type": "DirectoryOrCreate"}}
