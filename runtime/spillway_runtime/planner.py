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
a named term. The formulas for bytes and step time are in `estimates`; this module
chooses between placements with them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from spillway_runtime.estimates import (
    OPTIMIZER_SWAP_BYTES_PER_PARAM,
    OPTIMIZER_SWAP_BYTES_PER_PARAM_NO_GRADS,
    StepTime,
    activation_bytes,
    lora_parameters,
    model_state_bytes,
    nvme_state_bytes,
    step_time,
)
from spillway_runtime.hardware import AioSettings, NodeHardware
from spillway_runtime.hf_shape import count_decoder
from spillway_runtime.plan_summary import PlanSummary
from spillway_runtime.spec import POLICY_TIERS, DType, Method, Offload, Tier, Training
from spillway_runtime.units import GiB, format_bytes, format_count

# --- Constants, each with its reason -------------------------------------------------

# CUDA context, cuBLAS workspaces and allocator fragmentation on each GPU.
GPU_RESERVED_BYTES = 1 * GiB
GPU_RESERVED_FRACTION = 0.05
# Host memory of one training process before any model state: Python, torch, DeepSpeed,
# transformers' tokenizer machinery, CUDA host allocations. Measured with the runtime's
# `memory` events (torch 2.15, DeepSpeed 0.19.8, transformers 5.23, CPU-only): 602 MiB
# after torch + DeepSpeed + gloo, 787 MiB once AutoTokenizer.from_pretrained has imported
# its ~1000 modules, ~90 MiB more for DeepSpeed's CPU Adam / aio ops at engine set-up.
# CUDA's context and host allocations add ~1 GiB (not measured here: no GPU).
CPU_PROCESS_OVERHEAD_CPU = int(0.8 * GiB)
CPU_PROCESS_OVERHEAD_GPU = CPU_PROCESS_OVERHEAD_CPU + 1 * GiB
# On a CPU accelerator the process's resident high-water mark carries ~12 B/param more than
# the model-state formulas: the safetensors file pages mapped while loading (fp32 on disk)
# and the cast copy, and "device" gradient buffers that live in host RAM. Fitted on the
# engine-stage growth of 0.75M-21M parameter runs (benchmarks/bench_planner_fidelity.py).
CPU_ACCELERATOR_EXTRA_BYTES_PER_PARAM = 12
# Kept free for the OS, page cache and the kubelet.
CPU_RESERVED_FRACTION = 0.08
CPU_RESERVED_MIN = 1 * GiB
# Swap files are block-aligned and written per sub-group; leave slack on the volume.
NVME_SLACK_FRACTION = 0.10
# DeepSpeed swaps a sub-group only when it holds at least max(1 MiB, aio block) bytes of fp32
# (OptimizerSwapper.swappable_tensor); smaller sub-groups stay in CPU RAM.
MIN_AIO_BYTES = 1 << 20
# DeepSpeed's default tile of the CPU optimizer step, in elements.
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
MIN_SUB_GROUP_SIZE = 10_000_000
# The optimizer swapper needs one pinned buffer per swapped tensor (param, 2 moments, grad);
# the pipelined swapper overlaps reads and writes and needs twice that.
OPTIMIZER_SWAP_BUFFERS = 4
OPTIMIZER_SWAP_BUFFERS_PIPELINED = 8
# Parameter swapper: buffers of 1e8 elements (DeepSpeed's default size), but 16 of them, not
# DeepSpeed's 5: a Llama layer gathers 7 swappable matrices at once and prefetches the next
# layer's, and with 5 the swapper fails ("Not enough buffers 0 for swapping 1").
PARAM_SWAP_BUFFER_COUNT = 16
PARAM_SWAP_BUFFER_SIZE = 100_000_000
# Pinning more than this share of RAM risks memlock limits and starves the page cache.
MAX_PINNED_FRACTION = 0.5

OffloadTier = Literal["gpu", "cpu", "nvme"]



