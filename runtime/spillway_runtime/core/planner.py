"""The tier planner: where each piece of training state lives, and what that costs.

Given a model's shape, a node's hardware and the job's training settings, it
scores every ZeRO placement (stage, optimizer tier, parameter tier), keeps the
fastest one that fits and the user allows, and explains the rest. Pure
arithmetic: no torch, no I/O. The runtime's DeepSpeed config, the operator's
pod sizing and the API's dry-run all read the `OffloadPlan` it returns.

Model-state bytes follow DeepSpeed's estimators
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`)
with `additional_buffer_factor=1.0`; what they leave out (activations, NVMe swap
files, pinned swap buffers, runtime overhead, headroom) is added on top, each as
a named term. What a placement is sized from is in `placement_inputs`, its bytes
in each tier in `tier_sizing`, the formulas for bytes and step time in `estimates`;
this module chooses between placements with them. The names those modules define
that callers take from here are re-exported.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from spillway_runtime.core.estimates import (
    MIN_AIO_BYTES,
    StepTime,
    activation_bytes,
    gradient_partition_bytes,
    holds_gradient_partition,
    lora_parameters,
    lora_tensors,
    model_state_bytes,
    step_time,
)
from spillway_runtime.core.hardware import AioSettings, NodeHardware
from spillway_runtime.core.placement_inputs import OPTIMIZER_SWAP_BUFFERS, ModelShape, PlacementInputs, SwapSettings
from spillway_runtime.core.plan_summary import PlanSummary
from spillway_runtime.core.spec import (
    GRADIENT_ACCUMULATION_MAX,
    POLICY_TIERS,
    FineTuneJobSpec,
    Method,
    Offload,
    Training,
    twin_flow_placement,
    zenflow_settings,
)
from spillway_runtime.core.spec_types import DType, Tier
from spillway_runtime.core.tier_sizing import (
    CPU_RESERVED_FRACTION,
    CPU_RESERVED_MIN,
    Shortfall,
    TierBytes,
    size_placement,
)
from spillway_runtime.core.units import format_bytes, format_count


class Rejection(BaseModel):
    placement: str
    why: str


# What one checkpoint holds per parameter: the fp32 masters and both Adam moments, once each
# (12 B), and under ZeRO-1/2 the 16-bit weights too (2 B); ZeRO-3 rebuilds those from the
# masters. Measured by tests/integration/test_exact_resume.py for every placement.
CHECKPOINT_BYTES_PER_PARAM = {3: 12}
CHECKPOINT_BYTES_PER_PARAM_DEFAULT = 14


class OffloadPlan(BaseModel):
    feasible: bool
    node: str
    accelerator: Literal["cuda", "cpu"]
    nodes: int
    gpus_per_node: int
    processes_per_node: int = Field(1, description="Training processes per node: one per GPU, or CPU processes")
    zero_stage: int
    optimizer: Tier
    parameters: Tier
    activation_checkpointing: bool
    bytes: TierBytes
    capacity: TierBytes
    activation_bytes: int = Field(description="Per GPU (or per process on a CPU accelerator)")
    headroom: TierBytes
    swap: SwapSettings
    aio: AioSettings
    step: StepTime
    predicted_step_seconds: float
    tokens_per_step: int
    amortizing_accumulation: int | None = Field(
        None, description="Optimizer on NVMe, its I/O adding over NVME_OVERHEAD_SHARE to the step: the smallest "
        "training.gradientAccumulation at which it adds at most that; none where no accumulation up to "
        "GRADIENT_ACCUMULATION_MAX does")
    predicted_total_seconds: float
    predicted_cost_usd: float | None = None
    shortfalls: list[Shortfall] = Field(default_factory=list)
    reasons: list[str] = Field(default_factory=list)
    rejected: list[Rejection] = Field(default_factory=list)
    model: ModelShape

    @property
    def checkpoint_bytes(self) -> int:
        """The size of one checkpoint of this plan, all ranks together (data position, RNG and
        the small files are under a megabyte more)."""
        per = CHECKPOINT_BYTES_PER_PARAM.get(self.zero_stage, CHECKPOINT_BYTES_PER_PARAM_DEFAULT)
        return self.model.trainable * per  # LoRA: the adapters only (the base is the model's files)

    @property
    def uses_nvme(self) -> bool:
        """DeepSpeed is told to offload to NVMe: it needs a directory there even when every
        piece is under its minimum swap size and stays in RAM (`bytes.nvme` 0)."""
        return "nvme" in (self.optimizer, self.parameters)

    @property
    def world_size(self) -> int:
        """Training processes in all: one per GPU, or resources.cpuProcesses, on each node."""
        return self.nodes * max(1, self.processes_per_node)

    @property
    def label(self) -> str:
        """Short form for printer columns: 'Z3 opt:nvme par:cpu'."""
        return _label(self.zero_stage, self.optimizer, self.parameters)


    def summary(self, price_per_hour: float | None = None, **placement: object) -> PlanSummary:
        """This plan in brief, as every reader sees it. `placement`: the cluster's part
        (shape, node_names, gpu_product, rejected_shapes, attempt)."""
        return PlanSummary.model_validate({
            "label": self.label, "feasible": self.feasible, "node": self.node, "accelerator": self.accelerator,
            "model_name": self.model.name, "model_parameters": self.model.params, "node_count": self.nodes,
            "gpus_per_node": self.gpus_per_node, "processes_per_node": self.processes_per_node,
            "zero_stage": self.zero_stage, "optimizer": self.optimizer, "parameters": self.parameters,
            "activation_checkpointing": self.activation_checkpointing,
            "optimizer_cpu_resident_fraction": self.swap.cpu_resident_fraction,
            "nvme_bytes_per_step": self.step.nvme_bytes,
            "bytes": self.bytes.model_dump(exclude={"cpu_pageable"}),
            "capacity": self.capacity.model_dump(exclude={"cpu_pageable"}),
            "predicted_step_seconds": self.predicted_step_seconds,
            "predicted_total_seconds": self.predicted_total_seconds,
            "predicted_cost_usd": self.predicted_cost_usd, "price_per_hour_usd": price_per_hour,
            "tokens_per_step": self.tokens_per_step, "reasons": self.reasons,
            "rejected": [r.model_dump() for r in self.rejected],
            "shortfalls": [s.describe() for s in self.shortfalls], **placement,
        })


class PlanningError(ValueError):
    """No placement fits; `plan` holds the closest one and its shortfalls."""

    def __init__(self, plan: OffloadPlan):
        self.plan = plan
        shorts = "; ".join(s.describe() for s in plan.shortfalls) or "no placement is allowed"
        super().__init__(f"no placement fits on {plan.node}: closest is {plan.label}: {shorts}")


# --- Placement scoring ---------------------------------------------------------------

_PLACEMENTS: list[tuple[int, Tier, Tier]] = [
    (2, "gpu", "gpu"),
    (3, "gpu", "gpu"),
    (2, "cpu", "gpu"),
    (3, "cpu", "gpu"),
    (3, "cpu", "cpu"),
    (3, "nvme", "gpu"),
    (3, "nvme", "cpu"),
    (3, "cpu", "nvme"),
    (3, "nvme", "nvme"),
]


def _label(stage: int, optimizer: Tier, parameters: Tier) -> str:
    return f"Z{stage} opt:{optimizer} par:{parameters}"


def parse_label(label: str) -> tuple[int, str, str]:
    """(zero stage, optimizer tier, parameter tier) of a label `_label` wrote, as a checkpoint's
    manifest records it; ValueError for anything else."""
    match = re.fullmatch(r"Z(\d) opt:(\w+) par:(\w+)", label)
    if match is None:
        raise ValueError(f"not a plan label: {label!r}")
    return int(match[1]), match[2], match[3]


def _forced_stage(offload: Offload) -> int | None:
    zero = offload.deepspeed.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return int(stage) if isinstance(stage, int) else None


def _allowed(offload: Offload, stage: int, optimizer: Tier, parameters: Tier) -> str | None:
    """Why the user's offload settings exclude this placement, or None."""
    forced = _forced_stage(offload)
    if forced is not None and forced != stage:
        return f"offload.deepspeed sets zero_optimization.stage {forced}"
    if offload.overlap == "zenflow" and (stage, optimizer, parameters) != (2, "cpu", "gpu"):
        return "offload.overlap is zenflow (ZeRO-2, the optimizer in CPU RAM, the parameters on the accelerator)"
    if offload.gpu_resident_fraction is not None and not twin_flow_placement(stage, optimizer, parameters):
        return ("offload.gpuResidentFraction is set (Twin-Flow: ZeRO-3, the optimizer in CPU RAM, the parameters "
                "on the accelerator or in CPU RAM)")
    allowed = set(POLICY_TIERS[offload.policy]) - {"auto"}  # the spec's one table of what each policy allows
    if not {optimizer, parameters} <= allowed:
        where = ", ".join(t for t in ("gpu", "cpu", "nvme") if t in allowed)
        return f"offload.policy is {offload.policy} (state only in {where})"
    if offload.optimizer != "auto" and offload.optimizer != optimizer:
        return f"offload.optimizer is {offload.optimizer}"
    if offload.parameters != "auto" and offload.parameters != parameters:
        return f"offload.parameters is {offload.parameters}"
    return None


