"""List and get latency with many jobs and progress points in PostgreSQL, against a trivial route.

    python benchmarks/bench_api.py [--jobs 10000] [--points 1000000] [--requests 2000]

Starts a throwaway PostgreSQL with hack/postgres.sh (or uses SPILLWAY_TEST_POSTGRES_URL),
bulk-loads the rows, serves the app with uvicorn on 127.0.0.1 and measures requests/s and
p99 for /healthz (the baseline), GET one job, list a page, and one job's history, printing
each as a ratio to the baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from sqlalchemy import insert, text

from spillway_runtime.supervisor import free_port

REPO = Path(__file__).resolve().parents[1]


def load(url: str, jobs: int, points: int) -> None:
    from spillway_api.db import make_engine, migrate
    from spillway_api.models import Job, ProgressPoint

    engine = make_engine(url)
    migrate(engine)
    spec = {"model": {"uri": "/m", "parameterCount": 7_000_000_000}, "dataset": {"uri": "/d"}}
    with engine.begin() as conn:
        conn.execute(insert(Job), [{"namespace": f"team-{i % 20}", "name": f"job-{i}", "launcher": "kubernetes",
                                    "spec": spec, "phase": "Running", "events_read": 0, "version": 1}
                                   for i in range(jobs)])
        per_job = max(1, points // jobs)
        batch: list[dict[str, object]] = []
        for job_id in range(1, jobs + 1):
            for step in range(per_job):
                batch.append({"job_id": job_id, "step": step, "loss": 2.0, "source_key": f"b:{step}"})
            if len(batch) >= 50_000:
                conn.execute(insert(ProgressPoint), batch)
                batch.clear()
        if batch:
            conn.execute(insert(ProgressPoint), batch)
        conn.execute(text("ANALYZE"))


def measure(client: httpx.Client, path: str, n: int) -> tuple[float, float]:
    latencies = []
    start = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        r = client.get(path)
        latencies.append(time.perf_counter() - t)
        r.raise_for_status()
    total = time.perf_counter() - start
    return n / total, statistics.quantiles(latencies, n=100)[98] * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    url = os.environ.get("SPILLWAY_TEST_POSTGRES_URL")
    pg_dir = None
    if not url:
        pg_dir = tempfile.mkdtemp(prefix="spillway-bench-pg-")
        env = {**os.environ, "SPILLWAY_PG_DIR": pg_dir}
        url = subprocess.run([str(REPO / "hack" / "postgres.sh"), "start"], env=env, check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
    try:
        t = time.perf_counter()
        load(url, args.jobs, args.points)
        print(f"loaded {args.jobs} jobs, {args.points} progress points in {time.perf_counter() - t:.0f} s")
        from spillway_api.main import create_app
        from spillway_api.settings import Settings

        data = Path(tempfile.mkdtemp())
        app = create_app(Settings(database_url=url, data_dir=data, auth="none"))
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        routes = {"trivial /healthz": "/healthz",
                  "get job": "/v1/namespaces/team-7/jobs/job-4567",
                  "list 50 jobs": "/v1/namespaces/team-7/jobs?limit=50&offset=100",
                  "history (1000 points)": "/v1/namespaces/team-7/jobs/job-4567/history?limit=1000"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            results = {name: measure(client, path, args.requests) for name, path in routes.items()}
        base_rps, base_p99 = results["trivial /healthz"]
        print(f"{'route':24} {'req/s':>8} {'p99 ms':>8} {'rps ratio':>10} {'p99 ratio':>10}")
        for name, (rps, p99) in results.items():
            print(f"{name:24} {rps:8.0f} {p99:8.2f} {rps / base_rps:10.2f} {p99 / base_p99:10.2f}")
        server.should_exit = True
    finally:
        if pg_dir:
            subprocess.run([str(REPO / "hack" / "postgres.sh"), "destroy"],
                           env={**os.environ, "SPILLWAY_PG_DIR": pg_dir}, capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
