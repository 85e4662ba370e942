"""The job service: what routes and launchers do to jobs, in one transaction each.

Routes call `JobService` with a session; it reads and writes the database and asks
the job's launcher (local process or Kubernetes object) to act. History arrives
through `record_event` (the runtime's events, from the local launcher) and
`record_object` (FineTuneJob objects, from the Kubernetes watch). Both are
idempotent: each row carries a source key unique per job.
"""

from __future__ import annotations

import getpass
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import ValidationError
from sqlalchemy import delete as delete_rows
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from spillway_api.errors import ApiError, not_found
from spillway_api.models import (
    Attempt,
    Checkpoint,
    CostEntry,
    Evaluation,
    Job,
    ProgressPoint,
    Rollback,
    Transition,
    utcnow,
)
from spillway_api.schemas import JobCreate
from spillway_operator.admission import new_job_problems
from spillway_runtime.core.contract import (
    RECORD_PHASES,
    TERMINAL_PHASES,
    ExitCode,
    Phase,
    exit_outcome,
    preference_metrics,
)
from spillway_runtime.core.planner import plan_summary
from spillway_runtime.core.spec import FineTuneJob
from spillway_runtime.core.status import CheckpointRecord, Progress, step_time_fields

log = logging.getLogger(__name__)

# Phases that end an attempt: a later run of the job is a new attempt.
ATTEMPT_ENDS: frozenset[str] = TERMINAL_PHASES | {"Suspended", "Preempted", *RECORD_PHASES}


@dataclass(frozen=True)
class Caller:
    """Who makes a request: kept with rollbacks and transitions."""

    name: str
    groups: tuple[str, ...] = ()


LOCAL_CALLER = Caller(getpass.getuser())


class Launcher(Protocol):
    """Runs jobs somewhere. Called after the job's row is written, inside its transaction:
    a launcher that raises rolls the request back."""

    name: str

    def submit(self, session: Session, job: Job) -> None: ...

    def update_spec(self, session: Session, job: Job) -> None: ...

    def delete(self, session: Session, job: Job) -> None: ...


