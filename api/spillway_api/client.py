"""A Python client of the REST API, for tools that would otherwise hand-write requests.

Where this sits: beside the routes, sharing their schemas (`spillway_api.schemas`): what a
call returns is the model the route answers with, parsed, and an error is the route's
`Problem` as a `SpillwayError`. Works against a local `spillway api` (its token file) and a
cluster's API (a `kubectl create token ... --audience spillway` token). `spillway jobs`
(below) is its command line.

    with Client("https://spillway.example.org", token) as api:
        job = api.submit("team-a", yaml.safe_load(open("finetune.yaml")))
        done = api.wait("team-a", job.name)
        print(done.phase, api.cost("team-a", job.name).usd)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from spillway_api.schemas import (
    AttemptsPublic,
    CheckpointsPublic,
    JobCost,
    JobHistory,
    JobPublic,
    JobsPublic,
    NamespaceCost,
    PlansPublic,
    Problem,
    RollbackPublic,
)
from spillway_runtime.core.contract import TERMINAL_PHASES

M = TypeVar("M", bound=BaseModel)
PAGE = 500  # the API's largest page
ENDED = TERMINAL_PHASES | {"Deleted"}  # phases a job's record never leaves


class SpillwayError(Exception):
    """An error answer: its HTTP status, machine-readable code and the sentence saying what to
    change; `errors` lists invalid fields ('path: message') when there are any."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.status, self.code, self.errors = problem.status, problem.code, problem.errors or []
        super().__init__(f"{problem.status} {problem.code}: {problem.detail}")


class Client:
    def __init__(self, url: str, token: str | None = None, *, timeout: float = 30.0,
                 verify: bool | str = True, transport: httpx.BaseTransport | None = None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout, verify=verify,
                                  transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- requests ------------------------------------------------------------------------

    def _call(self, method: str, path: str, model: type[M] | None, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.is_error:
            try:
                problem = Problem.model_validate(response.json())
            except ValueError:  # not the API's answer (a proxy's page)
                problem = Problem(status=response.status_code, code="http_error", detail=response.text[:500])
            raise SpillwayError(problem)
        return model.model_validate(response.json()) if model is not None else None

    @staticmethod
    def _job(namespace: str, name: str = "") -> str:
        return f"/v1/namespaces/{namespace}/jobs" + (f"/{name}" if name else "")

    # -- jobs ----------------------------------------------------------------------------

    def submit(self, namespace: str, job: dict[str, Any]) -> JobPublic:
        """A FineTuneJob document (as in a finetune.yaml): validated by the same models as the CRD."""
        result: JobPublic = self._call("POST", self._job(namespace), JobPublic, json=job)
        return result

    def jobs(self, namespace: str | None = None, phase: str | None = None) -> Iterator[JobPublic]:
        """Every job (of a namespace, in a phase), page after page."""
        path = self._job(namespace) if namespace else "/v1/jobs"
        offset = 0
        while True:
            params: dict[str, Any] = {"offset": offset, "limit": PAGE, **({"phase": phase} if phase else {})}
            page: JobsPublic = self._call("GET", path, JobsPublic, params=params)
            yield from page.data
            offset += len(page.data)
            if not page.data or offset >= page.count:
                return

    def get(self, namespace: str, name: str) -> JobPublic:
        result: JobPublic = self._call("GET", self._job(namespace, name), JobPublic)
        return result

    def delete(self, namespace: str, name: str) -> None:
        self._call("DELETE", self._job(namespace, name), None)

    def suspend(self, namespace: str, name: str) -> JobPublic:
        result: JobPublic = self._call("POST", self._job(namespace, name) + "/suspend", JobPublic)
        return result

    def resume(self, namespace: str, name: str) -> JobPublic:
        result: JobPublic = self._call("POST", self._job(namespace, name) + "/resume", JobPublic)
        return result

    def rollback(self, namespace: str, name: str, checkpoint: str, reason: str) -> RollbackPublic:
        """Restart from `checkpoint` (a name from `checkpoints`); `reason` is kept in the history."""
        result: RollbackPublic = self._call("POST", self._job(namespace, name) + "/rollback", RollbackPublic,
                                            json={"checkpoint": checkpoint, "reason": reason})
        return result

    def history(self, namespace: str, name: str) -> JobHistory:
        result: JobHistory = self._call("GET", self._job(namespace, name) + "/history", JobHistory)
        return result

    def attempts(self, namespace: str, name: str) -> AttemptsPublic:
        result: AttemptsPublic = self._call("GET", self._job(namespace, name) + "/attempts", AttemptsPublic)
        return result

    def checkpoints(self, namespace: str, name: str) -> CheckpointsPublic:
        result: CheckpointsPublic = self._call("GET", self._job(namespace, name) + "/checkpoints", CheckpointsPublic)
        return result

    def cost(self, namespace: str, name: str | None = None) -> JobCost | NamespaceCost:
        """One job's cost, or a namespace's."""
        if name:
            job_cost: JobCost = self._call("GET", self._job(namespace, name) + "/cost", JobCost)
            return job_cost
        total: NamespaceCost = self._call("GET", f"/v1/namespaces/{namespace}/cost", NamespaceCost)
        return total

    def plan(self, request: dict[str, Any], namespace: str | None = None) -> PlansPublic:
        """POST /v1/plan (a PlanRequest: parameterCount or a spec, hardware or the cluster's nodes)."""
        params = {"namespace": namespace} if namespace else {}
        result: PlansPublic = self._call("POST", "/v1/plan", PlansPublic, json=request, params=params)
        return result

    def wait(self, namespace: str, name: str, phases: frozenset[str] | set[str] = ENDED,
             timeout: float = 3600.0, interval: float = 2.0) -> JobPublic:
        """Poll until the job is in one of `phases` (by default those its record never leaves);
        TimeoutError with its last phase otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(namespace, name)
            if job.phase in phases:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"{namespace}/{name} still {job.phase} after {timeout:.0f} s")
            time.sleep(interval)
