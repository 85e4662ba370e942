"""The Kubernetes launcher: jobs are FineTuneJob objects; a watch keeps their history.

`KubernetesLauncher` creates, patches and deletes the objects (the operator does the
rest). `FineTuneJobWatch` lists and watches FineTuneJobs in every namespace and
records each change through `JobService.record_object`. The resourceVersion it has
recorded is stored in `watch_bookmarks` in the same transaction as the change, so
after an API restart it resumes where it stopped; when the server has compacted
that version (410 Gone) it lists again, and the source keys keep replays from
duplicating history.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from spillway_api.errors import ApiError
from spillway_api.models import CostEntry, Job, ProgressPoint, WatchBookmark, utcnow
from spillway_api.service import ATTEMPT_ENDS, JobService, _insert_once, _iso
from spillway_api.settings import Settings
from spillway_runtime.core.contract import preference_metrics
from spillway_runtime.core.spec_types import API_GROUP, API_VERSION
from spillway_runtime.core.status import FineTuneJobStatus, Progress, read_status

log = logging.getLogger(__name__)
PLURAL = "finetunejobs"
BOOKMARK = "finetunejobs"


def load_kube_client() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
        return client.ApiClient()
    except config.ConfigException:
        return config.new_client_from_config()


def _api_error(err: Any, namespace: str, name: str) -> ApiError:
    status = getattr(err, "status", 500)
    if status == 404:
        return ApiError(503, "crd_missing", "the FineTuneJob CRD is not installed in the cluster (helm install "
                        "spillway, or kubectl apply -f crds/)")
    if status == 409:
        return ApiError(409, "job_exists", f"a FineTuneJob {name!r} already exists in {namespace!r}")
    if status == 422:
        return ApiError(422, "rejected_by_cluster", f"the API server rejected the FineTuneJob: {err.body}")
    return ApiError(502, "cluster_error", f"the Kubernetes API server answered {status}: {getattr(err, 'reason', err)}")


class KubernetesLauncher:
    name = "kubernetes"

    def __init__(self, api_client: Any):
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)

    def submit(self, session: Session, job: Job) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "FineTuneJob",
                "metadata": {"name": job.name, "namespace": job.namespace}, "spec": job.spec}
        try:
            created: Any = self.custom.create_namespaced_custom_object(API_GROUP, API_VERSION, job.namespace, PLURAL, body)
        except ApiException as err:
            raise _api_error(err, job.namespace, job.name) from None
        job.uid = created["metadata"].get("uid")
        job.resource_version = str(created["metadata"].get("resourceVersion") or "") or None

    def update_spec(self, session: Session, job: Job) -> None:
        from kubernetes.client.exceptions import ApiException

        patch = {"spec": {"resumeFrom": job.spec.get("resumeFrom"), "suspend": bool(job.spec.get("suspend"))}}
        try:
            patched: Any = self.custom.patch_namespaced_custom_object(
                API_GROUP, API_VERSION, job.namespace, PLURAL, job.name, patch)
        except ApiException as err:
            raise _api_error(err, job.namespace, job.name) from None
        job.resource_version = str(patched["metadata"].get("resourceVersion") or "") or job.resource_version

    def delete(self, session: Session, job: Job) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.custom.delete_namespaced_custom_object(API_GROUP, API_VERSION, job.namespace, PLURAL, job.name)
        except ApiException as err:
            if err.status != 404:
                raise _api_error(err, job.namespace, job.name) from None


def record_object(session: Session, obj: dict[str, Any], event_type: str, price_per_gpu_hour: float) -> None:
    """One watch event: upsert the job row and add what changed to its history."""
    meta = obj.get("metadata", {})
    rv = str(meta.get("resourceVersion", ""))
    service = JobService(session, {}, "kubernetes")
    job = _row_of(session, service, obj, event_type)
    if job is None:
        return
    job.uid = meta.get("uid") or job.uid
    # An event older than what the row already shows (the watch lags behind our own create or
    # patch) still adds its history, but must not put back the spec and status it replaced.
    stale = _older(rv, job.resource_version)
    if not stale:
        job.resource_version = rv
    if event_type == "DELETED":
        service.transition(job, "Deleted", "deleted from the cluster", f"deleted:{job.uid}")
        return
    raw: dict[str, Any] = obj.get("status") or {}
    status = read_status(raw)
    if not stale:
        _follow_attempts(service, job, read_status(job.status), status)
        job.spec = obj.get("spec") or job.spec
        job.status = raw
    if status.plan is not None:
        job.plan = status.plan.dump()
    if status.phase and status.phase != job.phase:
        reason = next((c.message or c.reason for c in reversed(status.conditions) if c.message or c.reason), None)
        service.transition(job, status.phase, reason, f"phase:{rv}:{status.phase}")
    progress = status.progress
    if progress is not None and progress.step is not None:
        _record_progress(service, job, progress, raw["progress"], stale)
    if progress is not None and progress.eval_step is not None:
        # keyed by the values as written, as every recorded point since the first
        written = raw["progress"]
        service.add_evaluation(job, progress.eval_step, progress.eval_loss, None,
                               f"eval:{written.get('evalStep')}:{written.get('evalLoss')}",
                               preference=preference_metrics(progress.preference, "eval_"))
    for ckpt in status.checkpoints:
        if ckpt.name:
            service.add_checkpoint(job, ckpt)
    # A rollback is done once the operator has restarted the job from the checkpoint
    # (status.appliedResumeFrom) or someone cleared spec.resumeFrom. Progress alone says nothing:
    # right after the request it still shows the steps the rollback is about to undo.
    resume_from = job.spec.get("resumeFrom")
    if not stale and (resume_from is None or status.applied_resume_from == resume_from):
        service.complete_rollbacks(job)
    cost = status.cost
    if cost is not None and (cost.usd is not None or cost.gpu_hours is not None):
        _record_cost(session, job, cost.usd or 0.0, cost.gpu_hours or 0.0, rv, price_per_gpu_hour)


def _row_of(session: Session, service: JobService, obj: dict[str, Any], event_type: str) -> Job | None:
    """The job's row for this object: found, made for an object first seen (its history begins
    Pending), or taken over by an object created again under a deleted one's name. None: the
    event is not this row's to record (the object is gone, or an older one of the same name)."""
    meta = obj.get("metadata", {})
    namespace, name = meta.get("namespace", "default"), meta["name"]
    job = session.scalars(select(Job).where(Job.namespace == namespace, Job.name == name)).one_or_none()
    if job is None:
        if event_type == "DELETED" or meta.get("deletionTimestamp"):
            return None  # deleted through the API (its row is gone) or before we ever saw it: nothing to keep
        job = Job(namespace=namespace, name=name, launcher="kubernetes", phase="Pending", spec=obj.get("spec") or {},
                  uid=meta.get("uid"), events_read=0)
        session.add(job)
        session.flush()
        service.transition(job, "Pending", "created in the cluster", f"created:{meta.get('uid')}",
                           _iso(meta.get("creationTimestamp")))
    elif job.uid and meta.get("uid") and job.uid != meta.get("uid"):
        if job.phase != "Deleted" or event_type == "DELETED":
            return None  # an older object of the same name; its successor is what the row describes
        # Deleted with kubectl and created again under the same name: the row follows the new object.
        job.uid = meta.get("uid")
        service.transition(job, "Pending", "created again in the cluster", f"created:{meta.get('uid')}",
                           _iso(meta.get("creationTimestamp")))
    return job


