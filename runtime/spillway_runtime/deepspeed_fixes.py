"""Mends for DeepSpeed 0.19.8 defects that a Spillway placement runs into, each applied
only where that placement needs it, each with the test that found it.

Where this sits: the recipe calls `apply(plan)` before `deepspeed.initialize`.
"""

from __future__ import annotations

from typing import Any

from spillway_runtime.core.estimates import gradient_partition_held, resident_sub_groups
from spillway_runtime.core.planner import OffloadPlan
from spillway_runtime.core.spec_types import DType

_MARK = "_spillway_unique_params"
_RESIDENT_MARK = "_spillway_resident_sub_groups"
_resident_fraction = 0.0  # read by the patched ZeRO-3 optimizer as it is built (`keep_first_sub_groups_in_ram`)
_whole_gradient_buffer = False  # `apply`'s: `hold_one_steps_gradient_partitions_only` leaves every optimizer as is


def apply(plan: OffloadPlan, whole_gradient_buffer: bool = False) -> None:
    """`whole_gradient_buffer`: leave DeepSpeed's own 16-bit gradient buffer (a test's reference)."""
    global _whole_gradient_buffer
    view_zenflow_weights_in_column_order()  # only ZenFlow's optimizers take the mended path
    _whole_gradient_buffer = whole_gradient_buffer
    if plan.zero_stage == 3 and plan.optimizer != "gpu":
        hold_one_steps_gradient_partitions_only()
    if plan.parameters == "nvme":
        swap_each_parameter_in_once()
    if plan.uses_nvme:
        quiet_ssd_endurance_warning()
    if plan.swap.gpu_resident_fraction > 0:
        run_twin_flow_as_deepspeed_describes_it()
    if plan.optimizer == "nvme" and plan.swap.cpu_resident_fraction > 0:
        keep_first_sub_groups_in_ram(plan.swap.cpu_resident_fraction)
    else:
        global _resident_fraction
        _resident_fraction = 0.0


def keep_first_sub_groups_in_ram(fraction: float) -> None:
    """Tiered optimizer state (the plan's `swap.cpu_resident_fraction`): ZeRO-3 swaps every
    optimizer sub-group above its minimum size to NVMe; with this, the first
    floor(share x sub-groups) of each rank stay in CPU RAM and never touch the disk, and the
    rest swap as before. DeepSpeed asks one method whether a sub-group is swapped, everywhere
    (building the fp32 partitions, the step, gradients, checkpoint save and load):
    `DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup`; a sub-group it answers no
    for is handled as one too small to swap is, in pageable RAM. The count is fixed the first
    time an optimizer asks, from its number of sub-groups (each rank its own)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    global _resident_fraction
    _resident_fraction = fraction
    original = DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup
    if getattr(original, _RESIDENT_MARK, False):
        return

    def swappable(self: Any, sub_group_id: int) -> bool:
        if not original(self, sub_group_id):
            return False
        keep = self.__dict__.get(_RESIDENT_MARK)
        if keep is None:
            keep = resident_sub_groups(_resident_fraction, len(self.fp16_partitioned_groups_flat))
            setattr(self, _RESIDENT_MARK, keep)
        return bool(sub_group_id >= keep)

    setattr(swappable, _RESIDENT_MARK, True)
    DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup = swappable


def quiet_ssd_endurance_warning() -> None:
    """DeepSpeed's async-I/O op logs a paragraph about consumer SSDs' write endurance at the
    first write, in the middle of the progress bar and of every pod's log. The op checks a
    marker on `deepspeed.utils` first (`deepspeed_aio_op_desc.cpp`); with it set, the
    runtime says the same once, with this run's figures (a `log` event)."""
    import deepspeed.utils

    deepspeed.utils._deepspeed_nvme_write_warning_emitted = True


