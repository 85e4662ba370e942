"""Node pools that scale from zero: node shapes declared in the chart's values, planned on
as if their nodes were there.

Where this sits: below `reconciler` and `placement`; settings in, plain Node dicts out.
Real GPU clusters bring GPU nodes up on demand (cluster-autoscaler, Karpenter): the node a
job needs often does not exist yet. A declared pool is a template of its nodes (GPU
product, count and memory, CPU and RAM, NVMe, labels, taints, price); the operator plans
on the nodes that exist first, and only when none fits on the pools' template nodes
("declared" nodes, never pinned by name). Pods for a declared shape select the pool's
labels, so the autoscaler sees pending pods it can satisfy with that pool and brings a
node up; when it comes, its probed hardware is checked against the template
(`waits.check_arrived_node`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from spillway_runtime.core.hardware import (
    ANNOTATIONS,
    GFD_COUNT,
    GFD_MEMORY_MIB,
    GFD_PRODUCT,
    GPU_RESOURCE,
    NVME_PATH_ANNOTATION,
)

POOL_ANNOTATION = "spillway.dev/declared-pool"  # on a template node, and on the pods planned on one
PRICE_ANNOTATION = "spillway.dev/declared-gpu-hour-usd"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True,
                              extra="forbid")


class PoolNvme(_Model):
    path: str = Field(description="The directory on the node's NVMe under which each job gets its own for swap files "
                      "(a hostPath subPath; mode 1777, see docs/security.md)")
    capacity: str = Field(description="Its size, a Kubernetes quantity (e.g. 1800G)")
    read_bytes_per_second: int | None = None
    write_bytes_per_second: int | None = None


class NodePool(_Model):
    """One node pool's nodes, as the autoscaler would make them."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    labels: dict[str, str] = Field(
        min_length=1, description="Labels every node of the pool carries and only they do (e.g. "
        "karpenter.sh/nodepool or cloud.google.com/gke-nodepool): the pods select them")
    taints: list[dict[str, str]] = Field(default_factory=list)
    gpu_product: str | None = None
    gpu_count: int = Field(0, ge=0)
    gpu_memory: str | None = Field(None, description="Per GPU, a quantity (e.g. 24Gi)")
    cpu: str | int = Field(description="Allocatable CPU cores of a node (e.g. 16)")
    memory: str = Field(description="Allocatable RAM of a node (e.g. 64Gi)")
    nvme: PoolNvme | None = None
    gpu_hour_usd: float | None = Field(
        None, ge=0, alias="gpuHourUSD",
        description="Price per GPU-hour (per node-hour without GPUs); else the pricing ConfigMap's, as for any node")
    max_nodes: int = Field(16, ge=1, description="Most nodes the pool scales to")


def template_nodes(pools: list[NodePool]) -> list[dict[str, Any]]:
    """Each pool's nodes as Node objects the planner reads like real ones (Ready, the
    node probe's annotations from the template), marked with the pool's name."""
    from kubernetes.utils import parse_quantity

    out = []
    for pool in pools:
        labels = dict(pool.labels)
        annotations = {POOL_ANNOTATION: pool.name}
        resources = {"cpu": str(pool.cpu), "memory": pool.memory, "pods": "110"}
        if pool.gpu_count:
            resources[GPU_RESOURCE] = str(pool.gpu_count)
            labels[GFD_COUNT] = str(pool.gpu_count)
            if pool.gpu_product:
                labels[GFD_PRODUCT] = pool.gpu_product
            if pool.gpu_memory:
                labels[GFD_MEMORY_MIB] = str(int(parse_quantity(pool.gpu_memory)) >> 20)
        if pool.nvme is not None:
            capacity = str(int(parse_quantity(pool.nvme.capacity)))
            keys = {v: k for k, v in ANNOTATIONS.items()}
            annotations.update({NVME_PATH_ANNOTATION: pool.nvme.path, keys["nvme_capacity_bytes"]: capacity,
                                keys["nvme_free_bytes"]: capacity})
            for field, value in (("nvme_read_bytes_per_s", pool.nvme.read_bytes_per_second),
                                 ("nvme_write_bytes_per_s", pool.nvme.write_bytes_per_second)):
                if value:
                    annotations[keys[field]] = str(value)
        if pool.gpu_hour_usd is not None:
            annotations[PRICE_ANNOTATION] = str(pool.gpu_hour_usd)
        for i in range(pool.max_nodes):
            out.append({
                "metadata": {"name": f"{pool.name}-declared-{i}", "labels": labels, "annotations": annotations},
                "spec": {"taints": [dict(t) for t in pool.taints]},
                "status": {"allocatable": resources, "capacity": resources,
                           "conditions": [{"type": "Ready", "status": "True"}]},
            })
    return out


def pool_of(obj: dict[str, Any]) -> str | None:
    """The declared pool a template node or a pod planned on one belongs to."""
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(POOL_ANNOTATION)


def find(pools: list[NodePool], name: str | None) -> NodePool | None:
    return next((p for p in pools if p.name == name), None)