def _iso(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    try:
        parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _insert_once(session: Session, row: Any) -> bool:
    """Insert a history row unless its source key is already there (a replayed source)."""
    try:
        with session.begin_nested():
            session.add(row)
        return True
    except IntegrityError:
        return False


class JobService:
    def __init__(self, session: Session, launchers: dict[str, Launcher], default_launcher: str):
        self.session = session
        self.launchers = launchers
        self.default_launcher = default_launcher

    # -- reads ---------------------------------------------------------------------------

    def get(self, namespace: str, name: str, *, for_update: bool = False) -> Job:
        stmt = select(Job).where(Job.namespace == namespace, Job.name == name)
        if for_update:
            stmt = stmt.with_for_update()
        job = self.session.scalars(stmt).one_or_none()
        if job is None:
            raise not_found(namespace, name)
        return job

    def list_jobs(self, namespace: str | None, phase: str | None, offset: int, limit: int) -> tuple[list[Job], int]:
        stmt = select(Job)
        if namespace is not None:
            stmt = stmt.where(Job.namespace == namespace)
        if phase is not None:
            stmt = stmt.where(Job.phase == phase)
        count = self.session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
        rows = self.session.scalars(stmt.order_by(Job.namespace, Job.name).offset(offset).limit(limit)).all()
        return list(rows), count

    def history(self, job: Job, after_step: int | None, limit: int) -> dict[str, Any]:
        points = select(ProgressPoint).where(ProgressPoint.job_id == job.id)
        if after_step is not None:
            points = points.where(ProgressPoint.step > after_step)
        total = self.session.scalar(
            select(func.count()).select_from(ProgressPoint).where(ProgressPoint.job_id == job.id)
        ) or 0
        return {
            "transitions": self.session.scalars(
                select(Transition).where(Transition.job_id == job.id).order_by(Transition.id)
            ).all(),
            "progress": self.session.scalars(points.order_by(ProgressPoint.id).limit(limit)).all(),
            "rollbacks": self.session.scalars(
                select(Rollback).where(Rollback.job_id == job.id).order_by(Rollback.id)
            ).all(),
            "progress_count": total,
            "evaluations": self.session.scalars(
                select(Evaluation).where(Evaluation.job_id == job.id).order_by(Evaluation.id)
            ).all(),
        }

    def attempts(self, job: Job) -> list[dict[str, Any]]:
        """Every attempt of the job, oldest first, each with the cost charged while it ran."""
        costs = {row[0]: row[1:] for row in self.session.execute(
            select(CostEntry.attempt, func.sum(CostEntry.usd), func.sum(CostEntry.gpu_hours),
                   func.sum(CostEntry.seconds))
            .where(CostEntry.job_id == job.id).group_by(CostEntry.attempt)).all()}
        rows = self.session.scalars(select(Attempt).where(Attempt.job_id == job.id).order_by(Attempt.number)).all()
        return [{**{c: getattr(a, c) for c in ("number", "origin", "phase", "reason", "started_at", "ended_at",
                                                "first_step", "last_step", "last_loss", "exit_code")},
                 **dict(zip(("usd", "gpu_hours", "seconds"), costs.get(a.number, (0.0, 0.0, 0.0)), strict=True))}
                for a in rows]

    def checkpoints(self, job: Job) -> list[Checkpoint]:
        return list(self.session.scalars(
            select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step, Checkpoint.name)
        ).all())

    def cost(self, job: Job) -> dict[str, Any]:
        row = self.session.execute(
            select(func.coalesce(func.sum(CostEntry.usd), 0.0), func.coalesce(func.sum(CostEntry.gpu_hours), 0.0),
                   func.coalesce(func.sum(CostEntry.seconds), 0.0), func.count(CostEntry.id))
            .where(CostEntry.job_id == job.id)
        ).one()
        return {"namespace": job.namespace, "name": job.name, "usd": row[0], "gpu_hours": row[1],
                "seconds": row[2], "entries": row[3]}

    def namespace_cost(self, namespace: str, since: datetime | None, until: datetime | None) -> dict[str, Any]:
        stmt = (
            select(Job.namespace, Job.name, func.sum(CostEntry.usd), func.sum(CostEntry.gpu_hours),
                   func.sum(CostEntry.seconds), func.count(CostEntry.id))
            .join(Job, Job.id == CostEntry.job_id)
            .where(CostEntry.namespace == namespace)
            .group_by(Job.namespace, Job.name)
            .order_by(Job.name)
        )
        if since is not None:
            stmt = stmt.where(CostEntry.at >= since)
        if until is not None:
            stmt = stmt.where(CostEntry.at < until)
        jobs = [{"namespace": r[0], "name": r[1], "usd": r[2], "gpu_hours": r[3], "seconds": r[4], "entries": r[5]}
                for r in self.session.execute(stmt).all()]
        return {
            "namespace": namespace, "since": since, "until": until, "jobs": jobs,
            "usd": sum(j["usd"] for j in jobs), "gpu_hours": sum(j["gpu_hours"] for j in jobs),
            "seconds": sum(j["seconds"] for j in jobs), "entries": sum(j["entries"] for j in jobs),
        }

    # -- writes --------------------------------------------------------------------------

    def create(self, namespace: str, body: JobCreate, caller: Caller, launcher: str | None = None) -> Job:
        if body.metadata.namespace not in (None, namespace):
            raise ApiError(422, "namespace_mismatch",
                           f"metadata.namespace {body.metadata.namespace!r} differs from the path's {namespace!r}",
                           errors=[f"metadata.namespace: must be {namespace!r} or omitted"])
        problems = new_job_problems(body.spec, cluster=(launcher or self.default_launcher) != "local")
        if problems:
            # What the cluster's admission webhook and the operator refuse, refused here first:
            # a local job would fail the same way before training.
            raise ApiError(422, "invalid_request", "the job cannot be used: " + "; ".join(problems), errors=problems)
        exists = self.session.scalar(select(Job.id).where(Job.namespace == namespace, Job.name == body.metadata.name))
        if exists is not None:
            raise ApiError(409, "job_exists", f"a job {body.metadata.name!r} already exists in {namespace!r}; "
                           "delete it first or choose another name")
        kind = launcher or self.default_launcher
        job = Job(namespace=namespace, name=body.metadata.name, launcher=kind, phase="Pending",
                  spec=body.spec.model_dump(mode="json"), events_read=0)
        self.session.add(job)
        self.session.flush()
        self.transition(job, "Pending", f"submitted by {caller.name}", f"submit:{job.id}")
        self.launchers[kind].submit(self.session, job)
        return job

    def delete(self, job: Job) -> None:
        """Delete the job's row (its history goes with it, ON DELETE CASCADE). Two deletes
        that both read the row before either removed it: the second finds nothing to delete
        and answers 404, where the ORM's DELETE by identity raised StaleDataError (a 409 the
        operation does not document)."""
        self.launchers[job.launcher].delete(self.session, job)
        deleted = self.session.execute(delete_rows(Job).where(Job.id == job.id)).rowcount  # type: ignore[attr-defined]
        if not deleted:
            raise not_found(job.namespace, job.name)

    def rollback(self, job: Job, checkpoint: str, reason: str, caller: Caller) -> Rollback:
        valid = [c.name for c in self.checkpoints(job)]
        if checkpoint not in valid:
            raise ApiError(409, "unknown_checkpoint",
                           f"job {job.name!r} has no checkpoint {checkpoint!r}; choose one of the valid checkpoints",
                           valid_checkpoints=valid)
        pending = self.session.scalars(
            select(Rollback).where(Rollback.job_id == job.id, Rollback.origin == "api",
                                   Rollback.completed_at.is_(None))
        ).first()
        if pending is not None:
            raise ApiError(409, "rollback_in_progress",
                           f"a rollback to {pending.checkpoint!r} requested by {pending.requested_by} at "
                           f"{pending.at.isoformat()} is still in progress; retry once the job has resumed")
        step = (job.progress or {}).get("step")
        record = Rollback(job_id=job.id, checkpoint=checkpoint, reason=reason, requested_by=caller.name,
                          origin="api", from_step=step,
                          to_step=next((c.step for c in self.checkpoints(job) if c.name == checkpoint), None),
                          source_key=f"api:{job.version}:{checkpoint}")
        self.change_spec(job, {"resumeFrom": checkpoint, "suspend": False},
                         f"rolling back to {checkpoint} ({caller.name}): {reason}")
        self.session.add(record)
        self.session.flush()
        self.launchers[job.launcher].update_spec(self.session, job)
        return record

    def change_spec(self, job: Job, changes: dict[str, Any], message: str) -> None:
        """Compare-and-set on the version column: a concurrent change that read the same version loses (409)."""
        spec = {**job.spec, **changes}
        result = self.session.execute(
            update(Job).where(Job.id == job.id, Job.version == job.version)
            .values(spec=spec, message=message, version=Job.version + 1, updated_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        if getattr(result, "rowcount", 1) != 1:
            raise ApiError(409, "conflict", f"job {job.name!r} was changed by another request at the same time; "
                           "read it again and retry")
        self.session.refresh(job)

    def set_suspend(self, job: Job, suspend: bool, caller: Caller) -> Job:
        if suspend and job.phase in TERMINAL_PHASES:
            raise ApiError(409, "job_finished", f"job {job.name!r} is {job.phase}; there is nothing to suspend")
        self.change_spec(job, {"suspend": suspend}, f"{'suspend' if suspend else 'resume'} requested by {caller.name}")
        self.launchers[job.launcher].update_spec(self.session, job)
        return job

    # -- history ---------------------------------------------------------------------------

    def begin_attempt(self, job: Job, origin: str, reason: str, at: datetime | None = None,
                      number: int | None = None, previous_phase: str | None = None) -> Attempt:
        """Start the job's next attempt (or attempt `number`, the cluster's count). One still
        open ends now, in `previous_phase` when given (what the cluster says became of it)."""
        at = at or utcnow()
        current = self.current_attempt(job)
        if current is not None and current.ended_at is None:
            current.ended_at = at
            if previous_phase:
                current.phase = previous_phase
        attempt = Attempt(job_id=job.id, number=number or job.attempt + 1, origin=origin, phase=job.phase,
                          reason=reason, spec=job.spec, started_at=at)
        self.session.add(attempt)
        job.attempt = attempt.number
        self.session.flush()
        return attempt

    def current_attempt(self, job: Job) -> Attempt | None:
        if not job.attempt:
            return None
        return self.session.scalars(
            select(Attempt).where(Attempt.job_id == job.id, Attempt.number == job.attempt)).one_or_none()

    def set_exit_code(self, job: Job, code: int | None) -> None:
        job.exit_code = code
        attempt = self.current_attempt(job)
        if attempt is not None and (attempt.ended_at is None or code is not None):
            attempt.exit_code = code

    def transition(self, job: Job, phase: str, reason: str | None, key: str, at: datetime | None = None) -> None:
        if job.phase == phase and job.transitions:
            return
        at = at or utcnow()
        if _insert_once(self.session, Transition(job_id=job.id, from_phase=job.phase if job.transitions else None,
                                                 to_phase=phase, reason=reason, at=at, source_key=key,
                                                 attempt=job.attempt or None)):
            self.session.refresh(job, ["transitions"])
        job.phase = phase
        if reason:
            job.message = reason
        attempt = self.current_attempt(job)
        if attempt is not None and attempt.ended_at is None:  # an ended attempt's outcome is kept
            attempt.phase = phase
            attempt.reason = reason or attempt.reason
            if phase in ATTEMPT_ENDS:
                attempt.ended_at = at

    def record_step(self, job: Job, step: int, loss: float | None) -> None:
        """The current attempt's steps: where it started and how far it got."""
        attempt = self.current_attempt(job)
        if attempt is not None:  # a cluster object can end it and report its last step at once
            attempt.first_step = step if attempt.first_step is None else min(attempt.first_step, step)
            attempt.last_step, attempt.last_loss = step, loss

    def record_event(self, job: Job, event: dict[str, Any], key: str, price_per_hour: float) -> None:
        """One line of the runtime's events.jsonl."""
        kind = event.get("event")
        at = _iso(event.get("time")) or utcnow()
        if kind == "started":
            started = Progress(step=event.get("step", 0), total_steps=event.get("total_steps"))
            job.progress = {**(job.progress or {}), **started.model_dump(exclude_unset=True)}
            self.transition(job, "Running", f"started at step {event.get('step', 0)}", key, at)
        elif kind == "step":
            tiers = event.get("bytes") or {}
            point = ProgressPoint(
                job_id=job.id, step=int(event.get("step", 0)), loss=event.get("loss"), learning_rate=event.get("lr"),
                step_seconds=event.get("step_seconds"), tokens_per_second=event.get("tokens_per_s"),
                eta_seconds=event.get("eta_seconds"), gpu_bytes=tiers.get("gpu"), cpu_bytes=tiers.get("cpu"),
                nvme_bytes=tiers.get("nvme"), preference=preference_metrics(event), at=at, source_key=key,
                attempt=job.attempt or None,
            )
            if _insert_once(self.session, point):
                seconds = float(event.get("step_seconds") or 0.0)
                plan = plan_summary(job.plan)
                gpus = plan.gpus if plan is not None else 0
                self.session.add(CostEntry(job_id=job.id, namespace=job.namespace, at=at, seconds=seconds,
                                           gpu_hours=seconds * gpus / 3600, usd=seconds * price_per_hour / 3600,
                                           source_key=key, attempt=job.attempt or None))
                self.record_step(job, point.step, point.loss)
            stepped = Progress(step=point.step, loss=point.loss, tokens_per_second=point.tokens_per_second,
                               eta_seconds=point.eta_seconds, **step_time_fields(event))
            job.progress = {**(job.progress or {}), **stepped.model_dump(exclude_unset=True)}
        elif kind == "eval":
            self.add_evaluation(job, event.get("step"), event.get("eval_loss"), event.get("tokens"), key, at,
                                preference_metrics(event, "eval_"))
        elif kind == "checkpoint":
            try:
                self.add_checkpoint(job, CheckpointRecord.model_validate(event))
            except ValidationError as err:  # a line another version wrote: the rest of the history goes on
                log.warning("checkpoint event of %s/%s not recorded: %s", job.namespace, job.name, err)
        elif kind == "rollback":
            _insert_once(self.session, Rollback(
                job_id=job.id, checkpoint=event.get("checkpoint"), reason=str(event.get("reason", "divergence")),
                requested_by="runtime", origin="runtime", from_step=event.get("step"), to_step=event.get("to_step"),
                at=at, completed_at=at, source_key=key))
        elif kind == "resumed":
            self.complete_rollbacks(job, at)
            self.transition(job, "Running", f"resumed from {event.get('checkpoint')} at step {event.get('step')}",
                            key, at)
        elif kind == "preempted":
            phase = "Suspended" if job.spec.get("suspend") else "Preempted"
            self.transition(job, phase, f"stopped at step {event.get('step')} after a checkpoint", key, at)
        elif kind == "finished":
            said = event.get("message")  # a run that stopped early says why
            self.transition(job, "Succeeded", said or f"finished at step {event.get('step')}, loss {event.get('loss')}",
                            key, at)
        elif kind == "failed":
            phase = phase_for_exit(int(event.get("exit_code") or ExitCode.FAILED))
            self.set_exit_code(job, event.get("exit_code"))
            self.transition(job, phase, str(event.get("reason", "failed")), key, at)
        elif kind == "exported":
            job.message = f"model exported to {event.get('path')}"

    def add_evaluation(self, job: Job, step: Any, loss: Any, tokens: Any, key: str,
                       at: datetime | None = None, preference: dict[str, float] | None = None) -> None:
        """A held-out loss at a step (with DPO, the held-out pairs' metrics); the job's progress
        shows the latest."""
        if step is None:
            return
        value = float(loss) if isinstance(loss, int | float) and loss == loss else None
        if _insert_once(self.session, Evaluation(job_id=job.id, step=int(step), loss=value,
                                                 tokens=int(tokens) if isinstance(tokens, int) else None,
                                                 preference=preference, at=at or utcnow(), source_key=key[:128],
                                                 attempt=job.attempt or None)):
            held_out = Progress(eval_loss=value, eval_step=int(step))
            job.progress = {**(job.progress or {}), **held_out.model_dump(exclude_unset=True)}

    def add_checkpoint(self, job: Job, record: CheckpointRecord) -> None:
        """A checkpoint as the runtime reported it (a local run's event, a cluster job's status)."""
        if self.session.scalar(select(Checkpoint.id).where(Checkpoint.job_id == job.id,
                                                           Checkpoint.name == record.name)):
            return
        _insert_once(self.session, Checkpoint(
            job_id=job.id, name=record.name, step=record.step, loss=record.loss, time=_iso(record.time or None),
            size_bytes=record.size_bytes or None, sha256=record.sha256 or None, eval_loss=record.eval_loss))

    def complete_rollbacks(self, job: Job, at: datetime | None = None) -> None:
        for pending in self.session.scalars(
            select(Rollback).where(Rollback.job_id == job.id, Rollback.completed_at.is_(None))
        ):
            pending.completed_at = at or utcnow()

    def pending_rollback(self, job: Job) -> Rollback | None:
        return self.session.scalars(
            select(Rollback).where(Rollback.job_id == job.id, Rollback.completed_at.is_(None))
        ).first()


def phase_for_exit(code: int) -> Phase:
    """The phase a local run's exit leaves its job in (the contract's policy: nothing retries it here)."""
    return exit_outcome(code, "local").phase


def exit_message(code: int) -> str:
    if code == ExitCode.ABORTED:
        return "aborted (a second Ctrl-C) before the stop checkpoint; a new run resumes from the last good one"
    if code > 128:
        return f"runtime killed by signal {code - 128}"
    return f"runtime exited {code}"


def job_document(job: Job) -> dict[str, Any]:
    """The job as a FineTuneJob object (what `kubectl get -o yaml` would show)."""
    return FineTuneJob.model_validate(
        {"metadata": {"name": job.name, "namespace": job.namespace}, "spec": job.spec}
    ).model_dump(mode="json", exclude_none=True)