def _cpu_resident(offload: Offload) -> float | None:
    """The share of an NVMe optimizer kept in RAM: the job's; all on NVMe when the job put the
    optimizer there itself; else (None) what the RAM holds."""
    if offload.cpu_resident_fraction is not None:
        return offload.cpu_resident_fraction
    return 0.0 if offload.optimizer == "nvme" else None


def _zenflow(offload: Offload) -> dict[str, Any]:
    """PlacementInputs' ZenFlow fields: the interval of the CPU step and the share updated every step."""
    if offload.overlap != "zenflow":
        return {}
    settings = zenflow_settings(offload)
    return {"zenflow_interval": settings["update_interval"], "zenflow_topk": float(settings["topk_ratio"])}


def _sub_group_override(offload: Offload) -> int | None:
    zero = offload.deepspeed.get("zero_optimization")
    value = zero.get("sub_group_size") if isinstance(zero, dict) else None  # a misshapen one is refused later
    return int(value) if isinstance(value, int | float) and value >= 1 else None

def _evaluate(placement: PlacementInputs) -> OffloadPlan:
    """Size (`tier_sizing.size_placement`) and time one placement."""
    sized = size_placement(placement)
    sizing, tier_bytes, swap = sized.sizing, sized.bytes, sized.swap
    step = step_time(placement, sizing.checkpointing, swap)
    hw, training = placement.hw, placement.training
    total_seconds = step.total * training.max_steps
    price = placement.price_per_hour
    cost = None if price is None else round(total_seconds / 3600 * price * placement.nodes, 4)
    return OffloadPlan(
        feasible=not sized.shortfalls,
        node=hw.name,
        accelerator="cuda" if placement.on_gpu else "cpu",
        nodes=placement.nodes,
        gpus_per_node=placement.gpus_per_node,
        processes_per_node=placement.ranks_per_node,
        zero_stage=placement.stage,
        optimizer=placement.optimizer,
        parameters=placement.parameters,
        activation_checkpointing=sizing.checkpointing,
        bytes=tier_bytes,
        capacity=TierBytes(gpu=hw.gpu_memory_bytes if placement.on_gpu else 0, cpu=hw.usable_cpu_bytes,
                           nvme=hw.nvme_free_bytes),
        activation_bytes=sizing.activations,
        headroom=TierBytes(
            gpu=max(0, sizing.gpu_usable - tier_bytes.gpu) if placement.on_gpu else 0,
            cpu=max(0, sizing.cpu_usable - tier_bytes.cpu),
            nvme=max(0, hw.nvme_free_bytes - sized.nvme_need) if sizing.nvme else hw.nvme_free_bytes,
        ),
        swap=swap,
        aio=sized.aio,
        step=step,
        predicted_step_seconds=step.total,
        tokens_per_step=training.micro_batch_size * training.sequence_length * training.gradient_accumulation
        * placement.ranks,
        predicted_total_seconds=total_seconds,
        predicted_cost_usd=cost,
        shortfalls=sized.shortfalls,
        reasons=sizing.reasons,
        model=placement.shape,
    )


