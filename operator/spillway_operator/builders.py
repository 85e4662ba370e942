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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spillway_operator.settings import OperatorSettings
from spillway_runtime.core.contract import (
    TERMINAL_PHASES,
    Phase,
)
from spillway_runtime.core.planner import OffloadPlan
from spillway_runtime.core.spec import FineTuneJob, FineTuneJobSpec
from spillway_runtime.core.spec_types import API_GROUP, API_VERSION, KIND
from spillway_runtime.core.units import GiB
from spillway_runtime.training.dsconfig import build_deepspeed_config
from spillway_runtime.training.runconfig import S3_CACHE_MOUNT, RuntimeConfig, input_uris, resolve_uri

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

# Runtime exit codes (spillway_runtime.training.recipe); repeated here as the operator's contract.

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
    claims = []
    for _, uri in input_uris(spec):
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


def quantity(n: int) -> str:
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
        mixture_paths=[str(resolve_uri(m.uri, root, S3_CACHE_MOUNT)) for m in spec.dataset.mixture],
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
        "resources": {"requests": {"storage": quantity(checkpoint_size_bytes(spec, plan))}},
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