def swap_each_parameter_in_once() -> None:
    """ZeRO-3's NVMe prefetch (`PartitionedParameterCoordinator.__prefetch_nvme_param_partitions`)
    collects the parameters to swap in from the step's trace, where a parameter used at the end
    of the forward pass and again at the start of the backward pass (the output embedding)
    comes twice. Both copies are still NOT_AVAILABLE when collected, so the swapper is asked for
    the same parameter twice in one call and asserts ("param 26 already assigned swap buffer
    id 14"): a tiny Qwen2 with a 8,192-token vocabulary and its parameters on NVMe failed in
    its first step (tests/integration/test_planner_measured.py). Each parameter is swapped in
    once; the order is kept."""
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

    original = AsyncPartitionedParameterSwapper.swap_in
    if getattr(original, _MARK, False):
        return

    def swap_in(self: Any, params: list[Any], async_op: bool = True, swap_in_buffers: Any = None) -> Any:
        if swap_in_buffers is None:
            unique: dict[int, Any] = {}
            for param in params:
                unique.setdefault(id(param), param)
            params = list(unique.values())
        return original(self, params, async_op, swap_in_buffers)

    setattr(swap_in, _MARK, True)
    AsyncPartitionedParameterSwapper.swap_in = swap_in


_ZENFLOW_MARK = "_spillway_zenflow_views"


