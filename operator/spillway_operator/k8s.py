"""Kubernetes client calls, and nothing else: the operator's only door to the API server.

Where this sits: below `reconciler` (which decides) and `builders` (which shape the
objects); above `settings`. Reads use `_preload_content=False` and return plain
dicts (the same shape as `kubectl get -o json`), which is what the builders take,
and is ~5x cheaper than the client's model classes at hundreds of jobs.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from spillway_operator import metrics
from spillway_operator.builders import rfc3339
from spillway_runtime.core.spec_types import API_GROUP, API_VERSION, KIND

PLURAL = "finetunejobs"
FIELD_MANAGER = "spillway-operator"
T = TypeVar("T")

_lock = threading.Lock()
_api: client.ApiClient | None = None


def api_client() -> client.ApiClient:
    """One shared client: in-cluster credentials in a pod, else KUBECONFIG."""
    global _api
    with _lock:
        if _api is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            cfg = client.Configuration.get_default_copy()
            # Default urllib3 pool of 4 serializes kopf's worker threads at scale.
            cfg.connection_pool_maxsize = 32
            _api = client.ApiClient(cfg)
        return _api


def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        metrics.API_REQUESTS.labels(call=getattr(fn, "__name__", "other")).inc()
        return fn(*args, **kwargs)
    except ApiException as err:
        metrics.API_ERRORS.labels(code=str(err.status)).inc()
        raise


def _json(response: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(response.data)
    return data


def core() -> client.CoreV1Api:
    return client.CoreV1Api(api_client())


def custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client())


def rbac() -> client.RbacAuthorizationV1Api:
    return client.RbacAuthorizationV1Api(api_client())


def networking() -> client.NetworkingV1Api:
    return client.NetworkingV1Api(api_client())


def storage() -> client.StorageV1Api:
    return client.StorageV1Api(api_client())


def admission() -> client.AdmissionregistrationV1Api:
    return client.AdmissionregistrationV1Api(api_client())


# ----------------------------------------------------------------- reads --


def get_job(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return _json(
            _call(
                custom().get_namespaced_custom_object,
                API_GROUP,
                API_VERSION,
                namespace,
                PLURAL,
                name,
                _preload_content=False,
            )
        )
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def list_objects(kind: str, namespace: str | None = None, label_selector: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """Every FineTuneJob (`jobs`), pod (`pods`) or node (`nodes`), cluster-wide or in one
    namespace, and the list's resourceVersion."""
    if kind == "jobs":
        api = custom()
        data = _json(
            _call(api.list_namespaced_custom_object, API_GROUP, API_VERSION, namespace, PLURAL, _preload_content=False)
            if namespace
            else _call(api.list_cluster_custom_object, API_GROUP, API_VERSION, PLURAL, _preload_content=False)
        )
    elif kind == "nodes":
        data = _json(_call(core().list_node, _preload_content=False))
    elif namespace:
        data = _json(_call(core().list_namespaced_pod, namespace, label_selector=label_selector, _preload_content=False))
    else:
        data = _json(_call(core().list_pod_for_all_namespaces, label_selector=label_selector, _preload_content=False))
    return list(data.get("items", [])), str((data.get("metadata") or {}).get("resourceVersion") or "")


def list_job_pods(namespace: str, job: str) -> list[dict[str, Any]]:
    from spillway_operator.builders import LABEL_JOB

    data = _json(_call(core().list_namespaced_pod, namespace, label_selector=f"{LABEL_JOB}={job}", _preload_content=False))
    return list(data.get("items", []))


def list_nodes() -> list[dict[str, Any]]:
    return list(_json(_call(core().list_node, _preload_content=False)).get("items", []))


def _exists(read: Callable[..., Any], *args: str) -> bool:
    """A GET that answers whether the object exists (404: no; any other error raises)."""
    try:
        _call(read, *args, _preload_content=False)
        return True
    except ApiException as err:
        if err.status == 404:
            return False
        raise


def node_exists(name: str) -> bool:
    return _exists(core().read_node, name)


_reads: dict[tuple[str, ...], tuple[float, Any]] = {}


def _reuse(key: tuple[str, ...], max_age: float, read: Callable[[], T], keep: Callable[[T], bool] = bool) -> T:
    """`read()`, or its result from at most `max_age` seconds ago when `keep` liked it."""
    now = time.monotonic()
    cached = _reads.get(key)
    if max_age > 0 and cached is not None and now - cached[0] <= max_age:
        value: T = cached[1]
        return value
    value = read()
    if keep(value):
        _reads[key] = (now, value)
    return value


