"""The steps' measured time against the plan's prediction, so every run checks the step-time model.

A step event carries the step's own seconds: its micro-batches and optimizer step, not the
checkpoint or the evaluation after it. A process's first step is left out: it pays what
happens once (DeepSpeed's swap buffers and first swap-ins, the allocator's first pages).
The status shows the mean of the last `WINDOW` steps and that mean over the plan's
`predicted_step_seconds` (`progress.stepSeconds`, `progress.stepTimeVsPlan`), and
`spillway run` ends with the whole run's mean beside the prediction. The mean, not the
median: the prediction is a step's share of the run (ZenFlow's CPU step comes once in its
interval, and the median of its steps would leave it out). Outside `BAND` (where the
step-time model held on a quiet machine, docs/one-machine.md: outside it the model missed) the
line says so and how to measure the machine again.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

WINDOW = 20  # steps in the status's mean: a minute of a slow run, a moment of a tiny one
BAND = (0.75, 1.33)  # measured/predicted the step-time model holds to (bench_offload_overhead.py)


def vs_plan(seconds: float, predicted: float | None) -> float | None:
    return round(seconds / predicted, 3) if predicted else None


class StepClock:
    """The last WINDOW steps of this process, its first left out."""

    def __init__(self, predicted_step_seconds: float | None) -> None:
        self.predicted = predicted_step_seconds
        self._seen = 0
        self._recent: deque[float] = deque(maxlen=WINDOW)

    def record(self, seconds: float) -> dict[str, float]:
        """The fields a step event gains: none until a step after the first was timed."""
        self._seen += 1
        if self._seen == 1:
            return {}
        self._recent.append(seconds)
        mean = statistics.fmean(self._recent)
        ratio = vs_plan(mean, self.predicted)
        return {"step_seconds_mean": round(mean, 4), **({} if ratio is None else {"step_time_vs_plan": ratio})}


def timed_steps(events: list[dict[str, Any]]) -> list[float]:
    """The step seconds of every launch in `events` (one events.jsonl), each launch's first
    step (the one after its `started` event) left out."""
    out: list[float] = []
    first = True
    for event in events:
        kind = event.get("event")
        if kind == "started":
            first = True
        elif kind == "step" and isinstance(event.get("step_seconds"), int | float):
            if not first:
                out.append(float(event["step_seconds"]))
            first = False
    return out


def step_time_line(predicted_step_seconds: float | None, events: list[dict[str, Any]]) -> str | None:
    """`spillway run`'s last word on speed: the measured mean beside the plan's prediction."""
    steps = timed_steps(events)
    if not steps:
        return None
    mean = statistics.fmean(steps)
    line = f"step time: {mean:.3g} s on average over {len(steps)} step{'s' if len(steps) != 1 else ''} " \
           "(each launch's first left out)"
    ratio = vs_plan(mean, predicted_step_seconds)
    if ratio is None:
        return line
    line += f"; the plan predicted {predicted_step_seconds:.3g} s: {ratio:.2f}x"
    if not BAND[0] <= ratio <= BAND[1]:
        line += (f", outside {BAND[0]}-{BAND[1]}: the step-time model did not hold on this machine this time "
                 "(a machine busy with other work, or rates measured on another day: `spillway run --reprobe` "
                 "measures them again)")
    return line
