"""DeepSpeed's checkpoints, written at the disk's speed while training goes on.

`engine.save_checkpoint` keeps deciding what a checkpoint holds and where (so its own
`load_checkpoint` reads it back), but through `SpillwayCheckpointEngine`, which DeepSpeed
calls for every file:
- `save` captures now (small state deep-copied, large tensors by reference) and queues the
  large tensors; `BackgroundWrite` writes them later with direct I/O, hashing as it goes.
  The tensors a checkpoint references are the optimizer's fp32 masters, Adam moments and
  16-bit partitions: only the next optimizer step changes them, and the recipe settles the
  write before that step, so forward and backward run while it is written.
- With the optimizer on NVMe, DeepSpeed (0.19.8) writes the optimizer state twice: in the
  ZeRO file (`optimizer.state_dict()`) and as a copy of the swap files
  (`offloaded_tensors/`), and its load reads only the swap files. The ZeRO file keeps only
  the sub-groups that stay in memory (`strip_swapped_subgroups`), and the swap files are
  copied by us, in the background, with direct I/O, instead of DeepSpeed's buffered
  `copytree` inside the save.
- `load` reads the large tensors back with direct I/O and checks each file's checksum as
  it reads, against the manifest (`expect`): one pass over the bytes, not two.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from spillway_runtime.ckpt_io import (
    CHUNK,
    TENSOR_SUFFIX,
    CheckpointIOError,
    DirectIO,
    Written,
    empty_for,
    join_state,
    refs_in,
    split_state,
)

OFFLOADED = "offloaded_tensors"
# Of RLIMIT_MEMLOCK, what the checkpoint's four I/O buffers may lock together: the optimizer
# swapper's buffers are fitted to 0.75 of it (dsconfig.MEMLOCK_SHARE).
MEMLOCK_SHARE = 0.15
MIN_CHUNK = 1 << 20


def direct_io(aio: Any, memlock: int | None, directory: Path) -> DirectIO:
    """A `DirectIO` with the node's tuned async I/O settings (the plan's `aio`), its four
    locked buffers fitted under RLIMIT_MEMLOCK (`memlock`, None when unlimited); through the
    page cache where they would be under `MIN_CHUNK` each, or where `directory`'s
    filesystem refuses O_DIRECT."""
    chunk = CHUNK if memlock is None else min(CHUNK, int(memlock * MEMLOCK_SHARE) // 4)
    return DirectIO(chunk=max(chunk, MIN_CHUNK), block_size=aio.block_size, queue_depth=aio.queue_depth,
                    parallelism=aio.intra_op_parallelism, direct=chunk >= MIN_CHUNK and takes_direct_io(directory))


def takes_direct_io(directory: Path) -> bool:
    probe = directory / f".direct-io-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        os.close(fd)
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


@dataclass
class Job:
    target: Path
    tensors: list[Any] = field(default_factory=list)
    source: Path | None = None  # a file to copy instead


class SpillwayCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    def __init__(self, io: DirectIO, zero_file_filter: Any = None):
        super().__init__()
        self.name = "SpillwayCheckpointEngine"
        self.io = io
        self.zero_file_filter = zero_file_filter  # (state_dict, path) -> state_dict
        self.jobs: list[Job] = []
        self.defer = False  # queue the large tensors (inside `deferring`), else write them at once
        self.expected: dict[Path, str] = {}  # file -> checksum, for `load`

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Saves inside this queue their large tensors for `take_jobs`; any other save through
        this engine (DeepSpeed's `save_16bit_model`, say) writes them before it returns."""
        self.defer = True
        try:
            yield
        finally:
            self.defer = False

    def create(self, info: CheckpointCommitInfo) -> None:
        return None

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return True  # tensors reached twice are written once (`split_state`)

    def save(self, state_dict: Any, path: str) -> None:
        import torch

        if self.zero_file_filter is not None:
            state_dict = self.zero_file_filter(state_dict, path)
        skeleton, tensors = split_state(state_dict)
        torch.save(skeleton, path)
        if tensors and self.defer:
            self.jobs.append(Job(Path(path + TENSOR_SUFFIX), tensors))
        elif tensors:
            self.io.write_tensors(Path(path + TENSOR_SUFFIX), tensors)

    def load(self, path: str, map_location: Any = None) -> Any:
        import torch

        skeleton = torch.load(path, map_location=map_location, weights_only=False)
        refs = refs_in(skeleton)
        if not refs:
            return skeleton
        tensors = [empty_for(ref) for ref in refs]
        data = Path(path + TENSOR_SUFFIX)
        digest = self.io.read_into(data, tensors)
        want = self.expected.get(data.resolve())
        if want is not None and digest != want:
            raise CheckpointIOError(f"{data} does not match its checksum")
        return join_state(skeleton, {ref.offset: t for ref, t in zip(refs, tensors, strict=True)})

    def take_jobs(self) -> list[Job]:
        jobs, self.jobs = self.jobs, []
        return jobs


