"""The operator's configuration: one typed object, read once from the environment.

Where this sits: the bottom of the operator's layers (handlers -> builders -> k8s
-> settings). Every field says its unit and why its default is what it is.
Environment variables are the field names upper-cased with the prefix
``SPILLWAY_OPERATOR_``, e.g. ``SPILLWAY_OPERATOR_RESYNC_SECONDS=5``.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from spillway_operator.node_pools import NodePool


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPILLWAY_OPERATOR_", extra="ignore")

    namespace: str = Field(
        "spillway-system",
        description="Namespace the operator runs in; the pricing ConfigMap is read from here",
    )
    pricing_configmap: str = Field(
        "spillway-pricing",
        description="ConfigMap with prices per GPU-hour keyed by GFD gpu.product (and 'default', 'cpu-node')",
    )
    default_gpu_hour_usd: float = Field(
        2.0,
        description="USD per GPU-hour when the pricing ConfigMap has no entry: a mid-range cloud list price",
    )
    default_cpu_node_hour_usd: float = Field(
        0.5, description="USD per hour for a node without GPUs when the pricing ConfigMap has no entry"
    )
    runtime_image: str = Field(
        "ghcr.io/spillway/runtime:0.1.0",
        description="Image of the training pods (python -m spillway_runtime)",
    )
    resync_seconds: float = Field(
        10.0,
        description="Seconds between periodic reconciles of every job: cost accrual, TTL, backoff expiry. "
        "Pod events reconcile at once; this only bounds how stale cost and TTL can be",
    )
    relist_seconds: float = Field(
        300.0,
        description="Seconds between full LISTs of jobs, pods and nodes that replace the operator's caches "
        "(the watches keep them current; a relist catches a deletion a reconnecting watch missed)",
    )
    workers: int = Field(
        8,
        ge=1,
        description="Reconcile worker threads. Each job is reconciled by one worker at a time; the work "
        "is mostly waiting on the API server",
    )
    replan_pending_seconds: float = Field(
        60.0,
        description="A pod the scheduler has refused for this long is re-planned when the nodes the job "
        "may use have changed since its plan (nodes came back or were added): the pending pods are "
        "replaced, nothing is counted, as none of them ran",
    )
    cost_update_seconds: float = Field(
        60.0,
        description="Most seconds status.cost of a running job may lag (its asOf says when it was "
        "computed); budgets are checked on every reconcile regardless",
    )
    image_pull_grace_seconds: float = Field(
        300.0,
        description="How long a training pod may fail to pull its image (ErrImagePull, ImagePullBackOff) "
        "before the job fails with the reason: long enough for a registry hiccup, short enough that a "
        "misspelt image does not hold GPUs for long",
    )
    read_model_config: bool = Field(
        True,
        description="Before planning a job whose model is on a PVC (pvc://) and whose spec gives no "
        "model.config, read the model's config.json there in a short pod (no GPU) and plan from its real "
        "shape; off: plan from spec.model.parameterCount",
    )
    model_config_timeout_seconds: int = Field(
        600,
        description="How long the pod that reads a pvc:// model's config.json before planning may take, "
        "from its creation (scheduling, image pull, reading); past it the job plans from "
        "spec.model.parameterCount, or fails naming why when there is none",
    )
    s3_cache_host_path: str = Field(
        "/var/cache/spillway/s3",
        description="The node directory (hostPath) that s3:// inputs are fetched into before a job's "
        "training pods start, and that they mount read-only: kept across jobs, so a second job on the same "
        "objects and node downloads nothing (its ETag manifest says what is current); put it on a disk "
        "with room for the models the node trains",
    )
    s3_fetch_timeout_seconds: int = Field(
        3600,
        description="How long the pod that fetches a job's s3:// inputs on a node may take, from its "
        "creation (scheduling, image pull, download): an hour moves ~100 GB at a modest 30 MB/s; past it "
        "the job fails naming the URIs and node",
    )
    node_pools: list[NodePool] = Field(
        default_factory=list,
        description="Node pools that scale from zero (the chart's nodePools, as JSON): when no node that "
        "exists fits a job, it is planned on the pools' template nodes and its pods select the pool's labels, "
        "so the autoscaler brings a node up; a job fails NoFit only when neither fits",
    )
    kueue: bool = Field(
        False,
        description="Integrate with Kueue (kueue.x-k8s.io/v1beta2, installed separately): a job with "
        "spec.queueName (or the label kueue.x-k8s.io/queue-name) gets a Workload and starts only once Kueue "
        "admits it; off: such a job fails at once, saying so (the chart's kueue.enabled)",
    )
    strict_phases: bool = Field(
        False,
        description="A phase change the phase machine (spillway_operator.phases) does not allow, or a status "
        "field outside the status contract (FineTuneJobStatus), raises instead of being logged (an illegal phase "
        "also counted and posted as a Warning Event) and applied: on in the tests, which must fail at the "
        "decision; off in production, where raising would retry the same decision forever",
    )
    backoff_base_seconds: float = Field(
        10.0, description="First retry delay after a failed attempt; doubles per failure (as Kubernetes Jobs)"
    )
    backoff_max_seconds: float = Field(360.0, description="Cap on the retry delay (Kubernetes Jobs cap at 6 min)")
    termination_grace_seconds: int = Field(
        600,
        description="Pod terminationGracePeriodSeconds: the runtime checkpoints on SIGTERM, and writing "
        "hundreds of GB of optimizer state takes minutes",
    )
    memory_overhead_bytes: int = Field(
        4 << 30,
        description="Added to the plan's CPU bytes for the pod's memory request: Python, CUDA context, "
        "data loader and NCCL buffers live outside the model state the planner counts",
    )
    nvme_headroom_fraction: float = Field(
        0.10,
        description="Extra NVMe requested above the plan's swap bytes, for DeepSpeed's alignment padding",
    )
    nvme_storage_class: str | None = Field(
        None,
        description="StorageClass of the NVMe volume (a generic ephemeral volume, one per pod) of a job "
        "that names none: a local-volume provisioner's class, with fsGroup ownership and no hostPath, so job "
        "namespaces can enforce Pod Security 'restricted'. None: each job gets its own directory under the "
        "node's NVMe root (nvme_host_root)",
    )
    nvme_host_root: str = Field(
        "/mnt/nvme/spillway",
        max_length=4096,
        description="The node directory under which each job gets its own NVMe directory "
        "(jobs/NAMESPACE/NAME, a hostPath subPath) when no StorageClass is used and the node advertises no "
        "path of its own (the node probe's spillway.dev/nvme-path, a node pool's nvme.path). It must be "
        "mode 1777 (the node probe makes it so); jobs never choose it",
    )
    network_policy: bool = Field(
        True,
        description="Give each job a NetworkPolicy, created before its pods: they accept connections only "
        "from pods of the same job (rendezvous, gloo/NCCL), and their metrics port only from "
        "metrics_namespaces",
    )
    metrics_namespaces: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Namespaces whose pods may scrape a training pod's metrics port (your Prometheus); "
        "empty: none",
    )
    checkpoint_storage_class: str | None = Field(
        None, description="StorageClass of checkpoint PVCs when the job names none (None: cluster default)"
    )
    pricing_cache_seconds: float = Field(
        5.0,
        description="Seconds the pricing ConfigMap and a StorageClass found to exist, read for every job "
        "placed, may be reused (0: read every time)",
    )
    leader_election: bool = Field(
        False,
        description="Reconcile only while holding the Lease `lease_name` in `namespace`: required for more "
        "than one replica; off by default because a single process needs no lease",
    )
    lease_name: str = Field("spillway-operator", description="Name of the leader-election Lease")
    metrics_port: int = Field(8080, description="Port of the Prometheus /metrics endpoint (0 disables it)")
    liveness_port: int = Field(8081, description="Port of kopf's /healthz liveness endpoint (0 disables it)")
    run_as_user: int = Field(1000, description="UID of the training container; non-root by default")
    webhook_port: int = Field(
        0,
        description="HTTPS port of the validating admission webhook, served by every replica (0: none; "
        "the chart sets it and registers the webhook)",
    )
    webhook_service: str = Field(
        "spillway-operator-webhook", description="Service the API server calls the webhook through (its DNS names "
        "go into the serving certificate)"
    )
    webhook_configuration: str = Field(
        "spillway-finetunejob-validation",
        description="ValidatingWebhookConfiguration whose caBundle the operator keeps trusting its certificate",
    )
    webhook_secret: str = Field(
        "spillway-webhook-tls", description="Secret in `namespace` holding the webhook's certificate and key"
    )
    webhook_cert_days: float = Field(
        365.0, gt=0, description="Validity of a certificate the operator makes; renewed at two thirds of it"
    )
    webhook_cert_check_seconds: float = Field(
        3600.0, gt=0,
        description="Seconds between checks of the certificate (renewal, and picking up one another replica made)",
    )


@lru_cache(maxsize=1)
def get_settings() -> OperatorSettings:
    return OperatorSettings()
