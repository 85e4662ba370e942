"""Exact resume: a run stopped and restarted is bit-identical to the uninterrupted one.

For every placement of optimizer state and parameters, a fresh process resumed from a
checkpoint reports the same raw float loss at each of at least 20 steps after the resume,
and its final checkpoint holds the same bytes (fp32 masters, both Adam moments, 16-bit
weights, step counts, RNG and data position) as the uninterrupted run's. On two placements,
one per ZeRO stage, the checkpoint is the one left by a run SIGKILLed in the step after it;
on the demo's placement it is the one a suspend writes (SIGTERM, a checkpoint off the
cadence, exit 75); on the others it is a copy of the uninterrupted run's own checkpoint,
which holds the same bytes (the run is deterministic) and costs no third process. The same
holds after an in-process divergence rollback, whose reference is a fresh process started
from the same checkpoint with the same rollback decisions (skipped batches, lower learning
rate). The stage 3 placement with the optimizer on NVMe also keeps one sub-group of its
optimizer state in memory, as a sub-group too small to swap does.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from spillway_runtime.checkpoints.store import LATEST, MANIFEST, CheckpointStore, checkpoint_name
from spillway_runtime.core.contract import ExitCode
from spillway_runtime.core.estimates import MIN_AIO_BYTES, _cut
from spillway_runtime.meta_shape import shape_from_config
from spillway_runtime.training.checkpointing import STATE_FILE
from spillway_runtime.training.runconfig import FaultInjection

from .conftest import Run, run_job

# (zero stage, optimizer, parameters); "gpu" is the accelerator device (the CPU here)
PLACEMENTS = [
    (2, "gpu", "gpu"),
    (2, "cpu", "gpu"),
    (3, "gpu", "gpu"),
    (3, "cpu", "gpu"),
    (3, "cpu", "cpu"),
    (3, "nvme", "gpu"),
    (3, "nvme", "cpu"),
    (3, "nvme", "nvme"),
]
MAX_STEPS = 28
# Checkpoints at 5, 10, ...: a kill after step 6 resumes from 5, a suspend from 6 or 7. Not 3:
# DeepSpeedCPUAdam's running beta^t happens to equal pow(beta, t) in float32 at t = 4, so a
# resume from step 3 hid the drift that the ones from 5 and later show.
EVERY = 5
COMPARED = 20  # steps after the resume that must match, at least
SLOW = FaultInjection(step_sleep_seconds=0.4)  # room for the signal to land where the test wants it
# What a SIGKILL leaves behind (a step half done after the checkpoint, the NVMe swap files
# mid-update, no clean-up) and how a restart finds the newest good checkpoint do not depend
# on the placement; what is saved and loaded does, and every placement resumes below. The
# kill is exercised once per ZeRO stage, the stage 3 one with the optimizer state on NVMe
# (not the parameters too: the wide model's steps take four times as long).
KILLED = [(2, "cpu", "gpu"), (3, "nvme", "gpu")]
# Cuts the small model's optimizer state into a swapped sub-group of 704,256 elements and a
# 48,512-element remainder under DeepSpeed's 1 MiB minimum swap size, which stays in memory:
# DeepSpeed's NVMe load restores only the swap files, so the remainder is put back by the
# runtime (a pod's memlock-fitted buffers cut every model this way).
IN_MEMORY_REMAINDER = 700_000
TWO_RANK_SUB_GROUP = 300_000  # of each rank's 376,384 elements: 300,000+ swapped, the rest in memory
# The wide model's share (3.2M elements a rank) with its parameters on NVMe too: its matrices
# swapped (3,093,504), the norms and the output head in memory (145,536)
TWO_RANK_WIDE_SUB_GROUP = 3_000_000
SUSPEND_PLACEMENT = (3, "nvme", "cpu")  # the demo's placement: its NVMe optimizer state is the hardest to restore
RESUMED = [p for p in PLACEMENTS if p != SUSPEND_PLACEMENT]  # that one resumes after its suspend


def placement_job(make_job, nvme: Path, stage: int, optimizer: str, parameters: str,
                  name: str = "job", sub_group_size: int | None = None) -> Path:
    # Parameters on NVMe need matrices above DeepSpeed's 1 MiB minimum swap size: the wide
    # model; every other placement trains the small one, which is four times faster.
    model = "wide" if parameters == "nvme" else "model"
    zero: dict[str, Any] = {"stage": stage}
    if (stage, optimizer, parameters) == (3, "nvme", "gpu"):
        zero["sub_group_size"] = sub_group_size or IN_MEMORY_REMAINDER
    elif sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    offload = {"optimizer": optimizer, "parameters": parameters, "nvme": {"path": str(nvme)},
               "deepspeed": {"zero_optimization": zero}}
    return make_job(name, model=model, training={"maxSteps": MAX_STEPS}, offload=offload,
                    checkpoint={"everySteps": EVERY, "keep": 10})


def final_checkpoint(run: Run) -> dict[str, Any]:
    """Every file of the last checkpoint: what torch.save wrote, loaded (its pickling of equal
    objects can differ after a load), and the sha256 of every other file (the NVMe swap files)."""
    root = run.run_dir / "checkpoints" / checkpoint_name(MAX_STEPS)
    manifest = json.loads((root / MANIFEST).read_text())
    return {name: torch.load(root / name, weights_only=False) if name.endswith(".pt") else entry["sha256"]
            for name, entry in manifest["files"].items()}


def assert_same(got: Any, expected: Any, path: str) -> None:
    """Equal to the bit: tensors by their bytes (so -0.0 != 0.0 and any one-ulp drift shows)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and (got.dtype, got.shape) == (expected.dtype, expected.shape), path
        assert torch.equal(got.detach().reshape(-1).view(torch.uint8),
                           expected.detach().reshape(-1).view(torch.uint8)), f"{path} differs"
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), f"{path}: keys {set(got) ^ set(expected)}"
        for key in expected:
            assert_same(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(expected), f"{path}: length"
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(expected, np.ndarray):
        assert np.array_equal(got, expected), f"{path} differs"
    elif hasattr(expected, "__dict__") and not isinstance(expected, type):
        assert type(got) is type(expected), path
        assert_same(vars(got), vars(expected), path)
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def assert_identical_after(resumed: Run, reference: Run, from_step: int) -> None:
    assert from_step <= MAX_STEPS - COMPARED + 1, f"resumed at step {from_step - 1}: fewer than {COMPARED} to compare"
    expected, got = reference.losses(), resumed.losses()
    mismatches = {s: (got.get(s), expected[s]) for s in range(from_step, MAX_STEPS + 1) if got.get(s) != expected[s]}
    assert not mismatches, f"losses differ from the uninterrupted run at steps {mismatches}"
    assert_same(final_checkpoint(resumed), final_checkpoint(reference), "final checkpoint")


@pytest.fixture(scope="module")
def references() -> dict[tuple[int, str, str], Run]:
    return {}


def reference_run(references, make_job, tmp_path_factory, placement) -> tuple[Run, Path]:
    """The uninterrupted run of a placement, shared by the tests of this module, and its NVMe
    directory, which the runs compared with it use too (the path is part of the DeepSpeed config
    that checkpoints hold)."""
    if placement not in references:
        root = tmp_path_factory.mktemp("reference")
        job = placement_job(make_job, root / "nvme", *placement, name="reference")
        run = run_job(job, root / "run")
        assert run.returncode == 0, run.log[-3000:]
        stage, optimizer, parameters = placement
        assert run.config.plan.label == f"Z{stage} opt:{optimizer} par:{parameters}"
        assert sorted(run.losses()) == list(range(1, MAX_STEPS + 1))
        # the state really went where the plan said: swap files of the predicted size (within 10%)
        predicted = run.config.plan.bytes.nvme
        measured = max(e["bytes"].get("nvme", 0) for e in run.of("step"))
        if "nvme" in placement[1:]:
            assert measured == pytest.approx(predicted, rel=0.10)
        else:
            assert predicted == 0 and measured == 0
        # each tensor once: fp32 masters and both moments, + the 16-bit weights under ZeRO-2,
        # as the planner sizes the checkpoint volume (with the optimizer on NVMe DeepSpeed's
        # own save held the optimizer state twice, 24 B/param); the small files are under 1 MiB
        size = json.loads((run.run_dir / "checkpoints" / checkpoint_name(MAX_STEPS) / MANIFEST).read_text())["sizeBytes"]
        assert run.config.plan.checkpoint_bytes <= size <= run.config.plan.checkpoint_bytes + (1 << 20), (
            size / run.config.plan.model.params)
        # with the optimizer on NVMe a checkpoint's swap files are the ones the swapper wrote,
        # moved into it; the next step reads them from there and writes new ones: no file of
        # any checkpoint (six kept, the first 23 steps old) was written after its commit
        store = CheckpointStore(run.run_dir / "checkpoints", keep=10)
        kept = store.list()
        assert len(kept) == 6
        assert {info.name: store.verify(info.path, deep=True) for info in kept} == {info.name: None for info in kept}
        references[placement] = run
    return references[placement], Path(references[placement].config.run_dir).parent / "nvme"


def copy_checkpoint(source: Path, target: Path, name: str) -> Path:
    """Copy one checkpoint of a run into a new run directory and point `latest` at it, as a
    restart would find it; returns the copy."""
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / name, target / "checkpoints" / name)
    (target / "checkpoints" / LATEST).write_text(name)
    return target / "checkpoints" / name