def _processes(hw: NodeHardware, gpus_per_node: int | None, cpu_processes: int) -> tuple[int, int]:
    """(GPUs per node, training processes per node): one per GPU, or the CPU processes."""
    gpus = hw.gpu_count if gpus_per_node is None else gpus_per_node
    if gpus > hw.gpu_count:
        raise ValueError(f"resources.gpusPerNode is {gpus} but {hw.name} has {hw.gpu_count} GPUs")
    return gpus, gpus if gpus else max(1, cpu_processes)


@dataclass(frozen=True)
class PlanInputs:
    """What the planner places, whoever asks (a job, `spillway plan`'s flags, the REST API): the
    model's shape and what the job says about training, offload, method and its processes. A
    job's are built by `of_spec`; the node's hardware is the planner's other input."""

    shape: ModelShape
    training: Training = field(default_factory=Training)
    offload: Offload = field(default_factory=Offload)
    method: Method | None = None
    dtype: DType = "bf16"
    gpus_per_node: int | None = None  # None: every GPU of the node
    nodes: int = 1
    price_per_hour: float | None = None  # of one node
    cpu_processes: int = 1  # processes per CPU node (no GPU)

    @classmethod
    def of_spec(cls, spec: FineTuneJobSpec, shape: ModelShape, *, gpus_per_node: int | None = None,
                price_per_hour: float | None = None, cpu_processes: int | None = None,
                method: Method | None = None) -> PlanInputs:
        """A job's: its training, offload, method (or `method`), dtype and nodes."""
        return cls(shape, spec.training, spec.offload, method or spec.method, spec.model.dtype, gpus_per_node,
                   spec.resources.nodes, price_per_hour,
                   spec.resources.cpu_processes if cpu_processes is None else cpu_processes)


