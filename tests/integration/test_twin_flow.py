"""offload.gpuResidentFraction: DeepSpeed's Twin-Flow on the CPU accelerator, stopped and resumed.

Twin-Flow keeps the first sub-groups of a CPU-RAM optimizer on the accelerator and steps them
with a torch AdamW. On the CPU accelerator the runtime puts that share on "cpu:0", so the same
AdamW steps it as on a GPU (`deepspeed_fixes.run_twin_flow_as_deepspeed_describes_it`). Three
things are shown here on a tiny Llama cut into 7 sub-groups, 3 of them on the "GPU":
- the share follows the learning-rate schedule (DeepSpeed 0.19.8 left its AdamW at the rate the
  engine was built with): the losses are those of the same job without Twin-Flow (all on the
  CPU Adam) within 1e-3 relative (measured: 2e-5 at step 4, 2e-4 at step 12: torch's AdamW
  rounds otherwise than DeepSpeed's CPU Adam, in bf16); without the mend they were 3e-3 apart
  at step 4 and 2e-2 at step 12;
- a run suspended mid-way resumes bit for bit: losses and final checkpoint equal to the
  uninterrupted Twin-Flow run's (DeepSpeed's checkpoint held none of the AdamW's moments);
- its checkpoint resumes without Twin-Flow too (every sub-group's moments on the CPU Adam);
- a rollback loads a checkpoint into the running engine, the GPU share's moments with it;
- DPO with full fine-tuning keeps a share of the policy's optimizer there too.
"""

from __future__ import annotations

import math
import shutil
import signal

import pytest

from spillway_runtime.core.contract import ExitCode
from spillway_runtime.training.runconfig import FaultInjection

from .conftest import run_job
from .test_dpo import EXAMPLES
from .test_exact_resume import assert_same, final_checkpoint

MAX_STEPS = 12
SUB_GROUP = 100_000  # elements: the tiny Llama's 0.9M parameters cut into 7 sub-groups


def twin_flow_job(make_job, name: str, share: float | None = 0.5):
    offload = {"optimizer": "cpu", "parameters": "gpu",
               "deepspeed": {"zero_optimization": {"stage": 3, "sub_group_size": SUB_GROUP}}}
    if share is not None:
        offload["gpuResidentFraction"] = share
    return make_job(name, training={"maxSteps": MAX_STEPS, "warmupSteps": 4}, checkpoint={"everySteps": 4},
                    offload=offload)


