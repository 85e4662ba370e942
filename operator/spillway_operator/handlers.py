"""kopf handlers: watch events feed the caches and a work queue; worker threads reconcile.

Where this sits: the top of the operator (handlers -> reconciler -> builders / k8s
-> settings). Importing this module registers the handlers with kopf's default
registry; `cli.operator` imports it and runs kopf.

kopf does the watching (lists, watches, reconnects); every handler here is an
`on.event` that only stores the object and queues the job's key, so kopf writes
nothing onto the jobs (no progress or diff-base annotations, no finalizers).
Events are hints: each queued key gets one level-triggered reconcile of the job
however many events arrived for it meanwhile (`workqueue`). A periodic resync
queues every job (cost accrual, TTL, backoff expiry) without reading the API, and
a slower relist replaces the caches (jobs, pods, nodes) with a fresh LIST, for
deletions a watch that reconnected may have missed.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import threading
import time
from typing import Any, cast

import kopf

from spillway_operator import k8s, metrics, queueing, reconciler, store
from spillway_operator.builders import LABEL_JOB
from spillway_operator.settings import get_settings
from spillway_operator.workqueue import WorkQueue
from spillway_runtime.core.spec_types import API_GROUP, API_VERSION

PLURAL = "finetunejobs"
SETTINGS = get_settings()
# Set by cli.operator before kopf starts: None watches every namespace.
WATCHED_NAMESPACES: list[str] | None = None
QUEUE = WorkQueue()
FORBIDDEN_RETRY_SECONDS = 30.0
log = logging.getLogger("spillway.operator")


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.level = logging.WARNING  # our own Events say what happened; kopf's are noise
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    metrics.serve(SETTINGS.metrics_port)
    # Caches filled before kopf's watches start and before any worker reads them (kopf
    # retries this handler when the API server is not there yet).
    await asyncio.to_thread(relist)
    for i in range(SETTINGS.workers):
        threading.Thread(target=_worker, name=f"reconcile-{i}", daemon=True).start()
    memo["resync"] = asyncio.create_task(_resync_loop())


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    QUEUE.shutdown()
    task = memo.get("resync")
    if task is not None:
        task.cancel()


def _watched(namespace: str) -> bool:
    return WATCHED_NAMESPACES is None or any(fnmatch.fnmatch(namespace, p) for p in WATCHED_NAMESPACES)


def relist() -> None:
    """Replace the caches with a fresh LIST: one request per kind (per watched namespace
    when the namespaces are named without globs), whatever the number of jobs."""
    names = WATCHED_NAMESPACES
    scopes: list[str | None] = [None] if names is None or any(set(n) & set("*?[") for n in names) else [*names]
    nodes, nodes_rv = k8s.list_objects("nodes")
    store.nodes.replace_all(nodes, nodes_rv)
    for cache, kind, selector in ((store.jobs, "jobs", None), (store.pods, "pods", LABEL_JOB)):
        items: list[dict[str, Any]] = []
        versions = []
        for namespace in scopes:
            listed, version = k8s.list_objects(kind, namespace, selector)
            items.extend(o for o in listed if _watched(o["metadata"]["namespace"]))
            versions.append(version)
        # Several lists: the oldest snapshot decides what counts as deleted.
        cache.replace_all(items, min(versions, key=lambda v: int(v) if v.isdigit() else 0))


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def job_event(event: kopf.RawEvent, **_: Any) -> None:
    obj = cast(dict[str, Any], event["object"])
    key = store.key_of(obj)
    if event.get("type") == "DELETED":
        store.jobs.delete(obj)
        QUEUE.add(key)
        return
    held = store.jobs.generation(key)
    store.jobs.upsert(obj)
    meta = obj["metadata"]
    generation = int(meta.get("generation") or 0)
    observed = (obj.get("status") or {}).get("observedGeneration")
    # Status-only changes (the runtime's progress, our own patches) need no reconcile; a
    # spec not yet reconciled does, even when our own patch response brought it first.
    if held is None or held != generation or observed != generation or meta.get("deletionTimestamp"):
        QUEUE.add(key)


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def pod_event(event: kopf.RawEvent, **_: Any) -> None:
    obj = cast(dict[str, Any], event["object"])
    if event.get("type") == "DELETED":
        store.pods.delete(obj)
    else:
        store.pods.upsert(obj)
    QUEUE.add((obj["metadata"]["namespace"], obj["metadata"]["labels"][LABEL_JOB]))


@kopf.on.event("", "v1", "nodes")
async def node_event(event: kopf.RawEvent, **_: Any) -> None:
    """Keep the node cache (placement reads it); on node loss, reconcile the jobs that ran
    there at once rather than waiting ~60 s for the pod garbage collector."""
    obj = cast(dict[str, Any], event["object"])
    if event.get("type") != "DELETED":
        store.nodes.upsert(obj)
        return
    store.nodes.delete(obj)
    name = obj["metadata"]["name"]
    for pod in store.pods.select(lambda p: (p.get("spec") or {}).get("nodeName") == name):
        QUEUE.add((pod["metadata"]["namespace"], pod["metadata"]["labels"][LABEL_JOB]))


async def workload_event(event: kopf.RawEvent, **_: Any) -> None:
    """A Kueue Workload of a job changed (admitted, evicted, preempted): reconcile the job."""
    obj = cast(dict[str, Any], event["object"])
    QUEUE.add((obj["metadata"]["namespace"], obj["metadata"]["labels"][LABEL_JOB]))


if SETTINGS.kueue:
    # Only with Kueue on: its API may not exist in the cluster otherwise.
    kopf.on.event(queueing.GROUP, queueing.VERSION, queueing.WORKLOADS, labels={LABEL_JOB: kopf.PRESENT})(
        workload_event)


def _worker() -> None:
    while True:
        key = QUEUE.get()
        if key is None:
            return
        try:
            _process(key)  # type: ignore[arg-type]
        except Exception:  # never let a worker die: the key is retried
            log.exception("reconcile of %s crashed", key)
            QUEUE.add_rate_limited(key)
        finally:
            QUEUE.done(key)
            metrics.QUEUE_DEPTH.set(len(QUEUE))


def _process(key: tuple[str, str]) -> None:
    namespace, name = key
    try:
        result = reconciler.reconcile(namespace, name, SETTINGS)
    except reconciler.PermanentFailure:
        QUEUE.forget(key)  # written into the job's status; a spec change queues it again
        return
    except Exception as err:
        if k8s.namespace_terminating(err):
            QUEUE.forget(key)  # the job goes with its namespace; its DELETED event comes next
            return
        if k8s.is_forbidden(err):
            # Retrying alone cannot help: say so on the job, and look again for when an
            # admin grants the permission.
            message = reconciler.report_forbidden(namespace, name, err)
            log.warning("%s/%s: %s", namespace, name, message)
            QUEUE.add_after(key, FORBIDDEN_RETRY_SECONDS)
            return
        delay = QUEUE.add_rate_limited(key)
        log.warning("reconcile of %s/%s failed, retry in %.1f s: %s", namespace, name, delay, err)
        return
    QUEUE.forget(key)
    if result.requeue_after is not None:
        QUEUE.add_after(key, result.requeue_after)


async def _resync_loop() -> None:
    """Queue every job each `resync_seconds` (reads nothing from the API); relist the
    caches each `relist_seconds`."""
    last_relist = time.monotonic()
    while True:
        await asyncio.sleep(SETTINGS.resync_seconds)
        if time.monotonic() - last_relist >= SETTINGS.relist_seconds:
            try:
                await asyncio.to_thread(relist)
                last_relist = time.monotonic()
            except Exception as err:
                log.warning("relist failed (the watches still feed the caches): %s", err)
        for key in store.jobs.list_keys():
            QUEUE.add(key)
        metrics.QUEUE_DEPTH.set(len(QUEUE))
