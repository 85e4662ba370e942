"""Resume across shapes without DeepSpeed training: which changes are refused, and how a ZeRO-3
file's swapped sub-groups are put back from the checkpoint's swap files before conversion.
The conversions and loads themselves run for real in tests/integration/test_reshard.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from spillway_runtime.checkpoints.engine import saved_swap_dir
from spillway_runtime.checkpoints.universal import UniversalError, _write_native
from spillway_runtime.core.contract import ExitCode
from spillway_runtime.training.checkpointing import Checkpointing
from spillway_runtime.training.resharding import Shape, refuse_reshard
from spillway_runtime.training.run import RunFailed


def attempt(shape: Shape, lora: bool = False, pinned_share: float | None = None,
            checkpoint_dir: Path | None = None) -> Checkpointing:
    run: Any = SimpleNamespace(
        world_size=shape.world_size,
        plan=SimpleNamespace(zero_stage=shape.zero_stage, optimizer=shape.optimizer, parameters=shape.parameters,
                             swap=SimpleNamespace(cpu_resident_fraction=shape.resident),
                             label=f"Z{shape.zero_stage} opt:{shape.optimizer} par:{shape.parameters}"),
        spec=SimpleNamespace(method=SimpleNamespace(lora=lora), resume_from=None,
                             offload=SimpleNamespace(cpu_resident_fraction=pinned_share)),
        cfg=SimpleNamespace(checkpoint_dir=str(checkpoint_dir)),
        log=lambda message: None)
    return Checkpointing(run)


CHECKPOINT: Any = SimpleNamespace(name="step-00000004")


@pytest.mark.parametrize(("written", "planned"), [
    (Shape(2, 2, "cpu", "gpu"), Shape(1, 3, "nvme", "gpu")),  # onto NVMe with another layout
    (Shape(2, 3, "cpu", "gpu"), Shape(2, 3, "nvme", "cpu")),  # onto NVMe alone
    (Shape(2, 3, "nvme", "gpu"), Shape(1, 2, "cpu", "gpu")),  # from NVMe
])
def test_optimizer_on_nvme_takes_the_universal_path(written, planned):
    refuse_reshard(CHECKPOINT, written, planned, lora=False)  # no RunFailed


@pytest.mark.parametrize(("written", "planned", "converted"), [
    (Shape(1, 3, "nvme", "cpu", 0.5), Shape(1, 3, "nvme", "cpu", 0.25), True),  # another share in RAM
    (Shape(1, 3, "nvme", "cpu", 0.5), Shape(1, 3, "nvme", "cpu"), True),  # all on NVMe now
    (Shape(1, 3, "nvme", "cpu", 0.5), Shape(1, 3, "cpu", "cpu"), True),  # all in RAM
    (Shape(1, 3, "nvme", "cpu", 0.5), Shape(1, 3, "nvme", "cpu", 0.5), False),  # unchanged: a plain load
    (Shape(1, 3, "cpu", "cpu"), Shape(1, 3, "cpu", "gpu"), False),  # parameters moved alone: same files
])
def test_a_change_of_the_optimizers_share_in_ram_is_a_conversion(written, planned, converted):
    """A tiered checkpoint keeps its resident sub-groups' state in the ZeRO files and the rest in
    swap files: resumed with another share, what the load expects in swap files is elsewhere."""
    assert (written.swapped != planned.swapped or written.layout != planned.layout) is converted
    assert attempt(planned)._shape() == planned


@pytest.mark.parametrize(("written", "planned", "lora", "named"), [
    (Shape(2, 3, "cpu", "nvme"), Shape(1, 3, "cpu", "gpu"), False, "written with parameters on NVMe"),
    (Shape(2, 3, "nvme", "gpu"), Shape(1, 3, "nvme", "nvme"), False, "planned with parameters on NVMe"),
    (Shape(2, 2, "cpu", "gpu"), Shape(1, 3, "cpu", "gpu"), True, "LoRA (method.lora)"),
])
def test_refused_with_bad_input_naming_what_to_change(written, planned, lora, named):
    with pytest.raises(RunFailed) as refused:
        refuse_reshard(CHECKPOINT, written, planned, lora)
    assert refused.value.exit_code == ExitCode.BAD_INPUT
    assert named in str(refused.value) and "offload.parameters" in str(refused.value)


@pytest.mark.parametrize(("written", "planned", "pinned", "kept"), [
    (0.5, 0.25, None, 0.5),  # parameters on NVMe cannot convert: the checkpoint's share, as it ran before
    (0.25, 0.5, None, 0.25),  # less than planned: fits, and no conversion
    (0.5, 0.25, 0.25, 0.25),  # the job's own share: converted on load
])
def test_a_restart_keeps_the_share_its_checkpoint_was_written_with_unless_the_job_pinned_one(
        tmp_path, written, planned, pinned, kept):
    """The planner's share moves with the free RAM of each attempt; a resume under another one
    converts the checkpoint (or, parameters on NVMe, is refused)."""
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "latest").write_text("step-00000004")
    (tmp_path / "step-00000004" / "manifest.json").write_text(
        f'{{"plan": "Z3 opt:nvme par:nvme", "worldSize": 1, "cpuResidentFraction": {written}}}')
    checkpoints = attempt(Shape(1, 3, "nvme", "nvme", planned), pinned_share=pinned, checkpoint_dir=tmp_path)
    checkpoints.keep_share()
    assert checkpoints.run.plan.swap.cpu_resident_fraction == kept
    onto_cpu = attempt(Shape(1, 3, "nvme", "cpu", 0.25), checkpoint_dir=tmp_path)
    onto_cpu.keep_share()  # another placement: the load converts
    assert onto_cpu.run.plan.swap.cpu_resident_fraction == 0.25


def zero3_rank_files(tag: Path, rank: int, flats: list[torch.Tensor], shapes: list[dict[str, tuple[int, ...]]],
                     states: dict[int, dict[str, Any]]) -> Path:
    optim = tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"fp32_flat_groups": flats, "partition_count": 2,
                                         "optimizer_state_dict": {"state": states}}}, optim)
    torch.save({"param_shapes": shapes}, tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    return optim


def swap_file(folder: Path, name: str, values: torch.Tensor, padded_to: int = 64) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    padded = torch.zeros(-(-values.numel() // padded_to) * padded_to, dtype=torch.float32)
    padded[:values.numel()] = values
    padded.numpy().tofile(folder / name)


def test_swapped_subgroups_come_back_from_the_swap_files_cut_to_their_partition(tmp_path):
    tag = tmp_path / "ds"
    tag.mkdir()
    # three sub-groups of one rank's ZeRO-3 state (2 processes): 0 and 2 swapped (empty masters,
    # step only), 1 in memory; partitions are ceil(numel / 2) per parameter: 3 + 2, 4, 5
    shapes = [{"a": (5,), "b": (3,)}, {"c": (2, 4)}, {"d": (9,)}]
    in_memory = {"exp_avg": torch.full((4,), 0.5), "exp_avg_sq": torch.full((4,), 0.25), "step": 4}
    optim = zero3_rank_files(tag, 1, [torch.empty(0), torch.arange(4.0), torch.empty(0)], shapes,
                             {0: {"step": 4}, 1: in_memory, 2: {"step": 4}})
    folder = saved_swap_dir(tag, 1)
    for ds_id, numel, base in (("0_1", 5, 10.0), ("3_3", 5, 20.0)):  # ids: a=0, b=1, c=2, d=3
        swap_file(folder, f"{ds_id}.tensor.swp", torch.arange(numel) + base)
        swap_file(folder, f"exp_avg-{ds_id}.tensor.swp", torch.full((numel,), base + 1))
        swap_file(folder, f"exp_avg_sq-{ds_id}.tensor.swp", torch.full((numel,), base + 2))
    native = tmp_path / "native"
    native.mkdir()

    _write_native([optim], native, lambda path: torch.load(path, weights_only=False), None)

    inner = torch.load(native / optim.name, weights_only=False)["optimizer_state_dict"]
    flats, states = inner["fp32_flat_groups"], inner["optimizer_state_dict"]["state"]
    assert torch.equal(flats[0], torch.arange(5.0) + 10) and torch.equal(flats[2], torch.arange(5.0) + 20)
    assert torch.equal(flats[1], torch.arange(4.0))
    assert torch.equal(states[0]["exp_avg"], torch.full((5,), 11.0))
    assert torch.equal(states[2]["exp_avg_sq"], torch.full((5,), 22.0))
    assert states[0]["step"] == 4 and torch.equal(states[1]["exp_avg"], torch.full((4,), 0.5))

    (folder / "3_3.tensor.swp").unlink()  # a swapped sub-group without its files: not converted
    with pytest.raises(UniversalError, match="2 optimizer sub-groups are not in it"):
        _write_native([optim], native, lambda path: torch.load(path, weights_only=False), None)