def plan_tiers(
    shape: ModelShape,
    hw: NodeHardware,
    training: Training | None = None,
    offload: Offload | None = None,
    *,
    dtype: DType = "bf16",
    gpus_per_node: int | None = None,
    nodes: int = 1,
    price_per_hour: float | None = None,
    cpu_processes: int = 1,
    method: Method | None = None,
) -> OffloadPlan:
    """`plan_placement` with its inputs one by one (the planner's tests vary one at a time)."""
    return plan_placement(PlanInputs(shape, training or Training(), offload or Offload(), method, dtype,
                                     gpus_per_node, nodes, price_per_hour, cpu_processes), hw)


def plan_placement(inputs: PlanInputs, hw: NodeHardware) -> OffloadPlan:
    """Choose the fastest placement that fits and is allowed; explain the others.

    Returns an infeasible plan (feasible=False, shortfalls set) when nothing fits: the
    candidate with the smallest total shortfall, so the caller can say what is missing.
    """
    training, offload, dtype, nodes = inputs.training, inputs.offload, inputs.dtype, inputs.nodes
    price_per_hour = inputs.price_per_hour
    shape, lora_notes = _with_lora(inputs.shape, inputs.method)
    training, reference_forwards, objective_notes = _with_objective(training, inputs.method)
    # DPO with full fine-tuning: a frozen copy of the base is the reference
    reference_params = shape.params if reference_forwards and not (inputs.method and inputs.method.lora) else 0
    gpus, ranks_per_node = _processes(hw, inputs.gpus_per_node, inputs.cpu_processes)

    candidates: list[OffloadPlan] = []
    rejected: list[Rejection] = []
    placements: dict[str, PlacementInputs] = {}
    for stage, optimizer, parameters in _PLACEMENTS:
        label = _label(stage, optimizer, parameters)
        why = _allowed(offload, stage, optimizer, parameters)
        if why:
            rejected.append(Rejection(placement=label, why=f"excluded: {why}"))
            continue
        if "nvme" in (optimizer, parameters) and hw.nvme_free_bytes <= 0:
            rejected.append(Rejection(placement=label, why="node has no NVMe volume"))
            continue
        placements[label] = PlacementInputs(
            shape=shape, hw=hw, training=training, dtype=dtype, stage=stage, optimizer=optimizer,
            parameters=parameters, gpus_per_node=gpus, ranks_per_node=ranks_per_node, nodes=nodes,
            price_per_hour=price_per_hour, cpu_resident=_cpu_resident(offload),
            sub_group_size=_sub_group_override(offload), deepspeed=offload.deepspeed,
            reference_forwards=reference_forwards,
            reference_params=reference_params, gpu_resident=offload.gpu_resident_fraction or 0.0, **_zenflow(offload),
        )
        candidates.append(_evaluate(placements[label]))
    if not candidates:
        raise ValueError(
            "the offload settings exclude every placement on this node: "
            + "; ".join(f"{r.placement}: {r.why}" for r in rejected)
        )

    best = _best(candidates, rejected)
    best.reasons = [*_explain(best), *lora_notes, *objective_notes, *best.reasons]
    full = inputs.method is None or not inputs.method.lora
    if offload.gpu_resident_fraction is None and offload.overlap == "none" and full:
        best.reasons.extend(_gpu_share_hint(best, placements[best.label]))
    if best.feasible:
        best.reasons.extend(_amortizing_reasons(best, placements[best.label]))
    return best


