"""The FineTuneJob status: the one shape of what a job reports, beside the spec.

Where this sits: next to `spec` (importable without torch). The CRD's status schema is
generated from `FineTuneJobStatus` (spillway_operator.crd); the runtime's reporter
(`k8s_status`) and `spillway run`'s recorder (spillway_api.service) write `Progress` and
`CheckpointRecord`; the API reads a cluster job's status with `read_status`. The operator
owns every field but `progress`, `checkpoints` and `mirror`, which the runtime writes under
its own field manager. camelCase on the wire, snake_case in Python.

Reading never fails on what another version wrote: unknown keys are kept (open records,
`extra="allow"`, which the CRD keeps as x-kubernetes-preserve-unknown-fields) or ignored
(the list entries, which the API server prunes), and `read_status` reads a known key in a
shape it cannot parse as absent.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator
from pydantic.alias_generators import to_camel

from spillway_runtime.core.contract import PHASES, Phase
from spillway_runtime.core.plan_summary import PlanSummary
from spillway_runtime.core.planner import plan_summary

log = logging.getLogger("spillway.status")

RUNTIME_OWNED = "Owned by the runtime (field manager spillway-runtime)"
# A list whose entries the API server (and server-side apply) tell apart by these keys.
_LIST_MAP = "x-kubernetes-list-type"


def _list_map(*keys: str) -> dict[str, Any]:
    return {_LIST_MAP: "map", "x-kubernetes-list-map-keys": list(keys)}


class OpenRecord(BaseModel):
    """A status record that keeps keys it does not know (another version's)."""

    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True, extra="allow")


class ListEntry(BaseModel):
    """An entry of a keyed status list: unknown keys are read past, and pruned by the API server."""

    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True, extra="ignore")


class Condition(ListEntry):
    """A Kubernetes condition, one per type."""

    type: str = Field(description="e.g. Planned, Running, Suspended, Admitted")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field("", description="One CamelCase word")
    message: str = Field("", description="What happened, in words")
    last_transition_time: str = Field("", json_schema_extra={"format": "date-time"},
                                      description="When the status last changed")
    observed_generation: int = Field(0, description="The spec's generation the condition was decided on")


class CheckpointRecord(ListEntry):
    """A good checkpoint on the job's volume, as the runtime lists it (the API's record of it too)."""

    name: str = Field(description="e.g. checkpoint-00000200")
    step: int = Field(0, description="The optimizer step it holds (the next step trained after it is step + 1)")
    loss: float | None = Field(None, description="The training loss at the step")
    time: str = Field("", description="When it was written (RFC 3339)")
    size_bytes: int = Field(0, description="Bytes on the volume")
    sha256: str = Field("", description="Digest of the manifest's file table: identifies the checkpoint")
    eval_loss: float | None = Field(None, description="The held-out loss of these weights, when evaluated")

    @field_validator("time", mode="before")
    @classmethod
    def _rfc3339(cls, value: Any) -> Any:
        """A runtime event's time (seconds since the epoch) as the status writes it."""
        if isinstance(value, int | float) and not isinstance(value, bool):
            return datetime.fromtimestamp(value, UTC).isoformat().replace("+00:00", "Z")
        return value