@pytest.mark.integration
def test_a_twin_flow_run_follows_the_schedule_and_resumes_bit_identically(tmp_path, make_job, monkeypatch):
    monkeypatch.setattr("tests.integration.test_exact_resume.MAX_STEPS", MAX_STEPS)
    reference = run_job(twin_flow_job(make_job, "reference"), tmp_path / "reference")
    assert reference.returncode == 0, reference.log[-3000:]
    plan = reference.config.plan
    assert plan.label == "Z3 opt:cpu par:gpu" and plan.swap.gpu_resident_fraction == 0.5
    assert reference.config.deepspeed["zero_optimization"]["offload_optimizer"]["ratio"] == 0.5
    [kept] = [r for r in plan.reasons if "kept and updated on the GPU" in r]
    [placed] = [e["message"] for e in reference.of("log") if e["message"].startswith("Twin-Flow:")]
    planned = kept.split(" sub-groups")[0].removeprefix("optimizer: ")
    assert placed.startswith(f"Twin-Flow: {planned} optimizer sub-groups kept and updated on cpu:0"), (kept, placed)
    assert int(planned.split(" of ")[1]) >= 6, planned
    assert sorted(reference.losses()) == list(range(1, MAX_STEPS + 1))

    plain = run_job(twin_flow_job(make_job, "plain", share=None), tmp_path / "plain")
    assert plain.returncode == 0, plain.log[-3000:]
    twin, cpu = reference.losses(), plain.losses()
    print("losses, Twin-Flow / CPU Adam:", [(twin[s], cpu[s]) for s in (1, 4, 8, 12)])
    assert twin[1] == cpu[1]  # the same model as built and the same batch: no update yet
    assert all(abs(twin[s] - cpu[s]) <= 1e-3 * abs(cpu[s]) for s in twin), (twin, cpu)
    assert twin[MAX_STEPS] < twin[1] - 0.2  # it learns

    job = twin_flow_job(make_job, "job")
    slow = FaultInjection(step_sleep_seconds=0.4)
    suspended = run_job(job, tmp_path / "run", faults=slow, signal_at_step=6, sig=signal.SIGTERM)
    assert suspended.returncode == ExitCode.PREEMPTED, suspended.log[-3000:]
    stopped_at = suspended.of("preempted")[-1]["step"]
    assert 6 <= stopped_at < MAX_STEPS

    # the same checkpoint, resumed with every sub-group on the CPU Adam: the moments move with it
    shutil.copytree(tmp_path / "run", tmp_path / "run-cpu")
    on_cpu = run_job(twin_flow_job(make_job, "job-on-cpu", share=None), tmp_path / "run-cpu")
    assert on_cpu.returncode == 0, on_cpu.log[-3000:]
    assert on_cpu.of("resumed")[-1]["step"] == stopped_at
    moved = on_cpu.losses()
    assert all(abs(moved[s] - twin[s]) <= 1e-3 * abs(twin[s]) for s in range(stopped_at + 1, MAX_STEPS + 1)), (
        moved, twin)

    resumed = run_job(job, tmp_path / "run")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert resumed.of("resumed")[-1]["step"] == stopped_at
    got = resumed.losses()
    assert {s: got[s] for s in range(stopped_at + 1, MAX_STEPS + 1)} == {
        s: twin[s] for s in range(stopped_at + 1, MAX_STEPS + 1)}
    assert_same(final_checkpoint(resumed), final_checkpoint(reference), "final checkpoint")

    # another number of processes goes through DeepSpeed's universal checkpoint, which would give
    # the GPU share's moments to the CPU Adam: refused, by name
    resharded = run_job(job, tmp_path / "run", processes=2)
    assert resharded.returncode == ExitCode.BAD_INPUT, resharded.log[-3000:]
    assert "does not carry the Adam moments of Twin-Flow's GPU share" in resharded.log


@pytest.mark.integration
def test_a_rollback_in_the_running_process_restores_the_gpu_shares_moments(tmp_path, make_job):
    """A NaN micro-batch at step 6 rolls the running engine back to step 4's checkpoint, loaded
    into the live engine. The GPU share's AdamW must take the checkpoint's moments and step
    counts, not keep those of the abandoned steps: the run is the same job's without Twin-Flow
    within 1e-3 at every step (with the load's mend off, the steps after the rollback were not)."""
    nan_at_step_6 = FaultInjection(nan_micro_batches=[10])  # two micro-batches a step
    twin = run_job(twin_flow_job(make_job, "twin"), tmp_path / "twin", faults=nan_at_step_6)
    assert twin.returncode == 0, twin.log[-3000:]
    [rollback] = twin.of("rollback")
    assert rollback["step"] == 6 and rollback["checkpoint"] == "step-00000004"
    plain = run_job(twin_flow_job(make_job, "plain", share=None), tmp_path / "plain", faults=nan_at_step_6)
    assert plain.returncode == 0, plain.log[-3000:]
    assert [(r["step"], r["checkpoint"]) for r in plain.of("rollback")] == [(6, "step-00000004")]
    after, cpu = twin.losses(), plain.losses()
    assert sorted(after) == list(range(1, MAX_STEPS + 1)) and all(math.isfinite(loss) for loss in after.values())
    assert all(abs(after[s] - cpu[s]) <= 1e-3 * abs(cpu[s]) for s in range(5, MAX_STEPS + 1)), (after, cpu)


