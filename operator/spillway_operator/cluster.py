"""The cluster as the reconciler sees it: one narrow interface, and its implementation
over the watch caches (`store`) and the API server (`k8s`).

Where this sits: below `reconciler`, `status` and `children`, above `k8s` and `store`.
Everything the job state machine reads from or does to the cluster goes through a
`Cluster`, so the same code runs against the API server in the operator and against an
in-memory cluster in the unit tests (tests/unit/operator/test_reconciler.py).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from spillway_operator import k8s, store


class Cluster(Protocol):
    def job(self, namespace: str, name: str, fresh: bool = False) -> dict[str, Any] | None:
        """A FineTuneJob as last seen; `fresh`: read from the API server now."""

    def job_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        """Pods labelled with the job's name (every attempt's)."""

    def nodes(self, fresh: bool = False) -> list[dict[str, Any]]:
        """Every node as last seen; `fresh`: a LIST now."""

    def node_exists(self, name: str) -> bool: ...

    def configmap_data(self, namespace: str, name: str, max_age: float = 0.0) -> dict[str, str] | None:
        """A ConfigMap's data; None when absent or not ours to read."""

    def pvc_exists(self, namespace: str, name: str) -> bool: ...

    def storage_class_exists(self, name: str, max_age: float = 0.0) -> bool: ...

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create unless it exists; the created object, or None when it already existed."""

    def apply_configmap(self, obj: dict[str, Any]) -> None: ...

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> None: ...

    def delete_job(self, namespace: str, name: str) -> None: ...

    def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A merge patch of the status subresource (with metadata.resourceVersion: only if
        the job has not changed since); the job as stored."""

    def post_event(self, job: dict[str, Any], type_: str, reason: str, message: str, now: datetime) -> None: ...

    def kueue_get(self, plural: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """A Kueue object (kueue.x-k8s.io/v1beta2), or None when it does not exist."""

    def kueue_list(self, plural: str, namespace: str | None, label_selector: str | None) -> list[dict[str, Any]]:
        """Kueue objects of a namespace (None: of a cluster-scoped kind)."""

    def patch_kueue(self, plural: str, namespace: str, name: str, patch: dict[str, Any], status: bool = False) -> None:
        """A merge patch of a namespaced Kueue object (or its status); a resourceVersion in the
        patch makes it conditional."""

    def delete_kueue(self, plural: str, namespace: str, name: str) -> None: ...


class KubeCluster:
    """Reads from the watch caches once the handlers have filled them, else from the API
    server; writes to the API server and keeps the caches current with its answers."""

    def job(self, namespace: str, name: str, fresh: bool = False) -> dict[str, Any] | None:
        if not fresh and store.jobs.synced.is_set():
            return store.jobs.get((namespace, name))
        return k8s.get_job(namespace, name)

    def job_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        if store.pods.synced.is_set():
            return store.pods.by_index(namespace, name)
        return k8s.list_job_pods(namespace, name)

    def nodes(self, fresh: bool = False) -> list[dict[str, Any]]:
        # The watch-fed cache is current to the last event: a node that turned Ready or
        # lost a taint counts at once.
        if not fresh and store.nodes.synced.is_set():
            return store.nodes.snapshot()
        return k8s.list_nodes()

    def node_exists(self, name: str) -> bool:
        # A miss in the cache is checked with the API server: the node watch may simply be
        # behind the pod watch (a pod bound to a node registered a moment ago).
        if store.nodes.synced.is_set() and store.nodes.generation(("default", name)) is not None:
            return True
        return k8s.node_exists(name)

    def configmap_data(self, namespace: str, name: str, max_age: float = 0.0) -> dict[str, str] | None:
        return k8s.read_configmap_data(namespace, name, max_age=max_age)

    def pvc_exists(self, namespace: str, name: str) -> bool:
        return k8s.pvc_exists(namespace, name)

    def storage_class_exists(self, name: str, max_age: float = 0.0) -> bool:
        return k8s.storage_class_exists(name, max_age=max_age)

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        created = k8s.create_if_absent(obj)
        if created is not None and obj.get("kind") == "Pod":
            store.pods.upsert(created)
        return created

    def apply_configmap(self, obj: dict[str, Any]) -> None:
        k8s.apply_configmap(obj)

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> None:
        k8s.delete_pod(namespace, name, grace_seconds)

    def delete_job(self, namespace: str, name: str) -> None:
        k8s.delete_job(namespace, name)

    def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        updated = k8s.patch_job_status(namespace, name, patch)
        store.jobs.upsert(updated)
        return updated

    def post_event(self, job: dict[str, Any], type_: str, reason: str, message: str, now: datetime) -> None:
        k8s.post_event(job, type_, reason, message, now)

    def kueue_get(self, plural: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        return k8s.kueue_get(plural, name, namespace)

    def kueue_list(self, plural: str, namespace: str | None, label_selector: str | None) -> list[dict[str, Any]]:
        return k8s.kueue_list(plural, namespace, label_selector)

    def patch_kueue(self, plural: str, namespace: str, name: str, patch: dict[str, Any], status: bool = False) -> None:
        k8s.patch_kueue(plural, namespace, name, patch, status)

    def delete_kueue(self, plural: str, namespace: str, name: str) -> None:
        k8s.delete_kueue(plural, namespace, name)


KUBE: Cluster = KubeCluster()
