"""A real `uvicorn` serving the API for tests that talk to it over HTTP (the dashboard in
Chromium, the Python client and `spillway jobs`)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from spillway_api.settings import Settings
from tests import polling


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(root: Path, auth: str) -> Iterator[dict[str, Any]]:
    """`uvicorn` serving create_app() on a free loopback port, configured by SPILLWAY_* variables."""
    port = free_port()
    env = {**os.environ, "SPILLWAY_DATABASE_URL": f"sqlite:///{root / 'api.db'}", "SPILLWAY_DATA_DIR": str(root / "data"),
           "SPILLWAY_AUTH": auth, "SPILLWAY_LOCAL_POLL_SECONDS": "0.1", "SPILLWAY_LOCAL_PRICE_PER_HOUR": "3.6",
           "DS_ACCELERATOR": "cpu"}
    log = (root / "uvicorn.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "spillway_api.main:create_app",
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"uvicorn exited {proc.returncode}:\n{(root / 'uvicorn.log').read_text()}")
        try:
            return httpx.get(url + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        polling.wait_for(up, 60, "uvicorn to answer")
        token = Settings(data_dir=root / "data").resolved_token_file.read_text().strip() if auth == "token" else ""
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"} if token else {},
                          timeout=30) as api:
            yield {"url": url, "token": token, "api": api}
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
