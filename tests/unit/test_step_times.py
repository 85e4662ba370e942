"""The steps' measured time against the plan's prediction (training.step_times)."""

from __future__ import annotations

from spillway_runtime.training.step_times import WINDOW, StepClock, step_time_line, timed_steps


def test_the_clock_leaves_the_first_step_out_and_keeps_the_mean_of_the_last_window() -> None:
    clock = StepClock(predicted_step_seconds=2.0)
    assert clock.record(30.0) == {}  # the first step: swap buffers, first pages
    assert clock.record(2.0) == {"step_seconds_mean": 2.0, "step_time_vs_plan": 1.0}
    assert clock.record(4.0) == {"step_seconds_mean": 3.0, "step_time_vs_plan": 1.5}
    for _ in range(WINDOW):
        fields = clock.record(1.0)
    assert fields == {"step_seconds_mean": 1.0, "step_time_vs_plan": 0.5}  # the early steps left the window
    unplanned = StepClock(None)  # a plan without a prediction: the mean alone
    assert unplanned.record(5.0) == {} and unplanned.record(1.0) == {"step_seconds_mean": 1.0}


def step(seconds: float) -> dict[str, object]:
    return {"event": "step", "step_seconds": seconds}


def test_each_launchs_first_step_is_left_out_of_the_runs_mean() -> None:
    events = [{"event": "started"}, step(9.0), step(1.0), step(1.2), {"event": "checkpoint"},
              {"event": "started"}, step(8.0), step(1.1), {"event": "step"}]
    assert timed_steps(events) == [1.0, 1.2, 1.1]


def test_the_last_line_puts_the_mean_beside_the_prediction_and_says_when_the_model_missed() -> None:
    events = [{"event": "started"}, step(9.0), step(1.0), step(1.2), step(1.1)]
    line = step_time_line(1.0, events)
    assert line == ("step time: 1.1 s on average over 3 steps (each launch's first left out); "
                    "the plan predicted 1 s: 1.10x")
    slow = step_time_line(0.5, events)
    assert slow is not None and "2.20x, outside 0.75-1.33" in slow and "spillway run --reprobe" in slow
    fast = step_time_line(2.0, events)
    assert fast is not None and "0.55x, outside" in fast
    assert step_time_line(None, events) == "step time: 1.1 s on average over 3 steps (each launch's first left out)"
    assert step_time_line(1.0, [{"event": "started"}, step(9.0)]) is None  # nothing but a first step
