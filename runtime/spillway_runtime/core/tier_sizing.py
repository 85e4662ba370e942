"""The bytes of one placement in each tier: model states, swap files, pinned buffers and the
training processes, against what the node leaves usable.

Where this sits: `planner` calls `size_placement` for every placement it scores, then times
it (`estimates.step_time`) and keeps the fastest that fits. The formulas for model-state and
activation bytes are in `estimates`; this module adds what DeepSpeed's estimators leave out
and fits the swap settings to the RAM that is left. Pure arithmetic: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from spillway_runtime.core.estimates import (
    DTYPE_BYTES,
    MIN_AIO_BYTES,
    OPTIMIZER_SWAP_BYTES_PER_PARAM,
    OPTIMIZER_SWAP_BYTES_PER_PARAM_NO_GRADS,
    SubGroupCut,
    activation_bytes,
    gpu_sub_groups,
    gradient_partition_bytes,
    model_state_bytes,
    nvme_state_bytes,
    placement_cut,
    resident_sub_groups,
    step_time,
    sub_group_cut,
)
from spillway_runtime.core.hardware import AioSettings
from spillway_runtime.core.memlock import (
    MemlockError,
    SwapLocks,
    Trainable,
    fit_swap,
    floor_locked,
    merge_settings,
    swap_budget,
)
from spillway_runtime.core.placement_inputs import (
    OPTIMIZER_SWAP_BUFFERS,
    OPTIMIZER_SWAP_BUFFERS_PIPELINED,
    ModelShape,
    PlacementInputs,
    SwapSettings,
)
from spillway_runtime.core.spec_types import Tier
from spillway_runtime.core.units import GiB, format_bytes

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
# DeepSpeed's default tile of the CPU optimizer step, in elements.
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
MIN_SUB_GROUP_SIZE = 10_000_000
# The finest sub-group the planner tries when it trades the pipelined swapper's pinned buffers
# (13 sub-groups' worth) for sub-groups kept in RAM (`size_placement`): 100M fp32 elements
# are 400 MB per swap file, far above the request size at which an NVMe drive reaches its
# bandwidth, and one CPU Adam call of about 0.1 s; finer cuts gain little RAM and add calls.
FINEST_CHOSEN_SUB_GROUP = 100_000_000
TIERED_SUB_GROUPS = 8  # the fewest sub-groups per rank a RAM-resident share is cut into, above the minimum
# The fewest a GPU share (Twin-Flow) is cut into: it is kept in whole sub-groups, and with the
# optimizer in CPU RAM a finer cut costs no swap buffers, only more (still large) CPU Adam calls.
TWIN_FLOW_SUB_GROUPS = 32
# Pinning more than this share of RAM risks memlock limits and starves the page cache.
MAX_PINNED_FRACTION = 0.5

OffloadTier = Literal["gpu", "cpu", "nvme"]


class TierBytes(BaseModel):
    """Bytes in each tier: what a placement needs, what the node has, or what is left."""

    gpu: int = Field(0, description="Per GPU")
    cpu: int = Field(0, description="Per node, pinned + pageable")
    cpu_pinned: int = 0
    cpu_pageable: int = 0
    nvme: int = Field(0, description="Per node")


class Shortfall(BaseModel):
    """A tier that a placement needs more of than the node has; or "memlock": the bytes
    DeepSpeed's NVMe swap must lock (mlock) in a process, over what the node's RLIMIT_MEMLOCK
    leaves it beside the checkpoint's buffers (`core.memlock`)."""

    tier: OffloadTier | Literal["memlock"]
    need_bytes: int
    have_bytes: int

    @property
    def short_bytes(self) -> int:
        return max(0, self.need_bytes - self.have_bytes)

    @property
    def label(self) -> str:
        return {"gpu": "GPU memory per GPU", "cpu": "CPU RAM", "nvme": "NVMe space",
                "memlock": "Memory a process may lock (RLIMIT_MEMLOCK)"}[self.tier]

    def describe(self) -> str:
        if self.tier == "memlock":
            return (f"{self.label} is short by {format_bytes(self.short_bytes)}: DeepSpeed's NVMe swap buffers lock "
                    f"at least {format_bytes(self.need_bytes)} beside the checkpoint's, and the node leaves "
                    f"{format_bytes(self.have_bytes)} (raise LimitMEMLOCK in the node's container runtime, or keep "
                    "the state in CPU RAM: offload.optimizer/parameters: cpu)")
        return (
            f"{self.label} is short by {self.short_bytes / GiB:.1f} GiB "
            f"(needs {format_bytes(self.need_bytes)}, has {format_bytes(self.have_bytes)})"
        )