class Progress(OpenRecord):
    """Where training is: the runtime's last step (at most every few seconds) and evaluation."""

    step: int | None = Field(None, description="Optimizer steps done")
    total_steps: int | None = Field(None, description="spec.training.maxSteps")
    loss: float | None = Field(None, description="The last step's training loss (mean over the ranks)")
    step_display: str = Field("", description="step/totalSteps, what `kubectl get ftj` prints")
    loss_display: str = Field("", description="The loss in 4 digits, what `kubectl get ftj` prints")
    learning_rate: float | None = Field(None, description="The last step's learning rate")
    tokens_per_second: float | None = Field(None, description="Tokens trained per second, every rank together")
    step_seconds: float | None = Field(
        None, description="The mean of the last 20 steps' seconds (a step's micro-batches and optimizer step, "
        "not its checkpoint; each process's first step left out)")
    step_time_vs_plan: float | None = Field(
        None, description="stepSeconds over status.plan.predictedStepSeconds: how well the plan's step-time model "
        "holds on this node (outside 0.75-1.33 it missed: docs/one-machine.md, \"Every run checks the model\")")
    eta_seconds: float | None = Field(None, description="Predicted seconds to the last step")
    bytes: dict[str, int] = Field(default_factory=dict, description="Bytes in use per tier (gpu, cpu, nvme)")
    updated_at: str | None = Field(None, description="When the step ended (RFC 3339)")
    eval_loss: float | None = Field(None, description="The last held-out loss, until the next evaluation")
    eval_step: int | None = Field(None, description="The step evalLoss was measured at")
    preference: dict[str, float] = Field(
        default_factory=dict, description="Preference tuning (DPO): the last step's rewards and log-probabilities "
        "under TRL's names (rewards/margins, rewards/accuracies, ...), and the last evaluation's (eval_...)")


class StepTimeFields(TypedDict, total=False):
    step_seconds: float
    step_time_vs_plan: float


def step_time_fields(event: dict[str, Any]) -> StepTimeFields:
    """A runtime step event's step time as `Progress` fields, where it has them (`training.step_times`:
    none on a process's first step)."""
    out = StepTimeFields()
    mean, ratio = event.get("step_seconds_mean"), event.get("step_time_vs_plan")
    if isinstance(mean, int | float) and not isinstance(mean, bool):
        out["step_seconds"] = float(mean)
    if isinstance(ratio, int | float) and not isinstance(ratio, bool):
        out["step_time_vs_plan"] = float(ratio)
    return out


class Mirror(OpenRecord):
    """The copy of the checkpoints in object storage (spec.checkpoint.mirror)."""

    uri: str | None = Field(None, description="spec.checkpoint.mirror")
    checkpoint: str | None = Field(None, description="The latest checkpoint mirrored")
    step: int | None = Field(None, description="Its step")
    bytes_per_second: float | None = Field(None, description="The last upload's speed")
    lag_steps: int | None = Field(None, description="Steps trained since the mirrored checkpoint")
    last_error: str | None = Field(None, description="Why the last failed upload failed")
    failures: int | None = Field(None, description="Failed uploads in a row")
    updated_at: str | None = Field(None, description="When this record was written (RFC 3339)")


class Cost(OpenRecord):
    """What the job has cost: settled attempts plus the live one, as of `asOf` (the operator's)."""

    usd: float | None = Field(None, description="Settled plus the live attempt's, in US dollars")
    gpu_hours: float | None = Field(None, description="GPU hours, settled plus the live attempt's")
    settled_usd: float | None = Field(None, alias="settledUSD", description="Of the attempts that ended")
    settled_gpu_hours: float | None = Field(None, description="Of the attempts that ended")
    price_per_hour_usd: float | None = Field(None, alias="pricePerHourUSD",
                                             description="The live attempt's price of its nodes per hour")
    as_of: str | None = Field(None, description="When usd was computed (RFC 3339)")
    display: str | None = Field(None, description="e.g. $1.23, what `kubectl get ftj` prints")


class ModelConfigRead(OpenRecord):
    """The model's config.json as a reader pod found it at `source` (model.uri), or why not."""

    source: str | None = Field(None, description="The model.uri read")
    config: dict[str, Any] | None = Field(None, description="Its config.json")
    error: str | None = Field(None, description="Why it could not be read (the job plans from parameterCount)")


class InputsFetched(OpenRecord):
    """The s3:// inputs fetched onto the nodes of an attempt."""

    attempt: int | None = Field(None, description="The attempt they were fetched for")
    nodes: list[str] = Field(default_factory=list, description="The nodes whose S3 cache holds them")
    uris: list[str] = Field(default_factory=list, description="The s3:// URIs fetched")