def _record_progress(service: JobService, job: Job, progress: Progress, written: dict[str, Any],
                     stale: bool) -> None:
    """The runtime's last step as a progress point, once."""
    job.progress = progress.model_dump(exclude_unset=True)
    # The same step can come back after a rollback, with the same loss when the resume is
    # exact; the runtime's updatedAt tells the two apart, and a replayed event keeps it. The
    # key holds the values as written (the API server may write a loss of 3.0 as 3).
    key = f"progress:{written['step']}:{written.get('loss')}"
    if written.get("updatedAt"):
        key += f":{written['updatedAt']}"
    step = progress.step or 0
    new = _insert_once(service.session, ProgressPoint(
        job_id=job.id, step=step, loss=progress.loss, learning_rate=progress.learning_rate,
        tokens_per_second=progress.tokens_per_second, eta_seconds=progress.eta_seconds,
        gpu_bytes=progress.bytes.get("gpu"), cpu_bytes=progress.bytes.get("cpu"), nvme_bytes=progress.bytes.get("nvme"),
        preference=preference_metrics(progress.preference), at=_iso(progress.updated_at) or utcnow(),
        source_key=key[:128], attempt=job.attempt or None))
    if new and not stale:  # every status event repeats the last progress: only a new point is a step
        service.record_step(job, step, progress.loss)


