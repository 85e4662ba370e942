"""Several API processes starting together on one fresh database (replicas of the chart's
API, a rolling update, `spillway api` and `spillway run` at once): each brings the schema
up to date at start, exactly one applies the migrations, and every one of them starts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from spillway_api.db import alembic_config

pytestmark = pytest.mark.integration

PROCESSES = 6
# Each process waits for the go file, then migrates: they start as nearly together as
# processes can, so without a lock two of them create the same table.
STARTER = """
import os, sys, time
from spillway_api.db import make_engine, migrate
go = sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.005)
migrate(make_engine(sys.argv[1]))
"""


def test_processes_started_together_all_migrate_one_schema(database_url: str, tmp_path: Path) -> None:
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", STARTER, database_url, str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(PROCESSES)]
    time.sleep(3)  # every interpreter up and waiting (imports take about a second here)
    go.touch()
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * PROCESSES, "\n----\n".join(outputs)
    engine = create_engine(database_url)
    head = ScriptDirectory.from_config(alembic_config(engine)).get_current_head()
    with engine.connect() as conn:
        versions = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    assert versions == [head]
    assert {"jobs", "transitions", "progress_points"} <= set(inspect(engine).get_table_names())
    engine.dispose()
