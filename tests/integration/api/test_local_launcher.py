"""The local launcher with real training: a tiny job submitted over HTTP trains on the CPU,
its events become history, checkpoints and cost; a rollback restarts it from the chosen
checkpoint; of two concurrent rollbacks one wins. And `spillway run` records its job in
the database that `spillway api` serves."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway_api.settings import Settings
from spillway_runtime.core.plan_summary import PlanSummary
from tests import polling

from ..conftest import job_document

pytestmark = pytest.mark.integration


def wait_for(predicate: Any, timeout: float = 180, what: str = "condition") -> Any:
    return polling.wait_for(predicate, timeout, what)


# One training run, on SQLite (local mode's own database): the records it leaves are the
# service's, the same on PostgreSQL, whose own behaviours (int4 bounds, concurrent migrations,
# an unreachable server, racing deletes) tests/integration/api/test_jobs_api.py and
# test_migrations.py and test_attempts.py's records on both databases show.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_local_job_history_checkpoints_cost_and_rollback(make_client: Any, database_url: str, tmp_path: Path,
                                                          tiny_model: dict[str, Path]) -> None:
    settings = Settings(database_url=database_url, data_dir=tmp_path / "data", auth="token",
                        local_poll_seconds=0.1, local_price_per_hour=3.6)
    client = make_client(settings)
    doc = job_document("tiny", tiny_model["model"], tiny_model["data"],
                       training={"maxSteps": 6, "warmupSteps": 1}, checkpoint={"everySteps": 2, "keep": 5})
    r = client.post("/v1/namespaces/local/jobs", json={"metadata": doc["metadata"], "spec": doc["spec"]})
    assert r.status_code == 201, r.text
    base = "/v1/namespaces/local/jobs/tiny"
    job = wait_for(lambda: (j := client.get(base).json())["phase"] in ("Succeeded", "Failed")
                   and j["exitCode"] is not None and j, what="the job to finish")
    assert job["phase"] == "Succeeded", job
    assert job["exitCode"] == 0 and job["plan"]["accelerator"] == "cpu" and job["progress"]["step"] == 6
    # The plan summary a cluster job's status.plan also has, priced at the local rate.
    assert PlanSummary.model_validate(job["plan"]).price_per_hour_usd == 3.6 and job["plan"]["zeroStage"] in (2, 3)

    history = client.get(base + "/history").json()
    assert [p["step"] for p in history["progress"]] == [1, 2, 3, 4, 5, 6]
    assert all(p["loss"] > 0 and p["stepSeconds"] > 0 for p in history["progress"])
    assert [t["toPhase"] for t in history["transitions"]] == ["Pending", "Planning", "Running", "Succeeded"]
    checkpoints = [c["name"] for c in client.get(base + "/checkpoints").json()["data"]]
    assert checkpoints == ["step-00000002", "step-00000004", "step-00000006"]
    seconds = sum(p["stepSeconds"] for p in history["progress"])
    cost = client.get(base + "/cost").json()
    assert cost["entries"] == 6 and cost["usd"] == pytest.approx(seconds * 3.6 / 3600)
    ns_cost = client.get("/v1/namespaces/local/cost", params={"since": "2000-01-01T00:00:00Z"}).json()
    assert ns_cost["usd"] == pytest.approx(cost["usd"]) and [j["name"] for j in ns_cost["jobs"]] == ["tiny"]
    assert client.get("/v1/namespaces/local/cost", params={"until": "2000-01-01T00:00:00Z"}).json()["usd"] == 0

    unknown = client.post(base + "/rollback", json={"checkpoint": "step-00000099", "reason": "typo"})
    assert unknown.status_code == 409
    assert unknown.json()["validCheckpoints"] == checkpoints

    # two rollbacks at once: exactly one is accepted
    barrier = threading.Barrier(2)
    answers: list[Any] = []

    def roll(target: str) -> None:
        barrier.wait()
        answers.append(client.post(base + "/rollback", json={"checkpoint": target, "reason": f"loss spike, {target}"}))

    threads = [threading.Thread(target=roll, args=(c,)) for c in ("step-00000002", "step-00000004")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(a.status_code for a in answers)
    assert codes == [202, 409], [a.text for a in answers]
    winner = next(a.json() for a in answers if a.status_code == 202)
    assert winner["requestedBy"] and winner["origin"] == "api"
    assert client.get(base).json()["spec"]["resumeFrom"] == winner["checkpoint"]
    # until the job has resumed from it (a new process: seconds), another is refused naming it
    again = client.post(base + "/rollback", json={"checkpoint": "step-00000006", "reason": "second thoughts"})
    assert again.status_code == 409 and again.json()["code"] == "rollback_in_progress", again.text
    assert winner["checkpoint"] in again.json()["detail"]

    def rolled_back() -> Any:
        h = client.get(base + "/history").json()
        done = [r for r in h["rollbacks"] if r["origin"] == "api" and r["completedAt"]]
        job = client.get(base).json()
        return done and job["phase"] == "Succeeded" and job["exitCode"] == 0 and h
    history = wait_for(rolled_back, timeout=120, what="the rolled-back run to finish")
    steps = [p["step"] for p in history["progress"]]
    restart_from = int(winner["checkpoint"].rsplit("-", 1)[1])
    assert steps == [1, 2, 3, 4, 5, 6, *range(restart_from + 1, 7)]
    assert history["rollbacks"][0]["reason"] == f"loss spike, {winner['checkpoint']}"
    assert "resumeFrom" not in client.get(base).json()["spec"] or client.get(base).json()["spec"]["resumeFrom"] is None
    # The rollback's run is the job's second attempt; the first keeps its outcome and cost.
    attempts = client.get(base + "/attempts").json()["data"]
    assert [(a["number"], a["origin"], a["phase"], a["firstStep"], a["lastStep"]) for a in attempts] == [
        (1, "submit", "Succeeded", 1, 6), (2, "restart", "Succeeded", restart_from + 1, 6)]
    assert attempts[0]["usd"] == pytest.approx(cost["usd"])
    assert sum(a["usd"] for a in attempts) == pytest.approx(client.get(base + "/cost").json()["usd"])


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_spillway_run_is_recorded_for_the_api(make_client: Any, database_url: str, tmp_path: Path,
                                               tiny_model: dict[str, Path]) -> None:
    doc = job_document("cli-run", tiny_model["model"], tiny_model["data"], training={"maxSteps": 4, "warmupSteps": 1},
                       checkpoint={"everySteps": 2})
    doc["spec"]["dataset"]["validation"] = {"fraction": 0.1}  # evaluated at the end of each run
    job_file = tmp_path / "cli-run.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "SPILLWAY_DATABASE_URL": database_url, "SPILLWAY_DATA_DIR": str(tmp_path / "data"),
           "SPILLWAY_LOCAL_PRICE_PER_HOUR": "1.0", "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "spillway_api.cli", "run", str(job_file), "--run-dir",
                             str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "opt:" in result.stdout and "done" in result.stdout

    settings = Settings(database_url=database_url, data_dir=tmp_path / "data", auth="token")
    client = make_client(settings)
    job = client.get("/v1/namespaces/default/jobs/cli-run").json()
    assert job["phase"] == "Succeeded" and job["launcher"] == "local" and job["runDir"] == str(tmp_path / "run")
    history = client.get("/v1/namespaces/default/jobs/cli-run/history").json()
    assert [p["step"] for p in history["progress"]] == [1, 2, 3, 4]
    assert client.get("/v1/namespaces/default/jobs/cli-run/cost").json()["usd"] > 0

    # Run again, longer: a second attempt, resumed from the first's last checkpoint; the
    # first keeps its own outcome, steps and cost. A refused run of the name adds nothing.
    doc["spec"]["training"]["maxSteps"] = 6
    job_file.write_text(yaml.safe_dump(doc))
    again = subprocess.run([sys.executable, "-m", "spillway_api.cli", "run", str(job_file), "--run-dir",
                            str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    refused = {**doc, "spec": {**doc["spec"], "model": {"uri": str(tmp_path / "missing")}}}
    job_file.write_text(yaml.safe_dump(refused))
    result = subprocess.run([sys.executable, "-m", "spillway_api.cli", "run", str(job_file), "--run-dir",
                             str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr
    attempts = client.get("/v1/namespaces/default/jobs/cli-run/attempts").json()
    assert [(a["number"], a["origin"], a["phase"], a["firstStep"], a["lastStep"], a["exitCode"])
            for a in attempts["data"]] == [(1, "submit", "Succeeded", 1, 4, 0), (2, "rerun", "Succeeded", 5, 6, 0)]
    assert all(a["usd"] > 0 and a["endedAt"] for a in attempts["data"])
    total = client.get("/v1/namespaces/default/jobs/cli-run/cost").json()["usd"]
    assert sum(a["usd"] for a in attempts["data"]) == pytest.approx(total)
    job = client.get("/v1/namespaces/default/jobs/cli-run").json()
    assert job["phase"] == "Succeeded" and job["attempt"] == 2 and job["spec"]["training"]["maxSteps"] == 6
    evaluations = client.get("/v1/namespaces/default/jobs/cli-run/history").json()["evaluations"]
    assert [(e["step"], e["attempt"]) for e in evaluations] == [(4, 1), (6, 2)]
    assert evaluations[1]["loss"] < evaluations[0]["loss"] and job["progress"]["evalStep"] == 6

    # bad input keeps the runtime's exit code and still leaves a record
    bad = job_document("cli-bad", tmp_path / "missing", tiny_model["data"])
    job_file.write_text(yaml.safe_dump(bad))
    result = subprocess.run([sys.executable, "-m", "spillway_api.cli", "run", str(job_file), "--run-dir",
                             str(tmp_path / "run2")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2 and "spec.model.uri" in result.stderr
    failed = client.get("/v1/namespaces/default/jobs/cli-bad").json()
    assert failed["phase"] == "Failed" and failed["exitCode"] == 2