def _follow_attempts(service: JobService, job: Job, before: FineTuneJobStatus, status: FineTuneJobStatus) -> None:
    """The operator counts attempts in status.attempt (0 first): a higher count starts the
    next attempt here; the one it replaces ended as the operator's counters say."""
    if not status.phase:
        return
    number = status.attempt + 1
    if number <= job.attempt:
        return
    ended = None
    if status.failures > before.failures:
        ended = "Failed"
    elif status.preemptions > before.preemptions:
        ended = "Preempted"
    elif job.attempt and job.phase not in ATTEMPT_ENDS:
        ended = "Stopped"  # restarted by a rollback or a resume
    service.begin_attempt(job, "cluster", f"attempt {number - 1} of the operator", number=number,
                          previous_phase=ended)


def _older(rv: str, than: str | None) -> bool:
    """Whether resourceVersion rv precedes `than` (etcd revisions; anything else is never older)."""
    try:
        return than is not None and int(rv) < int(than)
    except ValueError:
        return False


def _record_cost(session: Session, job: Job, usd: float, gpu_hours: float, rv: str, price: float) -> None:
    """status.cost is cumulative; the ledger stores what it grew by since the last entry."""
    from sqlalchemy import func

    seen_usd, seen_hours = session.execute(
        select(func.coalesce(func.sum(CostEntry.usd), 0.0), func.coalesce(func.sum(CostEntry.gpu_hours), 0.0))
        .where(CostEntry.job_id == job.id)).one()
    if not usd and gpu_hours:
        usd = gpu_hours * price
    d_usd, d_hours = usd - seen_usd, gpu_hours - seen_hours
    if d_usd > 1e-9 or d_hours > 1e-9:
        _insert_once(session, CostEntry(job_id=job.id, namespace=job.namespace, at=utcnow(),
                                        seconds=max(0.0, d_hours) * 3600, gpu_hours=max(0.0, d_hours),
                                        usd=max(0.0, d_usd), source_key=f"cost:{rv}", attempt=job.attempt or None))