class ModelShape(BaseModel):
    """What the planner needs to know about a model; from config.json or a parameter count."""

    name: str = "model"
    params: int = Field(gt=0)
    largest_layer_params: int = Field(gt=0, description="Parameters of the largest module (DeepSpeed's L)")
    largest_param_numel: int = Field(gt=0, description="Elements of the largest single tensor")
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    linear_in_out: dict[str, int] = Field(
        default_factory=dict,
        description="Per linear-layer name (q_proj, down_proj, ...; not the output head): in+out features summed "
        "over the model's layers of that name. A LoRA adapter of rank r on them has r times that many parameters",
    )
    trainable_params: int | None = Field(None, description="Parameters that train (LoRA's adapters); none: all")

    @property
    def trainable(self) -> int:
        return self.params if self.trainable_params is None else self.trainable_params

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None) -> ModelShape:
        """The shape of a decoder from its Hugging Face config.json, by arithmetic (no torch):
        large vocabularies, GQA, tied embeddings and every MoE expert counted as transformers
        builds them. Raises `hf_shape.HFConfigError` naming the key it cannot use."""
        counts = count_decoder(config)
        return cls(
            name=name or str(config.get("_name_or_path") or counts.model_type),
            params=counts.params,
            largest_layer_params=counts.largest_layer_params,
            largest_param_numel=counts.largest_param_numel,
            hidden_size=counts.hidden_size,
            num_layers=counts.num_layers,
            vocab_size=counts.vocab_size,
            num_attention_heads=counts.num_attention_heads,
            linear_in_out=counts.linear_in_out,
        )

    @classmethod
    def from_param_count(cls, params: int, vocab_size: int = 32000) -> ModelShape:
        """A Llama-shaped decoder of about `params` parameters (num_layers = hidden/128).

        Used when only a count is known (`--params 13B`): P = 12 L h^2 + 2 V h.
        """
        hidden = 128
        for h in range(128, 65536 + 1, 128):
            if 12 * (h // 128) * h * h + 2 * vocab_size * h > params:
                break
            hidden = h
        layers = max(1, hidden // 128)
        embed = vocab_size * hidden
        inner = int(hidden * 8 / 3)
        mlp = 3 * hidden * inner
        return cls(
            name=format_count(params),
            params=params,
            largest_layer_params=max(embed, mlp + 4 * hidden * hidden),
            largest_param_numel=max(embed, hidden * int(hidden * 8 / 3)),
            hidden_size=hidden,
            num_layers=layers,
            vocab_size=vocab_size,
            num_attention_heads=max(1, hidden // 128),
            linear_in_out={**{name: layers * 2 * hidden for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
                           **{name: layers * (hidden + inner) for name in ("gate_proj", "up_proj", "down_proj")}},
        )


class TierBytes(BaseModel):
    gpu: int = Field(0, description="Per GPU")
    cpu: int = Field(0, description="Per node, pinned + pageable")
    cpu_pinned: int = 0
    cpu_pageable: int = 0
    nvme: int = Field(0, description="Per node")


class Shortfall(BaseModel):
    tier: OffloadTier
    need_bytes: int
    have_bytes: int

    @property
    def short_bytes(self) -> int:
        return max(0, self.need_bytes - self.have_bytes)

    def describe(self) -> str:
        label = {"gpu": "GPU memory per GPU", "cpu": "CPU RAM", "nvme": "NVMe space"}[self.tier]
        return (
            f"{label} is short by {self.short_bytes / GiB:.1f} GiB "
            f"(needs {format_bytes(self.need_bytes)}, has {format_bytes(self.have_bytes)})"
        )


class Rejection(BaseModel):
    placement: str
    why: str


class SwapSettings(BaseModel):
    sub_group_size: int
    optimizer_buffer_count: int = OPTIMIZER_SWAP_BUFFERS
    pipeline: bool = False
    param_buffer_count: int = PARAM_SWAP_BUFFER_COUNT
    param_buffer_size: int = PARAM_SWAP_BUFFER_SIZE
    pin_memory: bool = True
    cpu_resident_fraction: float = Field(
        0.0, description="With the optimizer on NVMe: the share of each rank's optimizer sub-groups kept in CPU "
        "RAM and never swapped (the first ones); the runtime keeps floor(share x sub-groups)")


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


def _sub_group_override(offload: Offload) -> int | None:
    zero = offload.deepspeed.get("zero_optimization")
    value = zero.get("sub_group_size") if isinstance(zero, dict) else None  # a misshapen one is refused later
    return int(value) if isinstance(value, int | float) and value >= 1 else None


def _choose_swap(shape: ModelShape, optimizer: Tier, parameters: Tier, ranks: int, cpu_spare: int,
                 sub_group_size: int | None = None) -> SwapSettings:
    """Size sub-groups and swap buffers to the RAM that is left.

    The optimizer swapper pins buffer_count x sub_group x 4 B per rank; DeepSpeed's default
    sub-group of 1e9 elements pins 16 GB per rank and exhausts host RAM (#3000), so the
    sub-group is lowered until the buffers take at most half of the spare RAM, and the
    read/write pipeline is switched on only when its double buffers also fit. A job's own
    `sub_group_size` (offload.deepspeed) is what DeepSpeed will use: it is taken as it is.
    """
    partition = max(1, shape.params // ranks)
    sub_group = min(DEFAULT_SUB_GROUP_SIZE, max(MIN_SUB_GROUP_SIZE, partition))
    if sub_group_size is not None:
        sub_group = sub_group_size
    param_size = max(PARAM_SWAP_BUFFER_SIZE, shape.largest_param_numel)
    if optimizer != "nvme":
        return SwapSettings(sub_group_size=sub_group, param_buffer_size=param_size)
    budget = max(0, cpu_spare) // 2 // ranks
    pipeline = False
    for buffers in (OPTIMIZER_SWAP_BUFFERS_PIPELINED, OPTIMIZER_SWAP_BUFFERS):
        # +1 for the fp32 gradient staging buffer of the largest sub-group.
        fits = budget // ((buffers + 1) * 4)
        if fits >= min(sub_group, 100_000_000) or buffers == OPTIMIZER_SWAP_BUFFERS:
            pipeline = buffers == OPTIMIZER_SWAP_BUFFERS_PIPELINED
            if sub_group_size is None:
                sub_group = max(MIN_SUB_GROUP_SIZE, min(sub_group, fits))
            break
    return SwapSettings(
        sub_group_size=int(sub_group),
        optimizer_buffer_count=OPTIMIZER_SWAP_BUFFERS_PIPELINED if pipeline else OPTIMIZER_SWAP_BUFFERS,
        pipeline=pipeline,
        param_buffer_size=param_size,
    )


def _pinned_bytes(swap: SwapSettings, optimizer: Tier, parameters: Tier, ranks_per_node: int, partition: int) -> int:
    """Swap buffers per node. DeepSpeed sizes the optimizer's by the largest sub-group it
    actually formed, which is never more than the rank's partition of the parameters; the
    parameter swapper's are allocated at their configured size whatever the model."""
    per_rank = 0
    if optimizer == "nvme":
        per_rank += (swap.optimizer_buffer_count + 1) * min(swap.sub_group_size, partition) * 4
    if parameters == "nvme":
        per_rank += swap.param_buffer_count * swap.param_buffer_size * 2
    return per_rank * ranks_per_node


@dataclass(frozen=True)
class PlacementInputs:
    """One placement on one node with everything that sizes it: what `_evaluate` scores and
    `estimates.step_time` times."""

    shape: ModelShape
    hw: NodeHardware
    training: Training
    dtype: DType
    stage: int
    optimizer: Tier
    parameters: Tier
    gpus_per_node: int  # 0: the CPU accelerator
    ranks_per_node: int  # training processes: one per GPU, or the CPU processes
    nodes: int = 1
    price_per_hour: float | None = None
    # With the optimizer on NVMe, the share of its sub-groups kept in RAM: a number (the job's,
    # or 0 when the job asked for NVMe), or None: the largest share the RAM holds.
    cpu_resident: float | None = 0.0
    sub_group_size: int | None = None  # the job's own (offload.deepspeed), which DeepSpeed uses

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def ranks(self) -> int:
        return self.ranks_per_node * self.nodes


@dataclass
class _Sizing:
    """The bytes of one placement as `_evaluate` works them out, step by step."""

    gpu_state: int  # model states per GPU (per process on a CPU accelerator)
    cpu_state: int  # model states in CPU RAM per node
    nvme: int  # swap files per node
    overhead: int  # the training processes themselves
    gpu_usable: int
    cpu_usable: int
    checkpointing: bool
    activations: int
    reasons: list[str]
    resident: int = 0  # optimizer state per node kept in RAM where the placement swaps the rest

    def cpu_spare(self, placement: PlacementInputs) -> int:
        """CPU RAM left for the swap buffers (on a CPU accelerator the "device" is RAM too)."""
        device = 0 if placement.on_gpu else (self.gpu_state + self.activations) * placement.ranks_per_node
        return self.cpu_usable - self.cpu_state - self.overhead - device


def _evaluate(placement: PlacementInputs) -> OffloadPlan:
    """Size and time one placement: memory -> swap minimum -> pinning -> shortfall."""
    sizing = _size_memory(placement)
    swap = _choose_swap(placement.shape, placement.optimizer, placement.parameters, placement.ranks,
                        sizing.cpu_spare(placement), placement.sub_group_size)
    aio = placement.hw.aio or AioSettings()
    swapped_per_param = _keep_unswappable_in_ram(placement, sizing, swap, aio)
    if swapped_per_param:
        _keep_share_in_ram(placement, sizing, swap, swapped_per_param)
    pinned = _pin(placement, sizing, swap)
    tier_bytes = _tier_bytes(placement, sizing, pinned)
    shortfalls, nvme_need = _shortfalls(placement, sizing, tier_bytes)

    step = step_time(placement, sizing.checkpointing, swap)
    hw, training = placement.hw, placement.training
    total_seconds = step.total * training.max_steps
    price = placement.price_per_hour
    cost = None if price is None else round(total_seconds / 3600 * price * placement.nodes, 4)
    return OffloadPlan(
        feasible=not shortfalls,
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
            nvme=max(0, hw.nvme_free_bytes - nvme_need) if sizing.nvme else hw.nvme_free_bytes,
        ),
        swap=swap,
        aio=aio,
        step=step,
        predicted_step_seconds=step.total,
        tokens_per_step=training.micro_batch_size * training.sequence_length * training.gradient_accumulation
        * placement.ranks,
        predicted_total_seconds=total_seconds,
        predicted_cost_usd=cost,
        shortfalls=shortfalls,
        reasons=sizing.reasons,
        model=placement.shape,
    )


def _size_memory(placement: PlacementInputs) -> _Sizing:
    """Model states (DeepSpeed's estimators), swap files, process overhead and the usable share
    of each tier; activation checkpointing on when `auto` and the activations would not fit."""
    p, shape, hw = placement, placement.shape, placement.hw
    gpu_state, cpu_state = model_state_bytes(
        p.stage, p.optimizer, p.parameters, shape.params, shape.largest_layer_params, p.ranks_per_node, p.nodes,
        shape.trainable_params,
    )
    if p.dtype == "fp32":
        # fp32 training keeps 4-byte weights and grads where the estimators assume 2.
        gpu_state += gpu_state // 2 if p.optimizer == "gpu" else 0
    overhead = p.ranks_per_node * (CPU_PROCESS_OVERHEAD_GPU if p.on_gpu else CPU_PROCESS_OVERHEAD_CPU)
    gpu_capacity = hw.gpu_memory_bytes if p.on_gpu else 0
    gpu_usable = max(0, int(gpu_capacity * (1 - GPU_RESERVED_FRACTION)) - GPU_RESERVED_BYTES)
    cpu_capacity = hw.usable_cpu_bytes
    cpu_usable = max(0, cpu_capacity - max(CPU_RESERVED_MIN, int(cpu_capacity * CPU_RESERVED_FRACTION)))

    reasons: list[str] = []
    choice = p.training.activation_checkpointing
    if choice == "auto":
        act_off = activation_bytes(shape, p.training, p.dtype, checkpointing=False)
        device_room = gpu_usable - gpu_state if p.on_gpu else cpu_usable - cpu_state - overhead - gpu_state
        checkpointing = act_off > device_room
        if checkpointing:
            reasons.append(
                f"activation checkpointing on: activations without it need {format_bytes(act_off)}, "
                f"{format_bytes(max(0, device_room))} is free beside the model state"
            )
    else:
        checkpointing = choice == "on"
    return _Sizing(
        gpu_state=gpu_state, cpu_state=cpu_state,
        nvme=nvme_state_bytes(p.optimizer, p.parameters, shape.params, p.nodes, shape.trainable_params),
        overhead=overhead, gpu_usable=gpu_usable, cpu_usable=cpu_usable, checkpointing=checkpointing,
        activations=activation_bytes(shape, p.training, p.dtype, checkpointing), reasons=reasons,
    )


def _keep_unswappable_in_ram(placement: PlacementInputs, sizing: _Sizing, swap: SwapSettings,
                             aio: AioSettings) -> int:
    """DeepSpeed swaps a tensor only when it holds at least max(1 MiB, aio block) bytes: what is
    smaller stays in CPU RAM, so its bytes move from the NVMe figure back to the CPU one.
    Returns the optimizer's bytes per trainable parameter on NVMe (0: nothing of it swapped)."""
    shape, ranks, nodes = placement.shape, placement.ranks, placement.nodes
    swapped = OPTIMIZER_SWAP_BYTES_PER_PARAM if placement.optimizer == "nvme" else 0
    min_swap = max(MIN_AIO_BYTES, aio.block_size)
    per_node_params = shape.params // nodes
    per_node_trainable = shape.trainable // nodes
    if placement.optimizer == "nvme":
        swap_unit = min(shape.trainable // ranks, swap.sub_group_size) * 4
        if swap_unit < min_swap:
            sizing.nvme -= OPTIMIZER_SWAP_BYTES_PER_PARAM * per_node_trainable
            sizing.cpu_state += (OPTIMIZER_SWAP_BYTES_PER_PARAM - 2) * per_node_trainable
            sizing.reasons.append(
                f"optimizer sub-groups of {format_bytes(swap_unit)} are below DeepSpeed's minimum swap size "
                f"({format_bytes(min_swap)}): the state stays in CPU RAM"
            )
            swapped = 0
        elif shape.largest_param_numel // ranks * 4 < min_swap:
            # every gradient fragment is too small to swap: fp32 grads stay in RAM
            moved = (OPTIMIZER_SWAP_BYTES_PER_PARAM - OPTIMIZER_SWAP_BYTES_PER_PARAM_NO_GRADS) * per_node_trainable
            sizing.nvme -= moved
            sizing.cpu_state += moved
            swapped = OPTIMIZER_SWAP_BYTES_PER_PARAM_NO_GRADS
        _, groups, remainder = _sub_groups(placement, swap)
        if swapped and groups > 1 and remainder * 4 < min_swap:
            # the last sub-group, what is left of the partition, is too small to swap
            sizing.nvme -= swapped * remainder * placement.ranks_per_node
            sizing.cpu_state += (swapped - 2) * remainder * placement.ranks_per_node
    if placement.parameters == "nvme" and shape.largest_param_numel // ranks * 2 < min_swap:
        sizing.nvme -= 2 * per_node_params
        sizing.cpu_state += 2 * per_node_params
        sizing.reasons.append("parameter partitions are below DeepSpeed's minimum swap size: they stay in CPU RAM")
    return swapped


def _keep_share_in_ram(placement: PlacementInputs, sizing: _Sizing, swap: SwapSettings, per_param: int) -> None:
    """Tiered optimizer state: the first K of each rank's n sub-groups stay in CPU RAM and never
    touch the disk, the rest swap as before. K is the job's share of n, or (share not given)
    the most sub-groups that the RAM left beside everything else holds. Their state moves from
    the NVMe figure to the CPU one, as for a sub-group too small to swap (DeepSpeed 0.19.8
    keeps such sub-groups in pageable memory: nothing more is pinned)."""
    group, groups, remainder = _sub_groups(placement, swap)
    # the sub-groups that swap at all: a last one too small to swap is in RAM already
    swappable = groups - 1 if groups > 1 and remainder * 4 < max(MIN_AIO_BYTES, (placement.hw.aio or AioSettings())
                                                                   .block_size) else groups
    ram_per_group = (per_param - 2) * group * placement.ranks_per_node
    share = placement.cpu_resident
    if share is not None:
        keep = int(share * groups + 1e-9)
    else:
        pinned = _pin(placement, dataclasses.replace(sizing, reasons=[]), swap.model_copy())
        room = sizing.cpu_usable - _tier_bytes(placement, sizing, pinned).cpu
        keep = max(0, min(swappable, room // max(1, ram_per_group)))
    if keep == 0:
        swap.cpu_resident_fraction = share or 0.0
        return
    resident_params = min(keep, swappable) * group * placement.ranks_per_node
    sizing.nvme -= per_param * resident_params
    sizing.cpu_state += (per_param - 2) * resident_params
    sizing.resident = (per_param - 2) * resident_params
    # the job's share as it is (the runtime keeps floor(share x its sub-groups), which a pod's
    # memlock-fitted sub-groups can make more than planned here); the planner's as a fraction
    swap.cpu_resident_fraction = share if share is not None else keep / groups
    on_nvme = max(0, swappable - keep)
    sizing.reasons.append(
        f"optimizer: {keep} of {groups} sub-groups per process kept in CPU RAM "
        f"({format_bytes(sizing.resident)} per node), {on_nvme} on NVMe"
        + ("" if on_nvme else ": nothing of it is swapped")
    )


def _sub_groups(placement: PlacementInputs, swap: SwapSettings) -> tuple[int, int, int]:
    """(elements per sub-group, sub-groups, elements in the last) of one rank's optimizer
    partition, as DeepSpeed cuts it (to whole parameters; here to elements)."""
    partition = max(1, -(-placement.shape.trainable // placement.ranks))
    group = min(swap.sub_group_size, partition)
    groups = -(-partition // group)
    return group, groups, partition - (groups - 1) * group


def _pin(placement: PlacementInputs, sizing: _Sizing, swap: SwapSettings) -> tuple[int, int]:
    """(swap buffers, pinned total) per node. With pin_memory DeepSpeed pins the CPU optimizer
    partitions too; past MAX_PINNED_FRACTION of RAM pinning is switched off (`swap.pin_memory`)."""
    pinned = _pinned_bytes(swap, placement.optimizer, placement.parameters, placement.ranks_per_node,
                           -(-placement.shape.params // placement.ranks))
    pinned_state = sizing.cpu_state if placement.optimizer == "cpu" and placement.on_gpu else 0
    capacity = placement.hw.usable_cpu_bytes
    if pinned + pinned_state > MAX_PINNED_FRACTION * capacity:
        swap.pin_memory = False
        sizing.reasons.append(
            f"pin_memory off: pinning {format_bytes(pinned + pinned_state)} would exceed "
            f"{int(MAX_PINNED_FRACTION * 100)}% of RAM"
        )
        pinned_state = 0
    return pinned, pinned + (pinned_state if swap.pin_memory else 0)


def _tier_bytes(placement: PlacementInputs, sizing: _Sizing, pinned: tuple[int, int]) -> TierBytes:
    buffers, pinned_total = pinned
    if placement.on_gpu:
        gpu_total = sizing.gpu_state + sizing.activations
        cpu_total = sizing.cpu_state + sizing.overhead + buffers
    else:
        # CPU accelerator: "device" memory is host memory; report it all under cpu.
        gpu_total = 0
        extra = CPU_ACCELERATOR_EXTRA_BYTES_PER_PARAM * placement.shape.params // placement.nodes
        cpu_total = (sizing.cpu_state + (sizing.gpu_state + sizing.activations) * placement.ranks_per_node
                     + sizing.overhead + buffers + extra)
    return TierBytes(gpu=gpu_total, cpu=cpu_total, cpu_pinned=pinned_total,
                     cpu_pageable=max(0, cpu_total - pinned_total), nvme=sizing.nvme)


def _shortfalls(placement: PlacementInputs, sizing: _Sizing, need: TierBytes) -> tuple[list[Shortfall], int]:
    """(what does not fit, NVMe needed with slack for block-aligned swap files)."""
    nvme_free = placement.hw.nvme_free_bytes
    nvme_need = int(need.nvme * (1 + NVME_SLACK_FRACTION))
    shortfalls: list[Shortfall] = []
    if placement.on_gpu and need.gpu > sizing.gpu_usable:
        shortfalls.append(Shortfall(tier="gpu", need_bytes=need.gpu, have_bytes=sizing.gpu_usable))
    if need.cpu > sizing.cpu_usable:
        shortfalls.append(Shortfall(tier="cpu", need_bytes=need.cpu, have_bytes=sizing.cpu_usable))
    if need.nvme and nvme_need > nvme_free:
        shortfalls.append(Shortfall(tier="nvme", need_bytes=nvme_need, have_bytes=nvme_free))
    return shortfalls, nvme_need


def _processes(hw: NodeHardware, gpus_per_node: int | None, cpu_processes: int) -> tuple[int, int]:
    """(GPUs per node, training processes per node): one per GPU, or the CPU processes."""
    gpus = hw.gpu_count if gpus_per_node is None else gpus_per_node
    if gpus > hw.gpu_count:
        raise ValueError(f"resources.gpusPerNode is {gpus} but {hw.name} has {hw.gpu_count} GPUs")
    return gpus, gpus if gpus else max(1, cpu_processes)


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
    """Choose the fastest placement that fits and is allowed; explain the others.

    Returns an infeasible plan (feasible=False, shortfalls set) when nothing fits: the
    candidate with the smallest total shortfall, so the caller can say what is missing.
    """
    training = training or Training()
    offload = offload or Offload()
    lora_notes: list[str] = []
    if method is not None and method.lora:
        trainable, missing = lora_parameters(shape, method.rank, method.peft_targets)
        if missing:
            lora_notes.append(f"LoRA: the model has no linear layers named {', '.join(missing)} (not counted)")
        shape = shape.model_copy(update={"trainable_params": max(1, trainable)})
        lora_notes.insert(0, f"LoRA rank {method.rank}: {format_count(trainable)} trainable parameters of "
                             f"{format_count(shape.params)}; the frozen base takes 2 B/param in the parameters' tier, "
                             "gradients and optimizer state count the adapters only")
    gpus, ranks_per_node = _processes(hw, gpus_per_node, cpu_processes)

    candidates: list[OffloadPlan] = []
    rejected: list[Rejection] = []
    for stage, optimizer, parameters in _PLACEMENTS:
        label = _label(stage, optimizer, parameters)
        why = _allowed(offload, stage, optimizer, parameters)
        if why:
            rejected.append(Rejection(placement=label, why=f"excluded: {why}"))
            continue
        if "nvme" in (optimizer, parameters) and hw.nvme_free_bytes <= 0:
            rejected.append(Rejection(placement=label, why="node has no NVMe volume"))
            continue
        plan = _evaluate(PlacementInputs(
            shape=shape, hw=hw, training=training, dtype=dtype, stage=stage, optimizer=optimizer,
            parameters=parameters, gpus_per_node=gpus, ranks_per_node=ranks_per_node, nodes=nodes,
            price_per_hour=price_per_hour, cpu_resident=_cpu_resident(offload),
            sub_group_size=_sub_group_override(offload),
        ))
        candidates.append(plan)
    if not candidates:
        raise ValueError(
            "the offload settings exclude every placement on this node: "
            + "; ".join(f"{r.placement}: {r.why}" for r in rejected)
        )

    feasible = [c for c in candidates if c.feasible]
    if feasible:
        # Fastest first; on a tie prefer less offload (the order of _PLACEMENTS).
        best = min(feasible, key=lambda c: (round(c.predicted_step_seconds, 6), candidates.index(c)))
    else:
        best = min(candidates, key=lambda c: sum(s.short_bytes for s in c.shortfalls))
    for c in candidates:
        if c is best:
            continue
        if not c.feasible:
            why = "; ".join(s.describe() for s in c.shortfalls)
        elif round(c.predicted_step_seconds, 6) <= round(best.predicted_step_seconds, 6):
            why = f"no faster ({c.predicted_step_seconds:.3g} s/step) and offloads more"
        else:
            why = f"slower: {c.predicted_step_seconds:.3g} s/step vs {best.predicted_step_seconds:.3g} s/step"
        rejected.append(Rejection(placement=c.label, why=why))
    best.rejected = rejected
    best.reasons = [*_explain(best), *lora_notes, *best.reasons]
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
    "ModelShape",
    "OffloadPlan",
    "PlanningError",
    "Shortfall",
    "TierBytes",
    "activation_bytes",
    "minimum_cpu_for",
    "model_state_bytes",
    "plan_tiers",
]
