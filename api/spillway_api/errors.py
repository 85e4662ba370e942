"""Problem responses: every error is {status, code, detail}, plus the fields at fault when there are any."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm.exc import StaleDataError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from spillway_api.schemas import Problem


class ApiError(Exception):
    def __init__(self, status: int, code: str, detail: str, **extra: Any):
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.extra = extra


def not_found(namespace: str, name: str) -> ApiError:
    return ApiError(404, "job_not_found", f"no job {name!r} in namespace {namespace!r}; list them with GET "
                    f"/v1/namespaces/{namespace}/jobs")


def problem_response(status: int, code: str, detail: str, headers: dict[str, str] | None = None,
                     **extra: Any) -> JSONResponse:
    body = Problem(status=status, code=code, detail=detail, **extra).model_dump(exclude_none=True)
    return JSONResponse(body, status_code=status, headers=headers)


PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": Problem, "description": what}
    for code, what in [(400, "The body is not valid JSON (malformed_json)"), (401, "No or invalid bearer token"),
                       (403, "Not allowed in this namespace"), (422, "Invalid request"),
                       (503, "Database unreachable")]
}


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path"):
        parts = parts[1:] if parts[0] == "body" else parts
    return ".".join(parts) or "(body)"


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return problem_response(exc.status, exc.code, exc.detail, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            return problem_response(400, "malformed_json", "the request body is not valid JSON")
        lines = []
        for e in errors:
            msg = str(e.get("msg", "")).removeprefix("Value error, ")
            if e.get("type") == "extra_forbidden":
                msg = "unknown field; check the spelling against the FineTuneJob reference"
            lines.append(f"{_field_path(tuple(e.get('loc', ())))}: {msg}")
        return problem_response(422, "invalid_request", "the request is invalid: " + "; ".join(lines[:5]),
                                errors=lines)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized", 403: "forbidden"}
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request))
        return problem_response(exc.status_code, codes.get(exc.status_code, "http_error"), str(exc.detail),
                                headers=headers or None)

    @app.exception_handler(StaleDataError)
    async def _stale(_request: Request, _exc: StaleDataError) -> JSONResponse:
        return problem_response(409, "conflict", "the job changed while this request ran; read it again and retry")

    async def _db_down(_request: Request, _exc: Exception) -> JSONResponse:
        return problem_response(503, "database_unavailable",
                                "the database is unreachable; nothing was written, retry later",
                                headers={"Retry-After": "5"})

    app.add_exception_handler(OperationalError, _db_down)
    app.add_exception_handler(PoolTimeout, _db_down)

    @app.exception_handler(DBAPIError)
    async def _dbapi(request: Request, exc: DBAPIError) -> JSONResponse:
        if exc.connection_invalidated:
            return await _db_down(request, exc)
        raise exc


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path. Starlette's own 405 names only the
    first route that matched the path, and FastAPI makes one route per method."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)

