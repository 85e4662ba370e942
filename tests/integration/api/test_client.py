"""The Python client (`spillway_api.client`) and `spillway jobs` against a real `uvicorn` serving
the API (local mode, SQLite, its own token): every answer parsed into the route's schema, every
error the route's Problem, and the command line printing what the API holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway_api.client import Client, SpillwayError
from spillway_api.schemas import JobPublic

from .conftest import job_body
from .servers import serve

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with serve(tmp_path_factory.mktemp("client"), "token") as s:
        yield s


def spillway_jobs(server: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPILLWAY_API_URL": server["url"], "SPILLWAY_TOKEN": server["token"], "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "spillway_api.cli", "jobs", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_the_client_submits_follows_and_reads_a_job(server: dict[str, Any]) -> None:
    with Client(server["url"], server["token"]) as api:
        for i in range(3):  # their model is missing: each fails at once, named
            submitted = api.submit("team-a", job_body(f"job-{i}"))
            assert isinstance(submitted, JobPublic) and submitted.name == f"job-{i}"
        api.submit("team-b", job_body("other"))
        done = api.wait("team-a", "job-2", timeout=120, interval=0.2)
        assert done.phase == "Failed" and done.exit_code == 2 and "spec.model.uri" in (done.message or "")
        for i in range(2):
            api.wait("team-a", f"job-{i}", timeout=120, interval=0.2)
        assert [j.name for j in api.jobs("team-a")] == ["job-0", "job-1", "job-2"]
        assert [(j.namespace, j.name) for j in api.jobs()] == [
            ("team-a", "job-0"), ("team-a", "job-1"), ("team-a", "job-2"), ("team-b", "other")]
        assert [j.name for j in api.jobs("team-a", phase="Running")] == []
        assert [t.to_phase for t in api.history("team-a", "job-0").transitions] == ["Pending", "Planning", "Failed"]
        assert api.checkpoints("team-a", "job-0").count == 0
        assert api.cost("team-a").usd >= 0

        with pytest.raises(SpillwayError) as dup:
            api.submit("team-a", job_body("job-0"))
        assert (dup.value.status, dup.value.code) == (409, "job_exists")
        with pytest.raises(SpillwayError) as bad:
            api.submit("team-a", job_body("bad", training={"maxSteps": 0}))
        assert bad.value.status == 422 and any("training.maxSteps" in e for e in bad.value.errors), bad.value.errors
        api.delete("team-a", "job-0")
        with pytest.raises(SpillwayError) as gone:
            api.get("team-a", "job-0")
        assert (gone.value.status, gone.value.code) == (404, "job_not_found")
        plans = api.plan({"parameterCount": "13B", "hardware": {
            "name": "l4", "gpu_count": 1, "gpu_memory_bytes": 24 << 30, "cpu_cores": 16, "cpu_memory_bytes": 64 << 30}})
        assert plans.data[0].node == "l4"

    with Client(server["url"], "not-the-token") as stranger, pytest.raises(SpillwayError) as refused:
        list(stranger.jobs())
    assert refused.value.status == 401


def test_spillway_jobs_lists_submits_and_names_what_is_wrong(server: dict[str, Any], tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_body("from-cli")))
    submitted = spillway_jobs(server, "submit", "-f", str(job), "-n", "cli")
    assert submitted.returncode == 0 and "cli/from-cli submitted" in submitted.stdout, submitted.stderr
    with Client(server["url"], server["token"]) as api:
        api.wait("cli", "from-cli", timeout=120, interval=0.2)
    table = spillway_jobs(server, "list", "-n", "cli")
    assert table.returncode == 0, table.stderr
    assert table.stdout.split()[:6] == ["NAMESPACE", "NAME", "PHASE", "PLAN", "STEP", "LOSS"]
    assert table.stdout.splitlines()[1].split()[:3] == ["cli", "from-cli", "Failed"]
    listed = json.loads(spillway_jobs(server, "list", "-n", "cli", "-o", "json").stdout)
    assert [(j["name"], j["phase"]) for j in listed] == [("from-cli", "Failed")]

    again = spillway_jobs(server, "submit", "-f", str(job), "-n", "cli")
    assert again.returncode == 2 and "409 job_exists" in again.stderr, again.stderr
    missing = spillway_jobs(server, "get", "nope", "-n", "cli")
    assert missing.returncode == 2 and "404 job_not_found" in missing.stderr
    unreachable = spillway_jobs(server, "list", "--api", "http://127.0.0.1:9")
    assert unreachable.returncode == 1 and "cannot reach the API at http://127.0.0.1:9" in unreachable.stderr