@pytest.mark.integration
@pytest.mark.parametrize("placement", RESUMED,
                         ids=[f"z{s}-opt_{o}-par_{p}{'-sigkill' if (s, o, p) in KILLED else ''}"
                              for s, o, p in RESUMED])
def test_resume_is_bit_identical(tmp_path, make_job, tmp_path_factory, references, placement):
    reference, nvme = reference_run(references, make_job, tmp_path_factory, placement)
    job = placement_job(make_job, nvme, *placement)

    if placement in KILLED:
        killed = run_job(job, tmp_path / "run", faults=SLOW, signal_at_step=EVERY + 1)
        assert killed.returncode == -9, killed.log[-3000:]
        assert not killed.of("finished")
    else:
        copy_checkpoint(reference.run_dir, tmp_path / "run", checkpoint_name(EVERY))
    resumed = run_job(job, tmp_path / "run")
    assert resumed.returncode == 0, resumed.log[-3000:]
    start = resumed.of("resumed")[-1]["step"]
    assert start == EVERY
    assert_identical_after(resumed, reference, start + 1)


@pytest.mark.integration
def test_suspend_and_resume_is_bit_identical(tmp_path, make_job, tmp_path_factory, references):
    reference, nvme = reference_run(references, make_job, tmp_path_factory, SUSPEND_PLACEMENT)
    job = placement_job(make_job, nvme, *SUSPEND_PLACEMENT)

    suspended = run_job(job, tmp_path / "run", faults=SLOW, signal_at_step=EVERY + 1, sig=signal.SIGTERM)
    assert suspended.returncode == ExitCode.PREEMPTED, suspended.log[-3000:]
    stopped_at = suspended.of("preempted")[-1]["step"]
    assert stopped_at % EVERY != 0, "the suspend checkpoint should be off the cadence"
    assert suspended.of("checkpoint")[-1]["step"] == stopped_at
    resumed = run_job(job, tmp_path / "run")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert resumed.of("resumed")[-1]["step"] == stopped_at
    assert_identical_after(resumed, reference, stopped_at + 1)


