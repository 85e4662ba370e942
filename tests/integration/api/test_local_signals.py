"""`spillway run` stopped from outside, as users and schedulers stop it.

SIGTERM, or Ctrl-C from a terminal (SIGINT to the whole foreground process group), single
or multi-process: the step finishes, a verified checkpoint of that step is written, the
command exits 75 and the job's record (what `spillway api` serves) says Preempted. Repeated
SIGTERMs change nothing; a second Ctrl-C aborts at once (exit 130; 75 if the stop
checkpoint was already durable) and the last good checkpoint is intact and resumable.
What a kill at any moment of a checkpoint write leaves behind is in
test_checkpoint_kill_points.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from spillway_api.db import make_engine, make_sessionmaker, migrate
from spillway_api.launchers.local import LocalRun
from spillway_api.models import Job
from spillway_api.settings import Settings
from spillway_runtime.checkpoints.store import CheckpointStore, checkpoint_name
from spillway_runtime.training.processes import TrainingProcess
from spillway_runtime.training.reporting import read_events
from tests import polling

from ..conftest import job_document

pytestmark = pytest.mark.integration

SPILLWAY = [sys.executable, "-m", "spillway_api.cli"]


class CliRun:
    """`spillway run` in a session of its own, as a shell starts a foreground job."""

    started: list[CliRun] = []  # this test's runs, ended by `_end_runs` when it ends

    def __init__(self, tmp_path: Path, job_file: Path, run_dir: Path, processes: int = 1):
        CliRun.started.append(self)
        self.run_dir = run_dir
        self.env = {**os.environ, "SPILLWAY_DATABASE_URL": f"sqlite:///{tmp_path / 'spillway.db'}",
                    "SPILLWAY_DATA_DIR": str(tmp_path / "data"), "COLUMNS": "200"}
        self.log = tmp_path / f"cli-{time.monotonic_ns()}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [*SPILLWAY, "run", str(job_file), "--run-dir", str(run_dir), "--processes", str(processes)],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.run_dir / "events.jsonl") if e["event"] == kind]

    def wait_for_step(self, step: int) -> None:
        def reached() -> bool:
            assert self.proc.poll() is None, f"spillway run exited {self.proc.returncode}: {self.output()[-3000:]}"
            return any(e["step"] >= step for e in self.events("step"))
        polling.wait_for(reached, 300, f"step {step}")

    def terminal_ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground group

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=600)
        finally:
            self.end()

    def end(self) -> None:
        """Kill what is left of the run: `spillway run` and its training processes (each in a
        session of its own, out of reach of a signal to the command's group). A test that
        failed waiting left a two-process run training for 18 minutes beside the next tests
        of a gate already short of CPU."""
        if self.proc.poll() is not None:
            return
        try:
            tree = [psutil.Process(self.proc.pid)]
            tree += tree[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(tree, timeout=30)

    def output(self) -> str:
        return self.log.read_text()


@pytest.fixture(autouse=True)
def _end_runs() -> Iterator[None]:
    yield
    while CliRun.started:
        CliRun.started.pop().end()


def write_job(tmp_path: Path, tiny_model: dict[str, Path], name: str, every: int) -> Path:
    doc = job_document(name, tiny_model["model"], tiny_model["data"],
                       training={"maxSteps": 200, "warmupSteps": 1},
                       offload={"optimizer": "nvme", "nvme": {"path": str(tmp_path / "nvme")}},
                       checkpoint={"everySteps": every, "keep": 3})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def good_checkpoint(run_dir: Path) -> str | None:
    """The checkpoint a restart would load: the newest whose every file matches its sha256."""
    info = CheckpointStore(run_dir / "checkpoints", keep=3).find_good()
    return info.name if info else None


def recorded(make_client: Any, tmp_path: Path, name: str) -> dict[str, Any]:
    client = make_client(Settings(database_url=f"sqlite:///{tmp_path / 'spillway.db'}",
                                  data_dir=tmp_path / "data", auth="token"))
    job: dict[str, Any] = client.get(f"/v1/namespaces/default/jobs/{name}").json()
    return job


# Ctrl-C with two processes takes the same path as SIGTERM once `spillway run` has it: not repeated
STOPS = [("sigterm", 1), ("terminal-ctrl-c", 1), ("sigterm", 2)]


@pytest.mark.parametrize(("how", "processes"), STOPS, ids=[f"{h}-{p}proc" for h, p in STOPS])
def test_stop_checkpoints_the_step_and_exits_75(tmp_path, tiny_model, make_client, how, processes):
    job = write_job(tmp_path, tiny_model, "stop", every=1000)  # no cadence checkpoint: only the stop one
    run = CliRun(tmp_path, job, tmp_path / "run", processes)
    run.wait_for_step(3)
    if how == "sigterm":
        for _ in range(6):  # a supervisor that keeps asking while the checkpoint is written: no harm
            run.proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
    else:
        run.terminal_ctrl_c()
    code = run.wait()

    assert code == 75, run.output()[-3000:]
    [preempted] = run.events("preempted")
    stopped = preempted["step"]
    assert stopped >= 3 and not run.events("finished")
    assert good_checkpoint(run.run_dir) == checkpoint_name(stopped)
    for rank in range(processes):
        assert (run.run_dir / "checkpoints" / checkpoint_name(stopped) / f"rank{rank}-spillway_state.pt").is_file()
    assert "stopping: the current step finishes and a checkpoint is written" in run.output()
    job_record = recorded(make_client, tmp_path, "stop")
    assert (job_record["phase"], job_record["exitCode"]) == ("Preempted", 75), job_record
    assert job_record["message"] == f"stopped at step {stopped} after a checkpoint"


# Second Ctrl-C this long after the first: at once (during the step), and later (during or
# after the stop checkpoint, which takes a fraction of a second for this model).
ABORT_DELAYS = [0.0, 0.4]


@pytest.mark.parametrize("delay", ABORT_DELAYS)
def test_second_ctrl_c_aborts_and_keeps_the_last_good_checkpoint(tmp_path, tiny_model, make_client, delay):
    job = write_job(tmp_path, tiny_model, "abort", every=2)
    run = CliRun(tmp_path, job, tmp_path / "run")
    run.wait_for_step(5)  # checkpoints at 2 and 4 exist
    run.terminal_ctrl_c()
    time.sleep(delay)
    run.terminal_ctrl_c()
    code = run.wait()

    before = [e["name"] for e in run.events("checkpoint")]
    kept = good_checkpoint(run.run_dir)
    assert kept is not None and kept in before, (kept, before)
    if code == 130:
        assert "aborted" in run.output()
        record = recorded(make_client, tmp_path, "abort")
        assert (record["phase"], record["exitCode"]) == ("Preempted", 130), record
        assert "aborted" in record["message"]
    else:  # the stop checkpoint was durable before the second Ctrl-C arrived
        assert code == 75, run.output()[-3000:]

    if delay != ABORT_DELAYS[-1]:
        return
    shorter = job.with_name("abort-resume.yaml")  # the same job, to an end a few steps on
    shorter.write_text(job.read_text().replace("maxSteps: 200", "maxSteps: 9"))
    resumed = CliRun(tmp_path, shorter, tmp_path / "run")
    assert resumed.wait() == 0, resumed.output()[-3000:]
    assert resumed.events("resumed")[-1]["checkpoint"] == kept


# A child that, asked to stop, writes its stop checkpoint's event and then takes its time to
# exit (as a rank waiting on its peers does): the window a second Ctrl-C can land in.
SLOW_EXITING_CHILD = """
import json, signal, sys, time
events = sys.argv[1]
def stop(_signum, _frame):
    time.sleep(5)  # writing the checkpoint
    with open(events, "a") as fh:
        fh.write(json.dumps({"event": "preempted", "step": 7, "checkpoint": "step-000007"}) + "\\n")
    time.sleep(600)
signal.signal(signal.SIGTERM, stop)
with open(events, "a") as fh:
    fh.write(json.dumps({"event": "started", "step": 0}) + "\\n")
time.sleep(600)
"""


@pytest.mark.parametrize("second_after", ["stop checkpoint", "stop request"])
def test_a_second_ctrl_c_is_an_abort_only_if_the_stop_checkpoint_was_not_durable(tmp_path, second_after):
    """Exit 75 and "stopped at step 7" once the child reported its stop checkpoint, 130 and
    "aborted" before: the exit code and the record tell what a restart will find."""
    engine = make_engine(f"sqlite:///{tmp_path / 'spillway.db'}")
    migrate(engine)
    sessions = make_sessionmaker(engine)
    with sessions.begin() as session:
        job = Job(namespace="default", name="late", launcher="local", spec={}, phase="Running")
        session.add(job)
        session.flush()
        job_id = job.id
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    events = run_dir / "events.jsonl"
    run = LocalRun(sessions, job_id, poll_seconds=0.05)
    run.child = TrainingProcess([sys.executable, "-c", SLOW_EXITING_CHILD, str(events)], dict(os.environ))
    outcome: list[tuple[int, bool]] = []
    follower = threading.Thread(target=lambda: outcome.append(run._follow(run_dir)))
    follower.start()
    try:
        polling.wait_for(lambda: events.exists() and b"started" in events.read_bytes(), 60, "the child started")
        run.stop()
        if second_after == "stop checkpoint":
            polling.wait_for(lambda: b"preempted" in events.read_bytes(), 60, "the stop checkpoint")
        run.abort()
        follower.join(60)
    finally:
        run.child.abort()
    assert not follower.is_alive()
    with sessions() as session:
        record = session.get(Job, job_id)
        assert record is not None
        if second_after == "stop checkpoint":
            assert outcome == [(75, False)]
            assert (record.phase, record.exit_code, record.message) == ("Preempted", 75, "stopped at step 7 after a checkpoint")
        else:
            assert outcome == [(130, False)]
            assert (record.phase, record.exit_code) == ("Preempted", 130)
            assert record.message is not None and record.message.startswith("aborted")


def test_a_killed_spillway_run_leaves_no_training_process_behind(tmp_path, tiny_model):
    job = write_job(tmp_path, tiny_model, "orphan", every=1000)
    run = CliRun(tmp_path, job, tmp_path / "run")
    run.wait_for_step(3)

    sessions = make_sessionmaker(make_engine(run.env["SPILLWAY_DATABASE_URL"]))

    def row_phase() -> tuple[str, int | None]:
        with sessions() as session:
            [row] = session.query(Job).all()
            return row.phase, row.owner_pid

    # The command reads the run's events on its own beat: kill it once its row says Running.
    polling.wait_for(lambda: row_phase() == ("Running", run.proc.pid), 60, "the job's row to say Running")
    trainers = psutil.Process(run.proc.pid).children(recursive=True)
    assert trainers, "spillway run started no training process"
    run.proc.send_signal(signal.SIGKILL)  # only the command, as an OOM killer would
    run.proc.wait()

    _gone, alive = psutil.wait_procs(trainers, timeout=300)
    assert not alive, f"training processes outlived spillway run: {alive}"
    [preempted] = run.events("preempted")  # they were asked to stop, not killed: a checkpoint
    assert good_checkpoint(run.run_dir) == checkpoint_name(preempted["step"])

    # Nobody recorded that end: the row still says Running, owned by the dead command. The
    # next `spillway api` to start (this app's start-up) reads the run's last events and ends
    # the attempt as the run did, naming where a new run resumes.
    from fastapi.testclient import TestClient

    from spillway_api.main import create_app

    settings = Settings(database_url=run.env["SPILLWAY_DATABASE_URL"], data_dir=Path(run.env["SPILLWAY_DATA_DIR"]),
                        auth="none")
    assert row_phase() == ("Running", run.proc.pid)
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as api:  # --no-auth: loopback only
        job = api.get("/v1/namespaces/default/jobs/orphan").json()
        assert job["phase"] == "Preempted" and f"stopped at step {preempted['step']}" in job["message"], job
        [attempt] = api.get("/v1/namespaces/default/jobs/orphan/attempts").json()["data"]
        assert attempt["phase"] == "Preempted" and attempt["endedAt"] and attempt["lastStep"] == preempted["step"]


def test_a_run_killed_with_its_trainer_ends_failed_naming_where_it_resumes(tmp_path):
    """A run whose command and training process both died mid-step (no stop checkpoint): the
    next start of `spillway run` or `spillway api` ends its attempt Failed, at its last step,
    naming the dead process and the checkpoint a new run resumes from."""
    from spillway_api.launchers.local import end_orphaned_runs
    from spillway_api.service import JobService

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    now = time.time()
    events = [{"event": "started", "step": 0, "total_steps": 10, "time": now},
              *[{"event": "step", "step": s, "loss": 3.0 - s / 10, "time": now + s} for s in (1, 2, 3)],
              {"event": "checkpoint", "name": checkpoint_name(2), "step": 2, "loss": 2.8, "time": now + 2,
               "sizeBytes": 10, "sha256": "0" * 64}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    engine = make_engine(f"sqlite:///{tmp_path / 'spillway.db'}")
    migrate(engine)
    sessions = make_sessionmaker(engine)
    with sessions.begin() as session:
        job = Job(namespace="default", name="killed", launcher="local", spec={}, phase="Pending", events_read=0,
                  run_dir=str(run_dir))
        session.add(job)
        session.flush()
        service = JobService(session, {}, "local")
        service.begin_attempt(job, "submit", "submit on this machine")
        service.transition(job, "Running", "training", "run")
        job.owner_pid = gone.pid
        alive = Job(namespace="default", name="mine", launcher="local", spec={}, phase="Running", events_read=0,
                    owner_pid=os.getpid())  # a live owner's job is left alone
        session.add(alive)

    assert end_orphaned_runs(sessions) == ["default/killed"]
    with sessions() as session:
        job = session.query(Job).filter_by(name="killed").one()
        assert (job.phase, job.owner_pid) == ("Failed", None)
        assert f"pid {gone.pid}" in job.message and f"resumes from {checkpoint_name(2)}" in job.message
        attempt = JobService(session, {}, "local").current_attempt(job)
        assert attempt is not None and (attempt.phase, attempt.last_step) == ("Failed", 3) and attempt.ended_at is not None
        assert session.query(Job).filter_by(name="mine").one().phase == "Running"
    assert end_orphaned_runs(sessions) == []  # once
