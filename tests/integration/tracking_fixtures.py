"""A real MLflow tracking server for the tests: `mlflow server` on a free loopback port with a
SQLite backend in a temporary directory, from its own virtual environment (hack/toolenv mlflow: the
full mlflow package conflicts with requirements.lock). Import the fixture into a test module
to use it; the tests talk to it with the runtime's own client (mlflow-skinny)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .storage_fixtures import ROOT, _free_ports, serving


@dataclass(frozen=True)
class MlflowServer:
    uri: str
    log: Path


def tool_command(tool: str) -> Path:
    """`hack/toolenv TOOL`'s command, its environment built first if missing (a hash check
    when it is there): mlflow, checkov."""
    toolenv = str(ROOT / "hack" / "toolenv")
    path = Path(subprocess.run([toolenv, tool, "path"], check=True, capture_output=True, text=True).stdout.strip())
    if not (path.parent.parent / ".complete").is_file():
        subprocess.run([toolenv, tool, "build"], check=True)
    return path


def mlflow_command() -> Path:
    return tool_command("mlflow")


def _answers(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


@contextlib.contextmanager
def mlflow_server(root: Path) -> Iterator[MlflowServer]:
    """`mlflow server` with its database and artifacts under `root`, until the block ends."""
    root.mkdir(parents=True, exist_ok=True)
    (port,) = _free_ports(1)
    uri = f"http://127.0.0.1:{port}"
    command = [str(mlflow_command()), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
               "--default-artifact-root", str(root / "artifacts")]
    log = root / "mlflow.log"
    # The server's environment, not the tests': our virtual environment's variables would lead
    # its Python to our packages.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    log.unlink(missing_ok=True)
    # the first start creates the database (Alembic migrations); the server ignores SIGTERM
    # for more than 3 s, and its data is thrown away
    with serving(command, log, lambda: _answers(uri), f"mlflow server on {uri}", timeout=120, grace=3,
                 cwd=root, env=env):
        yield MlflowServer(uri, log)


@pytest.fixture(scope="session")
def tracking_server(tmp_path_factory) -> Iterator[MlflowServer]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server
