"""Dependencies as `Annotated` aliases: a session per request, the job service, the caller.

`SessionDep` commits when the handler returns, before the response is sent, and then
runs what launchers queued for after the commit (starting a local run), so nothing
starts for a request that did not commit. `Allowed(verb)` authenticates and authorizes for the path's namespace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from spillway_api.auth import Authenticator
from spillway_api.errors import ApiError
from spillway_api.service import Caller, JobService
from spillway_api.settings import Settings

bearer = HTTPBearer(auto_error=False, description="Local token file, or a Kubernetes token in cluster mode")


def get_session(request: Request) -> Iterator[Session]:
    session: Session = request.app.state.sessions()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        actions: list[Callable[[], Any]] = session.info.pop("after_commit", [])
        session.close()
    for action in actions:
        action()


# scope="function": the commit (and what waits for it) runs before the response is sent. By
# default FastAPI ends a `yield` dependency after sending it: a client could hear 200 for a
# change not yet committed, and its next request, reading the row before that commit, lost
# its compare-and-set to it (a 409 on a resume right after a suspend).
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def get_service(request: Request, session: SessionDep) -> JobService:
    return JobService(session, request.app.state.launchers, request.app.state.settings.launcher)


ServiceDep = Annotated[JobService, Depends(get_service)]


def _token(credentials: HTTPAuthorizationCredentials | None) -> str | None:
    return credentials.credentials if credentials else None


def allowed(verb: str) -> Callable[..., Caller]:
    def check(request: Request,
              credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Caller:
        auth: Authenticator = request.app.state.auth
        token = _token(credentials)
        caller = auth.authenticate(token)
        auth.authorize(caller, token, verb, request.path_params.get("namespace"))
        return caller

    return check


CanList = Annotated[Caller, Depends(allowed("list"))]
CanGet = Annotated[Caller, Depends(allowed("get"))]
CanCreate = Annotated[Caller, Depends(allowed("create"))]
CanPatch = Annotated[Caller, Depends(allowed("patch"))]
CanDelete = Annotated[Caller, Depends(allowed("delete"))]


def may_plan(request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
             namespace: Annotated[str | None, Query(
                 min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                 description="Plan as for a job in this namespace: the caller must be allowed to create "
                 "FineTuneJobs there (cluster mode). Omitted: allowed to create them in every namespace")] = None,
             ) -> Caller:
    """A plan reads the cluster's nodes, shapes and prices and runs the planner: in cluster
    mode, for whoever may create a job where it would run (SubjectAccessReview), not for any
    holder of a token."""
    auth: Authenticator = request.app.state.auth
    token = _token(credentials)
    caller = auth.authenticate(token)
    try:
        auth.authorize(caller, token, "create", namespace)
    except ApiError as err:
        if err.status == 403 and namespace is None:
            err.detail += "; to plan for a namespace where you may, add ?namespace=NAMESPACE"
        raise
    return caller


MayPlan = Annotated[Caller, Depends(may_plan)]


def reject_unknown_query(request: Request) -> None:
    """A query parameter the operation does not take is an error, not ignored: `?limt=5`
    would otherwise answer with the default page and no word of the typo."""
    from fastapi.routing import APIRoute

    route = request.scope.get("route")
    if not isinstance(route, APIRoute) or not request.query_params:
        return
    known = _query_names(route.dependant)
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        raise ApiError(422, "invalid_request", f"unknown query parameter(s) {unknown}; this operation takes "
                       f"{sorted(known) or 'none'}", errors=[f"{name or '(empty name)'}: unknown query parameter"
                                                             for name in unknown])


def _query_names(dependant: Any) -> set[str]:
    """The query parameters of an operation and of every dependency it has."""
    names = {param.alias for param in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names

