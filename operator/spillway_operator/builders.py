"""Pure functions from a FineTuneJob (and the cluster facts read for it) to desired objects.

Where this sits: below `reconciler` (which reads the cluster and applies what these
functions return) and above nothing but the runtime's spec and planner. No client
calls, no clock reads (the caller passes `now`), no kopf: every function here is
unit-tested on plain dicts.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spillway_operator import node_pools
from spillway_operator.placement import ShapeChoice
from spillway_operator.settings import OperatorSettings
from spillway_runtime.contract import (
    ATTEMPT_ENV,
    JOB_NAME_ENV,
    JOB_NAMESPACE_ENV,
    METRICS_PORT_ENV,
    POD_METRICS_PORT,
    STOP_GRACE_SECONDS_ENV,
    TERMINAL_PHASES,
    ExitCode,
    Phase,
    exit_outcome,
)
from spillway_runtime.dsconfig import build_deepspeed_config
from spillway_runtime.hardware import GPU_RESOURCE, NodeHardware
from spillway_runtime.planner import OffloadPlan
from spillway_runtime.runconfig import PVC_MOUNT_ROOT, S3_CACHE_MOUNT, RuntimeConfig, resolve_uri, s3_inputs
from spillway_runtime.spec import API_GROUP, API_VERSION, KIND, FineTuneJob, FineTuneJobSpec
from spillway_runtime.units import GiB

LABEL_JOB = "spillway.dev/job"
LABEL_ATTEMPT = "spillway.dev/attempt"
LABEL_RANK = "spillway.dev/rank"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "spillway-operator"

CONFIG_DIR = "/etc/spillway"
CONFIG_FILE = "runtime.json"
WORK_ROOT = "/var/lib/spillway"
CHECKPOINT_DIR = f"{WORK_ROOT}/checkpoints"
RUN_DIR = f"{WORK_ROOT}/run"
NVME_DIR = f"{WORK_ROOT}/nvme"
RENDEZVOUS_PORT = 29500

# Runtime exit codes (spillway_runtime.recipe); repeated here as the operator's contract.

PHASE_PENDING: Phase = "Pending"
PHASE_QUEUED: Phase = "Queued"
PHASE_PLANNED: Phase = "Planned"
PHASE_SCHEDULED: Phase = "Scheduled"
PHASE_RUNNING: Phase = "Running"
PHASE_SUCCEEDED: Phase = "Succeeded"
PHASE_FAILED: Phase = "Failed"
PHASE_SUSPENDED: Phase = "Suspended"
PHASE_BUDGET_EXCEEDED: Phase = "BudgetExceeded"
FINISHED_PHASES = TERMINAL_PHASES  # the phases a job never leaves, as the API and dashboard know them


# ----------------------------------------------------------------- names --


def child_name(job: str, suffix: str) -> str:
    """Deterministic child names, so a restarted operator finds what it made before.
    Long job names are shortened with a hash to stay within the 63-character DNS label."""
    name = f"{job}-{suffix}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(job.encode()).hexdigest()[:8]
    return f"{job[: 63 - len(suffix) - 10]}-{digest}-{suffix}"


def pod_name(job: str, attempt: int, rank: int) -> str:
    return child_name(job, f"a{attempt}-{rank}")


def configmap_name(job: str) -> str:
    return child_name(job, "runtime")


def checkpoint_pvc_name(job: str) -> str:
    return child_name(job, "checkpoints")


def runtime_account_name(job: str) -> str:
    return child_name(job, "runtime")


def service_name(job: str) -> str:
    return child_name(job, "ranks")


# ------------------------------------------------------------ conditions --


def rfc3339(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int,
    now: datetime,
) -> list[dict[str, Any]]:
    """metav1.Condition semantics: lastTransitionTime moves only when status flips."""
    value = "True" if status else "False"
    out = []
    found = False
    for c in conditions:
        if c.get("type") != type_:
            out.append(c)
            continue
        found = True
        changed = c.get("status") != value
        out.append(
            {
                "type": type_,
                "status": value,
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": rfc3339(now) if changed else c.get("lastTransitionTime", rfc3339(now)),
            }
        )
    if not found:
        out.append(
            {
                "type": type_,
                "status": value,
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": rfc3339(now),
            }
        )
    return out


def condition(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


# ---------------------------------------------------------------- children --


def owner_reference(job: dict[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_meta(job: dict[str, Any], name: str, component: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    labels = {LABEL_JOB: job["metadata"]["name"], LABEL_COMPONENT: component, LABEL_MANAGED_BY: MANAGER}
    labels.update(extra or {})
    return {
        "name": name,
        "namespace": job["metadata"]["namespace"],
        "labels": labels,
        "ownerReferences": [owner_reference(job)],
    }


def _claims(spec: FineTuneJobSpec) -> list[str]:
    held_out = spec.dataset.validation.uri if spec.dataset.validation else None
    uris = [spec.model.uri, spec.dataset.uri, spec.model.tokenizer_uri or "", held_out or ""]
    claims = []
    for uri in uris:
        if uri.startswith("pvc://"):
            claim = uri[len("pvc://") :].split("/", 1)[0]
            if claim and claim not in claims:
                claims.append(claim)
    return claims


def input_claims(spec: FineTuneJobSpec) -> list[str]:
    """PersistentVolumeClaims named by pvc:// URIs (mounted read-only at /mnt/pvc/CLAIM)."""
    return _claims(spec)


