"""`SwapFiles`: the optimizer's swap files go into a checkpoint by a rename (a link when the
current state is already in one, a copy across filesystems), and the swapper's next
swap-in of each reads it from there. The real swapper is exercised by the exact-resume
tests; here a swapper of the same shape records what it was asked to read."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from spillway_runtime.checkpoints.engine import SwapFiles, saved_swap_dir


class Swapper:
    """DeepSpeed's optimizer swapper as `SwapFiles` sees it: a folder, per-parameter swap
    infos whose tensors have a `swap_path`, and `_swap_in_parameter`."""

    def __init__(self, folder: Path, names: list[str]):
        self.swap_folder = str(folder)
        self.infos = {name: SimpleNamespace(tensors=[SimpleNamespace(swap_path=os.path.join(folder, name))])
                      for name in names}
        self.reads: list[str] = []

    def _get_param_swap_info(self, parameter: str) -> Any:
        return self.infos[parameter]

    def _swap_in_parameter(self, aio_handle: Any, parameter: str, dest_buffers: Any) -> None:
        for tensor in self.infos[parameter].tensors:
            self.reads.append(tensor.swap_path)
            Path(tensor.swap_path).read_bytes()  # the file must be there

    def swap_out(self, parameter: str, data: bytes) -> None:
        for tensor in self.infos[parameter].tensors:
            Path(tensor.swap_path).write_bytes(data)


def make(folder: Path) -> tuple[Swapper, SwapFiles]:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("1.tensor.swp", "exp_avg-1.tensor.swp"):
        (folder / name).write_bytes(b"step 1 " + name.encode())
    (folder / "1.gradient.swp").write_bytes(b"not optimizer state")
    swapper = Swapper(folder, ["1.tensor.swp", "exp_avg-1.tensor.swp"])
    return swapper, SwapFiles(swapper)


def test_a_save_moves_the_files_and_the_next_swap_in_reads_them_from_the_checkpoint(tmp_path: Path) -> None:
    swapper, files = make(tmp_path / "swap")
    staging, final = tmp_path / "ckpt" / ".staging-step-1", tmp_path / "ckpt" / "step-1"
    jobs = files.save_jobs(staging / "ds", rank=0)
    saved = saved_swap_dir(staging / "ds", 0)
    assert sorted(job.target.name for job in jobs) == ["1.tensor.swp", "exp_avg-1.tensor.swp"]
    assert all(job.in_place and job.source is None for job in jobs)  # nothing to copy: checksummed in place
    assert sorted(p.name for p in (tmp_path / "swap").iterdir()) == ["1.gradient.swp"]
    assert (saved / "1.tensor.swp").read_bytes() == b"step 1 1.tensor.swp"

    staging.rename(final)  # the store's commit
    files.committed(staging, final)
    swapper._swap_in_parameter(None, "1.tensor.swp", None)
    moved = saved_swap_dir(final / "ds", 0) / "1.tensor.swp"
    assert swapper.reads == [str(moved)]
    # the path is the swap folder's again for the swap-out: the checkpoint's file is not written
    swapper.swap_out("1.tensor.swp", b"step 2")
    assert moved.read_bytes() == b"step 1 1.tensor.swp" and (tmp_path / "swap" / "1.tensor.swp").read_bytes() == b"step 2"
    swapper._swap_in_parameter(None, "1.tensor.swp", None)
    assert swapper.reads[-1] == str(tmp_path / "swap" / "1.tensor.swp")
    assert files.where("exp_avg-1.tensor.swp") == saved_swap_dir(final / "ds", 0) / "exp_avg-1.tensor.swp"


def test_a_second_save_before_the_next_step_links_the_first_ones_files(tmp_path: Path) -> None:
    _swapper, files = make(tmp_path / "swap")
    files.save_jobs(tmp_path / "ckpt" / "a" / "ds", rank=0)
    jobs = files.save_jobs(tmp_path / "ckpt" / "b" / "ds", rank=0)
    first = saved_swap_dir(tmp_path / "ckpt" / "a" / "ds", 0) / "1.tensor.swp"
    second = saved_swap_dir(tmp_path / "ckpt" / "b" / "ds", 0) / "1.tensor.swp"
    assert all(job.in_place for job in jobs) and os.path.samefile(first, second)
    assert files.where("1.tensor.swp") == second  # the first may be pruned when the second commits


def test_across_filesystems_the_files_are_copied_and_stay_in_the_swap_folder(tmp_path: Path) -> None:
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm is on the same filesystem as the test's directory")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        swapper, files = make(Path(other) / "swap")
        jobs = files.save_jobs(tmp_path / "ckpt" / "ds", rank=0)
        assert all(not job.in_place and job.source is not None and job.source.parent == Path(other) / "swap"
                   for job in jobs)
        assert files.pending == {}
        swapper._swap_in_parameter(None, "1.tensor.swp", None)
        assert swapper.reads == [str(Path(other) / "swap" / "1.tensor.swp")]


def test_at_exit_a_rank_removes_its_own_swap_files_and_the_folders_left_empty(tmp_path: Path) -> None:
    from spillway_runtime.training.disk_usage import remove_swap_files

    nvme = tmp_path / "nvme"
    for rank in (0, 1):
        for kind in ("optimizer", "fp16params", "reference/zero_stage_3/fp16params"):  # DPO's reference's too
            folder = nvme / ("" if kind.startswith("reference") else "zero_stage_3") / kind / f"rank{rank}"
            folder.mkdir(parents=True)
            (folder / "state.tensor.swp").write_bytes(b"x" * 8192)
    checkpoint = tmp_path / "ckpt.swp"
    checkpoint.write_bytes(b"y" * 4096)
    os.link(checkpoint, nvme / "zero_stage_3" / "optimizer" / "rank0" / "linked.swp")  # a checkpoint's file

    freed = remove_swap_files(nvme, 0)
    assert freed >= 3 * 8192
    left = sorted(str(p.relative_to(nvme)) for p in nvme.rglob("*") if p.is_file())
    assert left == ["reference/zero_stage_3/fp16params/rank1/state.tensor.swp",
                    "zero_stage_3/fp16params/rank1/state.tensor.swp", "zero_stage_3/optimizer/rank1/state.tensor.swp"]
    assert checkpoint.read_bytes() == b"y" * 4096  # a checkpoint linked to a swap file keeps its bytes
    assert remove_swap_files(nvme, 1) >= 3 * 8192
    assert list(nvme.iterdir()) == []  # nothing of DeepSpeed's layout is left; the mount itself stays
    assert remove_swap_files(nvme, 0) == 0  # nothing to remove: a rank that never swapped