def view_zenflow_weights_in_column_order() -> None:
    """ZenFlow (ZeRO-1/2) flattens each matrix column by column, so that a column of it is
    contiguous (`zenflow_utils._flatten_dense_tensors`), but DeepSpeed 0.19.8's
    `DeepSpeedZeroOptimizer._update_model_bit16_weights` views every parameter row by row
    (`flat.narrow(offset, numel).view(shape)`; it called `self.unflatten` before). Every
    weight matrix of a ZenFlow run was scrambled as the engine was built, its values in other
    places, and again after each optimizer step; its gradients are mapped column by column, so
    the updates landed on other weights than the ones they were for: a 0.1M-parameter Llama's
    first loss was not the model's (5.569 where ZeRO-Offload's is 5.563, every value moved by
    up to 0.13) and training barely learned (tests/integration/test_zenflow.py). Here a ZenFlow
    optimizer views each matrix column by column, at DeepSpeed's offsets (padding included)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer._update_model_bit16_weights
    if getattr(original, _ZENFLOW_MARK, False):
        return

    def update(self: Any, group_index: int) -> None:
        if not getattr(self, "zenflow", False):
            original(self, group_index)
            return
        flat = self.bit16_groups_flat[group_index]
        for p, meta, offset in zip(self.round_robin_bit16_groups[group_index], self.round_robin_bit16_meta[group_index],
                                   self.round_robin_bit16_offsets[group_index], strict=True):
            block = flat.narrow(0, offset, meta.numel())
            p.data = (block.view(meta.shape[1], meta.shape[0]).t() if meta.dim() == 2 else block.view(meta.shape)).data
        for param_index, param in enumerate(self.bit16_groups[group_index]):
            param.data = self.round_robin_bit16_groups[group_index][
                self.round_robin_bit16_indices[group_index][param_index]].data

    setattr(update, _ZENFLOW_MARK, True)
    DeepSpeedZeroOptimizer._update_model_bit16_weights = update


_TWIN_FLOW_MARK = "_spillway_twin_flow"
_ADAM_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
_twin_flow_originals: dict[str, Any] = {}  # DeepSpeed's own ZeRO-3 methods that the mends below wrap


def run_twin_flow_as_deepspeed_describes_it() -> None:
    """Twin-Flow (`offload_optimizer.ratio`, Spillway's offload.gpuResidentFraction): DeepSpeed
    0.19.8 keeps the first int((1 - ratio) x n) of a rank's n optimizer sub-groups on the
    accelerator and steps them with a second optimizer, a torch AdamW (`backup_optimizer`).
    Three defects, each found on the CPU suite's tiny Llama (tests/integration/test_twin_flow.py):

    - The AdamW's first param group is built with the learning rate, betas, eps and weight
      decay the CPU Adam had when the engine was built, and nothing updates them (Spillway
      passes one group): the learning-rate schedule never reached the share on the accelerator
      (warmup and decay ran on the CPU's sub-groups only; the accelerator's trained at the
      configured peak rate from the first step). Here each of its steps takes them from the CPU
      Adam's groups first (`_twin_flow_step`).
    - A checkpoint holds the CPU Adam's state only: the AdamW's moments and step counts were in
      none, so a resumed run's accelerator share restarted Adam from zero. Here they are written
      into the checkpoint's optimizer state beside the CPU Adam's, under the sub-group's index
      and in its format (`step`, `exp_avg`, `exp_avg_sq`), and moved back into the AdamW after a
      load (`_twin_flow_state_dict`, `_twin_flow_load_state_dict`). A checkpoint so written
      resumes with every sub-group on the CPU Adam too. (DeepSpeed's universal checkpoint load
      is not mended: the runtime refuses a Twin-Flow resume through it.)
    - On the CPU accelerator the share is mapped to the device named "cpu", which the step
      takes for the CPU Adam's: Twin-Flow silently did not run, and `spillway run` on one
      machine trained another optimizer than the GPU pod. Here the share is put on "cpu:0"
      (the same memory), so the AdamW steps it there as it does on a GPU
      (`_twin_flow_fp32_partitions`).
    """
    from deepspeed.runtime.zero import stage3

    cls = stage3.DeepSpeedZeroOptimizer_Stage3
    if getattr(cls._optimizer_step, _TWIN_FLOW_MARK, False):
        return
    for name, function in (("_create_fp32_partitions", _twin_flow_fp32_partitions), ("_optimizer_step", _twin_flow_step),
                           ("_rigid_state_dict", _twin_flow_state_dict),
                           ("_rigid_load_state_dict", _twin_flow_load_state_dict)):
        _twin_flow_originals[name] = getattr(cls, name)
        setattr(function, _TWIN_FLOW_MARK, True)
        setattr(cls, name, function)


class _CpuShareNamed:
    """The accelerator, with the device name Twin-Flow's share is put on: "cpu:0"."""

    _name = "cpu:0"

    def __init__(self, accelerator: Any):
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


def _twin_flow_fp32_partitions(self: Any) -> Any:
    from deepspeed.runtime.zero import stage3

    create = _twin_flow_originals["_create_fp32_partitions"]
    real = stage3.get_accelerator
    if not (self.offload_optimizer and self.partial_offload != 1.0 and real()._name == "cpu"):
        return create(self)
    stage3.get_accelerator = lambda: _CpuShareNamed(real())  # read once here: the share's device name
    try:
        return create(self)
    finally:
        stage3.get_accelerator = real


def _twin_flow_step(self: Any, sub_group_id: int) -> Any:
    backup = getattr(self, "backup_optimizer", None)
    if backup is not None:
        for mine, theirs in zip(backup.param_groups, self.optimizer.param_groups, strict=True):
            for key in _ADAM_HYPERPARAMETERS:
                mine[key] = theirs[key]
    return _twin_flow_originals["_optimizer_step"](self, sub_group_id)


def _twin_flow_state_dict(self: Any) -> Any:
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    state_dict = _twin_flow_originals["_rigid_state_dict"](self)
    backup = getattr(self, "backup_optimizer", None)
    if backup is None:
        return state_dict
    states = state_dict[OPTIMIZER_STATE_DICT]["state"]
    for index, flat in _accelerator_share(self):
        state = backup.state.get(flat)
        if state:
            states[index] = {"step": int(float(state["step"])), "exp_avg": state["exp_avg"],
                             "exp_avg_sq": state["exp_avg_sq"]}
    return state_dict


def _twin_flow_load_state_dict(self: Any, state_dict: Any, load_optimizer_states: bool = True) -> Any:
    import torch

    backup = getattr(self, "backup_optimizer", None)
    if backup is not None and load_optimizer_states:
        backup.state.clear()  # an in-process rollback would otherwise hold both copies a while
    loaded = _twin_flow_originals["_rigid_load_state_dict"](self, state_dict, load_optimizer_states)
    if backup is None or not load_optimizer_states:
        return loaded
    # The load replaced the CPU Adam's group dicts; those DeepSpeed shared with the AdamW
    # (`add_param_group`, groups after the first) still list every sub-group of theirs
    for group in backup.param_groups:
        group["params"] = []
    for _index, flat in _accelerator_share(self):
        state = self.optimizer.state.pop(flat, None)
        if state and "exp_avg" in state:
            backup.state[flat] = {"step": torch.tensor(float(state["step"]), dtype=torch.float32),
                                  "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
    return loaded


def _accelerator_share(zero: Any) -> list[tuple[int, Any]]:
    """(index in the CPU Adam's state dict, fp32 flat partition) of each sub-group Twin-Flow
    keeps on the accelerator: the index torch's `Optimizer.state_dict` gives it, over the
    param groups as ZeRO-3 fills them for a checkpoint."""
    zero._set_fp32_optimizer_param_groups()
    try:
        index = {id(p): i for i, p in enumerate(p for group in zero.optimizer.param_groups for p in group["params"])}
    finally:
        zero._clear_fp32_optimizer_param_groups()
    return [(index[id(flat)], flat) for i, flat in enumerate(zero.fp32_partitioned_groups_flat)
            if zero.subgroup_to_device[i] != "cpu"]


_ONE_STEP_MARK = "_spillway_one_step_gradients"
_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"  # the name-mangled map
_one_step_originals: dict[str, Any] = {}  # DeepSpeed's own ZeRO-3 methods that the mend below wraps


def one_step_gradient_partitions(zero: Any) -> bool:
    """Whether ZeRO-3 optimizer `zero` takes the mend below (`estimates.gradient_partition_held`'s
    rule, read from the optimizer)."""
    import torch

    dtype: DType = "fp16" if zero.dtype == torch.float16 else "fp32" if zero.dtype == torch.float32 else "bf16"
    # a subclass with its own `partition_grads` (SuperOffload's) would never free the partitions
    own = type(zero).partition_grads is _partition_grads_then_free
    return (own and bool(zero.offload_optimizer) and not _whole_gradient_buffer
            and not gradient_partition_held(zero.gradient_accumulation_steps, dtype, bool(zero.zenflow)))


def gradient_buffer_bytes(engine: Any) -> int | None:
    """What DeepSpeed's whole-model 16-bit gradient buffer of `engine`'s ZeRO-3 optimizer holds
    (0 under the mend below); None without one (no ZeRO-3 optimizer, or ZeRO-2)."""
    buffer = getattr(getattr(engine, "optimizer", None), "grad_partitions_flat_buffer", None)
    return None if buffer is None else int(buffer.numel() * buffer.element_size())


def hold_one_steps_gradient_partitions_only() -> None:
    """ZeRO-3 with the optimizer offloaded: DeepSpeed 0.19.8 allocates a 16-bit gradient partition
    of the whole model in host RAM (`grad_partitions_flat_buffer`, 2 B/param, pinned where
    pin_memory is on) to accumulate gradients over the micro-steps of an optimizer step. Every
    micro-step copies each reduced partition down into it and back up to the device
    (`partition_grads`), and at the boundary converts it to fp32 for the CPU Adam or the swap
    files. With one micro-step a step nothing accumulates, yet the buffer stays: on 64 GiB of RAM
    it is what binds the largest model with everything on NVMe (25.0B, 47.0 GiB of it the
    buffer). With one micro-step a step (and no fp16 loss scaling, whose overflow check reads the
    buffer, and no ZenFlow), each parameter's partition is allocated on the device when its
    bucket is reduced and freed once the boundary's copy has taken it: no buffer in RAM, no
    16-bit round trip to the host, the same values (tests/integration/test_one_step_gradients.py)."""
    import deepspeed
    from deepspeed.runtime.zero import stage3

    if deepspeed.__version__ != "0.19.8":  # `_setup_without_the_gradient_buffer` is that version's set-up, in part
        raise RuntimeError(f"deepspeed {deepspeed.__version__}: Spillway's ZeRO-3 mends are for 0.19.8, the version "
                           "it pins; install that one")
    cls = stage3.DeepSpeedZeroOptimizer_Stage3
    if getattr(cls.partition_grads, _ONE_STEP_MARK, False):
        return
    for name, function in (("_setup_for_real_optimizer", _setup_without_the_gradient_buffer),
                           ("partition_grads", _partition_grads_then_free),
                           ("_finalize_offload_gradient_accumulation", _finalize_then_free)):
        _one_step_originals[name] = getattr(cls, name)
        setattr(function, _ONE_STEP_MARK, True)
        setattr(cls, name, function)


class _PartitionsOnDemand(dict):  # type: ignore[type-arg]
    """ds_id -> its 16-bit gradient partition, allocated (zeroed, as DeepSpeed's buffer is) on
    the device the first time `partition_grads` asks for it."""

    def __init__(self, numel: dict[int, int], dtype: Any, device: str):
        super().__init__()
        self._numel, self._dtype, self._device = numel, dtype, device

    def __missing__(self, ds_id: int) -> Any:
        import torch

        self[ds_id] = partition = torch.zeros(self._numel[ds_id], dtype=self._dtype, device=self._device)
        return partition


def _setup_without_the_gradient_buffer(self: Any) -> Any:
    if not one_step_gradient_partitions(self):
        return _one_step_originals["_setup_for_real_optimizer"](self)
    import torch
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed 0.19.8's `_setup_for_real_optimizer` up to the buffer, which is left out (and
    # but for its log lines)
    self._create_fp32_partitions()
    dist.barrier()
    self._create_next_swappable_fp32_groups()
    self.initialize_optimizer_states()
    dist.barrier()
    device = get_accelerator().current_device_name()
    if self.contiguous_gradients:
        for dtype, bucket in self.ipg_buckets.items():
            bucket.buffer = torch.empty(self.reduce_bucket_size, dtype=dtype, device=device)
    self.grad_partitions_flat_buffer = torch.empty(0, dtype=self.gradient_accumulation_dtype, device=device)
    numel = {param.ds_id: param.partition_numel() for group in self.fp16_groups for param in group}
    setattr(self, _GRAD_PARTITIONS, _PartitionsOnDemand(numel, self.gradient_accumulation_dtype, device))
    return None


def _partition_grads_then_free(self: Any, params_to_release: list[Any], grad_partitions: list[Any]) -> Any:
    buffers = _one_step_originals["partition_grads"](self, params_to_release, grad_partitions)
    partitions = self.__dict__.get(_GRAD_PARTITIONS)
    if isinstance(partitions, _PartitionsOnDemand) and self.is_gradient_accumulation_boundary():
        for param in params_to_release:  # the boundary's copy (fp32, for the CPU Adam or the swap) has them
            partitions.pop(param.ds_id, None)
    return buffers


def _finalize_then_free(self: Any) -> Any:
    """DeepSpeed's unmanaged accumulation (the boundary at `engine.step`, which Spillway does
    not use): the boundary's copies read the partitions on the current stream, not the reduce
    stream they were allocated on, so they are recorded on it before they are freed."""
    from deepspeed.accelerator import get_accelerator

    finalized = _one_step_originals["_finalize_offload_gradient_accumulation"](self)
    partitions = self.__dict__.get(_GRAD_PARTITIONS)
    if isinstance(partitions, _PartitionsOnDemand):
        if not get_accelerator().is_synchronized_device():
            for partition in partitions.values():
                partition.record_stream(get_accelerator().current_stream())
        partitions.clear()
    return finalized
