"""The local launcher: run the runtime as a child process and record its events.

A `LocalRun` owns one job while it runs: it plans (`prepare_local_run`), starts
`python -m spillway_runtime` (`runtime_command` / `runtime_env`), and every poll
copies new lines of the run's events.jsonl into the database, then looks at the
job's row for requests: a pending rollback or `suspend` makes it SIGTERM the
child (the runtime checkpoints and exits 75); after a rollback it starts again
with `spec.resumeFrom`. `spillway run` drives a `LocalRun` in the foreground;
`spillway api` drives them in threads, and starts one for a job that nobody owns
when a rollback or resume asks for it. Ownership is the owner's pid in the row.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
import zlib
from pathlib import Path
from typing import IO, Any

import yaml
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from spillway_api.models import Job
from spillway_api.service import JobService, exit_message, phase_for_exit
from spillway_api.settings import Settings
from spillway_runtime.core.contract import TERMINAL_PHASES, ExitCode
from spillway_runtime.core.spec import FineTuneJob, SpecError
from spillway_runtime.local import prepare_local_run, runtime_command, runtime_env
from spillway_runtime.training.processes import TrainingProcess

log = logging.getLogger(__name__)



def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalRun:
    """Runs one job to the end (or until suspended, deleted or stopped), recording as it goes."""

    def __init__(self, sessions: sessionmaker[Session], job_id: int, *, processes: int = 1,
                 price_per_hour: float = 0.0, poll_seconds: float = 0.5, output: IO[Any] | None = None,
                 foreground: bool = False, origin: str = "restart", reprobe: bool = False):
        self.sessions = sessions
        # What the first attempt of this run is (`Attempt.origin`): "rerun" for `spillway
        # run` of a recorded job, "restart" for a resume or rollback; "submit" for a job's first.
        self.origin = origin
        self.job_id = job_id
        self.processes = processes
        self.price_per_hour = price_per_hour
        self.poll_seconds = poll_seconds
        self.output = output
        self.foreground = foreground
        self.child: TrainingProcess | None = None
        self._stop_requested = threading.Event()
        self._stop_checkpointed = False  # the child reported its stop checkpoint durable
        self.finished = threading.Event()
        self._carried_out: int | None = None
        self.config: Any = None
        self.error: Exception | None = None
        self.on_planned: Any = None
        self.reprobe = reprobe  # measure the disk's async I/O again on the next attempt only

    def _service(self, session: Session) -> JobService:
        return JobService(session, {}, "local")

    def stop(self) -> None:
        """Ask the run to checkpoint and stop (one SIGTERM to the child), as a preemption would."""
        self._stop_requested.set()
        if self.child is not None:
            self.child.stop()

    def abort(self) -> None:
        """Stop now, without the stop checkpoint (the last good one is kept)."""
        self._stop_requested.set()
        if self.child is not None:
            self.child.abort()

    def run(self) -> int:
        code = 0
        try:
            while True:
                code, restart = self._attempt()
                if not (restart or self._rollback_arrived_late(code)):
                    break
            with self.sessions.begin() as session:
                job = session.get(Job, self.job_id)
                if job is not None and job.owner_pid == os.getpid():
                    job.owner_pid = None
        finally:
            self.finished.set()
        return code

    def _rollback_arrived_late(self, code: int) -> bool:
        """A rollback requested while the child was exiting: nobody else will start it, so we do."""
        if self._stop_requested.is_set() or code not in (0, ExitCode.PREEMPTED) or self.error is not None:
            return False
        with self.sessions() as session:
            job = session.get(Job, self.job_id)
            pending = self._service(session).pending_rollback(job) if job is not None else None
            return pending is not None and pending.id != self._carried_out

    def _attempt(self) -> tuple[int, bool]:
        with self.sessions.begin() as session:
            job = session.get(Job, self.job_id)
            if job is None:
                return 0, False
            job.owner_pid = os.getpid()
            service = self._service(session)
            origin, self.origin = ("submit" if not job.attempt else self.origin), "restart"
            service.begin_attempt(job, origin, f"{origin} on this machine")
            service.set_exit_code(job, None)
            # rollbacks pending now are what this attempt carries out (spec.resumeFrom is already set)
            pending = service.pending_rollback(job)
            self._carried_out = pending.id if pending is not None else None
            service.transition(job, "Planning", "planning against this machine", f"plan:{job.version}:{time.time()}")
            document = FineTuneJob.model_validate(
                {"metadata": {"name": job.name, "namespace": job.namespace}, "spec": job.spec})
            job_file, run_dir = Path(job.job_file or ""), Path(job.run_dir or "")
        try:
            config = prepare_local_run(job_file, run_dir=run_dir, processes=self.processes, job=document,
                                       reprobe=self.reprobe)
            self.reprobe = False
        except Exception as err:  # every way a job cannot start ends the run with a reason
            return self._refused(err), False
        self.config = config
        if self.on_planned is not None:
            self.on_planned(config)
        with self.sessions.begin() as session:
            job = session.get(Job, self.job_id)
            if job is None:
                return 0, False
            job.plan = config.plan.summary(price_per_hour=self.price_per_hour or None).dump()
        if self._stop_requested.is_set():  # stopped while planning: nothing to start, nothing lost
            return ExitCode.PREEMPTED, False
        log_file = None if self.foreground else (run_dir / "runtime.log").open("ab")
        try:
            # In its own session either way: a terminal's Ctrl-C reaches `spillway run`, which decides
            self.child = TrainingProcess(
                runtime_command(run_dir / "runtime.json", self.processes), runtime_env(config),
                tie_to_parent=self.foreground, stdout=self.output or log_file,
                stderr=subprocess.STDOUT if log_file else None,
            )
            code, restart = self._follow(run_dir)
        finally:
            if log_file is not None:
                log_file.close()
        return code, restart

    def _refused(self, err: Exception) -> int:
        from spillway_runtime.core.planner import PlanningError

        code = ExitCode.PLAN_INFEASIBLE if isinstance(err, PlanningError) else ExitCode.BAD_INPUT
        reason = str(err)
        if isinstance(err, SpecError):
            reason = "; ".join(err.problems)
        with self.sessions.begin() as session:
            job = session.get(Job, self.job_id)
            if job is not None:
                if isinstance(err, PlanningError):
                    job.plan = err.plan.summary(price_per_hour=self.price_per_hour or None).dump()
                self._service(session).set_exit_code(job, code)
                job.owner_pid = None
                self._service(session).transition(job, "Failed", reason, f"refused:{job.version}:{time.time()}")
        if not isinstance(err, SpecError | ValueError | PlanningError | OSError):
            log.exception("local run of job %s could not start", self.job_id, exc_info=err)
        self.error = err
        return code

    def _follow(self, run_dir: Path) -> tuple[int, bool]:
        assert self.child is not None
        acted: str | None = None
        while True:
            code = self.child.poll()
            acted = self._sync(run_dir, acted) or acted
            if code is not None:
                break
            if self._stop_requested.is_set():
                self.child.stop()
            time.sleep(self.poll_seconds)
        self._sync(run_dir, acted, final=code)  # ingests the last events first
        code = self._outcome(code)
        return code, acted == "rollback" and code in (0, ExitCode.PREEMPTED) and not self._stop_requested.is_set()

    def _outcome(self, code: int) -> int:
        """A second Ctrl-C that landed after the stop checkpoint was durable lost nothing: the
        preemption the child reported, not an abort."""
        return ExitCode.PREEMPTED if code == ExitCode.ABORTED and self._stop_checkpointed else code

    def _sync(self, run_dir: Path, acted: str | None, final: int | None = None) -> str | None:
        """Copy new events into the database; act on rollback, suspend and deletion."""
        with self.sessions.begin() as session:
            job = session.scalars(select(Job).where(Job.id == self.job_id)).one_or_none()
            if job is None:  # deleted: stop the run
                if final is None and self.child is not None and self.child.poll() is None:
                    self._stop_requested.set()
                    self.child.stop()
                return "deleted"
            service = self._service(session)
            self._ingest(service, job, run_dir / "events.jsonl")
            if final is not None:
                final = self._outcome(final)
                service.set_exit_code(job, final)
                if job.phase not in TERMINAL_PHASES | {"Suspended", "Preempted"} or (
                    final != ExitCode.PREEMPTED and job.phase in ("Suspended", "Preempted")
                ):
                    service.transition(job, phase_for_exit(final), exit_message(final),
                                       f"exit:{job.events_read}:{final}")
                if acted == "rollback" and final in (0, ExitCode.PREEMPTED):
                    service.transition(job, "Pending", "restarting from the requested checkpoint",
                                       f"restart:{job.version}")
                return None
            if acted is None and self.child is not None and self.child.poll() is None:
                pending = service.pending_rollback(job)
                if pending is not None and pending.id != self._carried_out:
                    self.child.stop()
                    return "rollback"
                if job.spec.get("suspend"):
                    self.child.stop()
                    return "suspend"
        return None

    def _ingest(self, service: JobService, job: Job, events: Path) -> None:
        stopped = ingest_events(service, job, events, self.price_per_hour)
        if stopped is not None:
            self._stop_checkpointed = stopped


def ingest_events(service: JobService, job: Job, events: Path, price_per_hour: float) -> bool | None:
    """Copy the lines of a run's events.jsonl that the row has not read into the database.
    Returns whether the last of them that starts or stops a run says it stopped with a
    checkpoint (`preempted`), or None when none of them does."""
    if not events.exists():
        return None
    with events.open("rb") as fh:
        if fh.seek(0, os.SEEK_END) < job.events_read:
            job.events_read = 0  # a new run directory
        fh.seek(job.events_read)
        data = fh.read()
    run_key = zlib.crc32(str(events).encode())
    offset = job.events_read
    stopped: bool | None = None
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # the runtime is still writing it
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            event = None
        if isinstance(event, dict):
            service.record_event(job, event, f"ev:{run_key:x}:{offset}", price_per_hour)
            if event.get("event") in ("started", "resumed", "preempted"):
                stopped = event.get("event") == "preempted"
            if event.get("event") == "resumed" and job.spec.get("resumeFrom"):
                # done: later restarts resume from the newest checkpoint again
                job.spec = {k: v for k, v in job.spec.items() if k != "resumeFrom"}
        offset += len(line)
    job.events_read = offset
    return stopped


def end_orphaned_runs(sessions: sessionmaker[Session], price_per_hour: float = 0.0) -> list[str]:
    """Jobs recorded as run by a process of this machine that is gone (a SIGKILLed `spillway
    run`, an API killed with its jobs): what their runs wrote is read in, and the attempt ends
    as the run did: Preempted when its last word was a stop checkpoint, else Failed, naming
    the checkpoint that running it again resumes from. Called when `spillway api` and
    `spillway run` start; returns the jobs it ended, as NAMESPACE/NAME."""
    ended = []
    with sessions.begin() as session:
        orphans = session.scalars(select(Job).where(Job.launcher == "local", Job.owner_pid.is_not(None))).all()
        for job in orphans:
            pid = job.owner_pid
            if pid == os.getpid() or _alive(pid):
                continue
            service = JobService(session, {}, "local")
            stopped = ingest_events(service, job, Path(job.run_dir) / "events.jsonl", price_per_hour) \
                if job.run_dir else None
            job.owner_pid = None
            if job.phase in TERMINAL_PHASES | {"Suspended", "Preempted", "Pending"}:
                continue  # it had ended (or not started) before its owner went
            good = service.checkpoints(job)
            resume = f"running it again resumes from {good[-1].name}" if good else "it has no checkpoint to resume from"
            if stopped:
                service.transition(job, "Preempted", f"stopped with a checkpoint; the process that ran it (pid {pid}) "
                                   f"is gone: {resume}", f"orphan:{pid}:{job.version}")
            else:
                service.set_exit_code(job, None)
                service.transition(job, "Failed", f"the process that ran it (pid {pid}) is gone with no exit status "
                                   f"(killed?): {resume}", f"orphan:{pid}:{job.version}")
            ended.append(f"{job.namespace}/{job.name}")
    for name in ended:
        log.warning("%s: its process is gone; its attempt is ended", name)
    return ended


class LocalLauncher:
    """Runs API-submitted jobs (and rolled-back or resumed ones nobody owns) in threads of this process."""

    name = "local"

    def __init__(self, sessions: sessionmaker[Session], runs_dir: Path, *, price_per_hour: float = 0.0,
                 poll_seconds: float = 0.5):
        self.sessions = sessions
        self.runs_dir = runs_dir
        self.price_per_hour = price_per_hour
        self.poll_seconds = poll_seconds
        self.runs: dict[int, tuple[LocalRun, threading.Thread]] = {}
        self._lock = threading.Lock()

    def submit(self, session: Session, job: Job) -> None:
        run_dir = self.runs_dir / job.namespace / job.name
        run_dir.mkdir(parents=True, exist_ok=True)
        job_file = run_dir / "job.yaml"
        job_file.write_text(yaml.safe_dump({
            "apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob",
            "metadata": {"name": job.name, "namespace": job.namespace}, "spec": job.spec}))
        job.run_dir, job.job_file = str(run_dir), str(job_file)
        job_id = job.id
        _after_commit(session, lambda: self.start(job_id))

    def update_spec(self, session: Session, job: Job) -> None:
        if self.owned_elsewhere(job) or self.training_here(job.id):
            return  # the owner sees the request on its next poll
        if job.spec.get("suspend"):
            if job.phase not in TERMINAL_PHASES:
                JobService(session, {}, "local").transition(job, "Suspended", job.message, f"suspend:{job.version}")
            return
        job_id = job.id
        _after_commit(session, lambda: self.start(job_id))

    def delete(self, session: Session, job: Job) -> None:
        entry = self.runs.get(job.id)
        if entry is not None:
            entry[0].stop()
        elif self.owned_elsewhere(job) and job.owner_pid:
            pass  # the owner sees the row gone on its next poll and stops its child

    def owned_elsewhere(self, job: Job) -> bool:
        return job.owner_pid not in (None, os.getpid()) and _alive(job.owner_pid)

    def training_here(self, job_id: int) -> bool:
        entry = self.runs.get(job_id)
        return entry is not None and entry[1].is_alive() and not entry[0].finished.is_set()

    def start(self, job_id: int) -> None:
        with self._lock:
            if self.training_here(job_id):
                return
            previous = self.runs.get(job_id)
            if previous is not None:
                previous[1].join(30)  # a run that has just finished is still clearing its ownership
            run = LocalRun(self.sessions, job_id, price_per_hour=self.price_per_hour, poll_seconds=self.poll_seconds)
            thread = threading.Thread(target=self._run, args=(run,), name=f"local-job-{job_id}", daemon=True)
            self.runs[job_id] = (run, thread)
            thread.start()

    def _run(self, run: LocalRun) -> None:
        try:
            run.run()
        except Exception:  # a thread that dies silently would leave the job Running forever
            log.exception("local job %s crashed its launcher", run.job_id)

    def shutdown(self, timeout: float = 60) -> None:
        """Checkpoint and stop every run this process owns (on API shutdown)."""
        for run, _ in list(self.runs.values()):
            run.stop()
        for _, thread in list(self.runs.values()):
            thread.join(timeout)


def record_local_job(settings: Settings, job: FineTuneJob, job_file: Path,
                     run_dir: Path) -> tuple[sessionmaker[Session], int]:
    """Create (or take over, for a re-run) the job's row for `spillway run`; migrates the database first."""
    from spillway_api.db import make_engine, make_sessionmaker, migrate

    engine = make_engine(settings.database_url)
    migrate(engine)
    sessions = make_sessionmaker(engine)
    end_orphaned_runs(sessions, settings.local_price_per_hour)
    with sessions.begin() as session:
        namespace, name = job.metadata.namespace, job.metadata.name
        row = session.scalars(select(Job).where(Job.namespace == namespace, Job.name == name)).one_or_none()
        spec = job.spec.model_dump(mode="json")
        if row is None:
            row = Job(namespace=namespace, name=name, launcher="local", phase="Pending", spec=spec, events_read=0)
            session.add(row)
            session.flush()
            JobService(session, {}, "local").transition(row, "Pending", f"spillway run {job_file}",
                                                        f"submit:{row.id}")
        else:
            if _alive(row.owner_pid) and row.owner_pid != os.getpid():
                raise SpecError(str(job_file), [f"job {namespace}/{name} is already running (pid {row.owner_pid})"])
            if row.run_dir != str(run_dir):
                row.events_read = 0
            row.spec = spec
        row.launcher = "local"
        row.job_file, row.run_dir = str(job_file), str(run_dir)
        return sessions, row.id


def local_job_exists(settings: Settings, namespace: str, name: str) -> bool:
    """Whether the database already records a job of this name (an earlier `spillway run`)."""
    from spillway_api.db import make_engine, migrate

    engine = make_engine(settings.database_url)
    try:
        migrate(engine)
        with engine.connect() as conn:
            found = conn.execute(select(Job.id).where(Job.namespace == namespace, Job.name == name)).first()
        return found is not None
    finally:
        engine.dispose()


def _after_commit(session: Session, action: Any) -> None:
    session.info.setdefault("after_commit", []).append(action)
