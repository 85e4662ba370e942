"""Two training processes under torchrun (gloo on the CPU), ZeRO-3 with the optimizer on
NVMe: each rank checkpoints its own shard and swap files, and a resume after SIGKILL of
the whole process group reproduces the uninterrupted run."""

import pytest

from spillway_runtime.runconfig import FaultInjection

from .conftest import run_job


@pytest.mark.integration
def test_two_processes_zero3_nvme_checkpoint_per_rank_and_resume(tmp_path, make_job):
    offload = {"optimizer": "nvme", "parameters": "cpu", "nvme": {"path": str(tmp_path / "nvme")}}
    job = make_job(training={"maxSteps": 8}, offload=offload)

    reference = run_job(job, tmp_path / "reference", processes=2)
    assert reference.returncode == 0, reference.log[-4000:]
    assert reference.of("started")[0]["world_size"] == 2
    ckpt = tmp_path / "reference" / "checkpoints" / "step-00000006"
    for rank in (0, 1):
        assert (ckpt / f"rank{rank}-spillway_state.pt").is_file()
        assert list((ckpt / "ds" / "offloaded_tensors" / f"rank{rank:02d}").glob("exp_avg-*.tensor.swp"))
        assert list((ckpt / "ds").glob(f"*zero_pp_rank_{rank}_*optim_states.pt"))

    killed = run_job(job, tmp_path / "run", processes=2, faults=FaultInjection(step_sleep_seconds=0.5),
                     signal_at_step=5)
    assert killed.returncode != 0
    resumed = run_job(job, tmp_path / "run", processes=2)
    assert resumed.returncode == 0, resumed.log[-4000:]
    start = resumed.of("resumed")[-1]["step"]
    assert start == 3
    expected, got = reference.losses(), resumed.losses()
    mismatches = {s: (got[s], expected[s]) for s in range(start + 1, 9) if got[s] != expected[s]}
    assert not mismatches, f"losses differ from the uninterrupted run (raw floats) at {mismatches}"