def read_configmap_data(namespace: str, name: str, max_age: float = 0.0) -> dict[str, str] | None:
    """A ConfigMap's data (None when absent or not readable); with `max_age`, a copy read at
    most that many seconds ago is reused (the pricing ConfigMap, read for every job)."""
    return _reuse(
        ("configmap", namespace, name), max_age, lambda: _read_configmap_data(namespace, name), lambda _: True
    )


def _read_configmap_data(namespace: str, name: str) -> dict[str, str] | None:
    try:
        cm = _json(_call(core().read_namespaced_config_map, name, namespace, _preload_content=False))
        return dict(cm.get("data") or {})
    except ApiException as err:
        if err.status in (403, 404):
            return None
        raise


def pvc_exists(namespace: str, name: str) -> bool:
    return _exists(core().read_namespaced_persistent_volume_claim, name, namespace)


def storage_class_exists(name: str, max_age: float = 0.0) -> bool:
    """With `max_age`, a class seen at most that long ago counts (a missing one is always
    looked up again: the admin may just have created it)."""
    return _reuse(("storageclass", name), max_age, lambda: _exists(storage().read_storage_class, name))


# ---------------------------------------------------------------- writes --


def _creator(kind: str) -> Callable[..., Any]:
    creators: dict[str, Callable[..., Any]] = {
        "Pod": core().create_namespaced_pod,
        "ConfigMap": core().create_namespaced_config_map,
        "PersistentVolumeClaim": core().create_namespaced_persistent_volume_claim,
        "ServiceAccount": core().create_namespaced_service_account,
        "Service": core().create_namespaced_service,
        "Secret": core().create_namespaced_secret,
        "Role": rbac().create_namespaced_role,
        "RoleBinding": rbac().create_namespaced_role_binding,
        "NetworkPolicy": networking().create_namespaced_network_policy,
    }
    return creators[kind]


def create_if_absent(obj: dict[str, Any]) -> dict[str, Any] | None:
    """Create `obj`; an existing object of the same name counts as done (idempotent).
    Returns the created object as the API server stored it, None when it existed."""
    try:
        if obj["apiVersion"] == KUEUE_API:
            return _json(_call(custom().create_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION,
                               obj["metadata"]["namespace"], obj["kind"].lower() + "s", obj,
                               field_manager=FIELD_MANAGER, _preload_content=False))
        return _json(
            _call(
                _creator(obj["kind"]),
                obj["metadata"]["namespace"],
                obj,
                field_manager=FIELD_MANAGER,
                _preload_content=False,
            )
        )
    except ApiException as err:
        if err.status == 409:
            return None
        raise


def apply_configmap(obj: dict[str, Any]) -> None:
    """Create the ConfigMap, or replace its data when it exists (the plan may change per attempt)."""
    if create_if_absent(obj) is not None:
        return
    _call(
        core().patch_namespaced_config_map,
        obj["metadata"]["name"],
        obj["metadata"]["namespace"],
        {"data": obj["data"], "metadata": {"annotations": obj["metadata"].get("annotations", {})}},
        field_manager=FIELD_MANAGER,
        _preload_content=False,
    )


# ----------------------------------------------------------------- Kueue --

KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
KUEUE_API = f"{KUEUE_GROUP}/{KUEUE_VERSION}"