def restart_with_rollback_state(source: Path, target: Path, rollback: dict) -> None:
    """Copy a checkpoint into a new run directory with the rollback's decisions recorded in it,
    as if the process had been restarted right after the rollback."""
    copied = copy_checkpoint(source, target, rollback["checkpoint"])
    state_path = copied / f"rank0-{STATE_FILE}"
    state = torch.load(state_path, weights_only=False)
    state.update(skip_ranges=[tuple(rollback["skipped_micro_batches"])], lr_scale=rollback["lr_scale"],
                 rollbacks=rollback["rollbacks"])
    torch.save(state, state_path)
    manifest_path = copied / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    data = state_path.read_bytes()
    manifest["files"][state_path.name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.integration
@pytest.mark.parametrize("parameters", ["gpu", "nvme"])
def test_two_processes_suspend_and_resume_is_bit_identical(tmp_path, make_job, tiny_model, parameters):
    """Two ranks, each checkpointing its own shard, each partition cut into a swapped sub-group
    and an in-memory remainder (as a pod's memlock-fitted buffers cut it). The remainder holds small parameters that
    ZeRO-3 keeps gathered whole on every rank: with two ranks they must be gathered again
    from the restored partitions, or the first step after the resume runs with them as
    the model was built (losses off by 1e-3 from there on). With the parameters on NVMe the
    remainder's 16-bit parameters have no partition in memory: they are written back to their
    swap files (a pod's resume failed with "'NoneType' object has no attribute 'data'")."""
    sub_group = TWO_RANK_SUB_GROUP if parameters == "gpu" else TWO_RANK_WIDE_SUB_GROUP
    shares = _cut(shape_from_config(tiny_model["model" if parameters == "gpu" else "wide"]).tensor_numels(), 2,
                  sub_group)
    assert len(shares) == 2 and shares[0] >= MIN_AIO_BYTES // 4 > shares[1], shares  # swapped, and in memory

    def job(name: str) -> Path:
        return placement_job(make_job, tmp_path / "nvme", 3, "nvme", parameters, name=name, sub_group_size=sub_group)

    shm_before = set(Path("/dev/shm").glob("deepspeed_*"))
    reference = run_job(job("reference"), tmp_path / "reference", processes=2)
    assert reference.returncode == 0, reference.log[-3000:]
    assert sorted(reference.losses()) == list(range(1, MAX_STEPS + 1))
    # nothing left in shared memory (DeepSpeed's shared-memory all-reduce, on where LOCAL_SIZE
    # is set, leaves a 66 MiB file there per process)
    assert set(Path("/dev/shm").glob("deepspeed_*")) - shm_before == set()
    # each rank checkpoints its own shard: its state file, ZeRO file and swap files
    checkpoint = reference.run_dir / "checkpoints" / checkpoint_name(EVERY)
    for rank in (0, 1):
        assert (checkpoint / f"rank{rank}-{STATE_FILE}").is_file()
        assert list((checkpoint / "ds" / "offloaded_tensors" / f"rank{rank:02d}").glob("exp_avg-*.tensor.swp"))
        assert list((checkpoint / "ds").glob(f"*zero_pp_rank_{rank}_*optim_states.pt"))
    suspended = run_job(job("job"), tmp_path / "run", processes=2, faults=SLOW, signal_at_step=EVERY + 1,
                        sig=signal.SIGTERM)
    assert suspended.returncode == ExitCode.PREEMPTED, suspended.log[-3000:]
    stopped_at = suspended.of("preempted")[-1]["step"]
    resumed = run_job(job("job"), tmp_path / "run", processes=2)
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert resumed.of("resumed")[-1]["step"] == stopped_at
    assert [e["world_size"] for e in resumed.of("started")][-1] == 2
    assert_identical_after(resumed, reference, stopped_at + 1)


@pytest.mark.integration
def test_divergence_rollback_in_process_is_bit_identical_to_a_restart(tmp_path, make_job):
    job = placement_job(make_job, tmp_path / "nvme", *SUSPEND_PLACEMENT)
    # a NaN in the step after the one after the first checkpoint: rolled back to that checkpoint
    bad = (EVERY + 1) * 2  # the first micro-batch of step EVERY + 2 (two per step)
    faults = FaultInjection(nan_micro_batches=[bad])
    rolled = run_job(job, tmp_path / "in-process", faults=faults)
    assert rolled.returncode == 0, rolled.log[-3000:]
    [rollback] = rolled.of("rollback")
    assert rollback["to_step"] == EVERY and rollback["skipped_micro_batches"] == [bad, bad + 2]

    restart_with_rollback_state(tmp_path / "in-process", tmp_path / "restarted", rollback)
    restarted = run_job(job, tmp_path / "restarted", faults=faults)
    assert restarted.returncode == 0, restarted.log[-3000:]
    assert restarted.of("resumed")[-1]["step"] == EVERY
    assert not restarted.of("rollback")  # the bad batch is skipped, as recorded
    assert_identical_after(rolled, restarted, EVERY + 1)