class FineTuneJobWatch:
    """Background thread: list+watch FineTuneJobs cluster-wide into the database.

    Each event is recorded in one transaction together with its resourceVersion (the
    bookmark), so a crash at any point either keeps both or neither: the restarted watch
    resumes from the bookmark and replays at most the event it was recording, which the
    source keys make harmless. When the bookmark is too old for the API server (410 Gone)
    it lists again: the list gives each job's current state, and jobs the watch had seen
    that are no longer listed are recorded as deleted.
    """

    # Server-side watch timeout: each watch request ends after this long and is renewed
    # from the last resourceVersion, so a silently dropped connection costs at most this.
    WATCH_SECONDS = 60
    # A failed event is retried this often (a request committing the same job's row
    # races the watch for its unique name) before the watch restarts from its bookmark.
    APPLY_ATTEMPTS = 3

    def __init__(self, api_client: Any, sessions: sessionmaker[Session], settings: Settings):
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.sessions = sessions
        self.settings = settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="finetunejob-watch", daemon=True)
        self._watch: Any = None
        self.synced = threading.Event()
        self.relists = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.stop()
            resp = getattr(w, "_resp", None)
            shutdown = getattr(resp, "shutdown", None)  # urllib3 >= 2.3: interrupts a blocked read
            if shutdown is not None:
                with contextlib.suppress(Exception):  # already closed
                    shutdown()
        self._thread.join(10)

    def _bookmark(self) -> str | None:
        with self.sessions() as session:
            row = session.get(WatchBookmark, BOOKMARK)
            return row.resource_version if row else None

    @staticmethod
    def _save_bookmark(session: Session, rv: str) -> None:
        row = session.get(WatchBookmark, BOOKMARK)
        if row is None:
            session.add(WatchBookmark(name=BOOKMARK, resource_version=rv))
        else:
            row.resource_version = rv

    def _apply(self, obj: dict[str, Any], event_type: str, bookmark: bool = True) -> None:
        for attempt in range(self.APPLY_ATTEMPTS):
            try:
                with self.sessions.begin() as session:
                    record_object(session, obj, event_type, self.settings.kube_price_per_gpu_hour)
                    rv = obj.get("metadata", {}).get("resourceVersion")
                    if rv and bookmark:
                        self._save_bookmark(session, str(rv))
                return
            except (IntegrityError, OperationalError):
                if attempt + 1 == self.APPLY_ATTEMPTS:
                    raise
                self._stop.wait(0.2 * (attempt + 1))

    def _list(self) -> str:
        listed: Any = self.custom.list_cluster_custom_object(API_GROUP, API_VERSION, PLURAL)
        seen: set[tuple[str, str]] = set()
        for obj in listed.get("items", []):
            meta = obj.get("metadata", {})
            seen.add((meta.get("namespace", "default"), meta.get("name", "")))
            # The list's own resourceVersion is the bookmark, written last: a crash
            # half-way through lists again.
            self._apply(obj, "MODIFIED", bookmark=False)
        rv = str(listed.get("metadata", {}).get("resourceVersion", ""))
        with self.sessions.begin() as session:
            # Rows whose object existed before the list (an older resourceVersion) but that the
            # list lacks were deleted while nobody watched. A row whose object was created after
            # the list (a POST racing it) is newer and left alone; its watch event follows.
            for job in session.scalars(select(Job).where(Job.launcher == "kubernetes", Job.phase != "Deleted",
                                                         Job.resource_version.is_not(None))):
                if (job.namespace, job.name) not in seen and _older(job.resource_version or "", rv):
                    JobService(session, {}, "kubernetes").transition(
                        job, "Deleted", "deleted from the cluster while the API was not watching",
                        f"deleted:{job.uid}")
            self._save_bookmark(session, rv)
        self.relists += 1
        return rv

    def _loop(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        rv = self._bookmark()
        while not self._stop.is_set():
            try:
                if not rv:
                    rv = self._list()
                self.synced.set()
                self._watch = w = watch.Watch()
                for event in w.stream(self.custom.list_cluster_custom_object, API_GROUP, API_VERSION, PLURAL,
                                      resource_version=rv, timeout_seconds=self.WATCH_SECONDS,
                                      allow_watch_bookmarks=True):
                    if self._stop.is_set():
                        break
                    obj, kind = event["object"], event["type"]
                    if kind == "ERROR":  # the client raises for most; what is left is not ours to record
                        if isinstance(obj, dict) and obj.get("code") == 410:
                            rv = None
                            break
                        continue
                    new_rv = str(obj.get("metadata", {}).get("resourceVersion") or "") or rv
                    if kind == "BOOKMARK":
                        # Nothing of ours changed up to here: keep the bookmark fresh, so a restart
                        # after a quiet hour does not find it compacted away.
                        if new_rv and new_rv != rv:
                            with self.sessions.begin() as session:
                                self._save_bookmark(session, new_rv)
                        rv = new_rv
                        continue
                    self._apply(obj, kind)
                    rv = new_rv
            except ApiException as err:
                if err.status == 410:
                    log.warning("FineTuneJob watch: resourceVersion %s is gone (410); listing again, so changes "
                                "since then are recorded as their end state only", rv)
                    rv = None
                    continue
                if self._stop.is_set():
                    break
                log.warning("FineTuneJob watch: %s %s; retrying", err.status, err.reason)
                self._stop.wait(2)
            except Exception:  # the watch must outlive a bad event or a dropped connection
                if self._stop.is_set():
                    break
                log.exception("FineTuneJob watch failed; retrying from resourceVersion %s", rv)
                self._stop.wait(2)
            finally:
                self._watch = None