def kueue_get(plural: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
    api = custom()
    try:
        if namespace:
            return _json(_call(api.get_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION, namespace, plural, name,
                               _preload_content=False))
        return _json(_call(api.get_cluster_custom_object, KUEUE_GROUP, KUEUE_VERSION, plural, name,
                           _preload_content=False))
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def kueue_list(plural: str, namespace: str | None, label_selector: str | None) -> list[dict[str, Any]]:
    if namespace is None:  # a cluster-scoped kind (ResourceFlavor)
        data = _json(_call(custom().list_cluster_custom_object, KUEUE_GROUP, KUEUE_VERSION, plural,
                           label_selector=label_selector or "", _preload_content=False))
    else:
        data = _json(_call(custom().list_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION, namespace, plural,
                           label_selector=label_selector or "", _preload_content=False))
    return list(data.get("items", []))


def patch_kueue(plural: str, namespace: str, name: str, patch: dict[str, Any], status: bool = False) -> None:
    api = custom()
    call = api.patch_namespaced_custom_object_status if status else api.patch_namespaced_custom_object
    _call(call, KUEUE_GROUP, KUEUE_VERSION, namespace, plural, name, patch, field_manager=FIELD_MANAGER,
          _preload_content=False)


def delete_kueue(plural: str, namespace: str, name: str) -> None:
    try:
        _call(custom().delete_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION, namespace, plural, name,
              _preload_content=False)
    except ApiException as err:
        if err.status != 404:
            raise


def read_secret(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return _json(_call(core().read_namespaced_secret, name, namespace, _preload_content=False))
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def replace_secret(obj: dict[str, Any]) -> bool:
    """Replace a Secret only if it is unchanged since `metadata.resourceVersion`; False if it changed."""
    try:
        _call(core().replace_namespaced_secret, obj["metadata"]["name"], obj["metadata"]["namespace"], obj,
              field_manager=FIELD_MANAGER, _preload_content=False)
        return True
    except ApiException as err:
        if err.status in (404, 409):
            return False
        raise


def read_webhook_configuration(name: str) -> dict[str, Any]:
    return _json(_call(admission().read_validating_webhook_configuration, name, _preload_content=False))


def set_webhook_ca_bundle(name: str, ca_bundle: str) -> None:
    """Set caBundle (base64 PEM) on every webhook of the ValidatingWebhookConfiguration `name`
    (a JSON patch per webhook, so the chart's other fields stay as Helm applied them)."""
    webhooks = read_webhook_configuration(name).get("webhooks") or []
    patch = [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": ca_bundle}
             for i in range(len(webhooks))]
    if patch:
        _call(admission().patch_validating_webhook_configuration, name, patch, _preload_content=False)


def delete_pod(namespace: str, name: str, grace_seconds: int | None = None) -> None:
    body = client.V1DeleteOptions(grace_period_seconds=grace_seconds, propagation_policy="Background")
    try:
        _call(core().delete_namespaced_pod, name, namespace, body=body, _preload_content=False)
    except ApiException as err:
        if err.status != 404:
            raise


def delete_job(namespace: str, name: str) -> None:
    try:
        _call(
            custom().delete_namespaced_custom_object,
            API_GROUP,
            API_VERSION,
            namespace,
            PLURAL,
            name,
            propagation_policy="Background",
            _preload_content=False,
        )
    except ApiException as err:
        if err.status != 404:
            raise


def patch_job_status(namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    """JSON merge patch of status (the client picks merge-patch for a dict body). Put
    metadata.resourceVersion in `patch` to make it conditional (409 when the job changed)."""
    return _json(
        _call(
            custom().patch_namespaced_custom_object_status,
            API_GROUP,
            API_VERSION,
            namespace,
            PLURAL,
            name,
            patch,
            field_manager=FIELD_MANAGER,
            _preload_content=False,
        )
    )


def post_event(job: dict[str, Any], type_: str, reason: str, message: str, now: datetime) -> None:
    """A core/v1 Event on the job, as `kubectl describe ftj` shows them."""
    meta = job["metadata"]
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "reason": reason,
        "message": message[:1024],
        "type": type_,
        "source": {"component": FIELD_MANAGER},
        "firstTimestamp": rfc3339(now),
        "lastTimestamp": rfc3339(now),
        "count": 1,
        "reportingComponent": FIELD_MANAGER,
    }
    try:
        _call(core().create_namespaced_event, meta["namespace"], event, _preload_content=False)
    except ApiException as err:
        if not namespace_terminating(err):
            raise  # else the job goes with its namespace: nobody will read the Event


def namespace_terminating(err: BaseException) -> bool:
    """403 because the namespace is being deleted: not a permission anybody can grant."""
    return isinstance(err, ApiException) and err.status == 403 and "NamespaceTerminating" in str(err.body or "")


def is_forbidden(err: BaseException) -> bool:
    """Our own RBAC refused the call: an admin has to grant something."""
    return isinstance(err, ApiException) and err.status == 403 and not namespace_terminating(err)


def is_transient(err: BaseException) -> bool:
    """Worth retrying: conflicts, throttling, server errors, and no connection at all."""
    if isinstance(err, ApiException):
        return err.status in (0, 409, 429) or err.status >= 500
    import urllib3

    return isinstance(err, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)