@dataclass(frozen=True)
class SizedPlacement:
    """What `size_placement` works out for one placement: the bytes in each tier, the swap
    settings fitted to them, and what does not fit."""

    sizing: Sizing
    swap: SwapSettings
    aio: AioSettings
    bytes: TierBytes
    shortfalls: list[Shortfall]
    nvme_need: int  # NVMe needed, with slack for block-aligned swap files


def size_placement(placement: PlacementInputs) -> SizedPlacement:
    """Size one placement: memory -> swap settings -> swap minimum -> RAM-resident share of the
    optimizer -> pinning -> shortfall. With the optimizer on NVMe and the sub-group the
    planner's to choose, finer sub-groups are tried too (`_finer_sub_groups`), each pipelined
    and plain, and the fastest predicted step that fits is kept (where none fits, the least short,
    whose bytes then say what binds the placement): the pipelined swapper pins 13
    buffers of the largest sub-group, so a finer cut frees RAM for more resident sub-groups
    (13B with 160 GiB of RAM: 52 GB of buffers at 1e9 elements), down to the largest tensor
    (a sub-group of its own: 8.6 GB at 1e8, the embedding's 164M elements), and the plain
    swapper pins 5 instead of 13."""
    sized = _size_with(placement, None)
    if placement.optimizer != "nvme" or placement.sub_group_size is not None:
        return _fit_to_memlock(placement, sized)
    best, best_seconds = sized, _seconds(placement, sized)
    for size in (sized.swap.sub_group_size, *_finer_sub_groups(sized.swap.sub_group_size)):
        for pipeline in (True, False):  # at the first size, the one `_choose_swap` did not choose
            swap = SwapSettings(
                sub_group_size=size, pipeline=pipeline, param_buffer_size=sized.swap.param_buffer_size,
                optimizer_buffer_count=OPTIMIZER_SWAP_BUFFERS_PIPELINED if pipeline else OPTIMIZER_SWAP_BUFFERS)
            candidate = _size_with(placement, swap)
            if candidate.shortfalls:  # where none fits, the one least short says what binds
                if best.shortfalls and _short(candidate) < _short(best):
                    best = candidate
                continue
            seconds = _seconds(placement, candidate)
            if best.shortfalls or seconds < best_seconds * (1 - 1e-6):
                best, best_seconds = candidate, seconds
    return _fit_to_memlock(placement, best)


def _fit_to_memlock(placement: PlacementInputs, sized: SizedPlacement) -> SizedPlacement:
    """`sized` with DeepSpeed's NVMe swap buffers fitted under the node's RLIMIT_MEMLOCK as the
    runtime will fit them (`core.memlock.fit_swap`: the fewest optimizer buffers, no pipelined
    I/O, smaller sub-groups) and sized again with them; where no fit exists, a "memlock"
    shortfall, so the planner chooses another placement and admission says why, before a pod
    that could only exit 2. No limit (none probed), or nothing on NVMe: `sized` as it is."""
    limit = placement.hw.memlock_bytes
    if limit is None or "nvme" not in (placement.optimizer, placement.parameters):
        return sized
    given, trainable, swappers = _swap_locks(placement, sized.swap), _trainable(placement), placement.parameter_swappers
    try:
        fitted, why = fit_swap(given, trainable, limit, swappers)
    except MemlockError:
        have = swap_budget(limit) or 0
        short = Shortfall(tier="memlock", need_bytes=max(have + 1, floor_locked(given, trainable, swappers)),
                          have_bytes=have)
        return dataclasses.replace(sized, shortfalls=[*sized.shortfalls, short])
    if fitted == given:
        return sized
    swap = SwapSettings(sub_group_size=fitted.sub_group_size, param_buffer_size=sized.swap.param_buffer_size,
                        pipeline=sized.swap.pipeline and not fitted.pipeline_off,
                        optimizer_buffer_count=fitted.optimizer_buffers)
    refitted = _size_with(placement, swap)
    refitted.sizing.reasons.append(f"NVMe swap fitted under the node's RLIMIT_MEMLOCK of {format_bytes(limit)}: {why}")
    return refitted


