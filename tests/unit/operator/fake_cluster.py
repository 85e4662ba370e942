"""An in-memory `Cluster` for the reconciler's unit tests: objects in a dict, a status
patch with the API server's merge-patch and resourceVersion rules, Events in a list.
Pods change only when a test says so (`run`, `exit`), as the kubelet would change them."""

from __future__ import annotations

import copy
import itertools
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException

from spillway_operator import builders as b

NODES_DIR = Path(__file__).resolve().parents[3] / "hack" / "kwok" / "nodes"
Key = tuple[str, str, str]  # kind, namespace ("" for cluster-scoped), name


def node(profile: str, name: str | None = None) -> dict[str, Any]:
    """A Ready node of one of the test cluster's profiles (hack/kwok/nodes)."""
    n: dict[str, Any] = yaml.safe_load((NODES_DIR / f"{profile}.yaml").read_text())
    n["metadata"]["name"] = name or profile
    n.setdefault("status", {})["conditions"] = [{"type": "Ready", "status": "True"}]
    return n


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch, as the API server applies --type=merge."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


class FakeCluster:
    def __init__(self, *nodes: dict[str, Any]) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.events: list[tuple[str, str, str]] = []
        self.deleted: list[tuple[str, int | None]] = []  # pods, with their grace period
        self._versions = itertools.count(1)
        for n in nodes:
            self.add(n)

    # -- what tests do ------------------------------------------------------------------
    def add(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", f"uid-{meta['name']}")
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", b.rfc3339(datetime.now(UTC)))
        meta["resourceVersion"] = str(next(self._versions))
        self.objects[self._key(obj)] = obj
        return copy.deepcopy(obj)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def names(self, kind: str) -> list[str]:
        return sorted(name for k, _, name in self.objects if k == kind)

    def set_spec(self, namespace: str, name: str, **fields: Any) -> None:
        job = self.objects[("FineTuneJob", namespace, name)]
        _merge(job["spec"], fields)
        job["metadata"]["generation"] += 1
        job["metadata"]["resourceVersion"] = str(next(self._versions))

    def set_pod(self, namespace: str, name: str, status: dict[str, Any], node_name: str | None = None) -> None:
        pod = self.objects[("Pod", namespace, name)]
        if node_name:
            pod["spec"]["nodeName"] = node_name
        _merge(pod.setdefault("status", {}), status)
        pod["metadata"]["resourceVersion"] = str(next(self._versions))

    def run(self, namespace: str, name: str, node_name: str) -> None:
        """Scheduled onto `node_name` and its container started."""
        self.set_pod(namespace, name, {"phase": "Running", "startTime": b.rfc3339(datetime.now(UTC)),
                                       "conditions": [{"type": "PodScheduled", "status": "True"}]}, node_name)

    def exit(self, namespace: str, name: str, code: int, message: str = "") -> None:
        """The training container exited with `code`; the pod's phase follows."""
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "message": message,
                      "finishedAt": b.rfc3339(datetime.now(UTC))}
        self.set_pod(namespace, name, {"phase": "Succeeded" if code == 0 else "Failed",
                                       "containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}]})

    def remove_node(self, name: str) -> None:
        del self.objects[("Node", "", name)]

    # -- the Cluster interface -------------------------------------------------------------
    def job(self, namespace: str, name: str, fresh: bool = False) -> dict[str, Any] | None:
        return self.get("FineTuneJob", namespace, name)

    def job_pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (kind, ns, _), o in self.objects.items()
                if kind == "Pod" and ns == namespace and o["metadata"].get("labels", {}).get(b.LABEL_JOB) == name]

    def nodes(self, fresh: bool = False) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (kind, _, _), o in self.objects.items() if kind == "Node"]

    def node_exists(self, name: str) -> bool:
        return ("Node", "", name) in self.objects

    def configmap_data(self, namespace: str, name: str, max_age: float = 0.0) -> dict[str, str] | None:
        cm = self.objects.get(("ConfigMap", namespace, name))
        return dict(cm.get("data") or {}) if cm is not None else None

    def pvc_exists(self, namespace: str, name: str) -> bool:
        return ("PersistentVolumeClaim", namespace, name) in self.objects

    def storage_class_exists(self, name: str, max_age: float = 0.0) -> bool:
        return ("StorageClass", "", name) in self.objects

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        return None if self._key(obj) in self.objects else self.add(obj)

    def apply_configmap(self, obj: dict[str, Any]) -> None:
        self.add(obj)

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> None:
        if self.objects.pop(("Pod", namespace, name), None) is not None:
            self.deleted.append((name, grace_seconds))

    def delete_job(self, namespace: str, name: str) -> None:
        del self.objects[("FineTuneJob", namespace, name)]

    def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        job = self.objects.get(("FineTuneJob", namespace, name))
        if job is None:
            raise ApiException(status=404, reason="Not Found")
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != job["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        _merge(job.setdefault("status", {}), patch.get("status") or {})
        job["metadata"]["resourceVersion"] = str(next(self._versions))
        return copy.deepcopy(job)

    def post_event(self, job: dict[str, Any], type_: str, reason: str, message: str, now: datetime) -> None:
        self.events.append((type_, reason, message))

    KUEUE_KINDS = {"workloads": "Workload", "resourceflavors": "ResourceFlavor", "localqueues": "LocalQueue",
                   "workloadpriorityclasses": "WorkloadPriorityClass"}

    def kueue_get(self, plural: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        return self.get(self.KUEUE_KINDS[plural], namespace or "", name)

    def kueue_list(self, plural: str, namespace: str | None, label_selector: str | None) -> list[dict[str, Any]]:
        namespace = namespace or ""
        key, _, value = (label_selector or "").partition("=")
        kind = self.KUEUE_KINDS[plural]
        return [copy.deepcopy(o) for (k, ns, _), o in sorted(self.objects.items())
                if k == kind and ns == namespace and (not key or (o["metadata"].get("labels") or {}).get(key) == value)]

    def patch_kueue(self, plural: str, namespace: str, name: str, patch: dict[str, Any], status: bool = False) -> None:
        obj = self.objects.get((self.KUEUE_KINDS[plural], namespace, name))
        if obj is None:
            raise ApiException(status=404, reason="Not Found")
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != obj["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        if status:
            _merge(obj.setdefault("status", {}), patch.get("status") or {})
        else:
            _merge(obj, {k: v for k, v in patch.items() if k != "status"})
        obj["metadata"]["resourceVersion"] = str(next(self._versions))

    def delete_kueue(self, plural: str, namespace: str, name: str) -> None:
        self.objects.pop((self.KUEUE_KINDS[plural], namespace, name), None)

    @staticmethod
    def _key(obj: dict[str, Any]) -> Key:
        meta = obj["metadata"]
        return obj["kind"], meta.get("namespace", ""), meta["name"]
