"""kopf handlers: thin decorators that hand every trigger to `reconciler.reconcile`.

Where this sits: the top of the operator (handlers -> reconciler -> builders / k8s
-> settings). Importing this module registers the handlers with kopf's default
registry; `cli.operator` imports it and runs kopf. Triggers are only hints: every
one of them runs the same level-triggered reconcile of the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from spillway_operator import k8s, metrics, reconciler
from spillway_operator.builders import LABEL_JOB
from spillway_operator.settings import get_settings
from spillway_runtime.spec import API_GROUP, API_VERSION

PLURAL = "finetunejobs"
SETTINGS = get_settings()
# Set by cli.operator before kopf starts: None watches every namespace.
WATCHED_NAMESPACES: list[str] | None = None
log = logging.getLogger("spillway.operator")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler progress in annotations, not status: status has a structural schema and is
    # shared with the runtime's server-side apply.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="spillway.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="spillway.dev", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # our own Events say what happened; kopf's are noise
    settings.execution.max_workers = 16
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    metrics.serve(SETTINGS.metrics_port)


def _reconcile(namespace: str, name: str) -> None:
    try:
        result = reconciler.reconcile(namespace, name, SETTINGS)
    except reconciler.PermanentFailure as err:
        raise kopf.PermanentError(str(err)) from None
    except Exception as err:
        if k8s.is_transient(err):
            raise kopf.TemporaryError(f"Kubernetes API: {err}", delay=5) from err
        if k8s.is_forbidden(err):
            message = reconciler.report_forbidden(namespace, name, err)
            raise kopf.TemporaryError(message, delay=30) from err
        raise
    if result.requeue_after is not None and result.requeue_after < 1:
        raise kopf.TemporaryError("requeue", delay=max(0.2, result.requeue_after))


@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL, field="spec")
def job_changed(name: str, namespace: str | None, **_: Any) -> None:
    _reconcile(namespace or "default", name)


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, **_: Any) -> None:
    memo["resync"] = asyncio.create_task(_resync_loop())


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("resync")
    if task is not None:
        task.cancel()


def _resync_one(namespace: str, name: str) -> None:
    reconciler.reconcile(namespace, name, SETTINGS)


async def _resync_loop() -> None:
    """Periodic reconcile of every job: cost accrual, TTL, backoff expiry, and a backstop
    for missed events. One loop, not a kopf timer per job: timers put a finalizer on every
    job, which blocks `kubectl delete` whenever the operator is down."""
    limit = asyncio.Semaphore(8)

    async def one(namespace: str, name: str) -> None:
        async with limit:
            try:
                await asyncio.to_thread(_resync_one, namespace, name)
            except reconciler.PermanentFailure:
                pass
            except Exception as err:
                log.warning("resync of %s/%s: %s", namespace, name, err)

    while True:
        await asyncio.sleep(SETTINGS.resync_seconds)
        try:
            jobs = await asyncio.to_thread(k8s.list_jobs, WATCHED_NAMESPACES)
        except Exception as err:
            log.warning("resync: cannot list FineTuneJobs: %s", err)
            continue
        await asyncio.gather(*(one(j["metadata"]["namespace"], j["metadata"]["name"]) for j in jobs))


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
def pod_event(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    job = labels[LABEL_JOB]
    namespace = namespace or "default"
    try:
        reconciler.reconcile(namespace, job, SETTINGS)
    except reconciler.PermanentFailure:
        pass  # written into the job's status already
    except Exception as err:
        if not k8s.is_transient(err):
            raise
        log.warning("pod event for %s/%s: %s (the periodic resync retries)", namespace, job, err)


@kopf.on.event("", "v1", "nodes")
def node_event(type: str, name: str, **_: Any) -> None:
    """Keep the set of live nodes; on node loss, reconcile the jobs that ran there at once
    rather than waiting ~60 s for the pod garbage collector."""
    if type in ("ADDED", "DELETED"):
        k8s.forget_nodes()
    if type == "DELETED":
        reconciler.known_nodes.discard(name)
        for namespace, job in k8s.jobs_with_pods_on(name):
            with contextlib.suppress(reconciler.PermanentFailure):
                reconciler.reconcile(namespace, job, SETTINGS)
    else:
        reconciler.known_nodes.add(name)
