"""The database: jobs and the history the cluster forgets (SQLAlchemy 2.0 typed ORM).

Every history row carries a `source_key` unique per job (an events-file line, a
resourceVersion, a request id), so replaying a source — re-reading events.jsonl,
a watch resumed from an older resourceVersion — never duplicates history.
Schema changes go through Alembic (spillway_api/migrations).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every backend (SQLite stores no zone: naive values are UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: UTCDateTime()}




class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("namespace", "name", name="uq_jobs_namespace_name"),
        Index("ix_jobs_namespace_phase", "namespace", "phase"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    namespace: Mapped[str] = mapped_column(String(63))
    name: Mapped[str] = mapped_column(String(63))
    uid: Mapped[str | None] = mapped_column(String(64))
    launcher: Mapped[str] = mapped_column(String(16))
    spec: Mapped[dict[str, Any]]
    phase: Mapped[str] = mapped_column(String(32), default="Pending")
    message: Mapped[str | None] = mapped_column(Text)
    plan: Mapped[dict[str, Any] | None]
    progress: Mapped[dict[str, Any] | None]
    status: Mapped[dict[str, Any] | None]
    # Local launcher: where the run lives, the job file that relative URIs resolve against,
    # and the process that owns the run (its pid and the host it runs on).
    run_dir: Mapped[str | None] = mapped_column(Text)
    job_file: Mapped[str | None] = mapped_column(Text)
    owner_pid: Mapped[int | None] = mapped_column(Integer)
    events_read: Mapped[int] = mapped_column(Integer, default=0)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    # Kubernetes launcher: the object's last resourceVersion seen by the watch.
    resource_version: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    # Bumped by every change of the spec (rollback, suspend, resume) with a conditional
    # UPDATE ... WHERE version = <read>: of two concurrent changes one matches no row (409).
    # Launchers' status writes leave it alone, so they never make a user's request fail.
    version: Mapped[int] = mapped_column(Integer, default=1)
    # The attempt now under way or last ended (`Attempt.number`); 0 before the first starts.
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    transitions: Mapped[list[Transition]] = relationship(
        back_populates="job", cascade="all, delete-orphan", passive_deletes=True, order_by="Transition.id"
    )


class Attempt(Base):
    """One run of a job: a `spillway run` (first or again), a restart after a rollback,
    suspend or preemption, or a cluster attempt (status.attempt). Its outcome, steps and
    cost are its own: a later attempt, or a refused one, never rewrites them."""

    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("job_id", "number", name="uq_attempts_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    # submit (the first), rerun (`spillway run` again), restart (rollback, resume or
    # preemption in this process), cluster (the operator's attempt counter)
    origin: Mapped[str] = mapped_column(String(16))
    phase: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str | None] = mapped_column(Text)
    spec: Mapped[dict[str, Any] | None]
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    first_step: Mapped[int | None] = mapped_column(Integer)
    last_step: Mapped[int | None] = mapped_column(Integer)
    last_loss: Mapped[float | None] = mapped_column(Float)
    exit_code: Mapped[int | None] = mapped_column(Integer)


class Transition(Base):
    __tablename__ = "transitions"
    __table_args__ = (UniqueConstraint("job_id", "source_key", name="uq_transitions_source"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    from_phase: Mapped[str | None] = mapped_column(String(32))
    to_phase: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str | None] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    source_key: Mapped[str] = mapped_column(String(128))
    attempt: Mapped[int | None] = mapped_column(Integer)

    job: Mapped[Job] = relationship(back_populates="transitions")


class ProgressPoint(Base):
    __tablename__ = "progress_points"
    __table_args__ = (
        UniqueConstraint("job_id", "source_key", name="uq_progress_source"),
        Index("ix_progress_job_at", "job_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    learning_rate: Mapped[float | None] = mapped_column(Float)
    step_seconds: Mapped[float | None] = mapped_column(Float)
    tokens_per_second: Mapped[float | None] = mapped_column(Float)
    eta_seconds: Mapped[float | None] = mapped_column(Float)
    gpu_bytes: Mapped[int | None] = mapped_column(BigInteger)
    cpu_bytes: Mapped[int | None] = mapped_column(BigInteger)
    nvme_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # DPO: the step's rewards and log-probabilities under TRL's names (rewards/margins, ...)
    preference: Mapped[dict[str, Any] | None]
    at: Mapped[datetime] = mapped_column(default=utcnow)
    source_key: Mapped[str] = mapped_column(String(128))
    attempt: Mapped[int | None] = mapped_column(Integer)


class Evaluation(Base):
    """A held-out loss: the runtime's `eval` event, or status.progress.evalLoss."""

    __tablename__ = "evaluations"
    __table_args__ = (UniqueConstraint("job_id", "source_key", name="uq_evaluations_source"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    preference: Mapped[dict[str, Any] | None]  # DPO: held-out pairs' metrics (eval_rewards/margins, ...)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    source_key: Mapped[str] = mapped_column(String(128))
    attempt: Mapped[int | None] = mapped_column(Integer)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "name", name="uq_checkpoints_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    time: Mapped[datetime | None]
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    sha256: Mapped[str | None] = mapped_column(String(64))
    eval_loss: Mapped[float | None] = mapped_column(Float)


class Rollback(Base):
    __tablename__ = "rollbacks"
    __table_args__ = (UniqueConstraint("job_id", "source_key", name="uq_rollbacks_source"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    checkpoint: Mapped[str | None] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text)
    requested_by: Mapped[str] = mapped_column(String(253))
    at: Mapped[datetime] = mapped_column(default=utcnow)
    # "api": a person asked for it; "runtime": divergence rollback inside the run
    origin: Mapped[str] = mapped_column(String(16))
    from_step: Mapped[int | None] = mapped_column(Integer)
    to_step: Mapped[int | None] = mapped_column(Integer)
    # An API rollback is pending until the launcher has restarted the run from it.
    completed_at: Mapped[datetime | None]
    source_key: Mapped[str] = mapped_column(String(128))


class CostEntry(Base):
    """One interval of compute charged to a job: the ledger that cost routes sum."""

    __tablename__ = "cost_entries"
    __table_args__ = (
        UniqueConstraint("job_id", "source_key", name="uq_cost_source"),
        Index("ix_cost_namespace_at", "namespace", "at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    namespace: Mapped[str] = mapped_column(String(63))
    at: Mapped[datetime] = mapped_column(default=utcnow)
    seconds: Mapped[float] = mapped_column(Float)
    gpu_hours: Mapped[float] = mapped_column(Float)
    usd: Mapped[float] = mapped_column(Float)
    source_key: Mapped[str] = mapped_column(String(128))
    attempt: Mapped[int | None] = mapped_column(Integer)


class WatchBookmark(Base):
    """Where the Kubernetes watch resumes after an API restart."""

    __tablename__ = "watch_bookmarks"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    resource_version: Mapped[str] = mapped_column(String(32))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
