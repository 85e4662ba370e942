"""The run's schedule and its guard: the learning rate at each step, and whether a step's loss
means the run has diverged (`spec.rollback`). Pure functions of what a checkpoint restores.
"""

from __future__ import annotations

import math
from collections import deque


class DivergencePolicy:
    """Decides whether a step's loss means the run has diverged."""

    def __init__(self, spike_factor: float, window: int):
        self.spike_factor = spike_factor
        self.history: deque[float] = deque(maxlen=window)

    def check(self, loss: float) -> str | None:
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if len(self.history) >= 3:
            average = sum(self.history) / len(self.history)
            if loss > self.spike_factor * average:
                return f"loss {loss:.4g} is above {self.spike_factor} x the running average {average:.4g}"
        return None

    def record(self, loss: float) -> None:
        self.history.append(loss)


def learning_rate(step: int, base: float, warmup: int, total: int, floor_ratio: float) -> float:
    """Linear warmup, then cosine decay to floor_ratio * base at the last step."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = base * floor_ratio
    return floor + (base - floor) * 0.5 * (1 + math.cos(math.pi * progress))
