"""Fixtures for the API over HTTP against real databases: SQLite files and a PostgreSQL
server that this session starts with hack/postgres.sh (or SPILLWAY_TEST_POSTGRES_URL).
If PostgreSQL cannot start, the session fails with the reason; nothing is skipped."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from spillway_api.main import create_app
from spillway_api.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[3]
POSTGRES_SH = REPO_ROOT / "hack" / "postgres.sh"

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a PostgreSQL server's maintenance database `spillway`."""
    if os.environ.get("SPILLWAY_TEST_POSTGRES_URL"):
        yield os.environ["SPILLWAY_TEST_POSTGRES_URL"]
        return
    pg_dir = tmp_path_factory.mktemp("pg")
    env = {**os.environ, "SPILLWAY_PG_DIR": str(pg_dir)}
    proc = subprocess.run([str(POSTGRES_SH), "start"], capture_output=True, text=True, env=env, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"hack/postgres.sh start failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}",
                    pytrace=False)
    try:
        yield proc.stdout.strip().splitlines()[-1]
    finally:
        subprocess.run([str(POSTGRES_SH), "destroy"], capture_output=True, env=env, timeout=60)


def fresh_postgres_database(server_url: str) -> str:
    """A new empty database on the server, so each test starts from nothing."""
    name = f"t_{secrets.token_hex(6)}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return server_url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'spillway.db'}"
    return fresh_postgres_database(request.getfixturevalue("postgres_server"))


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return Settings(database_url=database_url, data_dir=tmp_path / "data", auth="token", local_poll_seconds=0.1)


@pytest.fixture
def make_client(tmp_path: Path) -> Iterator[Any]:
    clients: list[TestClient] = []

    def make(settings: Settings, authenticated: bool = True, **kwargs: Any) -> TestClient:
        app = create_app(settings, **kwargs)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        if authenticated and settings.auth == "token":
            token = settings.resolved_token_file.read_text().strip()
            client.headers["Authorization"] = f"Bearer {token}"
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Any, settings: Settings) -> TestClient:
    c: TestClient = make_client(settings)
    return c


def job_body(name: str = "demo", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": name},
        "spec": {"model": {"uri": "/models/none", "parameterCount": "125M"}, "dataset": {"uri": "/data/none.jsonl"},
                 "training": {"maxSteps": 10}},
    }
    body["spec"].update(spec)
    return body