def _amortizing_reasons(best: OffloadPlan, placement: PlacementInputs) -> list[str]:
    """Sets the plan's `amortizing_accumulation`, and says it as a reason, timed with the tiers
    of `_accumulating`; none where the optimizer's NVMe I/O adds at most NVME_OVERHEAD_SHARE."""
    if not (best.optimizer == "nvme" and over_in_ram(best.step) > 1 + NVME_OVERHEAD_SHARE):
        return []
    timing = _accumulating(best, placement)
    now = placement.training.gradient_accumulation
    if timing is None:
        return [_accumulation_hint(best, now, None, False) + _gradient_partition_note(placement, None)]
    found = amortizing_accumulation(best, placement, timing)
    if found is None:
        return []
    micro_batches, step = found
    enough = over_in_ram(step) <= 1 + NVME_OVERHEAD_SHARE
    best.amortizing_accumulation = micro_batches if enough else None
    note = _gradient_partition_note(placement, timing) if timing is not best else ""
    return [_accumulation_hint(best, now, (micro_batches, step), enough) + note]


def _accumulating(plan: OffloadPlan, placement: PlacementInputs) -> OffloadPlan | None:
    """The plan whose tiers time the steps at more micro-batches: this one, or where it has one
    micro-batch a step and more make DeepSpeed hold a 16-bit gradient partition of the whole model
    in RAM (`holds_gradient_partition`), the same placement planned at two, its RAM shares sized
    beside that partition; None where the node does not hold it."""
    if plan.optimizer != "nvme" or holds_gradient_partition(placement):
        return plan
    two = _evaluate(_with_accumulation(placement, 2))
    return two if two.feasible else None


def _with_accumulation(placement: PlacementInputs, micro_batches: int) -> PlacementInputs:
    return replace(placement, training=placement.training.model_copy(update={"gradient_accumulation": micro_batches}))


