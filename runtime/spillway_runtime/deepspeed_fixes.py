"""Mends for DeepSpeed 0.19.8 defects that a Spillway placement runs into, each applied
only where that placement needs it, each with the test that found it.

Where this sits: the recipe calls `apply(plan)` before `deepspeed.initialize`.
"""

from __future__ import annotations

from typing import Any

from spillway_runtime.planner import OffloadPlan

_MARK = "_spillway_unique_params"


def apply(plan: OffloadPlan) -> None:
    if plan.parameters == "nvme":
        swap_each_parameter_in_once()
    if plan.uses_nvme:
        quiet_ssd_endurance_warning()


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