def _swap_locks(placement: PlacementInputs, swap: SwapSettings) -> SwapLocks:
    """What the DeepSpeed config built from `swap` will lock: its swap blocks as
    `dsconfig.build_deepspeed_config` writes them, with the job's offload.deepspeed merged last."""
    aio = placement.hw.aio or AioSettings()
    zero: dict[str, Any] = {"sub_group_size": swap.sub_group_size}
    if placement.optimizer != "gpu":
        zero["offload_optimizer"] = {"device": placement.optimizer, "buffer_count": swap.optimizer_buffer_count}
    if placement.parameters != "gpu":
        zero["offload_param"] = {"device": placement.parameters, "buffer_count": swap.param_buffer_count,
                                 "buffer_size": swap.param_buffer_size}
    settings = {"zero_optimization": zero, "bf16": {"enabled": placement.dtype == "bf16"},
                "fp16": {"enabled": placement.dtype == "fp16"},
                "aio": {"block_size": aio.block_size, "intra_op_parallelism": aio.intra_op_parallelism}}
    return SwapLocks.of(merge_settings(settings, dict(placement.deepspeed)))


LORA_PIECES = 1024  # a LoRA partition's pieces where its adapters are not known one by one


def _trainable(placement: PlacementInputs) -> Trainable:
    """The tensors DeepSpeed cuts the optimizer's sub-groups from: the model's, in order, for a
    full fine-tune; LoRA's adapters as PEFT makes them (`estimates.lora_tensors`), or where a
    shape does not carry them (read back from a stored plan), LORA_PIECES equal pieces of the
    partition, each at least a hidden row."""
    shape = placement.shape
    if shape.trainable_params is None:
        return Trainable(shape.tensor_numels(), placement.ranks)
    if shape.adapter_tensors:
        return Trainable(shape.adapter_tensors, placement.ranks)
    piece = max(shape.hidden_size, -(-shape.trainable_params // LORA_PIECES))
    count, rest = divmod(shape.trainable_params, piece)
    return Trainable((piece,) * count + ((rest,) if rest else ()), placement.ranks)


def _short(sized: SizedPlacement) -> int:
    return sum(s.short_bytes for s in sized.shortfalls)


def _finer_sub_groups(size: int) -> list[int]:
    """Sub-group sizes under `size` that the planner tries, halving down to
    FINEST_CHOSEN_SUB_GROUP (none when `size` is that or finer already)."""
    sizes = []
    while size > FINEST_CHOSEN_SUB_GROUP:
        size = max(FINEST_CHOSEN_SUB_GROUP, size // 2)
        sizes.append(size)
    return sizes


def _seconds(placement: PlacementInputs, sized: SizedPlacement) -> float:
    return step_time(placement, sized.sizing.checkpointing, sized.swap).total


def _size_with(placement: PlacementInputs, swap: SwapSettings | None) -> SizedPlacement:
    """`size_placement` with the swap settings given, or chosen by `_choose_swap` (None)."""
    sizing = _size_memory(placement)
    if swap is None:
        swap = _choose_swap(placement.shape, placement.optimizer, placement.parameters, placement.ranks,
                            sizing.cpu_spare(placement), placement.sub_group_size, placement.gpu_resident > 0)
    aio = placement.hw.aio or AioSettings()
    min_swap = max(MIN_AIO_BYTES, aio.block_size)
    groups = placement_cut(placement, swap)
    swapped_per_param = _keep_unswappable_in_ram(placement, sizing, swap, min_swap, groups)
    if swapped_per_param:
        _keep_share_in_ram(placement, sizing, swap, swapped_per_param, groups)
    if placement.gpu_resident and placement.optimizer == "cpu":
        _keep_share_on_gpu(placement, sizing, swap, groups)
    pinned = _pin(placement, sizing, swap)
    tier_bytes = _tier_bytes(placement, sizing, pinned)
    shortfalls, nvme_need = _shortfalls(placement, sizing, tier_bytes)
    return SizedPlacement(sizing=sizing, swap=swap, aio=aio, bytes=tier_bytes, shortfalls=shortfalls,
                          nvme_need=nvme_need)


@dataclass
class Sizing:
    """The bytes of one placement as `size_placement` works them out, step by step."""

    gpu_state: int  # model states per GPU (per process on a CPU accelerator)
    cpu_state: int  # model states in CPU RAM per node
    nvme: int  # swap files per node
    overhead: int  # the training processes themselves
    gpu_usable: int
    cpu_usable: int
    checkpointing: bool
    activations: int
    reasons: list[str]

    def cpu_spare(self, placement: PlacementInputs) -> int:
        """CPU RAM left for the swap buffers (on a CPU accelerator the "device" is RAM too)."""
        device = 0 if placement.on_gpu else (self.gpu_state + self.activations) * placement.ranks_per_node
        return self.cpu_usable - self.cpu_state - self.overhead - device


def _size_memory(placement: PlacementInputs) -> Sizing:
    """Model states (DeepSpeed's estimators), swap files, process overhead and the usable share
    of each tier; activation checkpointing on when `auto` and the activations would not fit."""
    p, shape, hw = placement, placement.shape, placement.hw
    gpu_state, cpu_state = model_state_bytes(
        p.stage, p.optimizer, p.parameters, shape.params, shape.largest_layer_params, p.ranks_per_node, p.nodes,
        shape.trainable_params, gradient_partition=gradient_partition_bytes(p),
    )
    if p.dtype == "fp32":
        # fp32 training keeps 4-byte weights and grads where the estimators assume 2.
        gpu_state += gpu_state // 2 if p.optimizer == "gpu" else 0
    if p.zenflow_interval:
        # ZenFlow's top-k Adam on the accelerator: both moments and the gradient of the columns it
        # selects, in the training dtype, for every whole matrix on every rank
        gpu_state += int(p.zenflow_topk * 3 * DTYPE_BYTES[p.dtype] * shape.trainable)
        # and its gradient accumulation over the interval: DeepSpeed's whole-parameter buffers in
        # CPU RAM, in the training dtype, per process (stage_1_and_2 `accumulated_grads_in_cpu`)
        cpu_state += DTYPE_BYTES[p.dtype] * shape.trainable * p.ranks_per_node
    gpu_state, cpu_state, reference_nvme = _with_reference(p, gpu_state, cpu_state)
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
    return Sizing(
        gpu_state=gpu_state, cpu_state=cpu_state,
        nvme=nvme_state_bytes(p.optimizer, p.parameters, shape.params, p.nodes, shape.trainable_params)
        + reference_nvme,
        overhead=overhead, gpu_usable=gpu_usable, cpu_usable=cpu_usable, checkpointing=checkpointing,
        activations=activation_bytes(shape, p.training, p.dtype, checkpointing), reasons=reasons,
    )


def _with_reference(p: PlacementInputs, gpu_state: int, cpu_state: int) -> tuple[int, int, int]:
    """(GPU per GPU, CPU per node, NVMe per node) with DPO's frozen reference of a full fine-tune:
    its 16-bit weights (2 B/param in the training dtype) where the parameters live. Under ZeRO-3
    partitioned like them (in GPU memory, CPU RAM or NVMe); under ZeRO-0-2 a whole copy on each
    GPU (as TRL places it: a plain module beside the engine). No gradient, no optimizer state."""
    if not p.reference_params:
        return gpu_state, cpu_state, 0
    weights = (4 if p.dtype == "fp32" else 2) * p.reference_params
    if p.stage != 3 or p.parameters == "gpu":
        share = weights if p.stage != 3 else weights // max(1, p.ranks_per_node * p.nodes)
        return gpu_state + share, cpu_state, 0
    if p.parameters == "cpu":
        return gpu_state, cpu_state + weights // p.nodes, 0
    return gpu_state, cpu_state, weights // p.nodes


def _choose_swap(shape: ModelShape, optimizer: Tier, parameters: Tier, ranks: int, cpu_spare: int,
                 sub_group_size: int | None = None, twin_flow: bool = False) -> SwapSettings:
    """Size sub-groups and swap buffers to the RAM that is left.

    The optimizer swapper pins buffer_count x sub_group x 4 B per rank; DeepSpeed's default
    sub-group of 1e9 elements pins 16 GB per rank and exhausts host RAM (#3000), so the
    sub-group is lowered until the buffers take at most half of the spare RAM, and the
    read/write pipeline is switched on only when its double buffers also fit. A job's own
    `sub_group_size` (offload.deepspeed) is what DeepSpeed will use: it is taken as it is.
    With the optimizer on NVMe, at least TIERED_SUB_GROUPS sub-groups per rank where
    MIN_SUB_GROUP_SIZE allows: a share is kept in whole sub-groups (0.5 of one sub-group would
    keep nothing), and the pipelined swapper reads the next sub-group and writes the last while
    one steps (with one sub-group there is nothing to overlap: `estimates.optimizer_phase`).
    So too for a share kept on the GPU (`twin_flow`), which DeepSpeed also counts in sub-groups.
    """
    partition = max(1, shape.params // ranks)
    sub_group = min(DEFAULT_SUB_GROUP_SIZE, max(MIN_SUB_GROUP_SIZE, partition))
    if optimizer == "nvme" or twin_flow:
        count = TIERED_SUB_GROUPS if optimizer == "nvme" else TWIN_FLOW_SUB_GROUPS
        sub_group = min(sub_group, max(MIN_SUB_GROUP_SIZE, _cut_into(shape, ranks, count)))
    if sub_group_size is not None:
        sub_group = sub_group_size
    if optimizer != "nvme":
        return SwapSettings(sub_group_size=sub_group, param_buffer_size=shape.largest_param_numel)
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
        # Each swapped-in parameter takes a whole buffer: as large as the largest tensor (DeepSpeed's
        # default, 1e8 elements, locked 3.2 GB in 16 buffers for a model of 0.75M parameters).
        param_buffer_size=shape.largest_param_numel,
    )




def _cut_into(shape: ModelShape, ranks: int, count: int) -> int:
    """The largest sub-group size (to 1/8) that DeepSpeed's cut makes `count` sub-groups of
    at least: each but the last holds more than the size (to the end of a tensor), so a
    partition / count cut makes fewer."""
    size = -(-max(1, shape.trainable // ranks) // count)
    while size > MIN_SUB_GROUP_SIZE and len(sub_group_cut(shape, ranks, size, 0).sizes) < count:
        size -= size // 8
    return size


def _pinned_bytes(swap: SwapSettings, optimizer: Tier, parameters: Tier, ranks_per_node: int, largest_group: int,
                  whole_group: int, parameter_swappers: int = 1) -> int:
    """Swap buffers per node. DeepSpeed sizes the optimizer's by the largest sub-group it
    actually formed (`SubGroupCut.largest`: more than the sub-group size by part of a tensor,
    or one tensor larger than it, such as the embedding); the parameter swapper's are
    allocated at their configured size whatever the model, once per engine
    (`parameter_swappers` 2 with DPO's frozen reference of a full fine-tune)."""
    per_rank = 0
    if optimizer == "nvme":
        per_rank += (swap.optimizer_buffer_count + 1) * largest_group * 4
    if parameters == "nvme":
        per_rank += swap.param_buffer_count * swap.param_buffer_size * 2 * parameter_swappers
        # and the partitioned swap buffer the updated 16-bit parameters leave through: the whole
        # tensors of the largest sub-group (`reserve_partitioned_swap_space`)
        per_rank += 2 * whole_group
    return per_rank * ranks_per_node


def _keep_unswappable_in_ram(placement: PlacementInputs, sizing: Sizing, swap: SwapSettings, min_swap: int,
                             groups: SubGroupCut) -> int:
    """DeepSpeed swaps a tensor only when it holds at least max(1 MiB, aio block) bytes: what is
    smaller stays in CPU RAM, so its bytes move from the NVMe figure back to the CPU one.
    Returns the optimizer's bytes per trainable parameter on NVMe (0: nothing of it swapped)."""
    shape, ranks, nodes = placement.shape, placement.ranks, placement.nodes
    swapped = OPTIMIZER_SWAP_BYTES_PER_PARAM if placement.optimizer == "nvme" else 0
    per_node_params = shape.params // nodes
    per_node_trainable = shape.trainable // nodes
    if placement.optimizer == "nvme":
        if groups.largest < groups.min_swap_elements:
            sizing.nvme -= OPTIMIZER_SWAP_BYTES_PER_PARAM * per_node_trainable
            sizing.cpu_state += (OPTIMIZER_SWAP_BYTES_PER_PARAM - 2) * per_node_trainable
            sizing.reasons.append(
                f"optimizer sub-groups of {format_bytes(groups.largest * 4)} are below DeepSpeed's minimum swap "
                f"size ({format_bytes(min_swap)}): the state stays in CPU RAM"
            )
            swapped = 0
        elif shape.largest_param_numel // ranks * 4 < min_swap:
            # every gradient fragment is too small to swap: fp32 grads stay in RAM
            moved = (OPTIMIZER_SWAP_BYTES_PER_PARAM - OPTIMIZER_SWAP_BYTES_PER_PARAM_NO_GRADS) * per_node_trainable
            sizing.nvme -= moved
            sizing.cpu_state += moved
            swapped = OPTIMIZER_SWAP_BYTES_PER_PARAM_NO_GRADS
        if swapped and groups.unswappable:
            # sub-groups too small to swap (the last, what is left of the partition) stay in RAM
            sizing.nvme -= swapped * groups.unswappable * placement.ranks_per_node
            sizing.cpu_state += (swapped - 2) * groups.unswappable * placement.ranks_per_node
    if placement.parameters == "nvme" and shape.largest_param_numel // ranks * 2 < min_swap:
        sizing.nvme -= 2 * per_node_params
        sizing.cpu_state += 2 * per_node_params
        sizing.reasons.append("parameter partitions are below DeepSpeed's minimum swap size: they stay in CPU RAM")
    return swapped


def _keep_share_in_ram(placement: PlacementInputs, sizing: Sizing, swap: SwapSettings, per_param: int,
                       groups: SubGroupCut) -> None:
    """Tiered optimizer state: the first K of each rank's n sub-groups stay in CPU RAM and never
    touch the disk, the rest swap as before. K is the job's share of n
    (`estimates.resident_sub_groups`, as the runtime counts it), or (share not given) the most
    sub-groups that the RAM left beside everything else holds. Their state moves from the NVMe
    figure to the CPU one, as for a sub-group too small to swap (DeepSpeed 0.19.8 keeps such
    sub-groups in pageable memory: nothing more is pinned)."""
    count, per_element = len(groups.sizes), (per_param - 2) * placement.ranks_per_node
    share = placement.cpu_resident
    if share is not None:
        keep = resident_sub_groups(share, count)
    else:
        pinned = _pin(placement, dataclasses.replace(sizing, reasons=[]), swap.model_copy())
        room = sizing.cpu_usable - _tier_bytes(placement, sizing, pinned).cpu
        keep = 0
        for size in groups.sizes:  # one too small to swap is in RAM already
            room -= per_element * size if size >= groups.min_swap_elements else 0
            if room < 0:
                break
            keep += 1
    fraction = share if share is not None else keep / count
    resident_params = groups.kept(fraction) * placement.ranks_per_node
    if resident_params == 0:
        swap.cpu_resident_fraction = share or 0.0
        return
    resident_bytes = (per_param - 2) * resident_params  # per node
    sizing.nvme -= per_param * resident_params
    sizing.cpu_state += resident_bytes
    # the job's share as it is (the runtime keeps floor(share x its sub-groups), which a pod's
    # memlock-fitted sub-groups can make more than planned here); the planner's as a fraction
    swap.cpu_resident_fraction = fraction
    on_nvme = len(groups.swapped(fraction))
    sizing.reasons.append(
        f"optimizer: {keep} of {count} sub-groups per process kept in CPU RAM "
        f"({format_bytes(resident_bytes)} per node), {on_nvme} on NVMe"
        + ("" if on_nvme else ": nothing of it is swapped")
    )


def _keep_share_on_gpu(placement: PlacementInputs, sizing: Sizing, swap: SwapSettings, groups: SubGroupCut) -> None:
    """Twin-Flow (offload.gpuResidentFraction): the first int(share x n) of each rank's n
    sub-groups keep their fp32 masters, both Adam moments and fp32 gradient (16 B/param) on the
    GPU and are updated there by torch's AdamW; their bytes leave CPU RAM. A 16-bit gradient
    partition held in RAM (`gradient_partition_bytes`) stays there whole."""
    share, count = placement.gpu_resident, len(groups.sizes)
    kept = groups.on_gpu(share)  # elements per rank
    swap.gpu_resident_fraction = share
    sizing.gpu_state += 16 * kept
    sizing.cpu_state -= 16 * kept * placement.ranks_per_node
    on_gpu = gpu_sub_groups(share, count)
    sizing.reasons.append(
        f"optimizer: {on_gpu} of {count} sub-groups per process kept and updated on the GPU (Twin-Flow, "
        f"{format_bytes(16 * kept)} per GPU), the rest in CPU RAM"
        + ("" if on_gpu else f": a share of {share:g} is under one sub-group, so none is"))


def tier_parts(placement: PlacementInputs, sized: SizedPlacement) -> dict[str, dict[str, int]]:
    """What fills each tier of a sized placement, by name, as `_tier_bytes` adds it up (per
    GPU, per node, per node): what `largest` names as the bound of a model's size. Of the
    model states in RAM, the kinds the placement keeps there, by name."""
    sizing, ranks = sized.sizing, placement.ranks_per_node
    states = _states_in_ram(placement)
    cpu = {states: sizing.cpu_state, "swap buffers": _swap_buffers(placement, sized.swap),
           "training processes": sizing.overhead}
    gpu = {"model states": sizing.gpu_state, "activations": sizing.activations}
    if not placement.on_gpu:  # the "device" is host memory
        cpu |= {"device model states": sizing.gpu_state * ranks, "activations": sizing.activations * ranks,
                "load copies and device gradients": CPU_ACCELERATOR_EXTRA_BYTES_PER_PARAM * placement.shape.params
                // placement.nodes}
        gpu = {}
    locked = {"swap buffers": floor_locked(_swap_locks(placement, sized.swap), _trainable(placement),
                                           placement.parameter_swappers)}
    return {"gpu": gpu, "cpu": cpu, "nvme": {"swap files": sizing.nvme}, "memlock": locked}


def _states_in_ram(placement: PlacementInputs) -> str:
    """What of the model states a placement keeps in RAM: "model states" where the optimizer is
    on the GPU; else its state there or not (fp32 master, moments and gradients), the 16-bit
    parameters there or not, and the gradient partition where DeepSpeed holds one
    (`gradient_partition_bytes`)."""
    if placement.optimizer == "gpu":
        return "model states"
    partition = gradient_partition_bytes(placement)
    kinds = ["optimizer state"] if placement.optimizer == "cpu" else []
    kinds += ["16-bit parameters"] if placement.parameters == "cpu" else []
    kinds += [f"{8 * partition}-bit gradients"] if partition else []
    return ", ".join(kinds) or "no model states"


def _swap_buffers(placement: PlacementInputs, swap: SwapSettings) -> int:
    largest = placement_cut(placement, swap).largest if "nvme" in (placement.optimizer, placement.parameters) else 0
    whole = min(placement.shape.trainable, largest * placement.ranks)  # its tensors whole, not a rank's share
    return _pinned_bytes(swap, placement.optimizer, placement.parameters, placement.ranks_per_node,
                         largest if placement.optimizer == "nvme" else 0, whole, placement.parameter_swappers)


def _pin(placement: PlacementInputs, sizing: Sizing, swap: SwapSettings) -> tuple[int, int]:
    """(swap buffers, pinned total) per node. With pin_memory DeepSpeed pins the CPU optimizer
    partitions too; past MAX_PINNED_FRACTION of RAM pinning is switched off (`swap.pin_memory`)."""
    pinned = _swap_buffers(placement, swap)
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


def _tier_bytes(placement: PlacementInputs, sizing: Sizing, pinned: tuple[int, int]) -> TierBytes:
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


def _shortfalls(placement: PlacementInputs, sizing: Sizing, need: TierBytes) -> tuple[list[Shortfall], int]:
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