def _gradient_partition_note(placement: PlacementInputs, timing: OffloadPlan | None) -> str:
    """What more micro-batches than one cost in RAM: the 16-bit gradient partition's bytes, and
    the RAM share kept beside it, or that the node does not hold it (`timing` None)."""
    partition = gradient_partition_bytes(_with_accumulation(placement, 2))
    held = f"{format_bytes(partition * placement.shape.trainable // placement.nodes)} per node"
    said = (" (more than one micro-batch a step: DeepSpeed holds a gradient partition of the whole model in RAM, "
            f"{held}")
    if timing is None:
        return f"{said}, which this node does not hold beside the rest in this placement)"
    kept = timing.swap.cpu_resident_fraction
    return f"{said}; in this placement {kept:.0%} of the optimizer's sub-groups stay in RAM beside it)"


# What the optimizer's NVMe I/O may add to a step before the plan says how to amortize it.
NVME_OVERHEAD_SHARE = 0.3


def over_in_ram(step: StepTime) -> float:
    """A step over the same step without the optimizer's NVMe I/O (what the pipelined Adam step
    does not hide, and the gradients' writes where they outlast the backward): 1 unless the
    optimizer is on NVMe. Positive: the Adam step takes time."""
    return step.total / (step.forward_backward(gradient_writes=False) + step.cpu_optimizer)


def amortizing_accumulation(plan: OffloadPlan, placement: PlacementInputs,
                             timing: OffloadPlan | None = None) -> tuple[int, StepTime] | None:
    """With the optimizer on NVMe its reads and writes cost the same every optimizer step however
    many micro-batches the step holds, while the forward and backward passes grow with them: the
    smallest training.gradientAccumulation (at most GRADIENT_ACCUMULATION_MAX) at which they add
    at most NVME_OVERHEAD_SHARE to the step, and that step; None when the plan's already add no
    more. Only the step time is recomputed, with the tiers of `timing` (`_accumulating`; the
    plan's own by default: the bytes do not depend on the accumulation but for the 16-bit
    gradient partition more than one micro-batch holds), and `over_in_ram` falls as the
    accumulation grows: searched by halving."""
    limit = 1 + NVME_OVERHEAD_SHARE
    if not (plan.optimizer == "nvme" and over_in_ram(plan.step) > limit):
        return None

    tiers = timing or plan

    def at(micro_batches: int) -> StepTime:
        return step_time(_with_accumulation(placement, micro_batches), tiers.activation_checkpointing, tiers.swap)

    low, high = placement.training.gradient_accumulation, GRADIENT_ACCUMULATION_MAX
    steps = {high: at(high)}  # over the limit at low; within it at high, if anywhere
    while high - low > 1 and over_in_ram(steps[high]) <= limit:
        middle = (low + high) // 2
        steps[middle] = at(middle)
        low, high = (low, middle) if over_in_ram(steps[middle]) <= limit else (middle, high)
    return high, steps[high]


def _accumulation_hint(best: OffloadPlan, now: int, found: tuple[int, StepTime] | None, enough: bool) -> str:
    """`amortizing_accumulation` as a reason: what the I/O adds now, and the step and tokens per
    second at that accumulation (or that none is enough; `found` None: none was searched).
    benchmarks/bench_nvme_step.py measures the ratio beside this prediction."""
    overhead = best.step.optimizer_phase - best.step.cpu_optimizer
    said = (f"the optimizer's NVMe I/O adds {overhead:.3g} s to every step however many micro-batches it holds "
            f"({over_in_ram(best.step):.2f}x the step without it; now {_rate(best.tokens_per_step / best.step.total)} "
            "tokens/s)")
    if found is None:
        return said
    micro_batches, step = found
    if not enough:
        return f"{said}; even at training.gradientAccumulation {micro_batches} it would be {over_in_ram(step):.2f}x"
    tokens = best.tokens_per_step // now * micro_batches
    return (f"{said}; at training.gradientAccumulation {micro_batches} (now {now}) it would be "
            f"{over_in_ram(step):.2f}x: {step.total:.3g} s a step of {tokens:,} tokens, {_rate(tokens / step.total)} tokens/s")