@pytest.mark.integration
def test_full_fine_tuning_dpo_keeps_a_share_of_the_policys_optimizer_on_the_gpu(tmp_path, tiny_model):
    """DPO with full fine-tuning: the policy's optimizer keeps 3 of its 7 sub-groups on the "GPU";
    the frozen reference is an engine without an optimizer, which Twin-Flow does not touch. The
    losses and log-probabilities are the same job's without Twin-Flow within 1e-3 relative, the
    reward margins within 1e-3; killed after a checkpoint and restarted, it reports the same
    steps to the bit."""
    import yaml

    example = EXAMPLES / "dpo-lora-local.yaml"

    def dpo_job(name: str, share: float | None):
        doc = yaml.safe_load(example.read_text())
        spec = doc["spec"]
        spec["model"]["uri"] = str(tiny_model["model"])
        spec["dataset"]["uri"] = str((example.parent / spec["dataset"]["uri"]).resolve())
        spec["dataset"].pop("validation")
        spec["method"] = {"type": "full", "objective": "dpo", "beta": 0.1}
        spec["training"].update({"maxSteps": 6, "microBatchSize": 2, "gradientAccumulation": 1,
                                 "learningRate": 1e-3, "evalEverySteps": 0, "warmupSteps": 2})
        spec["offload"] = {"optimizer": "cpu", "parameters": "gpu",
                           "deepspeed": {"zero_optimization": {"stage": 3, "sub_group_size": SUB_GROUP}},
                           **({"gpuResidentFraction": share} if share else {})}
        spec["checkpoint"] = {"everySteps": 3, "keep": 1}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    twin = run_job(dpo_job("twin", 0.5), tmp_path / "twin")
    assert twin.returncode == 0, twin.log[-3000:]
    [placed] = [e["message"] for e in twin.of("log") if e["message"].startswith("Twin-Flow:")]
    assert placed.startswith("Twin-Flow: 3 of 7 optimizer sub-groups kept and updated on cpu:0"), placed
    assert any("DPO reference: a frozen copy of the base" in e.get("message", "") for e in twin.of("log"))
    plain = run_job(dpo_job("plain", None), tmp_path / "plain")
    assert plain.returncode == 0, plain.log[-3000:]
    ours, theirs = ({e["step"]: e for e in run.of("step")} for run in (twin, plain))
    assert sorted(ours) == sorted(theirs) == list(range(1, 7))
    assert ours[1]["loss"] == theirs[1]["loss"]  # no update yet
    for s in ours:
        assert ours[s]["loss"] == pytest.approx(theirs[s]["loss"], rel=1e-3), (s, ours[s], theirs[s])
        assert ours[s]["rewards/margins"] == pytest.approx(theirs[s]["rewards/margins"], abs=1e-3), (s, ours[s])
        for logps in ("logps/chosen", "logps/rejected"):
            assert ours[s][logps] == pytest.approx(theirs[s][logps], rel=1e-3), (s, logps, ours[s], theirs[s])
    assert ours[6]["loss"] < ours[1]["loss"]  # it learns

    # SIGKILLed after step 3's checkpoint and restarted: the share's moments come back with it,
    # and steps 4-6 report what the uninterrupted run did, to the bit
    job = dpo_job("killed", 0.5)
    killed = run_job(job, tmp_path / "killed", faults=FaultInjection(step_sleep_seconds=0.4), signal_at_step=4)
    assert killed.returncode == -9, killed.log[-3000:]
    resumed = run_job(job, tmp_path / "killed")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert resumed.of("resumed")[-1]["step"] == 3
    quantities = ("loss", "rewards/margins", "logps/chosen", "logps/rejected")
    again = {e["step"]: e for e in resumed.of("step")}
    assert {s: [again[s][q] for q in quantities] for s in (4, 5, 6)} == {
        s: [ours[s][q] for q in quantities] for s in (4, 5, 6)}
