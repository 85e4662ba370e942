"""The plan summary: a plan in brief, in the one shape every reader sees.

Where this sits: beside the planner (`OffloadPlan.summary()` makes one). A cluster job's
`status.plan`, the plan a local job records, each answer of `POST /v1/plan` and the
dashboard all carry a `PlanSummary`; the full `OffloadPlan` is what the runtime reads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from spillway_runtime.core.spec_types import Tier


class SummaryModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True, extra="forbid")


class TierFigures(SummaryModel):
    gpu: int = Field(0, description="Bytes per GPU (per process on a CPU accelerator)")
    cpu: int = Field(0, description="Bytes per node, pinned and pageable")
    cpu_pinned: int = 0
    nvme: int = Field(0, description="Bytes per node")


class RejectedPlacement(SummaryModel):
    placement: str
    why: str


class RejectedShape(SummaryModel):
    shape: str
    nodes: int = Field(description="Nodes of this shape")
    why: str


class PlanSummary(SummaryModel):
    """A plan in brief, in the one shape every reader sees: a cluster job's status.plan, the
    plan a local job records, each answer of POST /v1/plan, and the dashboard. camelCase
    on the wire. The full `OffloadPlan` (swap and AIO settings, step-time parts) is what
    the runtime reads; this is what people read."""

    label: str = Field(description="e.g. 'Z3 opt:nvme par:cpu'")
    feasible: bool
    node: str = Field(description="The machine or node shape planned for")
    accelerator: Literal["cuda", "cpu"]
    model_name: str
    model_parameters: int
    node_count: int
    gpus_per_node: int
    processes_per_node: int
    zero_stage: int
    optimizer: Tier
    parameters: Tier
    activation_checkpointing: bool
    optimizer_cpu_resident_fraction: float = Field(
        0.0, description="With the optimizer on NVMe: the share of its sub-groups kept in CPU RAM, never swapped")
    nvme_bytes_per_step: int = Field(0, description="Predicted NVMe reads and writes per optimizer step, per node")
    bytes: TierFigures = Field(description="Planned bytes in each tier")
    capacity: TierFigures = Field(description="What each tier holds on the node")
    predicted_step_seconds: float
    predicted_total_seconds: float
    predicted_cost_usd: float | None = None
    price_per_hour_usd: float | None = Field(None, description="For all the job's GPUs (or CPU nodes)")
    tokens_per_step: int
    reasons: list[str] = Field(default_factory=list)
    rejected: list[RejectedPlacement] = Field(default_factory=list, description="Placements not chosen, and why")
    shortfalls: list[str] = Field(default_factory=list, description="Why it does not fit, tier by tier")
    # The cluster's part: which nodes, and the shapes that lost. Empty for a local run.
    shape: str | None = None
    node_names: list[str] = Field(default_factory=list)
    gpu_product: str | None = None
    rejected_shapes: list[RejectedShape] = Field(default_factory=list)
    attempt: int | None = Field(None, description="The attempt this plan was made for")

    @property
    def gpus(self) -> int:
        """GPUs the job holds: what a GPU-hour counts."""
        return self.gpus_per_node * self.node_count if self.accelerator == "cuda" else 0

    def dump(self) -> dict[str, object]:
        return self.model_dump(mode="json")
