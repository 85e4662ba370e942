"""The web dashboard: `/` serves the page, `/assets/{file}` its bundle (built from dashboard/
into spillway_api/static/ and committed, so nothing is fetched from a CDN or built at run time),
and `GET /v1/jobs` lists jobs across namespaces for the jobs table.

The page and its assets carry no data and need no token; every call the page makes to /v1
sends the bearer token the user typed (kept in sessionStorage), so the API's own
authentication and authorization apply unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from fastapi.security import HTTPAuthorizationCredentials

from spillway_api.auth import Authenticator
from spillway_api.deps import ServiceDep, bearer
from spillway_api.errors import PROBLEM_RESPONSES, ApiError
from spillway_api.schemas import JobPublic, JobsPublic
from spillway_api.service import Caller
from spillway_runtime.core.contract import Phase

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".svg": "image/svg+xml",
               ".map": "application/json"}
# The page is rebuilt with the package; a browser must not keep an old bundle after an upgrade.
NO_CACHE = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter(tags=["dashboard"], responses=PROBLEM_RESPONSES)


def _asset(name: str) -> FileResponse:
    # Only names that are files directly in static/: no path can reach outside it.
    files = {p.name: p for p in STATIC_DIR.iterdir() if p.is_file()} if STATIC_DIR.is_dir() else {}
    path = files.get(name)
    if path is None or path.suffix not in MEDIA_TYPES:
        raise ApiError(404, "not_found", f"the dashboard has no file {name!r}; rebuild it with hack/build-dashboard.sh")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=NO_CACHE)


@router.get("/", include_in_schema=False)
def index() -> FileResponse:
    return _asset("index.html")


@router.get("/assets/{name}", include_in_schema=False)
def asset(name: str) -> FileResponse:
    return _asset(name)


def _can_list(request: Request,
              credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Caller:
    """`list` in the namespace of the ?namespace= filter, or cluster-wide without one."""
    auth: Authenticator = request.app.state.auth
    token = credentials.credentials if credentials else None
    caller = auth.authenticate(token)
    auth.authorize(caller, token, "list", request.query_params.get("namespace") or None)
    return caller


@router.get("/v1/jobs", response_model=JobsPublic, tags=["jobs"])
def list_all_jobs(
    _caller: Annotated[Caller, Depends(_can_list)],
    service: ServiceDep,
    namespace: Annotated[str | None, Query(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)] = None,
    phase: Annotated[Phase | None, Query(description="Only jobs in this phase")] = None,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> JobsPublic:
    """Jobs in every namespace (or one), ordered by namespace and name. In cluster mode the caller
    needs `list` on finetunejobs.spillway.dev in that namespace, or cluster-wide without one."""
    rows, count = service.list_jobs(namespace, phase, offset, limit)
    return JobsPublic(data=[JobPublic.model_validate(r) for r in rows], count=count)
