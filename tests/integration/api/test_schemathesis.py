"""Property-based requests from the OpenAPI schema, with every schemathesis check: no 5xx, no
undocumented status code, responses that match their schemas, schema-violating input
refused (types, bounds, unknown query parameters), schema-valid input accepted, a 405
that lists the methods the path takes, and auth enforced. Once with a valid token and
once with none. Derandomized: the same requests every run.

Schema-valid input may still be refused where a rule relates two values, which a JSON
Schema cannot say (the rules it can say, it does: the policy's tiers, cpuProcesses without
GPUs, where the model's size comes from): the body's metadata.namespace against the path's,
`since` after `until` in the cost query, training.warmupSteps above training.maxSteps in a
job or a plan. Those three operations are spared the schema-valid-accepted check, and only it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from spillway_api.main import create_app
from spillway_api.settings import Settings

pytestmark = pytest.mark.integration

_DATA = Path(__import__("tempfile").mkdtemp(prefix="spillway-schemathesis-"))
SETTINGS = Settings(database_url=f"sqlite:///{_DATA / 'api.db'}", data_dir=_DATA, auth="token", local_poll_seconds=0.1)
APP = create_app(SETTINGS)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
CROSS_PARAMETER_RULES = {("POST", "/v1/namespaces/{namespace}/jobs"), ("GET", "/v1/namespaces/{namespace}/cost"),
                         ("POST", "/v1/plan")}


@pytest.fixture(scope="module")
def token() -> str:
    with TestClient(APP) as client:  # runs the lifespan: migrations, the token file
        client.get("/healthz")
    return SETTINGS.resolved_token_file.read_text().strip()


def _excluded(case: schemathesis.Case) -> list[Any]:
    return [positive_data_acceptance] if (case.method.upper(), case.path) in CROSS_PARAMETER_RULES else []


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_every_check_with_a_valid_token(case: schemathesis.Case, token: str) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {token}"}, excluded_checks=_excluded(case))


@schema.parametrize()
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_every_check_without_a_token(case: schemathesis.Case, token: str) -> None:
    response = case.call_and_validate(excluded_checks=_excluded(case))
    if case.path not in ("/healthz", "/readyz", "/metrics", "/", "/dashboard") and not case.path.startswith("/assets"):
        # 401, or what is refused before credentials are read: a body that is not JSON (400),
        # or not of the schema (422), or a method or path that does not exist.
        assert response.status_code in (400, 401, 404, 405, 422), (case.method, case.path, response.status_code)