def checkpoint_size_bytes(spec: FineTuneJobSpec, plan: OffloadPlan) -> int:
    """Auto size: `keep` checkpoints (`plan.checkpoint_bytes`: 12 B/param under ZeRO-3, 14
    under ZeRO-2), the best one when `keepBest` keeps it beyond those, one being written,
    and 1 GiB for the tokenized dataset, the data position and logs."""
    if spec.checkpoint.size:
        return spec.checkpoint.size
    count = spec.checkpoint.keep + 1 + (1 if spec.checkpoint.keep_best else 0)
    return plan.checkpoint_bytes * count + GiB


def nvme_volume_bytes(spec: FineTuneJobSpec, plan: OffloadPlan, settings: OperatorSettings) -> int:
    if spec.offload.nvme.size:
        return spec.offload.nvme.size
    return max(GiB, math.ceil(plan.bytes.nvme * (1 + settings.nvme_headroom_fraction) / GiB) * GiB)


def _quantity(n: int) -> str:
    """Bytes as a Kubernetes quantity, rounded up to whole MiB (readable in kubectl)."""
    return f"{-(-n // (1 << 20))}Mi"


def build_runtime_config(job: dict[str, Any], spec: FineTuneJobSpec, plan: OffloadPlan, resume_from: str | None) -> RuntimeConfig:
    """What the training process reads. resumeFrom is passed only on the attempt that applies a
    rollback; later attempts resume from the latest good checkpoint."""
    meta = job["metadata"]
    wire_spec = spec.model_copy(update={"resume_from": resume_from})
    ftj = FineTuneJob.model_validate(
        {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "spec": wire_spec.model_dump(mode="json"),
        }
    )
    nvme_dir = NVME_DIR if plan.uses_nvme else None
    ds = build_deepspeed_config(plan, wire_spec, nvme_path=nvme_dir, world_size=plan.world_size)
    root = Path("/")
    return RuntimeConfig(
        job=ftj,
        plan=plan,
        # s3:// at its place in the node's cache, which the fetch pods filled
        model_dir=str(resolve_uri(spec.model.uri, root, S3_CACHE_MOUNT)),
        tokenizer_dir=str(resolve_uri(spec.model.tokenizer_uri or spec.model.uri, root, S3_CACHE_MOUNT)),
        dataset_path=str(resolve_uri(spec.dataset.uri, root, S3_CACHE_MOUNT)),
        validation_path=(str(resolve_uri(spec.dataset.validation.uri, root, S3_CACHE_MOUNT))
                         if spec.dataset.validation and spec.dataset.validation.uri else None),
        run_dir=RUN_DIR,
        checkpoint_dir=CHECKPOINT_DIR,
        nvme_dir=nvme_dir,
        remove_swap_at_exit=nvme_dir is not None,
        export_dir=f"{CHECKPOINT_DIR}/export",
        events_path=f"{RUN_DIR}/events.jsonl",
        deepspeed=ds,
    )


