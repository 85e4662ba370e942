"""What goes over the wire: request and response schemas, separate from the ORM classes.

camelCase on the wire, as in the FineTuneJob itself. `JobCreate` validates the spec
with the same pydantic models the CRD is generated from.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from spillway_runtime.core.contract import AttemptPhase, JobPhase
from spillway_runtime.core.hardware import NodeHardware
from spillway_runtime.core.plan_summary import PlanSummary
from spillway_runtime.core.planner import plan_summary
from spillway_runtime.core.spec import FineTuneJobSpec, Method, Offload, Training
from spillway_runtime.core.spec_types import COUNT_SCHEMA


class WireModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, validate_by_name=True, validate_by_alias=True, serialize_by_alias=True,
        from_attributes=True,
    )


class JobMetadata(WireModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    namespace: str | None = Field(None, description="Must match the path's namespace when given",
                                  pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    labels: dict[Annotated[str, Field(max_length=317)], Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=64, description="Kubernetes labels (keys up to 317 characters, values 63)")


def _json_numbers(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer; pydantic's strict mode does not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _json_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_numbers(v) for v in value]
    return value


def _strictly(model: type[BaseModel], value: Any) -> Any:
    """A nested model of a request body, validated strictly: JSON has types, unlike YAML (where
    `3e-3` is a string), so over the API "3" is not an integer and false is not a price, as
    the OpenAPI says. A model's own `strict` stops at its fields; this reaches inside."""
    return model.model_validate(_json_numbers(value), strict=True) if isinstance(value, dict) else value