def _rate(per_second: float) -> str:
    return f"{per_second:,.0f}" if per_second >= 100 else f"{per_second:.3g}"


# The shares of a CPU-RAM optimizer `_gpu_share_hint` tries on the GPU, the largest first.
GPU_SHARES = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)


def _gpu_share_hint(best: OffloadPlan, placement: PlacementInputs) -> list[str]:
    """For a ZeRO-3 plan with the optimizer in CPU RAM on GPUs with memory to spare: the largest
    offload.gpuResidentFraction (of GPU_SHARES) that fits and the step it is predicted to save,
    as a reason. Only said, not chosen: Twin-Flow's speed on a GPU is not measured yet (the GPU
    kit's stage e measures it)."""
    if not (best.feasible and placement.on_gpu and twin_flow_placement(best.zero_stage, best.optimizer,
                                                                          best.parameters)):
        return []
    for share in GPU_SHARES:
        plan = _evaluate(replace(placement, gpu_resident=share))
        if plan.feasible and plan.step.gpu_share and plan.predicted_step_seconds < best.predicted_step_seconds * 0.99:
            return [f"offload.gpuResidentFraction: {share:g} would keep {plan.step.gpu_share:.0%} of the optimizer "
                    f"on the GPU and update it there (Twin-Flow, {format_bytes(plan.bytes.gpu - best.bytes.gpu)} more "
                    f"per GPU): {plan.predicted_step_seconds:.3g} s/step predicted instead of "
                    f"{best.predicted_step_seconds:.3g}; not chosen unasked, its GPU speed is not measured yet"]
    return []


def _with_lora(shape: ModelShape, method: Method | None) -> tuple[ModelShape, list[str]]:
    """With LoRA, the shape whose trainable parameters are the adapters', and what the plan
    says of them; otherwise the shape as it is."""
    if method is None or not method.lora:
        return shape, []
    trainable, missing = lora_parameters(shape, method.rank, method.peft_targets)
    notes = [f"LoRA rank {method.rank}: {format_count(trainable)} trainable parameters of "
             f"{format_count(shape.params)}; the frozen base takes 2 B/param in the parameters' tier, "
             "gradients and optimizer state count the adapters only"]
    if missing:
        notes.append(f"LoRA: the model has no linear layers named {', '.join(missing)} (not counted)")
    adapters = lora_tensors(shape, method.rank, method.peft_targets)
    return shape.model_copy(update={"trainable_params": max(1, trainable), "adapter_tensors": adapters or None}), notes


def _with_objective(training: Training, method: Method | None) -> tuple[Training, int, list[str]]:
    """DPO (method.objective): a micro-batch of microBatchSize pairs puts twice as many
    sequences through the policy (each pair's chosen and rejected answers), and once more
    through the reference without gradients (the base with the adapters off: no second copy of
    the weights). Sized and timed as a micro-batch twice the size plus one forward pass; the
    reference's activations are freed layer by layer (no gradient), below the policy's."""
    if method is None or method.objective != "dpo":
        return training, 0, []
    pairs = training.micro_batch_size
    notes = [f"DPO: {pairs} pair(s) per micro-batch are {2 * pairs} sequences through the policy (chosen and "
             "rejected), sized as such, and one more forward pass each through the reference"]
    if not method.lora:
        notes.append("DPO with full fine-tuning: the reference is a frozen copy of the base, 2 B/param beside the "
                     "16-bit parameters and placed as they are; no gradient or optimizer state, and not "
                     "checkpointed (it is the base)")
    return training.model_copy(update={"micro_batch_size": 2 * pairs}), 1, notes


# How much faster a placement that offloads more must be predicted to be chosen over one
# that offloads less (earlier in _PLACEMENTS): the step model is off by more than this (its
# held-out tier check reads 0.71-0.88), and a deeper tier costs swap files, locked buffers
# and disk writes that a prediction 1% faster does not pay for. A node's memlock fit once
# turned 0.283 against 0.281 s/step into the parameters moving to NVMe.
NEAR_TIE = 0.05