def build_configmap(job: dict[str, Any], config: RuntimeConfig, attempt: int) -> dict[str, Any]:
    meta = child_meta(job, configmap_name(job["metadata"]["name"]), "runtime-config")
    meta["annotations"] = {LABEL_ATTEMPT: str(attempt)}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {
            CONFIG_FILE: config.model_dump_json(indent=1),
            "deepspeed.json": json.dumps(config.deepspeed, indent=1, sort_keys=True),
        },
    }


def build_checkpoint_pvc(
    job: dict[str, Any], spec: FineTuneJobSpec, plan: OffloadPlan, settings: OperatorSettings
) -> dict[str, Any]:
    pvc_spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"] if plan.nodes == 1 else ["ReadWriteMany"],
        "resources": {"requests": {"storage": _quantity(checkpoint_size_bytes(spec, plan))}},
    }
    storage_class = spec.checkpoint.storage_class_name or settings.checkpoint_storage_class
    if storage_class:
        pvc_spec["storageClassName"] = storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": child_meta(job, checkpoint_pvc_name(job["metadata"]["name"]), "checkpoints"),
        "spec": pvc_spec,
    }


def build_runtime_rbac(job: dict[str, Any]) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding that let the pods patch only their own job's status."""
    name = job["metadata"]["name"]
    account = runtime_account_name(name)
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": child_meta(job, account, "runtime-rbac"),
        "rules": [
            {
                "apiGroups": [API_GROUP],
                "resources": ["finetunejobs"],
                "resourceNames": [name],
                "verbs": ["get"],
            },
            {
                "apiGroups": [API_GROUP],
                "resources": ["finetunejobs/status"],
                "resourceNames": [name],
                "verbs": ["get", "patch"],
            },
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": child_meta(job, account, "runtime-rbac"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": job["metadata"]["namespace"]}],
    }
    account_obj = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_meta(job, account, "runtime-rbac"),
    }
    return [account_obj, role, binding]


def build_headless_service(job: dict[str, Any]) -> dict[str, Any]:
    """DNS names for the rendezvous between the ranks of a multi-node job (rank 0's address)."""
    name = job["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(job, service_name(name), "rendezvous"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: name},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}],
        },
    }


