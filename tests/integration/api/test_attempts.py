"""Attempts: every run of a job keeps its own outcome, steps and cost, on SQLite and
PostgreSQL. Cluster attempts follow the operator's status.attempt through the watch's
`record_object`; the schema the migrations make is the models' (no drift), and a database
from before attempts gets one attempt per recorded job."""

from __future__ import annotations

from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

from spillway_api.db import alembic_config, make_engine, make_sessionmaker, migrate
from spillway_api.launchers.kubernetes import record_object
from spillway_api.models import Base, Job
from spillway_api.service import JobService

pytestmark = pytest.mark.integration


def _object(rv: int, **status: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "team", "name": "flow", "uid": "u-1", "resourceVersion": str(rv),
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"model": {"uri": "pvc://m/llama"}, "dataset": {"uri": "pvc://d/t.jsonl"}},
            "status": status}


def _attempts(sessions: Any) -> list[tuple[Any, ...]]:
    with sessions() as session:
        job = session.query(Job).one()
        return [(a["number"], a["origin"], a["phase"], a["first_step"], a["last_step"], round(a["usd"], 6))
                for a in JobService(session, {}, "kubernetes").attempts(job)]


def test_cluster_attempts_keep_their_own_outcome_steps_and_cost(database_url: str) -> None:
    engine = make_engine(database_url)
    migrate(engine)
    sessions = make_sessionmaker(engine)
    events = [
        _object(1),  # created: no attempt yet
        _object(2, phase="Running", attempt=0, progress={"step": 3, "loss": 2.5, "updatedAt": "t3"},
                cost={"usd": 1.0, "gpuHours": 0.5}),
        _object(3, phase="Running", attempt=0, progress={"step": 6, "loss": 2.0, "updatedAt": "t6"},
                cost={"usd": 2.0, "gpuHours": 1.0}),
        # The pod failed; the operator counts it and starts attempt 1 from step 4's checkpoint.
        _object(4, phase="Planned", attempt=1, failures=1, cost={"usd": 2.0, "gpuHours": 1.0}),
        _object(5, phase="Running", attempt=1, failures=1, progress={"step": 5, "loss": 2.2, "updatedAt": "t5b"},
                cost={"usd": 2.5, "gpuHours": 1.25}),
        # Preempted: the attempt ends in that phase, the next one starts later. Status keeps
        # showing the last progress, which is no step of the next attempt.
        _object(6, phase="Preempted", attempt=1, failures=1, preemptions=1, cost={"usd": 2.5, "gpuHours": 1.25},
                progress={"step": 5, "loss": 2.2, "updatedAt": "t5b"}),
        _object(7, phase="Planned", attempt=2, failures=1, preemptions=1, cost={"usd": 2.5, "gpuHours": 1.25},
                progress={"step": 5, "loss": 2.2, "updatedAt": "t5b"}),
        _object(8, phase="Running", attempt=2, failures=1, preemptions=1,
                progress={"step": 6, "loss": 2.1, "updatedAt": "t6c"}, cost={"usd": 3.5, "gpuHours": 1.75}),
        # A rollback restarts it while Running: neither a failure nor a preemption.
        _object(9, phase="Running", attempt=3, failures=1, preemptions=1,
                progress={"step": 4, "loss": 2.3, "updatedAt": "t4d"}, cost={"usd": 4.0, "gpuHours": 2.0}),
        # (a DPO job's status carries TRL's metrics of the step and of the held-out pairs)
        _object(10, phase="Succeeded", attempt=3, failures=1, preemptions=1,
                progress={"step": 8, "loss": 1.9, "updatedAt": "t8d", "evalLoss": 2.05, "evalStep": 8,
                          "preference": {"rewards/margins": 0.4, "rewards/accuracies": 0.75,
                                         "eval_rewards/margins": 0.3, "eval_rewards/accuracies": 0.5}},
                cost={"usd": 5.0, "gpuHours": 2.5}),
    ]
    for obj in events:
        with sessions.begin() as session:
            record_object(session, obj, "MODIFIED", 2.0)
    expected = [
        (1, "cluster", "Failed", 3, 6, 2.0),
        (2, "cluster", "Preempted", 5, 5, 0.5),
        (3, "cluster", "Stopped", 6, 6, 1.0),
        (4, "cluster", "Succeeded", 4, 8, 1.5),
    ]
    assert _attempts(sessions) == expected
    # The watch replays the event it was recording when it stopped: nothing changes.
    for obj in events[-1:]:
        with sessions.begin() as session:
            record_object(session, obj, "MODIFIED", 2.0)
    assert _attempts(sessions) == expected
    with sessions() as session:
        job = session.query(Job).one()
        assert job.attempt == 4 and job.phase == "Succeeded"
        history = JobService(session, {}, "kubernetes").history(job, None, 100)
        assert [(t.to_phase, t.attempt) for t in history["transitions"]] == [
            ("Pending", None), ("Running", 1), ("Planned", 2), ("Running", 2), ("Preempted", 2), ("Planned", 3),
            ("Running", 3), ("Succeeded", 4)]
        assert [(p.step, p.attempt) for p in history["progress"]] == [(3, 1), (6, 1), (5, 2), (6, 3), (4, 4), (8, 4)]
        assert [(e.step, e.loss, e.attempt) for e in history["evaluations"]] == [(8, 2.05, 4)]
        assert [p.preference for p in history["progress"]] == [None] * 5 + [
            {"rewards/margins": 0.4, "rewards/accuracies": 0.75}]
        assert history["evaluations"][0].preference == {"rewards/margins": 0.3, "rewards/accuracies": 0.5}
        assert job.progress["evalLoss"] == 2.05
    engine.dispose()


def test_the_migrations_make_exactly_the_models_schema(database_url: str) -> None:
    engine = make_engine(database_url)
    migrate(engine)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []
    engine.dispose()


def test_jobs_recorded_before_attempts_get_their_first(database_url: str) -> None:
    engine = make_engine(database_url)
    config = alembic_config(engine)
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0001")
        conn.execute(text(
            "INSERT INTO jobs (id, namespace, name, launcher, spec, phase, message, events_read, exit_code, "
            "created_at, updated_at, version) VALUES (1, 'default', 'old', 'local', '{}', 'Succeeded', 'done', 0, 0, "
            "'2026-01-01 00:00:00', '2026-01-01 01:00:00', 1)"))
        conn.execute(text("INSERT INTO transitions (job_id, to_phase, at, source_key) VALUES "
                          "(1, 'Pending', '2026-01-01 00:00:00', 'a'), (1, 'Succeeded', '2026-01-01 01:00:00', 'b')"))
        conn.execute(text("INSERT INTO progress_points (job_id, step, at, source_key) VALUES "
                          "(1, 1, '2026-01-01 00:10:00', 'p1'), (1, 7, '2026-01-01 00:50:00', 'p7')"))
        conn.execute(text("INSERT INTO cost_entries (job_id, namespace, at, seconds, gpu_hours, usd, source_key) "
                          "VALUES (1, 'default', '2026-01-01 00:50:00', 60, 0, 0.25, 'c1')"))
    migrate(engine)
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        job = session.query(Job).one()
        [attempt] = JobService(session, {}, "local").attempts(job)
        assert job.attempt == 1
        assert (attempt["number"], attempt["origin"], attempt["phase"], attempt["first_step"], attempt["last_step"],
                attempt["exit_code"], attempt["usd"]) == (1, "submit", "Succeeded", 1, 7, 0, 0.25)
        assert attempt["ended_at"] is not None
    engine.dispose()
