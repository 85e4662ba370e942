"""The run's schedule and its guards: the learning rate at each step, whether a step's loss
means the run has diverged (`spec.rollback`), and whether the held-out loss has stopped
improving (`training.earlyStopping`). Pure functions of what a checkpoint restores.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any


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


@dataclass
class EarlyStopping:
    """`training.earlyStopping`: stop once `patience` evaluations in a row have not lowered the
    best held-out loss by more than `min_delta` (a NaN is no improvement). Its state goes into
    every checkpoint, so that a resumed run stops where the uninterrupted one does."""

    patience: int
    min_delta: float = 0.0
    best: float | None = None
    best_step: int | None = None
    waited: int = 0  # evaluations since the best

    def record(self, step: int, loss: float) -> bool:
        """The held-out loss at `step`; True: stop training now."""
        if loss == loss and (self.best is None or loss < self.best - self.min_delta):
            self.best, self.best_step, self.waited = loss, step, 0
            return False
        self.waited += 1
        return self.waited >= self.patience

    @property
    def exhausted(self) -> bool:
        """The patience ran out (restored from the checkpoint of the step that stopped)."""
        return self.waited >= self.patience

    def state(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "waited": self.waited}

    def restore(self, state: dict[str, Any] | None) -> None:
        """From a checkpoint's state (None: one written without early stopping: from scratch)."""
        state = state or {}
        self.best, self.best_step, self.waited = state.get("best"), state.get("best_step"), int(state.get("waited", 0))