def _command(job: dict[str, Any], plan: OffloadPlan, attempt: int, rank: int) -> list[str]:
    config = f"{CONFIG_DIR}/{CONFIG_FILE}"
    name = job["metadata"]["name"]
    processes = max(1, plan.processes_per_node)  # one per GPU, or resources.cpuProcesses
    if plan.nodes == 1 and processes == 1:
        return ["python", "-m", "spillway_runtime", "--config", config]
    # Our supervisor, not torchrun: torchrun's agent exits 1 on SIGTERM and SIGKILLs the ranks
    # 30 s later, so a suspended or preempted pod could never checkpoint and exit 75.
    command = ["python", "-m", "spillway_runtime.supervisor", f"--processes={processes}", f"--config={config}"]
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
    hw = choice.hardware
    name = job["metadata"]["name"]
    meta = child_meta(job, pod_name(name, attempt, rank), "trainer", {LABEL_ATTEMPT: str(attempt), LABEL_RANK: str(rank)})
    meta["annotations"] = {"spillway.dev/plan": plan.label, "spillway.dev/shape": choice.shape}
    share = plan.gpus_per_node / hw.gpu_count if hw.gpu_count else 1.0
    memory = min(plan.bytes.cpu + settings.memory_overhead_bytes, int(hw.cpu_memory_bytes * share))
    memory = max(memory, plan.bytes.cpu)
    cpu = max(1, int(hw.cpu_cores * share * 0.8))
    requests: dict[str, str] = {"cpu": str(cpu), "memory": _quantity(memory)}
    limits: dict[str, str] = {}
    if plan.gpus_per_node:
        requests[GPU_RESOURCE] = str(plan.gpus_per_node)
        limits[GPU_RESOURCE] = str(plan.gpus_per_node)

    mounts = [
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
    init_containers: list[dict[str, Any]] = []
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

    env = [
        {"name": JOB_NAME_ENV, "value": name},
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
        "affinity": {} if choice.pool else {
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
        },
        "containers": [
            {
                "name": "trainer",
                "image": settings.runtime_image,
                "command": _command(job, plan, attempt, rank),
                "env": env,
                "ports": [{"name": "metrics", "containerPort": POD_METRICS_PORT, "protocol": "TCP"}],
                "resources": {"requests": requests, "limits": limits} if limits else {"requests": requests},
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
        ],
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if spec.resources.node_selector:
        pod_spec["nodeSelector"] = dict(spec.resources.node_selector)
    pool = node_pools.find(settings.node_pools, choice.pool)
    if pool is not None:
        # Planned on a pool's template: any node of the pool, once the autoscaler brings one up
        pod_spec["nodeSelector"] = {**pod_spec.get("nodeSelector", {}), **pool.labels}
        meta["annotations"][node_pools.POOL_ANNOTATION] = pool.name
    if spec.resources.tolerations:
        pod_spec["tolerations"] = [t.model_dump(mode="json", exclude_none=True) for t in spec.resources.tolerations]
    if plan.nodes > 1:
        pod_spec["hostname"] = pod_name(name, attempt, rank)
        pod_spec["subdomain"] = service_name(name)
        # The plan sized RAM and NVMe per node: two ranks must never share one, even
        # where a node has the GPUs for both.
        pod_spec.setdefault("affinity", {})["podAntiAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {LABEL_JOB: name, LABEL_ATTEMPT: str(attempt)}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    if not pod_spec["affinity"]:
        del pod_spec["affinity"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


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
                        "resources": {"requests": {"storage": _quantity(nvme_volume_bytes(spec, plan, settings))}},
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


# ------------------------------------------------------------ pod outcomes --

OUTCOME_PENDING = "pending"
OUTCOME_SCHEDULED = "scheduled"
OUTCOME_RUNNING = "running"
OUTCOME_SUCCEEDED = "succeeded"
OUTCOME_PREEMPTED = "preempted"  # recreate, do not count
OUTCOME_RETRYABLE = "retryable"  # count against backoffLimit
OUTCOME_PERMANENT = "permanent"  # no retry can help


@dataclass
class PodOutcome:
    kind: str
    exit_code: int | None = None
    reason: str = ""
    message: str = ""


def _exit_code(pod: dict[str, Any]) -> tuple[int | None, str, str]:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term is not None:
            return term.get("exitCode"), term.get("reason") or "", term.get("message") or ""
    return None, "", ""


def classify_pod(pod: dict[str, Any], node_exists: bool) -> PodOutcome:
    """What a training pod's state means for the job; an exit code means what the contract's
    `exit_outcome` says it means in a cluster."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    node = (pod.get("spec") or {}).get("nodeName")
    if node and not node_exists:
        return PodOutcome(OUTCOME_PREEMPTED, reason="NodeLost", message=f"node {node} is gone")
    disrupted = any(c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in status.get("conditions") or [])
    if (status.get("reason") == "Evicted" or (disrupted and phase not in ("Succeeded",))) and (
        phase in ("Failed",) or status.get("reason") == "Evicted" or (pod.get("metadata") or {}).get("deletionTimestamp")
    ):
        return PodOutcome(
            OUTCOME_PREEMPTED,
            reason=status.get("reason") or "Disrupted",
            message=status.get("message", ""),
        )
    if phase == "Succeeded":
        return PodOutcome(OUTCOME_SUCCEEDED, exit_code=0)
    if phase == "Failed":
        code, reason, message = _exit_code(pod)
        reason = reason or status.get("reason") or "Error"
        kind = exit_outcome(code, "cluster").kind if code is not None else OUTCOME_RETRYABLE
        if kind == OUTCOME_SUCCEEDED:  # exit 0 in a failed pod: another container failed it
            kind = OUTCOME_RETRYABLE
        if code == ExitCode.PREEMPTED:
            return PodOutcome(kind, code, "Preempted", "runtime checkpointed and exited 75")
        if code == ExitCode.BAD_INPUT:
            return PodOutcome(kind, code, "BadInput", message or "the runtime rejected its input")
        if code == ExitCode.DIVERGED:
            return PodOutcome(kind, code, "Diverged", message or "loss diverged after all rollbacks")
        return PodOutcome(kind, code, reason, message)
    if phase == "Running":
        return PodOutcome(OUTCOME_RUNNING)
    if node:
        return PodOutcome(OUTCOME_SCHEDULED)
    return PodOutcome(OUTCOME_PENDING)


# A container the kubelet can never start: retrying the attempt starts the same image
# with the same settings. (ErrImagePull and ImagePullBackOff may be a registry outage:
# they count only after the pull grace.)
NEVER_STARTS = {"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"}
PULL_FAILURES = {"ErrImagePull", "ImagePullBackOff"}


def container_never_starts(pod: dict[str, Any], now: datetime, pull_grace_seconds: float) -> PodOutcome | None:
    """A pod whose container cannot start (a bad image name, an image that cannot be pulled
    for `pull_grace_seconds`, a missing Secret or ConfigMap key): a permanent outcome that
    names the image, else None."""
    created = parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
    images = {c.get("name"): c.get("image") for c in (pod.get("spec") or {}).get("containers") or []}
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason") or ""
        overdue = created is not None and (now - created).total_seconds() >= pull_grace_seconds
        if reason == "CreateContainerConfigError" and (secrets := _secrets_of(pod, cs.get("name"))):
            # The kubelet's message says what is missing ('secret "x" not found', 'couldn't
            # find key K in Secret ns/x'); the check names where the Secret comes from
            message = (f"container {cs.get('name')} cannot start ({reason}): {waiting.get('message') or 'no message'}; "
                       f"check that the Secret {' or '.join(repr(n) for n in secrets)} (spec.storage.secretRef) "
                       "exists in the job's namespace with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
            return PodOutcome(OUTCOME_PERMANENT, reason=reason, message=message)
        if reason in NEVER_STARTS or (reason in PULL_FAILURES and overdue):
            image = cs.get("image") or images.get(cs.get("name")) or "?"
            message = (f"container {cs.get('name')} cannot start ({reason}) with image {image}: "
                       f"{waiting.get('message') or 'no message'}; check the operator's runtimeImage "
                       "(SPILLWAY_OPERATOR_RUNTIME_IMAGE) and the nodes' access to it")
            return PodOutcome(OUTCOME_PERMANENT, reason=reason, message=message)
    return None


def _secrets_of(pod: dict[str, Any], container: str | None) -> list[str]:
    """The Secrets a container's environment reads (secretKeyRef), in order."""
    names: list[str] = []
    spec = pod.get("spec") or {}
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if c.get("name") != container:
            continue
        for var in c.get("env") or []:
            name = ((var.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
            if name and name not in names:
                names.append(name)
    return names


def worst_outcome(outcomes: list[PodOutcome]) -> PodOutcome:
    """A multi-node attempt is as good as its worst rank."""
    order = [
        OUTCOME_PERMANENT,
        OUTCOME_RETRYABLE,
        OUTCOME_PREEMPTED,
        OUTCOME_PENDING,
        OUTCOME_SCHEDULED,
        OUTCOME_RUNNING,
        OUTCOME_SUCCEEDED,
    ]
    return min(outcomes, key=lambda o: order.index(o.kind))


def backoff_seconds(failures: int, settings: OperatorSettings) -> float:
    """Delay before attempt N+1 after `failures` counted failures (doubling, capped)."""
    if failures <= 0:
        return 0.0
    return float(min(settings.backoff_max_seconds, settings.backoff_base_seconds * 2 ** (failures - 1)))


# ------------------------------------------------------------------- cost --


def pod_run_seconds(pod: dict[str, Any], now: datetime) -> float:
    """Seconds the pod has held its node: from startTime to termination (or now)."""
    status = pod.get("status") or {}
    start = parse_time(status.get("startTime"))
    if start is None:
        return 0.0
    end: datetime | None = None
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term and term.get("finishedAt"):
            t = parse_time(term["finishedAt"])
            end = t if end is None or (t and t > end) else end
    if end is None:
        end = now
    return max(0.0, (end - start).total_seconds())


def cost_status(
    now: datetime, settled_usd: float, settled_gpu_hours: float, live_seconds: float, price_per_hour: float, gpus: int
) -> dict[str, Any]:
    """status.cost: settled attempts plus the live one, as of `now`."""
    usd = settled_usd + live_seconds / 3600 * price_per_hour
    gpu_hours = settled_gpu_hours + live_seconds / 3600 * max(gpus, 0)
    return {
        "asOf": rfc3339(now),
        "usd": round(usd, 6),
        "gpuHours": round(gpu_hours, 6),
        "settledUSD": round(settled_usd, 6),
        "settledGpuHours": round(settled_gpu_hours, 6),
        "pricePerHourUSD": price_per_hour,
        "display": f"${usd:,.2f}",
    }
