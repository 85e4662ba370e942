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
  moved into the checkpoint rather than copied, and read from it by the swapper's next
  swap-in (`SwapFiles`), instead of DeepSpeed's buffered `copytree` on save and on load.
- `load` reads the large tensors back with direct I/O, several chunks in flight, and checks
  each file's checksum as it reads, against the manifest (`expected`): one pass over the
  bytes, not two.
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

from spillway_runtime.checkpoints import unpickle
from spillway_runtime.checkpoints.tensor_io import (
    TENSOR_SUFFIX,
    CheckpointIOError,
    DirectIO,
    Written,
    empty_for,
    join_state,
    refs_in,
    split_state,
)
from spillway_runtime.core.memlock import MIN_CHUNK, chunk_under

OFFLOADED = "offloaded_tensors"


def direct_io(aio: Any, memlock: int | None, directory: Path) -> DirectIO:
    """A `DirectIO` with the node's tuned async I/O settings (the plan's `aio`), its
    locked buffers fitted under RLIMIT_MEMLOCK (`memlock`, None when unlimited); through the
    page cache where they would be under `MIN_CHUNK` each, or where `directory`'s
    filesystem refuses O_DIRECT."""
    chunk = chunk_under(memlock)
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
    in_place: bool = False  # a file already there, to checksum


class SpillwayCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    def __init__(self, io: DirectIO, zero_file_filter: Any = None):
        super().__init__()
        self.name = "SpillwayCheckpointEngine"
        self.io = io
        self.zero_file_filter = zero_file_filter  # (state_dict, path) -> state_dict
        self.jobs: list[Job] = []
        self.defer = False  # queue the large tensors (inside `deferring`), else write them at once
        self.expected: dict[Path, str] = {}  # file -> checksum, for `load`
        self.reading_once = False  # inside `reading`
        self.last: tuple[str, Any] | None = None  # there: the file `load` read last, and what it returned

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Saves inside this queue their large tensors for `take_jobs`; any other save through
        this engine (DeepSpeed's `save_16bit_model`, say) writes them before it returns."""
        self.defer = True
        try:
            yield
        finally:
            self.defer = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """One checkpoint's load: a file asked for twice in a row is read once. DeepSpeed's
        module load reads the model-states file once to check its process count, then again
        to use it (with ZeRO-1/2 the 16-bit weights: 2 bytes a parameter read twice)."""
        self.reading_once = True
        try:
            yield
        finally:
            self.reading_once, self.last = False, None

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
        if self.last is not None and self.last[0] == path:
            return self.last[1]
        self.last = None
        state = self._read(path, map_location)
        if self.reading_once:
            self.last = (path, state)
        return state

    def _read(self, path: str, map_location: Any) -> Any:
        skeleton = unpickle.load(path, map_location)
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


def read_swap_file(engine: SpillwayCheckpointEngine, path: Path) -> Any:
    """A checkpoint's optimizer swap file, whole (a uint8 tensor), read with `engine`'s I/O
    and checked as it is read against the checksum `engine.expected` holds for it, if any.
    The universal conversion's `read_swap` (`functools.partial(read_swap_file, engine)`)."""
    import torch

    data = torch.empty(path.stat().st_size, dtype=torch.uint8)
    digest = engine.io.read_into(path, [data])
    want = engine.expected.get(path.resolve())
    if want is not None and digest != want:
        raise CheckpointIOError(f"{path} does not match its checksum")
    return data


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
                if job.in_place:
                    self.written.append(Written(job.target, job.target.stat().st_size, self.io.digest(job.target)))
                elif job.source is not None:
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


def saved_swap_dir(tag_dir: Path, rank: int) -> Path:
    """Where DeepSpeed's load looks for a rank's swap files: `<tag>/offloaded_tensors/rank<NN>`."""
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str

    return tag_dir / OFFLOADED / f"rank{dp_index_to_str(rank)}"


class SwapFiles:
    """The optimizer's swap files (optimizer on NVMe) in checkpoints, moved rather than copied.

    DeepSpeed's swapper reads a sub-group's files at its swap-in, in the optimizer step, and
    writes them back at its swap-out, to the same paths (a file that is not there is
    created). So a checkpoint takes the files as they stand after a step by renaming them
    into itself (`save_jobs`; the background write only checksums them) and records each in
    `pending`; the swapper's next swap-in of that tensor reads it from the checkpoint (the
    hook `__init__` installs), and its swap-out writes a new file in the swap folder. A file
    of a checkpoint is never written again. A second checkpoint before the next step links
    the same files. A load (`load_view`) reads each file once where it is (the fp32 masters
    into the 16-bit partitions, every file checked) and leaves them there for the next
    swap-in, instead of DeepSpeed's buffered copy of every byte into the swap folder and
    its swap-in and swap-out of every sub-group. Where the swap folder and the checkpoints are on different filesystems,
    the save copies the files instead (direct I/O, in the background).

    Pending reads point into the staging directory until the store commits it
    (`committed`), which the recipe does before the next optimizer step. A checkpoint that
    fails to commit ends the run (the recipe's `RunFailed`): the restart loads the last
    good checkpoint, whatever the swap folder holds.
    """

    def __init__(self, swapper: Any, zero: Any = None):
        self.swapper = swapper
        self.zero = zero  # ZeRO-3's optimizer, whose load `load_view` takes over
        self.folder = Path(swapper.swap_folder)
        self.pending: dict[str, Path] = {}  # swap path -> where the state is until the next swap-in
        self.unchecked: dict[Path, str] = {}  # in a load: files not read yet -> their checksums
        self.problem: str | None = None  # in a load: a file that did not match
        for name in ("_swap_in_parameter", "_swap_in_optimizer_state"):  # partitioned, pipelined
            original = getattr(swapper, name, None)
            if original is not None:
                setattr(swapper, name, self._reading_pending(original))

    @classmethod
    def of(cls, engine: Any) -> SwapFiles | None:
        swapper = getattr(engine.optimizer, "optimizer_swapper", None)
        if swapper is None or not engine.zero_nvme_offload_optimizer():
            return None
        return cls(swapper, engine.optimizer)

    def _reading_pending(self, swap_in: Any) -> Any:
        def swap_in_pending(aio_handle: Any, parameter: Any, *args: Any, **kwargs: Any) -> Any:
            info = self.swapper._get_param_swap_info(parameter)
            redirected = []
            for tensor in info.tensors if info is not None and self.pending else []:
                source = self.pending.pop(tensor.swap_path, None)
                if source is not None:
                    redirected.append((tensor, tensor.swap_path))
                    tensor.swap_path = str(source)
            try:  # the reads are submitted (file names copied) before this returns
                return swap_in(aio_handle, parameter, *args, **kwargs)
            finally:
                for tensor, path in redirected:
                    tensor.swap_path = path

        return swap_in_pending

    def _key(self, name: str) -> str:
        return os.path.join(self.swapper.swap_folder, name)  # as DeepSpeed builds swap_path

    def names(self) -> list[str]:
        """The optimizer's swap files (not the gradients'), wherever they are now."""
        here = {p.name for p in self.folder.iterdir() if p.is_file() and "gradient" not in p.name}
        return sorted(here | {Path(key).name for key in self.pending})

    def where(self, name: str) -> Path:
        """Where the current state of swap file `name` is."""
        return self.pending.get(self._key(name), Path(self._key(name)))

    def save_jobs(self, tag_dir: Path, rank: int) -> list[Job]:
        """Put this rank's swap files into the checkpoint at `tag_dir`: what the background
        write must then do with each (checksum it, or copy it)."""
        target_dir = saved_swap_dir(tag_dir, rank)
        target_dir.mkdir(parents=True, exist_ok=True)
        same_fs = os.stat(self.folder).st_dev == os.stat(target_dir).st_dev
        jobs = []
        for name in self.names():
            key, target = self._key(name), target_dir / name
            earlier = self.pending.get(key)
            moved = False
            with contextlib.suppress(OSError):  # then copied
                if earlier is not None:
                    os.link(earlier, target)
                    moved = True
                elif same_fs:
                    os.rename(key, target)
                    moved = True
            jobs.append(Job(target, in_place=True) if moved else Job(target, source=earlier or Path(key)))
            if moved or earlier is not None:  # an earlier checkpoint may be pruned at this one's commit
                self.pending[key] = target
        return jobs

    def committed(self, staging: Path, final: Path) -> None:
        """The store renamed `staging` to `final`: pending reads follow."""
        for key, path in self.pending.items():
            if path.is_relative_to(staging):
                self.pending[key] = final / path.relative_to(staging)

    @contextlib.contextmanager
    def load_view(self, io: DirectIO, root: Path, tag: str, scratch: Path, rank: int,
                  expected: dict[Path, str]) -> Iterator[Path]:
        """The checkpoint at `root` as DeepSpeed's load should see it: a view of symbolic
        links in `scratch` whose swap-file folder is empty (DeepSpeed copies nothing), this
        rank's swap files pending for the swapper's next swap-in, where they are. Inside,
        DeepSpeed's load restores the sub-groups our way (`_restore`); every swap file is
        checked against `expected` by the end, and one that does not match raises there,
        after DeepSpeed's load and its collectives have run on every rank."""
        saved_dir = saved_swap_dir(root / tag, rank)
        self.pending.clear()
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
                self.pending[self._key(saved.name)] = saved.resolve()
                if (want := expected.get(saved.resolve())) is not None:
                    self.unchecked[saved.resolve()] = want
            (view / saved_dir.relative_to(root)).mkdir(parents=True, exist_ok=True)
            if self.zero is not None:
                self.zero.reset_swap_buffers = lambda: self._restore(io)
            yield view
            for path in list(self.unchecked):  # what the restore did not read: the Adam moments
                self._check(path, io.digest(path))
            if self.problem is not None:
                raise CheckpointIOError(self.problem)
        except BaseException:
            self.pending.clear()
            raise
        finally:
            if self.zero is not None and "reset_swap_buffers" in vars(self.zero):
                del self.zero.reset_swap_buffers
            self.unchecked.clear()
            self.problem = None
            shutil.rmtree(scratch, ignore_errors=True)

    def _check(self, path: Path, digest: str) -> None:
        want = self.unchecked.pop(path, None)
        if want is not None and digest != want and self.problem is None:
            self.problem = f"{path} does not match its checksum"

    def _restore(self, io: DirectIO) -> None:
        """ZeRO-3's `reset_swap_buffers` in DeepSpeed's load, without its second copy. There,
        each swapped sub-group is swapped in (every byte read), its 16-bit partition written
        from the fp32 masters, and swapped out again (every byte written to the swap folder).
        Here its masters are read from the checkpoint's file straight into the 16-bit
        partition (the same cast), checksummed as they are read; the Adam moments stay where
        they are for the next swap-in. A sub-group whose 16-bit partition is swapped too
        (parameters on NVMe) goes DeepSpeed's way, its files checked before it reads them."""
        zero = self.zero
        for i in range(len(zero.fp16_groups)):
            flat = zero.fp32_partitioned_groups_flat[i]
            master = self.pending.get(self._key(f"{self.swapper.parameter_id(flat)}.tensor.swp"))
            partition = zero.fp16_partitioned_groups_flat[i]
            if not zero._swappable_optimizer_subgroup(i) or master is None or partition is None:
                info = self.swapper._get_param_swap_info(flat) if zero._swappable_optimizer_subgroup(i) else None
                for key in info.get_swap_paths() if info is not None else []:
                    if (path := self.pending.get(key)) is not None and path in self.unchecked:
                        self._check(path, io.digest(path))
                timers: set[str] = set()
                zero._prepare_sub_group(i, timers)
                zero._reassign_or_swap_out_partitioned_parameters(i)
                zero._release_sub_group(i, timers)
                continue
            self._check(master, io.digest(master, self._casting_into(partition, flat.dtype,
                                                                      int(zero.fp16_partitioned_groups_flat_numel[i]))))
            zero._unflatten_partitioned_parameters(i)

    @staticmethod
    def _casting_into(partition: Any, dtype: Any, numel: int) -> Any:
        """A chunk reader that casts a masters file's elements into `partition`, in place."""
        target = partition.view(-1)

        def cast(offset: int, chunk: Any) -> None:
            first = offset // dtype.itemsize
            count = min(numel - first, int(chunk.numel()) // dtype.itemsize)
            if count > 0:
                target[first:first + count].copy_(chunk[:count * dtype.itemsize].view(dtype))

        return cast

@contextlib.contextmanager
def without_swap_copy(engine: Any) -> Iterator[None]:
    """Inside `engine.save_checkpoint`, skip DeepSpeed's buffered copy of the swap files
    (`SwapFiles.save_jobs` moves them): in its save that is the only use of this check."""
    engine.zero_nvme_offload_optimizer = lambda: False
    try:
        yield
    finally:
        del engine.zero_nvme_offload_optimizer
