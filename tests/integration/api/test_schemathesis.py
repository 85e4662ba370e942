"""Property-based requests from the OpenAPI schema (bounded): no operation answers 5xx."""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from spillway_api.main import create_app
from spillway_api.settings import Settings

pytestmark = pytest.mark.integration

_DATA = Path(__import__("tempfile").mkdtemp(prefix="spillway-schemathesis-"))
APP = create_app(Settings(database_url=f"sqlite:///{_DATA / 'api.db'}", data_dir=_DATA, auth="none",
                          local_poll_seconds=0.1))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def _migrated() -> None:
    from spillway_api.db import migrate

    migrate(APP.state.engine)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:500]}"