def _type_errors_are_invalid(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """The spec's unit parsers raise TypeError for a non-string size or count (e.g. {}), which
    pydantic does not turn into a validation error; make it one instead of a 500."""
    try:
        return handler(value)
    except TypeError as err:
        raise ValueError(f"a size or count field holds a value of the wrong type ({err}); use e.g. 13B or 500Gi") \
            from None


class JobCreate(WireModel):
    """A FineTuneJob document; apiVersion and kind may be omitted."""

    model_config = ConfigDict(extra="forbid")
    api_version: Literal["spillway.dev/v1alpha1"] = "spillway.dev/v1alpha1"
    kind: Literal["FineTuneJob"] = "FineTuneJob"
    metadata: JobMetadata
    spec: FineTuneJobSpec

    _spec_types = field_validator("spec", mode="wrap")(_type_errors_are_invalid)

    @field_validator("spec", mode="before")
    @classmethod
    def _strict_types(cls, value: Any) -> Any:
        return _strictly(FineTuneJobSpec, value)


class JobPublic(WireModel):
    namespace: str
    name: str
    uid: str | None
    launcher: Literal["local", "kubernetes"]
    phase: JobPhase = Field(description="The contract's phases, and Deleted: deleted from the cluster")
    message: str | None
    spec: dict[str, Any]
    plan: PlanSummary | None = Field(description="The plan in brief: the same shape for local and cluster jobs, "
                                     "and for POST /v1/plan")
    progress: dict[str, Any] | None

    @field_validator("plan", mode="before")
    @classmethod
    def _one_summary(cls, value: Any) -> Any:
        return value if isinstance(value, PlanSummary) else plan_summary(value)
    exit_code: int | None
    run_dir: str | None
    created_at: datetime
    updated_at: datetime
    version: int
    attempt: int = Field(description="The attempt under way or last ended (see /attempts); 0 before the first")


class JobsPublic(WireModel):
    data: list[JobPublic]
    count: int = Field(description="Jobs matching the filters, across all pages")


class TransitionPublic(WireModel):
    from_phase: str | None
    to_phase: str
    reason: str | None
    at: datetime
    attempt: int | None


class AttemptPublic(WireModel):
    number: int = Field(description="1 for the first run; one more for each later run of the job")
    origin: Literal["submit", "rerun", "restart", "cluster"] = Field(
        description="submit: the first run; rerun: `spillway run` of a recorded job; restart: a resume, rollback "
        "or preemption restart on this machine; cluster: an attempt of the operator (status.attempt + 1)")
    phase: AttemptPhase = Field(description="Its own outcome (or state, while it runs); Stopped: restarted by a "
                                "rollback or resume")
    reason: str | None
    started_at: datetime
    ended_at: datetime | None
    first_step: int | None
    last_step: int | None
    last_loss: float | None
    exit_code: int | None
    usd: float
    gpu_hours: float
    seconds: float


class AttemptsPublic(WireModel):
    data: list[AttemptPublic]
    count: int


class ProgressPointPublic(WireModel):
    step: int
    loss: float | None
    learning_rate: float | None
    step_seconds: float | None
    tokens_per_second: float | None
    eta_seconds: float | None
    gpu_bytes: int | None
    cpu_bytes: int | None
    nvme_bytes: int | None
    preference: dict[str, float] | None = Field(
        None, description="Preference tuning (DPO): the step's rewards and log-probabilities under TRL's names")
    at: datetime
    attempt: int | None


class RollbackPublic(WireModel):
    checkpoint: str | None
    reason: str
    requested_by: str
    at: datetime
    origin: Literal["api", "runtime"]
    from_step: int | None
    to_step: int | None
    completed_at: datetime | None


class EvaluationPublic(WireModel):
    step: int
    loss: float | None = Field(description="Mean loss over the held-out data's learned tokens")
    tokens: int | None
    preference: dict[str, float] | None = Field(
        None, description="Preference tuning (DPO): the held-out pairs' metrics (eval_rewards/margins, ...)")
    at: datetime
    attempt: int | None


class JobHistory(WireModel):
    transitions: list[TransitionPublic]
    progress: list[ProgressPointPublic]
    rollbacks: list[RollbackPublic]
    progress_count: int = Field(description="Progress points recorded in all; `progress` holds one page")
    evaluations: list[EvaluationPublic] = Field(description="Held-out losses (dataset.validation), in order")


class CheckpointPublic(WireModel):
    name: str
    step: int
    loss: float | None
    time: datetime | None
    size_bytes: int | None
    sha256: str | None
    eval_loss: float | None = Field(None, description="Held-out loss of these weights, when evaluated at its step")


class CheckpointsPublic(WireModel):
    data: list[CheckpointPublic]
    count: int


class RollbackRequest(WireModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint: str = Field(min_length=1, max_length=128, description="A checkpoint name from /checkpoints")
    reason: str = Field(min_length=1, max_length=2000, description="Why: kept in the job's history")


class CostPublic(WireModel):
    usd: float
    gpu_hours: float
    seconds: float
    entries: int


class JobCost(CostPublic):
    namespace: str
    name: str


class NamespaceCost(CostPublic):
    namespace: str
    since: datetime | None
    until: datetime | None
    jobs: list[JobCost]


class NodeShape(WireModel):
    """A Kubernetes Node object's hardware-relevant parts (labels, annotations, allocatable)."""

    metadata: dict[str, Any] = Field(default_factory=dict)
    status: dict[str, Any] = Field(default_factory=dict)


class PlanRequest(WireModel):
    # Strict: JSON has types (false is not a price, "3" not a GPU count), as for JobCreate.
    model_config = ConfigDict(extra="forbid", strict=True)
    parameter_count: Annotated[int | str | None, WithJsonSchema(COUNT_SCHEMA)] = Field(
        None, description="e.g. 13B; or give spec.model.parameterCount. Neither: the answer is the largest model "
        "each placement fits on each node shape (`largest`)")
    spec: FineTuneJobSpec | None = Field(None, description="Training and offload settings of the job to plan")
    training: Training | None = None
    offload: Offload | None = None
    method: Method | None = Field(None, description="full or lora (LoRA: the adapters' state only is sized)")
    dtype: Literal["bf16", "fp16", "fp32"] | None = None
    hardware: NodeHardware | None = Field(None, description="One machine's hardware, as `spillway probe` prints")
    nodes: list[NodeShape] | None = Field(
        None, description="Kubernetes Node objects; omitted (or empty) with no hardware: the cluster's nodes "
        "(cluster mode) or this machine (local mode)"
    )
    node_count: int = Field(1, ge=1, le=1024)
    gpus_per_node: int | None = Field(None, ge=0, le=64)
    price_per_hour: float | None = Field(None, ge=0, le=1e6)

    _spec_types = field_validator("spec", "offload", "method", mode="wrap")(_type_errors_are_invalid)

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers(cls, value: Any) -> Any:
        return _json_numbers(value)

    @field_validator("spec", "training", "offload", "hardware", mode="before")
    @classmethod
    def _strict_nested(cls, value: Any, info: ValidationInfo) -> Any:
        kind: dict[str, type[BaseModel]] = {"spec": FineTuneJobSpec, "training": Training, "offload": Offload,
                                            "hardware": NodeHardware}
        return _strictly(kind[str(info.field_name)], value)


class PlanPublic(WireModel):
    node: str
    feasible: bool
    label: str
    plan: PlanSummary | None = Field(description="None when the planner could not plan for this node at all "
                                     "(shortfalls says why)")
    shortfalls: list[str]


class LargestFitPublic(WireModel):
    placement: str
    parameters: int = Field(description="The largest parameter count that fits (3 significant digits); 0: none")
    predicted_step_seconds: float | None = None
    why_not: str | None = Field(None, description="Why the placement is out (the settings given, no NVMe)")
    bound_by: str | None = Field(None, description="What stops a larger model: the tier a model 1% larger is short "
                                 "of, and what fills it")


class LargestPublic(WireModel):
    node: str
    placements: list[LargestFitPublic]
    why_not: str | None = Field(None, description="Why this node shape answers nothing (more GPUs per node "
                                "asked for than it has); its placements are then empty")


class PlansPublic(WireModel):
    data: list[PlanPublic]
    count: int
    largest: list[LargestPublic] = Field(
        default_factory=list, description="Without a parameter count: per node shape, the largest model each "
        "placement fits with the training settings given, and its predicted step time")
    best: str | None = Field(description="Node of the plan that would run: in cluster mode the operator's "
                             "choice (the job's resources.placement, cheapest by default), else the fastest "
                             "feasible one; none if nothing fits")
    excluded: dict[str, str] = Field(default_factory=dict, description="Cluster mode: nodes the job's pods could "
                                     "not run on (not Ready, cordoned, nodeSelector, untolerated taints), and why")


class Problem(BaseModel):
    """Every error response: HTTP status, a machine-readable code, and a sentence saying what to change."""

    status: int
    code: str
    detail: str
    errors: list[str] | None = Field(None, description="Invalid fields, one 'path: message' line each")
    valid_checkpoints: list[str] | None = Field(None, alias="validCheckpoints")

    model_config = ConfigDict(validate_by_name=True, serialize_by_alias=True)


class Health(BaseModel):
    status: Literal["ok"]
