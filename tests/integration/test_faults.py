"""Divergence rollback, damaged checkpoints, a full disk and a rollback asked for, on real
DeepSpeed. Preemption (SIGTERM: a checkpoint of the current step, exit 75, the resume) is
test_exact_resume.py's suspend test, which also checks the resume to the bit; a malformed
dataset line is test_run_bad_input.py's."""

import shutil
import subprocess
from pathlib import Path

import pytest

from spillway_runtime.checkpoints.store import CheckpointStore
from spillway_runtime.core.contract import ExitCode
from spillway_runtime.training.reporting import read_events
from spillway_runtime.training.runconfig import FaultInjection

from .conftest import run_job

pytestmark = pytest.mark.integration


def test_nan_batch_rolls_back_lowers_lr_and_skips_the_batch(tmp_path, make_job):
    job = make_job(training={"maxSteps": 10}, checkpoint={"everySteps": 2},
                   offload={"optimizer": "nvme", "nvme": {"path": str(tmp_path / "nvme")}})
    # micro-batch 10 belongs to step 6 (two micro-batches per step)
    run = run_job(job, tmp_path / "run", faults=FaultInjection(nan_micro_batches=[10]))
    assert run.returncode == 0, run.log[-3000:]
    [rollback] = run.of("rollback")
    assert rollback["step"] == 6 and rollback["checkpoint"] == "step-00000004" and rollback["to_step"] == 4
    assert "loss is nan" in rollback["reason"]
    assert rollback["skipped_micro_batches"] == [10, 12]
    assert rollback["lr_scale"] == 0.5
    steps = run.of("step")
    assert all(s["loss"] == s["loss"] for s in steps)  # no NaN was ever reported as a step
    assert [s["step"] for s in steps][-1] == 10
    after = [s for s in steps if s["step"] == 6][-1]
    assert after["data_position"] == 14  # steps 5 and 6 replayed, batches 10-11 skipped
    assert run.of("finished")[0]["rollbacks"] == 1


def test_loss_spike_counts_as_divergence(tmp_path, make_job):
    job = make_job(training={"maxSteps": 8}, checkpoint={"everySteps": 2})
    run = run_job(job, tmp_path / "run", faults=FaultInjection(spike_micro_batches=[12]))
    assert run.returncode == 0, run.log[-3000:]
    [rollback] = run.of("rollback")
    assert "running average" in rollback["reason"]


def test_too_many_rollbacks_fail_with_the_reason(tmp_path, make_job):
    job = make_job(training={"maxSteps": 10}, checkpoint={"everySteps": 2}, rollback={"maxRollbacks": 1})
    run = run_job(job, tmp_path / "run", faults=FaultInjection(nan_micro_batches=[8, 14]))
    assert run.returncode == ExitCode.DIVERGED
    [failed] = run.of("failed")
    assert "rollback.maxRollbacks is 1" in failed["reason"]
    assert len(run.of("rollback")) == 1 and run.of("diverged")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """Where this module keeps the finished six-step runs its tests each damage or roll back a
    copy of (tests/conftest.py keeps the module's tests on one worker), and their NVMe folders:
    a folder is part of the DeepSpeed config a checkpoint holds, so a copy resumes with it."""
    return tmp_path_factory.mktemp("finished")


def finished_copy(finished: Path, key: str, job: Path, target: Path) -> dict[int, float]:
    """JOB run once for the module (under FINISHED/KEY) and its folder copied to TARGET: the
    losses of its steps."""
    source = finished / key
    if not (finished / f"{key}.done").exists():
        shutil.rmtree(source, ignore_errors=True)
        first = run_job(job, source)
        assert first.returncode == 0, first.log[-3000:]
        (finished / f"{key}.done").touch()
    shutil.copytree(source, target)
    return {e["step"]: e["loss"] for e in read_events(target / "events.jsonl") if e["event"] == "step"}


def test_damaged_latest_checkpoint_falls_back_to_previous(tmp_path, make_job, finished):
    job = make_job(training={"maxSteps": 6}, checkpoint={"everySteps": 2})
    finished_copy(finished, "six-steps", job, tmp_path / "run")
    ckpts = tmp_path / "run" / "checkpoints"
    shard = next((ckpts / "step-00000006" / "ds").glob("*model_states.pt"))
    shard.write_bytes(shard.read_bytes()[:-7] + b"garbage")
    job2 = make_job(training={"maxSteps": 8}, checkpoint={"everySteps": 2})
    again = run_job(job2, tmp_path / "run")
    assert again.returncode == 0, again.log[-3000:]
    assert again.of("resumed")[-1]["checkpoint"] == "step-00000004"
    assert any("step-00000006 rejected" in e.get("message", "") for e in again.of("log"))


