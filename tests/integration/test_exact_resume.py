"""A run SIGKILLed mid-way and resumed reproduces the uninterrupted run's per-step losses,
for every placement of optimizer state and parameters."""

import pytest

from spillway_runtime.runconfig import FaultInjection

from .conftest import run_job

PLACEMENTS = [
    # (zero stage, optimizer, parameters)
    (2, "gpu", "gpu"),
    (2, "cpu", "gpu"),
    (3, "cpu", "gpu"),
    (3, "cpu", "cpu"),
    (3, "nvme", "gpu"),
    (3, "nvme", "cpu"),
    (3, "nvme", "nvme"),
]
MAX_STEPS = 10
KILL_AT = 6  # checkpoints at 3, 6 (maybe), 9: the kill lands after 3 and before 9


@pytest.mark.integration
@pytest.mark.parametrize(("stage", "optimizer", "parameters"), PLACEMENTS,
                         ids=[f"z{s}-opt_{o}-par_{p}" for s, o, p in PLACEMENTS])
def test_sigkill_and_resume_reproduces_losses(tmp_path, make_job, stage, optimizer, parameters):
    offload = {"optimizer": optimizer, "parameters": parameters, "nvme": {"path": str(tmp_path / "nvme")},
               "deepspeed": {"zero_optimization": {"stage": stage}}}
    job = make_job(model="wide", training={"maxSteps": MAX_STEPS}, offload=offload)

    reference = run_job(job, tmp_path / "reference")
    assert reference.returncode == 0, reference.log[-3000:]
    assert reference.config.plan.label == f"Z{stage} opt:{optimizer} par:{parameters}"
    expected = reference.losses()
    assert sorted(expected) == list(range(1, MAX_STEPS + 1))

    slow = FaultInjection(step_sleep_seconds=0.4)
    killed = run_job(job, tmp_path / "interrupted", faults=slow, signal_at_step=KILL_AT)
    assert killed.returncode == -9, killed.log[-3000:]
    assert not killed.of("finished")

    resumed = run_job(job, tmp_path / "interrupted")
    assert resumed.returncode == 0, resumed.log[-3000:]
    resume = resumed.of("resumed")[-1]
    assert 3 <= resume["step"] < MAX_STEPS
    got = resumed.losses()
    for step in range(resume["step"] + 1, MAX_STEPS + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), f"step {step}"

    # the state really went where the plan said: swap files of the predicted size (within 10%)
    predicted = reference.config.plan.bytes.nvme
    measured = max(e["bytes"].get("nvme", 0) for e in reference.of("step"))
    if "nvme" in (optimizer, parameters):
        assert measured == pytest.approx(predicted, rel=0.10)
    else:
        assert predicted == 0 and measured == 0