def _best(candidates: list[OffloadPlan], rejected: list[Rejection]) -> OffloadPlan:
    """The feasible candidate that offloads least (the order of _PLACEMENTS) among those
    within NEAR_TIE of the fastest, else the one short by the fewest bytes; each other one
    joins `rejected` with why, and the best carries them."""
    feasible = [c for c in candidates if c.feasible]
    if feasible:
        fastest = min(round(c.predicted_step_seconds, 6) for c in feasible)
        best = next(c for c in feasible if round(c.predicted_step_seconds, 6) <= fastest * (1 + NEAR_TIE))
    else:
        best = min(candidates, key=lambda c: sum(s.short_bytes for s in c.shortfalls))
    for c in candidates:
        if c is best:
            continue
        if not c.feasible:
            why = "; ".join(s.describe() for s in c.shortfalls)
        elif round(c.predicted_step_seconds, 6) < round(best.predicted_step_seconds, 6):
            why = (f"under {NEAR_TIE:.0%} faster ({c.predicted_step_seconds:.3g} s/step vs "
                   f"{best.predicted_step_seconds:.3g}) and offloads more")
        elif round(c.predicted_step_seconds, 6) == round(best.predicted_step_seconds, 6):
            why = f"no faster ({c.predicted_step_seconds:.3g} s/step) and offloads more"
        else:
            why = f"slower: {c.predicted_step_seconds:.3g} s/step vs {best.predicted_step_seconds:.3g} s/step"
        rejected.append(Rejection(placement=c.label, why=why))
    best.rejected = rejected
    return best


def _explain(plan: OffloadPlan) -> Iterable[str]:
    p = plan.model.params
    yield (
        f"{format_count(p)} parameters; {plan.label} on {plan.node} "
        f"({plan.gpus_per_node} GPU x {plan.nodes} node, accelerator {plan.accelerator})"
    )
    if plan.optimizer != "gpu":
        where = "CPU RAM" if plan.optimizer == "cpu" else "NVMe swap files"
        yield f"Adam moments and fp32 master weights in {where}; the optimizer step runs on the CPU"
    if plan.parameters != "gpu":
        yield f"16-bit parameters partitioned to {plan.parameters.upper()} and prefetched layer by layer"
    if plan.bytes.nvme:
        yield (
            f"NVMe: {format_bytes(plan.bytes.nvme)} of swap files, sub-group "
            f"{plan.swap.sub_group_size:,} elements, pipelined I/O {'on' if plan.swap.pipeline else 'off'}; "
            f"{format_bytes(plan.step.nvme_bytes)} read and written per step"
        )
    yield plan.step.formula()
    yield plan.step.compute_rate()


def minimum_cpu_for(plan: OffloadPlan) -> int:
    """RAM a node needs for this placement (model state + overhead + reserve)."""
    need = plan.bytes.cpu
    return int(max(need + CPU_RESERVED_MIN, need / (1 - CPU_RESERVED_FRACTION)))


__all__ = [
    "MIN_AIO_BYTES",
    "OPTIMIZER_SWAP_BUFFERS",
    "ModelShape",
    "OffloadPlan",
    "PlacementInputs",
    "PlanningError",
    "Shortfall",
    "SwapSettings",
    "TierBytes",
    "activation_bytes",
    "minimum_cpu_for",
    "model_state_bytes",
    "parse_label",
    "plan_tiers",
]


def plan_summary(raw: object) -> PlanSummary | None:
    """A stored plan read back as the one summary. A full `OffloadPlan` (what local jobs
    recorded before there was one summary) is summarised; anything else (nothing planned
    yet, another version's shape) is None: the next plan replaces it."""
    if not isinstance(raw, dict) or not raw:
        return None
    try:
        return PlanSummary.model_validate(raw)
    except ValidationError:
        pass
    try:
        return OffloadPlan.model_validate(raw).summary()
    except ValidationError:
        return None