class BackgroundWrite:
    """The queued files of one checkpoint, written in a thread; `wait` returns what was written."""

    def __init__(self, io: DirectIO, jobs: list[Job]):
        self.io = io
        self.jobs = jobs
        self.written: list[Written] = []
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="spillway-checkpoint", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for job in self.jobs:
                if job.source is not None:
                    job.target.parent.mkdir(parents=True, exist_ok=True)
                    self.written.append(self.io.copy_file(job.source, job.target))
                else:
                    self.written.append(self.io.write_tensors(job.target, job.tensors))
        except BaseException as err:  # reported by `wait`, in the training thread
            self.error = err
        finally:
            self.jobs = []  # drop the references: the tensors may change from now on
            self.seconds = time.monotonic() - self.started

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> list[Written]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.written


def swap_folder(engine: Any) -> Path | None:
    """Where the optimizer's state is swapped to, when it is on NVMe."""
    swapper = getattr(engine.optimizer, "optimizer_swapper", None)
    if swapper is None or not engine.zero_nvme_offload_optimizer():
        return None
    return Path(swapper.swap_folder)


def saved_swap_dir(tag_dir: Path, rank: int) -> Path:
    """Where DeepSpeed's load looks for a rank's swap files: `<tag>/offloaded_tensors/rank<NN>`."""
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str

    return tag_dir / OFFLOADED / f"rank{dp_index_to_str(rank)}"


def swap_file_jobs(engine: Any, tag_dir: Path, rank: int) -> list[Job]:
    """Copies of the optimizer's swap files (not the gradients') into the checkpoint."""
    folder = swap_folder(engine)
    if folder is None:
        return []
    target = saved_swap_dir(tag_dir, rank)
    return [Job(target / src.name, source=src) for src in sorted(folder.iterdir())
            if src.is_file() and "gradient" not in src.name]


@contextlib.contextmanager
def without_swap_copy(engine: Any) -> Iterator[None]:
    """Inside `engine.save_checkpoint`, skip DeepSpeed's buffered copy of the swap files
    (`swap_file_jobs` copies them): in its save that is the only use of this check."""
    engine.zero_nvme_offload_optimizer = lambda: False
    try:
        yield
    finally:
        del engine.zero_nvme_offload_optimizer


@contextlib.contextmanager
def load_view(engine: Any, io: DirectIO, root: Path, tag: str, scratch: Path, rank: int,
              expected: dict[Path, str]) -> Iterator[Path]:
    """The checkpoint at `root` as DeepSpeed's load should see it, with this rank's swap
    files already in the swap folder: copied (and checked against `expected`) with direct
    I/O here, so that DeepSpeed's own buffered copy finds nothing left to do. Yields the
    directory to load from: `root` itself when the optimizer is not on NVMe, else a view
    of symbolic links in `scratch` with empty swap-file folders."""
    folder = swap_folder(engine)
    saved_dir = saved_swap_dir(root / tag, rank)
    if folder is None:
        yield root
        return
    if not saved_dir.is_dir():
        raise CheckpointIOError(f"the checkpoint holds no optimizer swap files for rank {rank} ({saved_dir})")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        view = scratch / root.name
        for src in sorted(root.rglob("*")):
            rel = src.relative_to(root)
            if OFFLOADED in rel.parts:
                continue
            if src.is_dir():
                (view / rel).mkdir(parents=True, exist_ok=True)
            else:
                (view / rel).parent.mkdir(parents=True, exist_ok=True)
                (view / rel).symlink_to(src.resolve())
        for saved in sorted(saved_dir.iterdir()):
            copied = io.copy_file(saved, folder / saved.name)
            want = expected.get(saved.resolve())
            if want is not None and copied.digest != want:
                raise CheckpointIOError(f"{saved} does not match its checksum")
        (view / saved_dir.relative_to(root)).mkdir(parents=True, exist_ok=True)
        yield view
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
