"""Resume across shapes: a checkpoint written by 2 processes under ZeRO-2 (optimizer on the
CPU) resumed by 1 process under ZeRO-3 (optimizer on the CPU, then on NVMe), by 1 process
under ZeRO-2 from ZeRO-3, by 2 processes with the optimizer moved onto NVMe alone, and one
written with the optimizer on NVMe resumed in memory, each continues the run: the same step,
the same samples next, the same learning-rate schedule, and losses that follow the
uninterrupted 2-process run's to within float32 rounding.

The global batch is kept (1 process accumulates 4 micro-batches where 2 processes
accumulated 2 each), so the two runs take the same optimizer steps on the same samples and
differ only in the order that floating-point sums run in (the gradient all-reduce against a
local accumulation, ZeRO-2's flat partitions against ZeRO-3's, the gradient norm summed over
other sub-groups). In float32 that moved the prototype's losses by at most 2.7e-7 relative
over 12 steps (these tests': at most 6.1e-8); `LOSS_RTOL` allows 40 times the prototype's,
while a resume that lost the Adam moments, the learning rate or the data position moves
losses by 1e-3 or more within two steps (the prototype's resume without moments: 1e-2 at the
second step after it; the first step's loss depends on the weights alone). What is still
refused (parameters on NVMe, LoRA) is in tests/unit/test_universal.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spillway_runtime.checkpoints.store import checkpoint_name

from .conftest import run_job
from .test_exact_resume import copy_checkpoint

MAX_STEPS = 12
EVERY = 4
MICRO_BATCH = 2
LOSS_RTOL = 1e-5


def shaped_job(make_job, name: str, stage: int, optimizer: str, accumulation: int, nvme: Path,
               sub_group_size: int | None = None) -> Path:
    zero: dict[str, Any] = {"stage": stage}
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    offload: dict[str, Any] = {"optimizer": optimizer, "parameters": "gpu", "nvme": {"path": str(nvme)},
                               "deepspeed": {"zero_optimization": zero}}
    return make_job(name, dtype="fp32", offload=offload, checkpoint={"everySteps": EVERY, "keep": 5},
                    training={"maxSteps": MAX_STEPS, "microBatchSize": MICRO_BATCH,
                              "gradientAccumulation": accumulation})


def steps_of(run) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in run.of("step")}


def resume(make_job, reference, root: Path, name: str, stage: int, optimizer: str, processes: int,
           sub_group_size: int | None = None):
    """A copy of the reference's step-4 checkpoint resumed by `processes` processes, the global
    batch kept (4 micro-batches between them)."""
    copy_checkpoint(reference.run_dir, root / name, checkpoint_name(EVERY))
    job = shaped_job(make_job, f"{name}-job", stage, optimizer, 4 // processes, root / f"{name}-nvme", sub_group_size)
    return run_job(job, root / name, processes=processes)


def assert_continues(resumed, reference, written: tuple[int, int, str], resumed_with: tuple[int, int, str]) -> None:
    """The resumed run took the universal path from `written` to `resumed_with` (processes,
    stage, optimizer) and continued the reference: the same samples, learning rate and,
    within `LOSS_RTOL`, losses."""
    assert resumed.returncode == 0, resumed.log[-3000:]
    processes, stage, optimizer = resumed_with
    assert resumed.config.plan.label == f"Z{stage} opt:{optimizer} par:gpu"
    assert resumed.of("resumed")[-1]["step"] == EVERY
    [resharded] = resumed.of("resharded")
    for side, shape in (("from", written), ("to", resumed_with)):
        assert (resharded[side]["worldSize"], resharded[side]["stage"], resharded[side]["optimizer"]) == shape
    # the converted copy lived in a staging folder, removed once every rank had loaded it
    assert not list((resumed.run_dir / "checkpoints").glob(".staging-*"))

    expected, got = steps_of(reference), steps_of(resumed)
    assert sorted(got) == list(range(EVERY + 1, MAX_STEPS + 1))
    for step in got:
        # the same samples consumed: a position counts micro-batches of MICRO_BATCH x processes samples
        assert got[step]["data_position"] * processes == expected[step]["data_position"] * written[0]
        assert got[step]["lr"] == expected[step]["lr"]
    differences = {step: abs(got[step]["loss"] - expected[step]["loss"]) / abs(expected[step]["loss"]) for step in got}
    print(f"relative loss differences, {written} -> {resumed_with}:", differences)
    assert max(differences.values()) <= LOSS_RTOL, differences


@pytest.mark.integration
@pytest.mark.parametrize(("written", "resumed_with"), [(2, 3), (3, 2)], ids=["z2_to_z3", "z3_to_z2"])
def test_two_ranks_resume_on_one_rank_with_another_zero_stage(tmp_path, make_job, written, resumed_with):
    reference = run_job(shaped_job(make_job, "reference", written, "cpu", 2, tmp_path / "nvme"),
                        tmp_path / "reference", processes=2)
    assert reference.returncode == 0, reference.log[-3000:]
    assert reference.config.plan.label == f"Z{written} opt:cpu par:gpu"

    resumed = resume(make_job, reference, tmp_path, "run", resumed_with, "cpu", 1)
    assert_continues(resumed, reference, (2, written, "cpu"), (1, resumed_with, "cpu"))

    if written == 2:
        # ZeRO-3 with the optimizer moved onto NVMe as well: one sub-group swapped (704,256 of
        # the model's 752,768 elements), the rest under DeepSpeed's 1 MiB minimum swap size in
        # memory; both filled from the universal checkpoint
        onto_nvme = resume(make_job, reference, tmp_path, "nvme-run", 3, "nvme", 1, sub_group_size=700_000)
        assert_continues(onto_nvme, reference, (2, 2, "cpu"), (1, 3, "nvme"))
    else:
        # the same processes and stage with the optimizer moved onto NVMe alone (each rank's
        # 376,384 elements: 300,000+ swapped, the rest in memory)
        moved = resume(make_job, reference, tmp_path, "moved-run", written, "nvme", 2, sub_group_size=300_000)
        assert_continues(moved, reference, (2, 3, "cpu"), (2, 3, "nvme"))


@pytest.mark.integration
def test_optimizer_state_on_nvme_resumes_in_memory_on_one_rank(tmp_path, make_job):
    # each rank's 376,384 elements: 300,000+ in swap files, which the conversion reads (cut
    # from their I/O padding), the rest in memory and in the ZeRO files
    reference = run_job(shaped_job(make_job, "reference", 3, "nvme", 2, tmp_path / "nvme", sub_group_size=300_000),
                        tmp_path / "reference", processes=2)
    assert reference.returncode == 0, reference.log[-3000:]
    assert reference.config.plan.label == "Z3 opt:nvme par:gpu"
    saved = reference.run_dir / "checkpoints" / checkpoint_name(EVERY) / "ds" / "offloaded_tensors"
    assert len(list(saved.glob("rank*/exp_avg_sq-*.tensor.swp"))) == 2  # one swapped sub-group a rank

    resumed = resume(make_job, reference, tmp_path, "run", 2, "cpu", 1)
    assert_continues(resumed, reference, (2, 3, "nvme"), (1, 2, "cpu"))
