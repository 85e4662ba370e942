"""The children of a FineTuneJob's attempt, created idempotently, and the inputs they need.

Where this sits: called by `reconciler` once an attempt is planned; shapes come
from `builders`, effects go through the reconciler's `Cluster`. Every create answers 409 for an object
that exists, which counts as done, so any of these may run again after a kill.
"""

from __future__ import annotations

from typing import Any

from spillway_operator import builders as b
from spillway_operator import metrics, pod_specs
from spillway_operator.cluster import Cluster
from spillway_operator.netpol import build_network_policy
from spillway_operator.settings import OperatorSettings
from spillway_runtime.core.spec import FineTuneJobSpec
from spillway_runtime.training.runconfig import RuntimeConfig


def create_children(
    cluster: Cluster,
    job: dict[str, Any],
    spec: FineTuneJobSpec,
    chosen: Any,
    attempt: int,
    config: RuntimeConfig,
    settings: OperatorSettings,
) -> list[str]:
    """Every child of this attempt, idempotently. The pods come as early as is safe: after
    their ServiceAccount (admission requires it), their NetworkPolicy (no pod of the job is
    ever open to other pods) and this attempt's ConfigMap (a container must never start on
    the previous attempt's config); the PVC, Service and Role they need later follow in the
    same call. Returns the names of the pods this call created."""
    plan = chosen.plan
    name = job["metadata"]["name"]
    cluster.create(b.build_runtime_rbac(job)[0])  # the ServiceAccount
    if settings.network_policy:
        cluster.create(build_network_policy(job, settings))
    cluster.apply_configmap(b.build_configmap(job, config, attempt))
    created = []
    for rank in range(plan.nodes):
        if cluster.create(pod_specs.build_pod(job, spec, chosen, attempt, rank, settings)) is not None:
            created.append(b.pod_name(name, attempt, rank))
            metrics.PODS_CREATED.inc()
    _create_later_children(cluster, job, spec, plan, settings)
    return created


def _create_later_children(
    cluster: Cluster, job: dict[str, Any], spec: FineTuneJobSpec, plan: Any, settings: OperatorSettings
) -> None:
    """The children the pods need only once they run: checkpoint PVC, rendezvous Service,
    the runtime's Role and RoleBinding."""
    cluster.create(b.build_checkpoint_pvc(job, spec, plan, settings))
    if plan.nodes > 1:
        cluster.create(b.build_headless_service(job))
    for obj in b.build_runtime_rbac(job)[1:]:
        cluster.create(obj)


def ensure_later_children(
    cluster: Cluster, job: dict[str, Any], spec: FineTuneJobSpec, settings: OperatorSettings
) -> bool:
    """Pods exist but status does not say their attempt's children were all created: the
    previous reconcile stopped (killed, an API error) between the pods and the rest. Create
    the rest from the plan in this attempt's ConfigMap; False when there is none to read."""
    meta = job["metadata"]
    data = cluster.configmap_data(meta["namespace"], b.configmap_name(meta["name"]))
    if not data or b.CONFIG_FILE not in data:
        return False
    plan = RuntimeConfig.model_validate_json(data[b.CONFIG_FILE]).plan
    _create_later_children(cluster, job, spec, plan, settings)
    return True


def missing_inputs(
    cluster: Cluster, namespace: str, spec: FineTuneJobSpec, plan: Any, settings: OperatorSettings
) -> list[str]:
    missing = []
    for claim in b.input_claims(spec):
        if not cluster.pvc_exists(namespace, claim):
            missing.append(f"PersistentVolumeClaim {claim!r} (from a pvc:// URI) does not exist in {namespace}")
    classes = []
    if plan.uses_nvme and (nvme_class := pod_specs.nvme_storage_class(spec, settings)):
        where = "offload.nvme.storageClassName" if spec.offload.nvme.storage_class_name else \
            "the operator's nvme.storageClassName"
        classes.append((where, nvme_class))
    if spec.checkpoint.storage_class_name:
        classes.append(("checkpoint.storageClassName", spec.checkpoint.storage_class_name))
    for field_name, cls in classes:
        if not cluster.storage_class_exists(cls, max_age=settings.pricing_cache_seconds):
            missing.append(f"StorageClass {cls!r} ({field_name}) does not exist")
    return missing
