"""List and get latency with many jobs and progress points in PostgreSQL, against a trivial route.

    python benchmarks/bench_api.py [--jobs 10000] [--points 1000000] [--requests 2000]
    python benchmarks/bench_api.py --concurrent [--clients 50] [--live 100] [--seconds 30]

Starts a throwaway PostgreSQL with hack/postgres.sh (or uses SPILLWAY_TEST_POSTGRES_URL),
bulk-loads the rows, serves the app with uvicorn on 127.0.0.1 and measures requests/s and
p99 for /healthz (the baseline), GET one job, list a page, and one job's history, printing
each as a ratio to the baseline measured in the same run.

--concurrent: the API in its own uvicorn process; `--clients` threads read (the trivial
route, a job, a page of jobs, a history) while `--live` running jobs report a step each,
in a loop, through the same service call the launchers use (`JobService.record_event`:
a progress row, a cost row and the job row, under the job's optimistic lock). Prints
each route's p99 under that load as a ratio to the trivial route's, the writes per
second, and every error (a non-2xx answer, a failed write): the target is none.
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

from spillway_runtime.training.supervisor import free_port

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


def serve_process(url: str, data: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The API in a uvicorn process of its own: the load generator's threads do not share its GIL."""
    port = free_port()
    env = {**os.environ, "SPILLWAY_DATABASE_URL": url, "SPILLWAY_DATA_DIR": str(data), "SPILLWAY_AUTH": "none"}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "spillway_api.main:create_app",
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the API did not start")
        time.sleep(0.1)


def concurrent(url: str, clients: int, live: int, seconds: float) -> None:
    from spillway_api.db import make_engine, make_sessionmaker
    from spillway_api.models import Job
    from spillway_api.service import JobService

    routes = {"trivial /healthz": "/healthz",
              "get job": "/v1/namespaces/team-7/jobs/job-4567",
              "list 50 jobs": "/v1/namespaces/team-7/jobs?limit=50&offset=100",
              "history (1000 points)": "/v1/namespaces/team-7/jobs/job-4567/history?limit=1000"}
    latencies: dict[str, list[float]] = {name: [] for name in routes}
    errors: list[str] = []
    writes = [0]
    stop = threading.Event()
    proc, base = serve_process(url, Path(tempfile.mkdtemp()))

    def reader(offset: int) -> None:
        names = list(routes)
        with httpx.Client(base_url=base, timeout=30) as client:
            i = offset
            while not stop.is_set():
                name = names[i % len(names)]
                t = time.perf_counter()
                try:
                    r = client.get(routes[name])
                    if r.status_code >= 300:
                        errors.append(f"{name}: HTTP {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as err:
                    errors.append(f"{name}: {err!r}")
                latencies[name].append(time.perf_counter() - t)
                i += 1

    sessions = make_sessionmaker(make_engine(url))

    def writer(job_ids: list[int]) -> None:
        step = 10_000
        while not stop.is_set():
            for job_id in job_ids:
                step += 1
                try:
                    with sessions.begin() as session:
                        job = session.get(Job, job_id)
                        assert job is not None
                        JobService(session, {}, "local").record_event(
                            job, {"event": "step", "step": step, "loss": 2.0, "step_seconds": 0.5}, f"bench:{step}", 2.0)
                    writes[0] += 1
                except Exception as err:  # counted and shown: the benchmark's point is that there are none
                    errors.append(f"write job {job_id}: {err!r}")
    live_ids = list(range(4000, 4000 + live))
    writer_threads = 10
    threads = [threading.Thread(target=reader, args=(i,)) for i in range(clients)]
    threads += [threading.Thread(target=writer, args=(live_ids[i::writer_threads],)) for i in range(writer_threads)]
    try:
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        proc.terminate()
        proc.wait(30)
    base_p99 = statistics.quantiles(latencies["trivial /healthz"], n=100)[98]
    print(f"{clients} readers and {live} live jobs writing for {seconds:.0f} s: {writes[0] / seconds:.0f} writes/s")
    print(f"{'route':24} {'requests':>9} {'p99 ms':>8} {'p99 ratio':>10}")
    for name, values in latencies.items():
        p99 = statistics.quantiles(values, n=100)[98]
        print(f"{name:24} {len(values):9d} {p99 * 1000:8.1f} {p99 / base_p99:10.2f}")
    print(f"errors: {len(errors)}")
    for line in errors[:20]:
        print(f"  {line}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrent", action="store_true", help="readers and writers at once (see above)")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--live", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=30)
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
        if args.concurrent:
            concurrent(url, args.clients, args.live, args.seconds)
            return
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
