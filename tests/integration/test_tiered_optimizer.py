"""Tiered optimizer state: with the optimizer on NVMe, a share of its sub-groups kept in CPU RAM
(`offload.cpuResidentFraction`) and the rest swapped, for real in DeepSpeed.

The small model's 752,768 optimizer elements cut at 270,000 make three sub-groups: two swapped
ones of 278,016 and 279,040 elements and a remainder of 195,712 under DeepSpeed's 1 MiB minimum
swap size, which stays in memory whatever the share. A share of 0.5 keeps floor(0.5 x 3) = 1
sub-group in RAM, the first. Shown here:
- the swap files: only the second sub-group's, and the NVMe bytes of each step within 10% of
  what the plan predicts;
- restarted from a checkpoint, bit-identical to the uninterrupted run (what a SIGKILL leaves
  behind does not depend on the placement: tests/integration/test_exact_resume.py kills others);
- its checkpoint resumed with the whole optimizer on NVMe and with it in CPU RAM (the resident
  sub-group's state is in the ZeRO files, the swapped one's in swap files: a conversion),
  bit-identical too (the same CPU Adam on the same numbers, wherever they are kept), the
  all-NVMe run's swap about twice the tiered one's, as planned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from spillway_runtime.checkpoints.store import checkpoint_name

from .conftest import Run, run_job
from .test_exact_resume import EVERY, MAX_STEPS, assert_identical_after, copy_checkpoint

SUB_GROUP = 270_000
SHARE = 0.5


def tiered_job(make_job, nvme: Path, name: str, share: float | None = SHARE, optimizer: str = "nvme") -> Path:
    offload: dict[str, Any] = {"optimizer": optimizer, "parameters": "gpu", "nvme": {"path": str(nvme)},
                               "deepspeed": {"zero_optimization": {"stage": 3, "sub_group_size": SUB_GROUP}}}
    if share is not None:
        offload["cpuResidentFraction"] = share
    return make_job(name, training={"maxSteps": MAX_STEPS}, offload=offload, checkpoint={"everySteps": EVERY, "keep": 10})


def nvme_bytes(run: Run) -> int:
    """The swap files' bytes during the run (the runtime's `bytes.nvme` of each step)."""
    return max(e["bytes"].get("nvme", 0) for e in run.of("step"))


def swap_files(run: Run, step: int) -> set[str]:
    folder = run.run_dir / "checkpoints" / checkpoint_name(step) / "ds" / "offloaded_tensors"
    return {p.name for p in folder.rglob("*.tensor.swp")}


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[Run, Path]]:
    return {}


def tiered_reference(references, make_job, tmp_path_factory) -> tuple[Run, Path]:
    """The uninterrupted tiered run, shared by this module's tests, and its NVMe directory (part
    of the DeepSpeed config that its checkpoints hold), which the runs compared with it use."""
    if "tiered" not in references:
        root = tmp_path_factory.mktemp("tiered")
        run = run_job(tiered_job(make_job, root / "nvme", "reference"), root / "run")
        assert run.returncode == 0, run.log[-3000:]
        references["tiered"] = (run, root / "nvme")
    return references["tiered"]


@pytest.mark.integration
def test_a_share_of_the_optimizer_in_ram_swaps_the_rest_and_resumes_bit_identically(
        tmp_path, make_job, tmp_path_factory, references):
    tiered, nvme = tiered_reference(references, make_job, tmp_path_factory)
    plan = tiered.config.plan
    assert plan.label == "Z3 opt:nvme par:gpu" and plan.swap.cpu_resident_fraction == SHARE
    assert any("1 of 3 sub-groups per process kept in CPU RAM" in r for r in plan.reasons), plan.reasons
    # the first sub-group (parameters 0-13) never reached the disk; the second did
    assert swap_files(tiered, MAX_STEPS) == {f"{kind}14_28.tensor.swp" for kind in ("", "exp_avg-", "exp_avg_sq-")}
    assert nvme_bytes(tiered) == pytest.approx(plan.bytes.nvme, rel=0.10)

    copy_checkpoint(tiered.run_dir, tmp_path / "run", checkpoint_name(EVERY))
    resumed = run_job(tiered_job(make_job, nvme, "job"), tmp_path / "run")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert resumed.of("resumed")[-1]["step"] == EVERY and not resumed.of("resharded")
    assert_identical_after(resumed, tiered, EVERY + 1)


@pytest.mark.integration
def test_spillway_export_writes_any_checkpoints_model_the_last_one_as_the_run_exported_it(
        tmp_path, make_job, tmp_path_factory, references):
    """`spillway export` reads a checkpoint as a resume does (swap files included, each against
    its checksum) and writes its model: the last checkpoint's is the run's own export to the bit."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    tiered, _ = tiered_reference(references, make_job, tmp_path_factory)
    checkpoints = tiered.run_dir / "checkpoints"

    def export(what: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "spillway_api.cli", "export", str(what), "--out", str(out), *flags],
                              capture_output=True, text=True, timeout=300)

    last = export(tiered.run_dir, tmp_path / "last")  # a run's folder: its newest checkpoint
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"{checkpoint_name(MAX_STEPS)} (step {MAX_STEPS})" in last.stdout
    final = load_file(tiered.run_dir / "final" / "model.safetensors")
    exported = load_file(tmp_path / "last" / "model.safetensors")
    assert set(exported) == set(final)
    for name, tensor in final.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name].view(-1).view(torch.uint8),
                                                                    tensor.view(-1).view(torch.uint8)), name
    assert (tmp_path / "last" / "tokenizer.json").is_file()

    earlier = export(checkpoints / checkpoint_name(EVERY), tmp_path / "earlier")
    assert earlier.returncode == 0, earlier.stderr[-3000:]
    at_five = load_file(tmp_path / "earlier" / "model.safetensors")
    assert set(at_five) == set(final) and any(not torch.equal(at_five[n], final[n]) for n in final)

    # --universal: DeepSpeed's universal checkpoint of the same step, whose fp32 masters are
    # what the model export cast to bf16, with the Adam moments beside them; into a new folder only
    universal = tmp_path / "universal"
    done = export(checkpoints / checkpoint_name(EVERY), universal, "--universal")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (universal / "latest_universal").read_text() == "ds"
    zero = universal / "ds" / "zero"
    assert {p.name for p in zero.iterdir() if (p / "fp32.pt").is_file()} == set(at_five)  # untied: a master each
    for folder in (p for p in zero.iterdir() if (p / "fp32.pt").is_file()):
        master = torch.load(folder / "fp32.pt", weights_only=True)["param"]
        assert master.dtype == torch.float32 and torch.equal(master.to(at_five[folder.name].dtype), at_five[folder.name])
        assert {"exp_avg.pt", "exp_avg_sq.pt"} <= {f.name for f in folder.iterdir()}, folder.name
    again = export(checkpoints / checkpoint_name(EVERY), universal, "--universal")
    assert again.returncode == 2 and "is not an empty folder" in again.stderr, again.stderr[-3000:]

    # a swap file damaged on disk: refused naming it, nothing half written
    copy = tmp_path / "damaged"
    copy_checkpoint(tiered.run_dir, copy, checkpoint_name(EVERY))
    [swap] = [p for p in (copy / "checkpoints" / checkpoint_name(EVERY)).rglob("exp_avg-*.tensor.swp")]
    data = bytearray(swap.read_bytes())
    data[100] ^= 0xFF
    swap.write_bytes(bytes(data))
    damaged = export(copy, tmp_path / "from-damaged")
    assert damaged.returncode == 2 and swap.name in damaged.stderr, damaged.stderr[-3000:]
    assert not (tmp_path / "from-damaged" / "model.safetensors").exists()


