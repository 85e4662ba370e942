"""/v1/namespaces/{namespace}/jobs: submit, list, read, history, checkpoints, rollback, suspend, delete."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, status

from spillway_api.deps import CanCreate, CanDelete, CanGet, CanList, CanPatch, ServiceDep
from spillway_api.errors import PROBLEM_RESPONSES
from spillway_api.schemas import (
    AttemptPublic,
    AttemptsPublic,
    CheckpointPublic,
    CheckpointsPublic,
    JobCost,
    JobCreate,
    JobHistory,
    JobPublic,
    JobsPublic,
    Problem,
    RollbackPublic,
    RollbackRequest,
)
from spillway_runtime.core.contract import Phase
from spillway_runtime.core.spec import MAX_STEPS

router = APIRouter(prefix="/v1/namespaces/{namespace}/jobs", tags=["jobs"], responses=PROBLEM_RESPONSES)

Namespace = Annotated[str, Path(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)]
Name = Annotated[str, Path(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)]
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": Problem, "description": "No such job"}}
CONFLICT: dict[int | str, dict[str, Any]] = {409: {"model": Problem, "description": "Conflicts with the job's state"}}


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic, responses=CONFLICT)
def create_job(caller: CanCreate, namespace: Namespace, body: JobCreate, service: ServiceDep) -> JobPublic:
    """Submit a FineTuneJob; the spec is validated by the same models as the CRD."""
    return JobPublic.model_validate(service.create(namespace, body, caller))


@router.get("", response_model=JobsPublic)
def list_jobs(
    _caller: CanList,
    namespace: Namespace,
    service: ServiceDep,
    phase: Annotated[Phase | None, Query(description="Only jobs in this phase")] = None,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JobsPublic:
    rows, count = service.list_jobs(namespace, phase, offset, limit)
    return JobsPublic(data=[JobPublic.model_validate(r) for r in rows], count=count)


@router.get("/{name}", response_model=JobPublic, responses=NOT_FOUND)
def get_job(_caller: CanGet, namespace: Namespace, name: Name, service: ServiceDep) -> JobPublic:
    return JobPublic.model_validate(service.get(namespace, name))


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
def delete_job(_caller: CanDelete, namespace: Namespace, name: Name, service: ServiceDep) -> None:
    """Delete the job and its history; a running job is checkpointed and stopped."""
    service.delete(service.get(namespace, name))


@router.get("/{name}/history", response_model=JobHistory, responses=NOT_FOUND)
def job_history(
    _caller: CanGet, namespace: Namespace, name: Name, service: ServiceDep,
    after_step: Annotated[int | None, Query(alias="afterStep", ge=0, le=MAX_STEPS,
                                                   description="Progress points after this step")]
    = None,
    limit: Annotated[int, Query(ge=1, le=10_000, description="Progress points per page")] = 1000,
) -> JobHistory:
    """Status transitions, rollbacks and the progress series (paged by step)."""
    return JobHistory.model_validate(service.history(service.get(namespace, name), after_step, limit))


@router.get("/{name}/attempts", response_model=AttemptsPublic, responses=NOT_FOUND)
def job_attempts(_caller: CanGet, namespace: Namespace, name: Name, service: ServiceDep) -> AttemptsPublic:
    """Every run of the job, oldest first, each with its own outcome, steps and cost."""
    rows = service.attempts(service.get(namespace, name))
    return AttemptsPublic(data=[AttemptPublic.model_validate(r) for r in rows], count=len(rows))


@router.get("/{name}/checkpoints", response_model=CheckpointsPublic, responses=NOT_FOUND)
def job_checkpoints(_caller: CanGet, namespace: Namespace, name: Name, service: ServiceDep) -> CheckpointsPublic:
    rows = service.checkpoints(service.get(namespace, name))
    return CheckpointsPublic(data=[CheckpointPublic.model_validate(r) for r in rows], count=len(rows))


@router.post("/{name}/rollback", response_model=RollbackPublic, status_code=status.HTTP_202_ACCEPTED,
             responses={**NOT_FOUND, **CONFLICT})
def rollback_job(caller: CanPatch, namespace: Namespace, name: Name, body: RollbackRequest,
                 service: ServiceDep) -> RollbackPublic:
    """Restart the job from a checkpoint: sets spec.resumeFrom and records who, when and why.

    409 with `validCheckpoints` for an unknown checkpoint; 409 while another rollback is in progress."""
    job = service.get(namespace, name)
    return RollbackPublic.model_validate(service.rollback(job, body.checkpoint, body.reason, caller))


@router.post("/{name}/suspend", response_model=JobPublic, responses={**NOT_FOUND, **CONFLICT})
def suspend_job(caller: CanPatch, namespace: Namespace, name: Name, service: ServiceDep) -> JobPublic:
    """Checkpoint and stop the job (spec.suspend = true)."""
    return JobPublic.model_validate(service.set_suspend(service.get(namespace, name), True, caller))


@router.post("/{name}/resume", response_model=JobPublic, responses={**NOT_FOUND, **CONFLICT})
def resume_job(caller: CanPatch, namespace: Namespace, name: Name, service: ServiceDep) -> JobPublic:
    """Start a suspended job again from its newest checkpoint (spec.suspend = false)."""
    return JobPublic.model_validate(service.set_suspend(service.get(namespace, name), False, caller))


@router.get("/{name}/cost", response_model=JobCost, responses=NOT_FOUND)
def job_cost(_caller: CanGet, namespace: Namespace, name: Name, service: ServiceDep) -> JobCost:
    return JobCost.model_validate(service.cost(service.get(namespace, name)))
