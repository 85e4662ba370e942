"""The largest model a node fits: "what is the biggest model I can fine-tune here?".

Where this sits: on top of the planner, using its placements and the same arithmetic
`plan_tiers` scores them with (package-internal helpers); `spillway plan --max-params`
prints it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pydantic import BaseModel, Field

from spillway_runtime.core.hardware import NodeHardware
from spillway_runtime.core.planner import (
    _PLACEMENTS,
    ModelShape,
    PlacementInputs,
    _allowed,
    _evaluate,
    _label,
    _processes,
)
from spillway_runtime.core.spec import Offload, Training
from spillway_runtime.core.spec_types import DType, Tier
from spillway_runtime.core.tier_sizing import size_placement, tier_parts
from spillway_runtime.core.units import format_bytes


class LargestFit(BaseModel):
    """The largest Llama-shaped model one placement fits on a node, with the settings given."""

    placement: str
    parameters: int = Field(description="0 when this placement fits no model here")
    predicted_step_seconds: float | None = None
    why_not: str | None = Field(None, description="Why the placement is out (the job's settings, no NVMe)")
    bound_by: str | None = Field(None, description="What stops a larger model: the tier short at the next size, "
                                 "and what fills it")


def largest_model(
    hw: NodeHardware,
    training: Training | None = None,
    offload: Offload | None = None,
    *,
    dtype: DType = "bf16",
    gpus_per_node: int | None = None,
    nodes: int = 1,
    cpu_processes: int = 1,
) -> list[LargestFit]:
    """For each placement the settings allow: the largest parameter count that fits (a
    Llama shape from `ModelShape.from_param_count`, sequence length and batch as given),
    found by bisection on the same arithmetic `plan_tiers` uses, to 3 significant digits,
    and the predicted step time at that size. The answer to "what is the biggest model I
    can fine-tune here?"."""
    training = training or Training()
    offload = offload or Offload()
    gpus, ranks_per_node = _processes(hw, gpus_per_node, cpu_processes)
    out: list[LargestFit] = []
    for stage, optimizer, parameters in _PLACEMENTS:
        label = _label(stage, optimizer, parameters)
        why = _allowed(offload, stage, optimizer, parameters)
        if why is None and "nvme" in (optimizer, parameters) and hw.nvme_free_bytes <= 0:
            why = "node has no NVMe volume"
        if why is not None:
            out.append(LargestFit(placement=label, parameters=0, why_not=why))
            continue

        def inputs_at(params: int, s: int = stage, o: Tier = optimizer, p: Tier = parameters) -> PlacementInputs:
            return PlacementInputs(
                shape=ModelShape.from_param_count(params), hw=hw, training=training, dtype=dtype, stage=s,
                optimizer=o, parameters=p, gpus_per_node=gpus, ranks_per_node=ranks_per_node, nodes=nodes,
            )

        def fits(params: int) -> bool:
            return _evaluate(inputs_at(params)).feasible

        params = _largest_fitting(fits)
        step = _evaluate(inputs_at(params)).predicted_step_seconds if params else None
        bound = None
        if params < LARGEST_SEARCHED:
            past = _past(params, fits)
            bound = _what_binds(inputs_at(past)) if past is not None else None
        out.append(LargestFit(placement=label, parameters=params, predicted_step_seconds=step, bound_by=bound))
    return out


def _past(params: int, fits: Callable[[int], bool]) -> int | None:
    """The first count 1%, 2%, ... 8% past the answer that does not fit (None if each does): the
    answer is rounded down to 3 digits, and the model shapes of nearby counts differ (layers,
    widths), so what fits is not monotonic in the count near the bound, and 1% past may fit."""
    for percent in range(1, 9):
        past = max(10**6, params + max(1, params * percent // 100))
        if not fits(past):
            return past
    return None


_NOT_PER_PARAM = {"swap buffers", "training processes", "activations", "swap files"}


def _what_binds(placement: PlacementInputs) -> str | None:
    """The tiers a model just past the largest is short of, each with its usable bytes and what
    fills it, largest first: "CPU RAM, 58.9 GiB usable: model states 49.5 GiB (2.0 B/param),
    swap buffers 10.0 GiB, training processes 1.8 GiB"."""
    sized = size_placement(placement)
    parts_of, params = tier_parts(placement, sized), placement.shape.params
    said = []
    for shortfall in sized.shortfalls:
        parts = sorted(((b, name) for name, b in parts_of[shortfall.tier].items() if b > 0), reverse=True)
        filled = ", ".join(f"{name} {format_bytes(b)}" + ("" if name in _NOT_PER_PARAM else f" ({b / params:.1f} B/param)")
                           for b, name in parts)
        said.append(f"{shortfall.label}, {format_bytes(shortfall.have_bytes)} usable: {filled}")
    return "; ".join(said) or None


LARGEST_SEARCHED = 10**13  # 10T parameters: beyond any node


def _largest_fitting(fits: Callable[[int], bool], low: int = 10**6) -> int:
    """The largest count in [low, LARGEST_SEARCHED] that fits, to 3 significant digits
    (bisection on a log scale: memory grows with the count); 0 when not even `low` fits."""
    if not fits(low):
        return 0
    if fits(LARGEST_SEARCHED):
        return LARGEST_SEARCHED
    lo, hi = low, LARGEST_SEARCHED
    while hi - lo > max(1, lo // 2000):
        mid = (lo + hi) // 2 if hi < 4 * lo else math.isqrt(lo * hi)
        if fits(mid):
            lo = mid
        else:
            hi = mid
    digits = len(str(lo)) - 3
    rounded = lo // 10**digits * 10**digits if digits > 0 else lo
    return rounded if fits(rounded) else lo
