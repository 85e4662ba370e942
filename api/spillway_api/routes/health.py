"""/healthz (the process answers), /readyz (the database answers), /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from spillway_api.errors import ApiError
from spillway_api.schemas import Health, Problem

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Problem}})
def readyz(request: Request) -> Health:
    try:
        with request.app.state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as err:  # any failure to reach the database means not ready
        raise ApiError(503, "database_unavailable", f"the database is unreachable: {type(err).__name__}") from None
    return Health(status="ok")


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