@pytest.mark.integration
@pytest.mark.parametrize(("share", "optimizer"), [(0.0, "nvme"), (None, "cpu")], ids=["all_on_nvme", "all_in_ram"])
def test_a_tiered_checkpoint_resumes_bit_identically_with_another_share(
        tmp_path, make_job, tmp_path_factory, references, share, optimizer):
    tiered, nvme = tiered_reference(references, make_job, tmp_path_factory)
    copy_checkpoint(tiered.run_dir, tmp_path / "run", checkpoint_name(EVERY))
    moved = run_job(tiered_job(make_job, nvme, "moved", share=share, optimizer=optimizer), tmp_path / "run")
    assert moved.returncode == 0, moved.log[-3000:]
    assert moved.config.plan.label == f"Z3 opt:{optimizer} par:gpu"
    [resharded] = moved.of("resharded")
    assert resharded["from"]["cpuResidentFraction"] == SHARE
    assert (resharded["to"]["optimizer"], resharded["to"]["cpuResidentFraction"]) == (optimizer, 0.0)
    # the same processes and stage: each rank's own generators, so nothing drifts
    expected, got = tiered.losses(), moved.losses()
    assert {s: got[s] for s in range(EVERY + 1, MAX_STEPS + 1)} == {s: expected[s] for s in range(EVERY + 1, MAX_STEPS + 1)}
    if optimizer == "nvme":
        planned = tiered.config.plan.bytes.nvme / moved.config.plan.bytes.nvme
        ratio = nvme_bytes(tiered) / nvme_bytes(moved)
        print(f"NVMe bytes: tiered {nvme_bytes(tiered)}, all on NVMe {nvme_bytes(moved)}: {ratio:.3f}, planned {planned:.3f}")
        assert ratio == pytest.approx(planned, rel=0.10)
    else:
        assert nvme_bytes(moved) == 0


@pytest.mark.integration
def test_the_pipelined_swapper_steps_many_swapped_sub_groups(tmp_path, make_job):
    """DeepSpeed's pipelined optimizer swapper holds three sub-groups at once (the one stepped,
    the next one read ahead, the last one still being written): with the 8 buffers planned
    before, a run of 3 or more swapped sub-groups died in its first step ("ran out of swap
    buffers"). The wide model's 6.5M elements in sub-groups of 1M: 7 swapped, pipelined."""
    offload: dict[str, Any] = {"optimizer": "nvme", "parameters": "gpu", "nvme": {"path": str(tmp_path / "nvme")},
                               "deepspeed": {"zero_optimization": {"stage": 3, "sub_group_size": 1_000_000}}}
    job = make_job("pipelined", model="wide", training={"maxSteps": 3}, offload=offload,
                   checkpoint={"everySteps": 100, "keep": 1})
    run = run_job(job, tmp_path / "run")
    assert run.returncode == 0, run.log[-3000:]
    swap = run.config.plan.swap
    assert swap.pipeline and swap.optimizer_buffer_count == 12, swap
    assert sorted(run.losses()) == [1, 2, 3]
    swapped = {name for name in swap_files(run, 3) if name.startswith("exp_avg_sq-")}  # the checkpoint's
    assert len(swapped) >= 3, swapped
