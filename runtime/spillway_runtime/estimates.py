"""The planner's arithmetic: bytes of model states, swap files and activations, and
seconds per step, for one placement on one node.

Where this sits: `planner` scores placements with these; `largest` and the tests call
them directly. Pure arithmetic: no torch, no I/O.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel

from spillway_runtime.hardware import (
    DEFAULT_CPU_ADAM_PARAMS_PER_S,
    DEFAULT_HOST_DEVICE_BPS,
    DEFAULT_NVME_READ_BPS,
    DEFAULT_NVME_WRITE_BPS,
    NodeHardware,
)
from spillway_runtime.spec import DType, Tier, Training

if TYPE_CHECKING:
    from spillway_runtime.planner import ModelShape, SwapSettings

# Share of peak FLOPs a fine-tune reaches on one GPU (dense decoder, bf16, good kernels).
MODEL_FLOPS_UTILISATION = 0.35
# CPU "accelerator" (DS_ACCELERATOR=cpu): achieved FLOP/s per core for bf16/fp32 matmuls.
CPU_FLOPS_PER_CORE = 25e9
# Swap files per parameter with the optimizer on NVMe: fp32 master, exp_avg, exp_avg_sq and
# the fp32 gradient (measured on DeepSpeed 0.19.8: 16.0 B/param on a 6.5M-parameter model).
# Each is read and written once per step. Gradient fragments under the minimum swap size stay
# in CPU RAM, which on tiny models leaves 12 B/param (measured on a 0.75M-parameter model).
OPTIMIZER_SWAP_BYTES_PER_PARAM = 16
OPTIMIZER_SWAP_BYTES_PER_PARAM_NO_GRADS = 12
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}


class StepTime(BaseModel):
    """Predicted seconds per optimizer step, and its parts."""

    compute: float
    host_device: float
    nvme: float
    cpu_optimizer: float
    total: float


# --- Model-state bytes ---------------------------------------------------------------


def model_state_bytes(
    stage: int, optimizer: Tier, parameters: Tier, params: int, largest_layer: int, gpus_per_node: int, nodes: int,
    trainable: int | None = None,
) -> tuple[int, int]:
    # gpus_per_node counts training processes: GPUs, or processes on a CPU accelerator.
    """(GPU bytes per GPU, CPU bytes per node) for model states, as DeepSpeed's estimators
    compute them with additional_buffer_factor=1.0 and zero.Init. NVMe placements extend
    them: what moves to NVMe leaves the CPU figure (see `nvme_state_bytes`). With LoRA
    (`trainable` < `params`) the 16-bit weights count every parameter and the gradients and
    optimizer state (fp32 master, both moments, fp32 gradient: 16 B) only the trainable."""
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
    # to swap files; the 16-bit gradient partition (stage3.grad_partitions_flat_buffer) stays
    # in CPU RAM, and the fp32 staging buffers are counted with the pinned swap buffers.
    if optimizer == "nvme":
        cpu_states -= OPTIMIZER_SWAP_BYTES_PER_PARAM * t // nodes
        cpu_states += 2 * t // nodes
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


def lora_parameters(shape: ModelShape, rank: int, target_modules: list[str] | str) -> tuple[int, list[str]]:
    """(LoRA parameters, target names the model has no linear layer of): each adapted layer
    of in x out features gains rank * (in + out) parameters, as PEFT builds them."""
    names = sorted(shape.linear_in_out) if target_modules == "all-linear" else list(target_modules)
    missing = [name for name in names if name not in shape.linear_in_out]
    return rank * sum(shape.linear_in_out.get(name, 0) for name in names), missing


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


def step_time(
    shape: ModelShape,
    hw: NodeHardware,
    training: Training,
    stage: int,
    optimizer: Tier,
    parameters: Tier,
    checkpointing: bool,
    gpus_per_node: int,
    nodes: int,
    swap: SwapSettings,
    ranks_per_node: int,
) -> StepTime:
    """Seconds per optimizer step. Transfers of parameters overlap with compute (prefetch);
    the optimizer phase (CPU step plus NVMe swapping of optimizer state) follows the
    backward pass, and its NVMe I/O overlaps with the CPU step only when pipelined."""
    p, t = shape.params, shape.trainable  # t < p with LoRA: only the adapters get gradients and updates
    ranks = ranks_per_node * nodes
    micro_steps = training.gradient_accumulation
    tokens_per_rank = training.micro_batch_size * training.sequence_length * micro_steps
    # forward 2P, backward 2P for the activations' gradients and 2T for the weights'; +2P recomputed
    flops = ((6 if checkpointing else 4) * p + 2 * t) * tokens_per_rank
    if gpus_per_node:
        compute = flops / (hw.peak_tflops * 1e12 * MODEL_FLOPS_UTILISATION)
        pcie = hw.host_device_bytes_per_s or DEFAULT_HOST_DEVICE_BPS
    else:
        # every process computes its own micro-batches on a share of the cores
        compute = flops * ranks_per_node / (CPU_FLOPS_PER_CORE * hw.cpu_cores)
        pcie = math.inf  # device memory is host memory
    host_device = 0.0
    if optimizer != "gpu":
        # grads down and updated 16-bit params up, each rank its own partition
        host_device += 4 * t / ranks / pcie
    if parameters != "gpu":
        # fetch for forward and backward, grads down, every micro-step
        host_device += (2 * 2 * p + 2 * t) / ranks * micro_steps / pcie
    read_bps = hw.nvme_read_bytes_per_s or DEFAULT_NVME_READ_BPS
    write_bps = hw.nvme_write_bytes_per_s or DEFAULT_NVME_WRITE_BPS
    param_nvme = 0.0
    if parameters == "nvme":
        param_nvme = (2 * 2 * p / nodes * micro_steps) / read_bps + (2 * t / nodes) / write_bps
    opt_nvme = 0.0
    if optimizer == "nvme":
        half = OPTIMIZER_SWAP_BYTES_PER_PARAM * t / nodes
        opt_nvme = half / read_bps + half / write_bps
    if optimizer == "gpu":
        # fused Adam on the GPU streams ~16 B/param three times at HBM speed (~2 TB/s)
        cpu_opt = 48 * t / ranks / 2e12 if gpus_per_node else t / nodes / (
            hw.cpu_adam_params_per_s or DEFAULT_CPU_ADAM_PARAMS_PER_S
        )
    else:
        cpu_opt = t / nodes / (hw.cpu_adam_params_per_s or DEFAULT_CPU_ADAM_PARAMS_PER_S)
    forward_backward = max(compute, host_device, param_nvme)
    optimizer_phase = max(cpu_opt, opt_nvme) if swap.pipeline else cpu_opt + opt_nvme
    return StepTime(
        compute=compute,
        host_device=host_device,
        nvme=param_nvme + opt_nvme,
        cpu_optimizer=cpu_opt,
        total=forward_backward + optimizer_phase,
    )