@pytest.mark.parametrize(("optimizer", "pattern"), [
    ("cpu", "*optim_states.pt.tensors"),
    ("nvme", "offloaded_tensors/*/exp_avg_sq-*"),  # checked at the end of the load
    ("nvme", "offloaded_tensors/*/[0-9]*.tensor.swp"),  # the fp32 masters: checked as they are cast
], ids=["cpu", "nvme-moment", "nvme-masters"])
def test_a_flipped_bit_in_a_tensor_file_is_found_as_it_is_read_and_the_previous_checkpoint_used(
        tmp_path, make_job, finished, optimizer, pattern):
    """The large files are checked while they are loaded, not read twice: one bit flipped in
    the optimizer state (the ZeRO file's tensors, or a swap file with the optimizer on NVMe)
    rejects that checkpoint and the restart resumes from the one before. The two NVMe cases
    damage copies of one run."""
    offload = {"optimizer": optimizer, "nvme": {"path": str(finished / f"nvme-{optimizer}")},
               "deepspeed": {"zero_optimization": {"stage": 3}}}
    job = make_job(training={"maxSteps": 6}, checkpoint={"everySteps": 2}, offload=offload)
    finished_copy(finished, f"z3-opt_{optimizer}", job, tmp_path / "run")
    latest = tmp_path / "run" / "checkpoints" / "step-00000006"
    [damaged] = list((latest / "ds").glob(pattern))
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    job2 = make_job(training={"maxSteps": 8}, checkpoint={"everySteps": 2}, offload=offload)
    again = run_job(job2, tmp_path / "run")
    assert again.returncode == 0, again.log[-3000:]
    assert again.of("resumed")[-1]["checkpoint"] == "step-00000004"
    rejected = [e["message"] for e in again.of("log") if "step-00000006 rejected" in e.get("message", "")]
    assert rejected and f"{damaged.name} does not match its checksum" in rejected[0]


def test_full_disk_during_checkpoint_keeps_the_last_good_one(tmp_path, make_job):
    small = tmp_path / "small"
    small.mkdir()
    # one Z2 checkpoint of the tiny model is ~11 MB: the first fits, the second cannot
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        job = make_job(training={"maxSteps": 6}, checkpoint={"everySteps": 2, "path": str(small)},
                       offload={"deepspeed": {"zero_optimization": {"stage": 2}}})
        run = run_job(job, tmp_path / "run")
        assert run.returncode == 1
        [failed] = run.of("checkpoint_failed")
        assert "no space left" in failed["reason"] and "last good checkpoint is intact" in failed["reason"]
        store = CheckpointStore(small, keep=5)
        assert (small / "latest").read_text() == "step-00000002"
        assert [c.name for c in store.list()] == ["step-00000002"]
        assert store.verify(small / "step-00000002") is None
        assert not list(small.glob(".staging-*"))
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_resume_from_rolls_back_once_and_keeps_the_abandoned_timeline(tmp_path, make_job, finished):
    job = make_job(training={"maxSteps": 6}, checkpoint={"everySteps": 2})
    losses_before = finished_copy(finished, "six-steps", job, tmp_path / "run")

    rollback_job = make_job(training={"maxSteps": 8}, checkpoint={"everySteps": 2})
    text = rollback_job.read_text().replace("spec:\n", "spec:\n  resumeFrom: step-00000002\n", 1)
    rollback_job.write_text(text)
    killed = run_job(rollback_job, tmp_path / "run", faults=FaultInjection(step_sleep_seconds=0.4),
                     signal_at_step=5)
    [rolled] = killed.of("rolled_back")
    assert rolled["checkpoint"] == "step-00000002"
    assert rolled["abandoned"] == ["step-00000004", "step-00000006"]
    # replaying from step 2 reproduces the original losses of steps 3 and 4
    replay = [e for e in killed.of("step") if e["time"] > rolled["time"]]
    assert replay[0]["step"] == 3 and replay[0]["loss"] == pytest.approx(losses_before[3], rel=1e-4)
    ckpts = tmp_path / "run" / "checkpoints"
    assert len(list(ckpts.glob("abandoned-*-step-00000006"))) == 1

    # the pod restarts with the same spec (resumeFrom still set): it continues, it does not roll back again
    again = run_job(rollback_job, tmp_path / "run")
    assert again.returncode == 0, again.log[-3000:]
    assert len(again.of("rolled_back")) == 1  # the events file spans both runs: still only the first
    assert again.of("resumed")[-1]["checkpoint"] == "step-00000004"
    assert max(again.losses()) == 8
