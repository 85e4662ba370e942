"""The planner's arithmetic: bytes of model states, swap files and activations, and
seconds per step, for one placement on one node.

Where this sits: `tier_sizing` sizes placements and `planner` times them with these;
`largest`, the runtime's ZeRO-3 mend (`resident_sub_groups`) and the tests call them
directly. They read `placement_inputs`' records and import nothing of the planner's.
Pure arithmetic: no torch, no I/O.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from pydantic import BaseModel, Field

from spillway_runtime.core.hardware import (
    DEFAULT_CPU_ADAM_PARAMS_PER_S,
    DEFAULT_HOST_DEVICE_BPS,
    DEFAULT_NVME_READ_BPS,
    DEFAULT_NVME_WRITE_BPS,
    AioSettings,
    matmul_rate_at,
)
from spillway_runtime.core.placement_inputs import ModelShape, PlacementInputs, SwapSettings
from spillway_runtime.core.spec import Training
from spillway_runtime.core.spec_types import DType, Tier

# Share of peak FLOPs a fine-tune reaches on one GPU (dense decoder, bf16, good kernels), where
# the probe measured no decoder layers on it (`NodeHardware.gpu_decoder`). The GPU kit's first
# H200 run (2026-12-04) found a 778M model's GPU-resident step 3.9x what this predicted.
MODEL_FLOPS_UTILISATION = 0.35
# CPU "accelerator" (DS_ACCELERATOR=cpu): FLOP/s per core assumed when the probe measured no
# decoder layers (`NodeHardware.cpu_matmul`). Real rates span 100x: fp32 on AVX2 reaches ~15-50
# GFLOP/s per core, bf16 without native bf16 instructions ~2 (measured on a 2-core AMD EPYC).
CPU_FLOPS_PER_CORE = 25e9
# Swap files per parameter with the optimizer on NVMe: fp32 master, exp_avg, exp_avg_sq and
# the fp32 gradient (measured on DeepSpeed 0.19.8: 16.0 B/param on a 6.5M-parameter model).
# Each is read and written once per step. Gradient fragments under the minimum swap size stay
# in CPU RAM, which on tiny models leaves 12 B/param (measured on a 0.75M-parameter model).
OPTIMIZER_SWAP_BYTES_PER_PARAM = 16
OPTIMIZER_SWAP_BYTES_PER_PARAM_NO_GRADS = 12
# Of the 16 written, the fp32 gradient's 4 go out in the backward (stage 3's gradient swapper, as
# each sub-group's gradients are partitioned), the state's 12 in the optimizer phase. Each
# swapped sub-group is one read and one write in the phase and one write in the backward, each
# paying the disk's cost per transfer (`NodeHardware.nvme_transfer_seconds`).
GRADIENT_SWAP_BYTES_PER_PARAM = 4
# DeepSpeed swaps a tensor only when it holds at least max(1 MiB, aio block) bytes
# (OptimizerSwapper.is_swappable_tensor); smaller ones stay in CPU RAM.
MIN_AIO_BYTES = 1 << 20
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
# ZeRO-3 gathers each parameter before its module runs and releases it after, in the forward
# and again in the backward: hooks per tensor, and copies of the 16-bit weights. Fitted to the
# extra time of ZeRO-3 over ZeRO-2 in the same runs of benchmarks/bench_offload_overhead.py on
# the CPU accelerator (2 cores, DeepSpeed 0.19.8): 26.5 ms for 39 tensors of 0.75M parameters,
# 14 ms for 12 of 6.5M, 75 ms for 75 of 21M; the fit is within 0.99-1.11 of each. Per
# micro-step (a forward and a backward). The hooks are host work wherever the model is; the
# copies are host memory only on the CPU accelerator (on a GPU they run at HBM speed, left out).
GATHER_SECONDS_PER_TENSOR = 0.67e-3
GATHER_SECONDS_PER_PARAM_ON_CPU = 1.16e-9
# Every ZeRO stage handles each gradient in the backward: a hook per tensor copies it into a
# bucket, reduces it, converts it to fp32 into the partition, and checks and clips the norm.
# Fitted to the time of ZeRO-2 (optimizer on the CPU) beyond the compute and the Adam step in
# the same runs (cProfile: dtype conversions, reductions, norms): 11.7 ms for 39 tensors of
# 0.75M parameters, 19 ms for 12 of 6.5M, 60 ms for 75 of 21M; the fit is within 0.83-1.02.
# The hooks run in every micro-step; the copies (host memory only on the CPU accelerator) in
# every micro-step under ZeRO-2 and once per optimizer step under ZeRO-3 (`gradient_handling`).
GRADIENT_SECONDS_PER_TENSOR = 0.24e-3
GRADIENT_SECONDS_PER_PARAM_ON_CPU = 2.03e-9


class StepTime(BaseModel):
    """Predicted seconds per optimizer step, and its parts (see `step_time` for how they add up)."""

    compute: float
    gather_release: float = Field(0.0, description="ZeRO-3: gathering and releasing each parameter, on the compute's path")
    gradients: float = Field(0.0, description="Bucketing, reducing, converting and clipping the gradients, in the backward")
    host_work_scale: float = Field(1.0, description="gradients and gather_release: the fitted constants times this "
                                   "(NodeHardware.host_work_scale, as the node's probe measured it)")
    host_device: float
    nvme: float = Field(description="parameter_nvme + gradient_nvme + optimizer_nvme")
    parameter_nvme: float = 0.0
    optimizer_nvme: float = Field(0.0, description="The optimizer phase's reads and writes: each swapped sub-group's "
                                  "state and gradient in, its state out")
    gradient_nvme: float = Field(0.0, description="The swapped sub-groups' fp32 gradients written in the backward, "
                                 "beside the compute")
    nvme_bytes: int = Field(0, description="Read and written per step and node, parameters and optimizer")
    cpu_optimizer: float = Field(description="The optimizer step: on the CPU, or fused Adam on the GPU")
    zenflow_interval: int = Field(0, description="offload.overlap zenflow: the CPU step every this many steps")
    zenflow_selective: float = Field(0.0, description="ZenFlow: the top-k columns' update every step, in cpu_optimizer")
    gpu_share: float = Field(0.0, description="Twin-Flow: the share of the optimizer's elements updated on the GPU")
    pipelined: bool = Field(False, description="Optimizer NVMe I/O overlaps the optimizer step")
    swapped_sub_groups: int = Field(0, description="Per rank: the optimizer sub-groups read and written every step")
    resident_share: float = Field(0.0, description="Of the optimizer state: kept in CPU RAM (stepped first, no I/O)")
    optimizer_phase: float = Field(0.0, description="The optimizer step and its NVMe I/O, as they overlap")
    total: float
    flops: float = Field(0.0, description="Per rank and step: forward, backward and any recomputation")
    flops_per_s: float = Field(0.0, description="Of one GPU; on the CPU accelerator, of all the node's cores")
    flops_source: str = ""

    def forward_backward(self, gradient_writes: bool = True) -> float:
        """The forward and backward passes: max(compute + gradients + ZeRO-3's gather and release,
        host-device, parameter NVMe + the gradients' NVMe writes), since the transfers overlap the
        compute (prefetch); `gradient_writes=False` leaves the writes out (the same step with the
        optimizer in RAM, `planner.over_in_ram`)."""
        disk = self.parameter_nvme + (self.gradient_nvme if gradient_writes else 0.0)
        return max(self.compute + self.gradients + self.gather_release, self.host_device, disk)

    def formula(self) -> str:
        """The sum `total` is, with the figures in it, as the plan's reasons state it."""
        compute = f"compute {self.compute:.3g} + gradients {self.gradients:.3g}" + (
            f" + ZeRO-3 gather/release {self.gather_release:.3g}" if self.gather_release else "") + (
            f" (DeepSpeed's host work measured at {self.host_work_scale:.2f}x the fitted constants)"
            if self.host_work_scale != 1.0 else "")
        disk = f"parameter NVMe {self.parameter_nvme:.3g}" + (
            f" + gradients' NVMe writes {self.gradient_nvme:.3g}" if self.gradient_nvme else "")
        forward_backward = f"max({compute}, host-device {self.host_device:.3g}, {disk})"
        if self.pipelined and self.swapped_sub_groups and self.optimizer_nvme:
            swapped_step = self.cpu_optimizer * (1 - self.resident_share)
            optimizer_phase = (f"optimizer phase {self.optimizer_phase:.3g} (pipelined swap over "
                               f"{self.swapped_sub_groups} sub-groups: the resident ones' step "
                               f"{self.cpu_optimizer - swapped_step:.3g}, then max(step {swapped_step:.3g}, optimizer "
                               f"NVMe {self.optimizer_nvme:.3g}) + the shorter / {self.swapped_sub_groups})")
        elif self.zenflow_interval:
            optimizer_phase = (f"optimizer step {self.cpu_optimizer:.3g} (ZenFlow: the CPU step "
                               f"{self.cpu_optimizer - self.zenflow_selective:.3g} a step, once every "
                               f"{self.zenflow_interval} steps, + the top-k columns' {self.zenflow_selective:.3g})")
        elif self.gpu_share:
            optimizer_phase = (f"optimizer step {self.cpu_optimizer:.3g} (Twin-Flow: {self.gpu_share:.0%} of the "
                               "optimizer updated on the GPU, the rest by the CPU)")
        else:
            optimizer_phase = f"optimizer step {self.cpu_optimizer:.3g} + optimizer NVMe {self.optimizer_nvme:.3g}"
        return f"step {self.total:.3g} s = {forward_backward} + {optimizer_phase}"

    def compute_rate(self) -> str:
        rate = (f"{self.flops_per_s / 1e12:.3g} TFLOP/s" if self.flops_per_s >= 1e12
                else f"{self.flops_per_s / 1e9:.3g} GFLOP/s")
        return f"compute: {self.flops / 1e9:.3g} GFLOP per rank at {rate} ({self.flops_source})"


# --- Model-state bytes ---------------------------------------------------------------


def model_state_bytes(
    stage: int, optimizer: Tier, parameters: Tier, params: int, largest_layer: int, gpus_per_node: int, nodes: int,
    trainable: int | None = None, gradient_partition: int = 0,
) -> tuple[int, int]:
    # gpus_per_node counts training processes: GPUs, or processes on a CPU accelerator.
    """(GPU bytes per GPU, CPU bytes per node) for model states, as DeepSpeed's estimators
    compute them with additional_buffer_factor=1.0 and zero.Init. NVMe placements extend
    them: what moves to NVMe leaves the CPU figure (see `nvme_state_bytes`). With LoRA
    (`trainable` < `params`) the 16-bit weights count every parameter and the gradients and
    optimizer state (fp32 master, both moments, fp32 gradient: 16 B) only the trainable.
    `gradient_partition`: bytes per trainable parameter of the gradient partition of the whole
    model that ZeRO-3 with the optimizer offloaded keeps in RAM (`gradient_partition_bytes`),
    which the estimators leave out."""
    t = params if trainable is None else trainable
    total_gpus = gpus_per_node * nodes
    per_node = gpus_per_node
    large = 4 * largest_layer
    if stage == 2:
        if optimizer == "gpu":
            return 2 * params + 18 * t // total_gpus, 4 * params * per_node
        return 2 * params, max(4 * total_gpus * params, 16 * t)
    if optimizer == "gpu":
        return large + (2 * params + 16 * t) // total_gpus, 4 * largest_layer * per_node
    if parameters == "gpu":
        gpu = large + 2 * params // total_gpus
        cpu_states = 16 * t // nodes
    else:
        gpu = large
        cpu_states = (2 * params + 16 * t) // nodes
    # Optimizer on NVMe: the fp32 master, both moments and the fp32 gradient (16 B/param) go
    # to swap files; the fp32 staging buffers are counted with the pinned swap buffers.
    if optimizer == "nvme":
        cpu_states -= OPTIMIZER_SWAP_BYTES_PER_PARAM * t // nodes
    cpu_states += gradient_partition * t // nodes
    # Parameters on NVMe: the 16-bit partition (2 B/param) leaves RAM for swap files.
    if parameters == "nvme":
        cpu_states -= 2 * params // nodes
    return gpu, cpu_states


def nvme_state_bytes(optimizer: Tier, parameters: Tier, params: int, nodes: int, trainable: int | None = None) -> int:
    per_node = 0
    if optimizer == "nvme":
        per_node += OPTIMIZER_SWAP_BYTES_PER_PARAM * (params if trainable is None else trainable) // nodes
    if parameters == "nvme":
        per_node += 2 * params // nodes
    return per_node


def resident_sub_groups(share: float, sub_groups: int) -> int:
    """How many of a rank's optimizer sub-groups a share of them keeps in CPU RAM:
    floor(share x sub-groups), the planner's count and the runtime's alike (the 1e-9 keeps
    a product such as 0.29 x 100 = 28.999999999999996 from flooring one short)."""
    return int(share * sub_groups + 1e-9)


def twin_flow_ratio(share: float) -> float:
    """DeepSpeed's `offload_optimizer.ratio` for a share of the optimizer kept on the GPU: the
    share offloaded, 1 - share (rounded, so 1 - 0.3 is 0.7, not 0.7000000000000001)."""
    return round(1 - share, 9)


def gpu_sub_groups(share: float, sub_groups: int) -> int:
    """How many of a rank's optimizer sub-groups Twin-Flow keeps and updates on the GPU: DeepSpeed
    0.19.8 puts sub-group i there while i < int((1 - ratio) x sub-groups) (stage3
    `subgroup_to_device`), the planner's count and the runtime's alike."""
    return int((1 - twin_flow_ratio(share)) * sub_groups) if share > 0 else 0


@dataclass(frozen=True)
class SubGroupCut:
    """One rank's optimizer partition as DeepSpeed 0.19.8 cuts it into sub-groups
    (`DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups`): the parameters in order, each
    rank's share of each (ceil(elements / ranks)), a sub-group closed once it holds at least
    `sub_group_size` elements. So each sub-group but the last is larger than the size by part
    of a tensor (a tensor larger than the size is a sub-group of its own), the last is what is
    left, and the optimizer swapper's buffers are as large as the largest. DeepSpeed swaps a
    sub-group only when its fp32 holds the minimum swap size (`is_swappable_tensor`); smaller
    ones stay in RAM. A share keeps the first floor(share x sub-groups) in RAM as well
    (`deepspeed_fixes.keep_first_sub_groups_in_ram`)."""

    sizes: tuple[int, ...]
    min_swap_elements: int

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def largest(self) -> int:
        return max(self.sizes)

    def kept(self, share: float) -> int:
        """Elements a share keeps in RAM that would otherwise swap."""
        keep = resident_sub_groups(share, len(self.sizes))
        return sum(n for n in self.sizes[:keep] if n >= self.min_swap_elements)

    def swapped(self, share: float) -> tuple[int, ...]:
        """The sub-groups (elements) read and written every step with `share` kept in RAM."""
        keep = resident_sub_groups(share, len(self.sizes))
        return tuple(n for n in self.sizes[keep:] if n >= self.min_swap_elements)

    def on_gpu(self, share: float) -> int:
        """Elements Twin-Flow keeps on the GPU with `share` (`gpu_sub_groups` of them, the first)."""
        return sum(self.sizes[:gpu_sub_groups(share, len(self.sizes))])

    @property
    def unswappable(self) -> int:
        """Elements in sub-groups under the minimum swap size."""
        return sum(n for n in self.sizes if n < self.min_swap_elements)


def sub_group_cut(shape: ModelShape, ranks: int, sub_group_size: int, min_swap_bytes: int) -> SubGroupCut:
    """How DeepSpeed cuts a rank's optimizer partition: over the model's tensors
    (`ModelShape.tensor_numels`) for a full fine-tune; a LoRA adapter's tensors are not
    modelled, so its partition is cut into equal sub-groups and a short last one."""
    if shape.trainable_params is None:
        sizes = _cut(shape.tensor_numels(), ranks, max(1, sub_group_size))
    else:
        partition = -(-shape.trainable_params // ranks)
        size = max(1, min(sub_group_size, partition))
        count = -(-partition // size)
        sizes = (size,) * (count - 1) + (partition - (count - 1) * size,)
    return SubGroupCut(sizes=sizes, min_swap_elements=-(-min_swap_bytes // 4))


@functools.lru_cache(maxsize=1024)
def sub_groups(tensors: tuple[int, ...], ranks: int, sub_group_size: int) -> tuple[tuple[int, ...], ...]:
    """The tensors (their whole elements, in the order the optimizer gets them) grouped as
    DeepSpeed 0.19.8's `_create_fp16_sub_groups` groups them: a group is closed once its
    tensors' shares of one rank (ceil(elements / ranks)) hold `sub_group_size` elements."""
    if sub_group_size >= sum(-(-n // ranks) for n in tensors):
        return (tensors,)
    groups: list[tuple[int, ...]] = []
    group: list[int] = []
    filled = 0
    for n in tensors:
        group.append(n)
        filled += -(-n // ranks)
        if filled >= sub_group_size:
            groups.append(tuple(group))
            group, filled = [], 0
    return (*groups, tuple(group)) if group else tuple(groups)


@functools.lru_cache(maxsize=1024)
def _cut(tensors: tuple[int, ...], ranks: int, sub_group_size: int) -> tuple[int, ...]:
    return tuple(sum(-(-n // ranks) for n in group) for group in sub_groups(tensors, ranks, sub_group_size))


def lora_parameters(shape: ModelShape, rank: int, target_modules: list[str] | str) -> tuple[int, list[str]]:
    """(LoRA parameters, target names the model has no linear layer of): each adapted layer
    of in x out features gains rank * (in + out) parameters, as PEFT builds them."""
    names = sorted(shape.linear_in_out) if target_modules == "all-linear" else list(target_modules)
    missing = [name for name in names if name not in shape.linear_in_out]
    return rank * sum(shape.linear_in_out.get(name, 0) for name in names), missing


# Linear layers whose input is the wide side and whose output is the hidden size (the rest take
# the hidden size in): a LoRA A is rank x in, its B out x rank.
OUTPUT_PROJECTIONS = frozenset({"o_proj", "down_proj", "out_proj", "dense", "dense_4h_to_h", "w2", "wo", "c_proj"})


def lora_tensors(shape: ModelShape, rank: int, target_modules: list[str] | str) -> tuple[int, ...]:
    """LoRA's trainable tensors in the order PEFT registers them, which is the order DeepSpeed
    cuts the optimizer's sub-groups from: per layer, per adapted linear layer in the model's
    order (`linear_in_out`), its A (rank x in) then its B (out x rank). Each linear layer is the
    hidden size by another (`ModelShape.tensor_numels`); adds up to `lora_parameters`."""
    names = [n for n in shape.linear_in_out if target_modules == "all-linear" or n in target_modules]
    h, layers = shape.hidden_size, shape.num_layers
    layer: list[int] = []
    for name in names:
        other = shape.linear_in_out[name] // layers - h
        if other > 0:
            wide_in = name in OUTPUT_PROJECTIONS
            layer += [rank * (other if wide_in else h), (h if wide_in else other) * rank]
    return tuple(layer) * layers


def activation_bytes(shape: ModelShape, training: Training, dtype: DType, checkpointing: bool) -> int:
    """Peak activation memory of one micro-batch on one GPU.

    Per layer without recomputation 34*s*b*h elements (Korthikanti et al. 2022, with
    fused/flash attention so the s^2 term vanishes); with full recomputation only each
    layer's input (s*b*h) is kept plus one layer's full set. Logits add s*b*V in the
    training dtype, plus fp32 copies for the loss and its gradient.
    """
    s, b, h = training.sequence_length, training.micro_batch_size, shape.hidden_size
    elem = DTYPE_BYTES[dtype]
    per_layer_full = 34 * s * b * h * elem
    layers = (2 * s * b * h * elem) * shape.num_layers + per_layer_full if checkpointing else (
        per_layer_full * shape.num_layers
    )
    logits = s * b * shape.vocab_size * (elem + 8)
    return int(layers + logits)


# --- Step time ----------------------------------------------------------------------


def compute_rate(placement: PlacementInputs) -> tuple[float, str]:
    """(FLOP/s of one GPU or of the CPU accelerator's node, where the figure comes from): the
    probe's decoder-layer rate in the training dtype at the model's hidden size, on the GPU
    (`NodeHardware.gpu_decoder`) or the CPU (`cpu_matmul`); where it measured none, a GPU's share
    of its peak or an assumed rate per core."""
    hw = placement.hw
    hidden, dtype = placement.shape.hidden_size, placement.dtype
    curve = hw.gpu_decoder if placement.on_gpu else hw.cpu_matmul
    measured = matmul_rate_at(curve, dtype, hidden)
    if measured is not None:
        sizes = sorted(r.hidden_size for r in curve if r.dtype == dtype)
        if hidden > sizes[-1]:
            at = f"at hidden size {sizes[-1]}, the largest measured (the model's is {hidden})"
        elif hidden < sizes[0]:
            at = f"at hidden size {sizes[0]}, the smallest measured (the model's is {hidden})"
        else:
            at = f"at hidden size {hidden}" + ("" if hidden in sizes else ", interpolated")
        return measured, f"measured: {dtype} decoder layers {at} on the {'GPU' if placement.on_gpu else 'CPU'}"
    if placement.on_gpu:
        per_gpu = hw.peak_tflops * 1e12 * MODEL_FLOPS_UTILISATION
        return per_gpu, f"{MODEL_FLOPS_UTILISATION:.0%} of the GPU's {hw.peak_tflops:g} TFLOPS peak"
    return CPU_FLOPS_PER_CORE * hw.cpu_cores, (
        f"assumed: {CPU_FLOPS_PER_CORE / 1e9:g} GFLOP/s per core x {hw.cpu_cores}; the probe measured no "
        f"{dtype} decoder layers"
    )


@dataclass(frozen=True)
class NvmeSeconds:
    """Seconds per step and node of each part's NVMe reads and writes, and their bytes."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    nvme_bytes: float = 0.0


def _nvme_seconds(placement: PlacementInputs, swap: SwapSettings) -> NvmeSeconds:
    """The parameters' NVMe reads and writes, the optimizer's gradients written in the backward
    and its state read and written in the optimizer phase: bytes at the disk's bandwidth, and
    for the optimizer the disk's cost per transfer, three a swapped sub-group (its gradients
    out in the backward; its state and gradient in and its state out in the phase) on each of
    the node's processes. The parameters' transfers (a module's tensors, fetched as it runs) are
    counted by their bytes alone."""
    hw, parameters, optimizer, nodes = placement.hw, placement.parameters, placement.optimizer, placement.nodes
    p, t = placement.shape.params, placement.shape.trainable
    micro_steps = placement.training.gradient_accumulation
    read_bps = hw.nvme_read_bytes_per_s or DEFAULT_NVME_READ_BPS
    write_bps = hw.nvme_write_bytes_per_s or DEFAULT_NVME_WRITE_BPS
    param_nvme = 0.0
    nvme_bytes = 0.0
    fetches = 2 + placement.reference_forwards  # forward, backward and (DPO) the reference's forward
    if parameters == "nvme":
        param_nvme = (fetches * 2 * p / nodes * micro_steps) / read_bps + (2 * t / nodes) / write_bps
        nvme_bytes += fetches * 2 * p / nodes * micro_steps + 2 * t / nodes
    grad_nvme = opt_nvme = 0.0
    if optimizer == "nvme":
        # the sub-groups kept in RAM (`swap.cpu_resident_fraction` of them, whole) and those under
        # the minimum swap size are never read or written
        cut = placement_cut(placement, swap)
        swapped = cut.swapped(swap.cpu_resident_fraction)
        per_param = t / nodes * sum(swapped) / cut.total
        half = OPTIMIZER_SWAP_BYTES_PER_PARAM * per_param
        gradients = GRADIENT_SWAP_BYTES_PER_PARAM * per_param
        transfer = (hw.nvme_transfer_seconds or 0.0) * len(swapped) * placement.ranks_per_node
        grad_nvme = gradients / write_bps + transfer
        opt_nvme = half / read_bps + (half - gradients) / write_bps + 2 * transfer
        nvme_bytes += 2 * half
    return NvmeSeconds(param_nvme, grad_nvme, opt_nvme, nvme_bytes)


def optimizer_phase(step: float, nvme: float, resident: float, swapped: int, pipelined: bool) -> float:
    """Seconds of the optimizer phase: the Adam step of every sub-group and the NVMe reads and
    writes of the swapped ones. Without the pipeline they add up. With it, sub-group i's step
    overlaps the read of i+1 and the write of i-1, so over `swapped` sub-groups the longer of
    the two runs whole and the shorter only where nothing hides it, one sub-group's worth (the
    first read, the last write): max(S, D) + min(S, D) / swapped (one sub-group: the sum). The
    resident sub-groups (`resident` of the state) are stepped first, with no I/O to hide."""
    if not pipelined or swapped <= 0 or nvme <= 0:
        return step + nvme
    stepped = step * (1 - resident)
    return step * resident + max(stepped, nvme) + min(stepped, nvme) / swapped


def swapped_sub_groups(placement: PlacementInputs, swap: SwapSettings) -> tuple[int, float]:
    """(A rank's optimizer sub-groups swapped every step, the share of its state in RAM: those
    kept there and those too small to swap)."""
    if placement.optimizer != "nvme":
        return 0, 1.0
    cut = placement_cut(placement, swap)
    swapped = cut.swapped(swap.cpu_resident_fraction)
    return len(swapped), 1 - sum(swapped) / cut.total


def placement_cut(placement: PlacementInputs, swap: SwapSettings) -> SubGroupCut:
    """`sub_group_cut` for a placement: its processes, sub-group size and minimum swap size."""
    min_swap = max(MIN_AIO_BYTES, (placement.hw.aio or AioSettings()).block_size)
    return sub_group_cut(placement.shape, placement.ranks, swap.sub_group_size, min_swap)


def gather_release(placement: PlacementInputs) -> float:
    """Seconds per step ZeRO-3 spends gathering and releasing parameters, one tensor at a time,
    in each forward (a frozen reference's too) and backward of every micro-step; 0 below stage 3."""
    if placement.stage != 3:
        return 0.0
    passes = (2 + placement.reference_forwards) / 2  # the fit is of one forward and one backward
    return passes * _engine_seconds(placement, GATHER_SECONDS_PER_TENSOR, GATHER_SECONDS_PER_PARAM_ON_CPU,
                                    placement.shape.params)


def gradient_handling(placement: PlacementInputs) -> float:
    """Seconds per step the engine spends on the gradients in every micro-step's backward: a
    hook per tensor, and on the CPU accelerator the host-memory copies of each process's. ZeRO-3
    converts its gradient partition to fp32, takes its norm and copies it once per optimizer step
    (with the optimizer offloaded at the accumulation boundary, `_offload_grad_partition_at_boundary`;
    on the device in `_prepare_fp32_grad_for_sub_group`); between boundaries it only adds each
    micro-step's partition into its buffer, a pass not counted apart. On the 210.5M model of
    benchmarks/bench_nvme_step.py (ZeRO-3, optimizer in CPU RAM, CPU accelerator) the step grew
    by 930-956 ms a micro-step at accumulations 1, 8 and 16, 0.86 of the prediction without that
    pass, and the boundary's own work was 215 ms, where these copies count 427."""
    copies = 1 if placement.stage == 3 else placement.training.gradient_accumulation
    return _engine_seconds(placement, GRADIENT_SECONDS_PER_TENSOR, GRADIENT_SECONDS_PER_PARAM_ON_CPU,
                           placement.shape.trainable, copies)


def _engine_seconds(placement: PlacementInputs, per_tensor: float, per_param_on_cpu: float, params: int,
                    copies: int | None = None) -> float:
    """Host work of DeepSpeed's per-tensor hooks in every micro-step, plus on the CPU accelerator
    copies of `params` in host memory by each process on the node (on a GPU at HBM speed: left
    out) in `copies` of them (every micro-step unless said); all of it at this node's speed
    (`NodeHardware.host_work_scale`: the constants as they are where the probe measured none)."""
    micro_steps = placement.training.gradient_accumulation
    seconds = placement.shape.parameter_tensors * per_tensor * micro_steps
    if not placement.on_gpu:
        seconds += params * per_param_on_cpu * placement.ranks_per_node * (micro_steps if copies is None else copies)
    return seconds * placement.hw.host_work


def gradient_partition_held(accumulation: int, dtype: DType, zenflow: bool) -> bool:
    """Whether ZeRO-3 with its optimizer offloaded keeps DeepSpeed 0.19.8's 16-bit gradient
    partition of the whole model in host RAM (`grad_partitions_flat_buffer`, 2 B/param) and
    copies each micro-step's gradients down into it and back up: where micro-steps accumulate
    into it (more than one a step), where fp16's loss scaling checks it for overflow, and under
    ZenFlow. Otherwise the runtime holds one bucket's partitions at a time, on the device
    (`deepspeed_fixes.hold_one_steps_gradient_partitions_only`)."""
    return accumulation > 1 or dtype == "fp16" or zenflow


def holds_gradient_partition(placement: PlacementInputs) -> bool:
    return placement.stage == 3 and placement.optimizer != "gpu" and gradient_partition_held(
        placement.training.gradient_accumulation, placement.dtype, bool(placement.zenflow_interval))


def gradient_partition_bytes(placement: PlacementInputs) -> int:
    """Bytes per trainable parameter of that partition (DeepSpeed's gradient accumulation dtype,
    the training dtype's) where it is held; 0 where not."""
    return DTYPE_BYTES[placement.dtype] if holds_gradient_partition(placement) else 0


def offloaded_zero3_bytes(trainable: int, gpu_share: float, parameters: Tier, micro_steps: int,
                          partition: int) -> float:
    """Bytes ZeRO-3 moves between the GPU and host memory per optimizer step for `trainable`
    parameters with the optimizer offloaded, as DeepSpeed 0.19.8's stage3 does: every micro-step
    the 16-bit gradient partition goes down into its CPU accumulation buffer and comes back up
    (`partition_grads`: `copy_` then `.to(device)` in the first, the accumulation's add on the GPU
    in the others), `partition` B/param each way (`gradient_partition_bytes`: 2, or 0 where no
    such buffer is held);
    at the boundary the fp32 gradients go down to the CPU Adam's partition (4 B/param); after
    its step the updated 16-bit parameters go up where they live on the GPU (2 B/param).
    Twin-Flow's GPU share keeps its fp32 gradients and parameters on the GPU. With the
    parameters off the GPU their term counts the gradients' way down."""
    down = partition * micro_steps if parameters == "gpu" else 0
    up = partition * micro_steps
    boundary = 4 * (1 - gpu_share)
    updated = 2 * (1 - gpu_share) if parameters == "gpu" else 0
    return (down + up + boundary + updated) * trainable


def step_time(placement: PlacementInputs, checkpointing: bool, swap: SwapSettings) -> StepTime:
    """Seconds per optimizer step: the forward and backward passes (`StepTime.forward_backward`:
    max(compute + the engine's gradient handling + ZeRO-3's gather and release, host-device,
    parameter NVMe + the gradients' NVMe writes), the transfers overlapping the compute); then the optimizer phase
    (`optimizer_phase`: the optimizer step and its NVMe I/O, overlapped when the swapper is
    pipelined, else added)."""
    shape, hw, training = placement.shape, placement.hw, placement.training
    optimizer, parameters, nodes = placement.optimizer, placement.parameters, placement.nodes
    p, t = shape.params, shape.trainable  # t < p with LoRA: only the adapters get gradients and updates
    ranks = placement.ranks
    micro_steps = training.gradient_accumulation
    tokens_per_rank = training.micro_batch_size * training.sequence_length * micro_steps
    # forward 2P, backward 2P for the activations' gradients and 2T for the weights'; +2P recomputed;
    # a frozen reference's forward (DPO) 2P more
    flops = ((6 if checkpointing else 4) * p + 2 * t + 2 * p * placement.reference_forwards) * tokens_per_rank
    flops_per_s, flops_source = compute_rate(placement)
    if placement.on_gpu:
        compute = flops / flops_per_s
        pcie = hw.host_device_bytes_per_s or DEFAULT_HOST_DEVICE_BPS
    else:
        # every process computes its own micro-batches on a share of the cores
        compute = flops * placement.ranks_per_node / flops_per_s
        pcie = math.inf  # device memory is host memory
    gpu_share = 0.0
    if placement.gpu_resident and optimizer == "cpu":
        cut = placement_cut(placement, swap)
        gpu_share = cut.on_gpu(placement.gpu_resident) / cut.total
    host_device = 0.0
    partition = gradient_partition_bytes(placement)
    if optimizer != "gpu" and placement.stage == 3:
        host_device += offloaded_zero3_bytes(t, gpu_share, parameters, micro_steps, partition) / ranks / pcie
    elif optimizer != "gpu":
        # grads down and updated 16-bit params up, each rank its own partition
        host_device += 4 * t / ranks / pcie
    if parameters != "gpu":
        # fetch for forward and backward (and DPO's reference forward), and the 16-bit grads down
        # where a buffer holds them, every micro-step
        host_device += ((2 + placement.reference_forwards) * 2 * p + partition * t) / ranks * micro_steps / pcie
    disk = _nvme_seconds(placement, swap)
    cpu_adam = hw.cpu_adam_params_per_s or DEFAULT_CPU_ADAM_PARAMS_PER_S
    # fused Adam on a GPU streams ~16 B/param three times at HBM speed (~2 TB/s)
    on_hbm = optimizer == "gpu" and placement.on_gpu
    optimizer_step = 48 * t / ranks / 2e12 if on_hbm else t / nodes / cpu_adam
    if gpu_share:
        # Twin-Flow: the GPU share's Adam at HBM speed (on the CPU accelerator torch's AdamW on host
        # memory: counted at the CPU rate), the rest on the CPU
        on_gpu = 48 * t * gpu_share / ranks / 2e12 if placement.on_gpu else t * gpu_share / nodes / cpu_adam
        optimizer_step = optimizer_step * (1 - gpu_share) + on_gpu
    zenflow = 0.0
    if placement.zenflow_interval:
        # ZenFlow: the CPU step once per interval; the top-k columns' Adam every step, at HBM speed
        # on a GPU (on the CPU accelerator torch's Adam on the columns: counted at the CPU rate)
        per_step = 48 * t / 2e12 if placement.on_gpu else t / nodes / cpu_adam  # whole matrices on every rank
        zenflow = placement.zenflow_topk * per_step
        optimizer_step = optimizer_step / placement.zenflow_interval + zenflow
    swapped, kept = swapped_sub_groups(placement, swap)
    phase = optimizer_phase(optimizer_step, disk.optimizer, kept, swapped, swap.pipeline)
    step = StepTime(
        compute=compute,
        gather_release=gather_release(placement),
        gradients=gradient_handling(placement),
        host_work_scale=hw.host_work,
        host_device=host_device,
        nvme=disk.parameters + disk.gradients + disk.optimizer,
        parameter_nvme=disk.parameters,
        gradient_nvme=disk.gradients,
        optimizer_nvme=disk.optimizer,
        nvme_bytes=int(disk.nvme_bytes),
        cpu_optimizer=optimizer_step,
        zenflow_interval=placement.zenflow_interval,
        zenflow_selective=zenflow,
        gpu_share=gpu_share,
        pipelined=swap.pipeline,
        swapped_sub_groups=swapped,
        resident_share=kept if placement.optimizer == "nvme" else 0.0,
        optimizer_phase=phase,
        total=0.0,
        flops=flops,
        flops_per_s=flops_per_s,
        flops_source=flops_source,
    )
    return step.model_copy(update={"total": step.forward_backward() + phase})