class FineTuneJobStatus(OpenRecord):
    """status of a FineTuneJob. The operator writes all but progress, checkpoints and mirror."""

    # Absent until the operator first writes it, never null: a string of the contract's phases
    phase: Annotated[Phase | None, WithJsonSchema({"type": "string", "enum": list(PHASES)})] = Field(
        None, description="Where the job is in its life (docs/finetunejob.md: Phases)")
    message: str | None = Field(None, description="Why it is in its phase, in words")
    observed_generation: int | None = Field(None, description="The spec's generation the operator last acted on")
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=_list_map("type"),
                                        description="Kubernetes conditions, one per type")
    plan: PlanSummary | None = Field(
        None, description="The plan in brief (the planner's PlanSummary) for the current attempt",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    cost: Cost | None = None
    progress: Progress | None = Field(None, description=RUNTIME_OWNED)
    checkpoints: list[CheckpointRecord] = Field(default_factory=list, description=RUNTIME_OWNED,
                                                json_schema_extra=_list_map("name"))
    mirror: Mirror | None = Field(None, description=RUNTIME_OWNED)
    attempt: int = Field(0, description="The attempt under way, 0 first; each new attempt adds one")
    failures: int = Field(0, description="Attempts that failed, counted against spec.backoffLimit")
    preemptions: int = Field(0, description="Attempts preempted or evicted (not counted)")
    replans: int = Field(0, description="Attempts replaced by a new plan (not counted)")
    children_attempt: int | None = Field(None, description="The attempt whose pods all exist")
    retry_after: str | None = Field(None, description="When the next attempt may start (RFC 3339)")
    finished_at: str | None = Field(None, description="When it reached a final phase (RFC 3339)")
    applied_resume_from: str | None = Field(None, description="The spec.resumeFrom a restart has applied")
    resume_attempt: int | None = Field(None, description="The attempt that resumes from appliedResumeFrom")
    model_config_read: ModelConfigRead | None = Field(None, alias="modelConfig")
    inputs_fetched: InputsFetched | None = None

    @field_validator("plan", mode="before")
    @classmethod
    def _one_summary(cls, value: Any) -> Any:
        """A plan in another version's shape reads as no plan (the next plan replaces it)."""
        return value if value is None or isinstance(value, PlanSummary) else plan_summary(value)


def read_status(raw: Any) -> FineTuneJobStatus:
    """A FineTuneJob's status as written by any version: a value this version cannot read
    (another type) is read as absent, the fields beside it kept (a bad `cost.display` leaves
    `cost.settledUSD`; a bad entry of a list goes whole), and said once in the log."""
    data: Any = dict(raw) if isinstance(raw, dict) else {}
    for _ in range(64):
        try:
            return FineTuneJobStatus.model_validate(data)
        except ValidationError as err:
            locs = [tuple(e["loc"]) for e in err.errors() if e["loc"]]
            if not locs:
                break
            said = ", ".join(".".join(map(str, loc)) for loc in locs)
            if said not in _WARNED:
                _WARNED.add(said)
                log.warning("status fields %s unreadable, read as absent: %s", said, err)
            # one at a time: removing a list's entry moves the entries after it
            data = _without(data, locs[0]) or {k: v for k, v in data.items() if k != locs[0][0]}
    return FineTuneJobStatus()


_WARNED: set[str] = set()  # what read_status has said, so that every reconcile does not say it again


def _without(value: Any, loc: tuple[Any, ...]) -> Any:
    """`value` without what `loc` points at: a field of a record, or a list's entry (whole).
    None when `loc` leads nowhere in `value` (an error already removed above it)."""
    head, rest = loc[0], loc[1:]
    if isinstance(value, dict) and head in value:
        if not rest:
            return {k: v for k, v in value.items() if k != head}
        inner = _without(value[head], rest)
        return None if inner is None else {**value, head: inner}
    if isinstance(value, list) and isinstance(head, int) and 0 <= head < len(value):
        return value[:head] + value[head + 1:]
    return None
