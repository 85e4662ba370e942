"""offload.overlap zenflow: DeepSpeed's ZenFlow on the CPU accelerator, stopped and resumed.

ZenFlow updates the top 10% of gradient columns every step and applies the rest on the CPU
every 4 steps. DeepSpeed's checkpoint misses its own step counter, and the step counts and
learning rate of its top-k Adam: without Spillway's `zenflow_state`, the first resumed step
matched and the next ones drifted, by up to 3e-3 relative within 8 steps here. Here a
suspend at step 5 trains on to the update boundary at step 8, checkpoints there and exits;
the restart's losses and final checkpoint are the uninterrupted ZenFlow run's, bit for bit.
ZenFlow is really on: the same job without it has the same first loss and other losses from
the second step.
"""

from __future__ import annotations

import signal

import pytest

from spillway_runtime.checkpoints.store import checkpoint_name
from spillway_runtime.core.contract import ExitCode
from spillway_runtime.export import ExportError, export_checkpoint
from spillway_runtime.training.runconfig import FaultInjection

from .conftest import run_job
from .test_exact_resume import assert_same, final_checkpoint

MAX_STEPS = 16
INTERVAL = 4  # ZenFlow's update interval (Spillway's default): checkpoints fall on its boundaries


def zenflow_job(make_job, name: str, overlap: str = "zenflow"):
    return make_job(name, training={"maxSteps": MAX_STEPS, "gradientAccumulation": 1},
                    checkpoint={"everySteps": INTERVAL, "keep": 10}, rollback={"onDivergence": False},
                    offload={"optimizer": "cpu", "parameters": "gpu", "overlap": overlap})


@pytest.mark.integration
def test_a_zenflow_run_suspended_off_its_boundary_resumes_bit_identically(tmp_path, make_job, monkeypatch):
    # final_checkpoint reads the run at MAX_STEPS of test_exact_resume's module
    monkeypatch.setattr("tests.integration.test_exact_resume.MAX_STEPS", MAX_STEPS)
    reference = run_job(zenflow_job(make_job, "reference"), tmp_path / "reference")
    assert reference.returncode == 0, reference.log[-3000:]
    plan = reference.config.plan
    assert plan.label == "Z2 opt:cpu par:gpu"
    assert reference.config.deepspeed["zero_optimization"]["zenflow"]["update_interval"] == INTERVAL
    assert "ZenFlow: the CPU step" in " ".join(plan.reasons)
    assert sorted(reference.losses()) == list(range(1, MAX_STEPS + 1))

    plain = run_job(zenflow_job(make_job, "plain", overlap="none"), tmp_path / "plain")
    assert plain.returncode == 0, plain.log[-3000:]
    zenflow, offload = reference.losses(), plain.losses()
    # the model as it was built (DeepSpeed 0.19.8 scrambled ZenFlow's weight matrices:
    # deepspeed_fixes.view_zenflow_weights_in_column_order), then ZenFlow's updates, not ZeRO-Offload's
    assert zenflow[1] == offload[1] and zenflow[2] != offload[2]
    print("losses, ZenFlow / ZeRO-Offload:", [(zenflow[s], offload[s]) for s in (1, 4, 8, 12, 16)])
    assert zenflow[MAX_STEPS] < zenflow[1] - 0.5 * (offload[1] - offload[MAX_STEPS])  # it learns

    job = zenflow_job(make_job, "job")
    slow = FaultInjection(step_sleep_seconds=0.4)
    suspended = run_job(job, tmp_path / "run", faults=slow, signal_at_step=5, sig=signal.SIGTERM)
    assert suspended.returncode == ExitCode.PREEMPTED, suspended.log[-3000:]
    stopped_at = suspended.of("preempted")[-1]["step"]
    assert stopped_at == 2 * INTERVAL  # on to the next update boundary, not a checkpoint at 5, 6 or 7
    assert [c["step"] for c in suspended.of("checkpoint")] == [INTERVAL, 2 * INTERVAL]

    resumed = run_job(job, tmp_path / "run")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert resumed.of("resumed")[-1]["step"] == stopped_at
    expected, got = reference.losses(), resumed.losses()
    assert {s: got[s] for s in range(stopped_at + 1, MAX_STEPS + 1)} == {
        s: expected[s] for s in range(stopped_at + 1, MAX_STEPS + 1)}
    assert_same(final_checkpoint(resumed), final_checkpoint(reference), "final checkpoint")

    # ZenFlow's optimizer state is column by column: DeepSpeed's universal converter would scramble
    # the weights (`spillway export` of a checkpoint), and another overlap cannot load it
    with pytest.raises(ExportError, match=r"written with offload\.overlap zenflow"):
        export_checkpoint(resumed.run_dir / "checkpoints" / checkpoint_name(MAX_STEPS), tmp_path / "export")
    other = run_job(zenflow_job(make_job, "job", overlap="none"), tmp_path / "run")
    assert other.returncode == ExitCode.BAD_INPUT, other.log[-3000:]
    assert "was written with offload.overlap zenflow, this run has none" in other.log
