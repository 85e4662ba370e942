"""The recipe's checkpoints: set-up and resume, save in the background, settle, load.

A part of `recipe.FineTuneRecipe` (its base class), kept apart because it is the part that
decides what "exact resume" means: what a checkpoint holds beyond DeepSpeed's own state
(step, data position, RNG, rollback and divergence state: `_state`), when it becomes
durable (`settle_checkpoint`, before the next optimizer step), and which checkpoint a
restart trusts (`_load_good`: a damaged file rejects its checkpoint on every rank).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import time
from pathlib import Path
from typing import Any

from spillway_runtime import k8s_status
from spillway_runtime.checkpoint import (
    STAGING,
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    PendingSave,
    pending_rollback,
)
from spillway_runtime.contract import ExitCode
from spillway_runtime.dsconfig import memlock_limit
from spillway_runtime.optimizer_state import (
    OptimizerStateError,
    load_with_parameters_on_nvme,
    partition_states,
    replay_adam_kernel,
    restore_in_memory_subgroups,
    restore_swapped_state,
    strip_swapped_subgroups,
)

STATE_FILE = "spillway_state.pt"
DS_TAG = "ds"


class RunFailed(RuntimeError):
    """The run cannot go on: a message that names what to change, and the exit code (here
    because this module is the lower of the recipe's two)."""

    def __init__(self, message: str, exit_code: int = ExitCode.FAILED):
        super().__init__(message)
        self.exit_code = exit_code


class Checkpointing:
    """Checkpoint methods of `FineTuneRecipe`, which sets what they use (below)."""

    cfg: Any
    spec: Any
    plan: Any
    rank: int
    world_size: int
    engine: Any
    torch: Any
    reporter: Any
    divergence: Any
    step: int
    data_position: int
    skip_ranges: list[tuple[int, int]]
    rollbacks: int
    lr_scale: float
    last_saved_step: int
    _barrier: Any
    _broadcast: Any
    _first_failure: Any
    _log: Any

    def _setup_checkpoints(self) -> None:
        from spillway_runtime.ds_checkpoint import SpillwayCheckpointEngine, SwapFiles, direct_io

        self.pending: PendingSave | None = None
        self.swap_files = SwapFiles.of(self.engine)  # the optimizer's, on NVMe
        io = direct_io(self.plan.aio, memlock_limit(), Path(self.cfg.checkpoint_dir))
        self.ckpt = SpillwayCheckpointEngine(io, functools.partial(strip_swapped_subgroups, self.engine))
        self.engine.checkpoint_engine = self.ckpt
        self.store = CheckpointStore(
            Path(self.cfg.checkpoint_dir),
            self.spec.checkpoint.keep,
            rank=self.rank,
            barrier=self._barrier,
            broadcast=self._broadcast,
            first_failure=self._first_failure,
            log=self._log,
            pinned=self._pending_rollback,
            keep_best=self.spec.checkpoint.keep_best,
            digest=self.ckpt.io.digest,
        )
        if self.rank == 0:
            self._check_writable(Path(self.cfg.checkpoint_dir), "checkpoint.path")
        # resumeFrom rolls back once: later restarts of the same job (preemption, node loss)
        # continue from the newest checkpoint of the new timeline, not from the rollback point.
        resume_from = self.spec.resume_from
        if resume_from is not None and self.store.applied_rollback() == resume_from:
            resume_from = None
        info = self._load_good(resume_from)
        abandoned: list[str] = []
        if info is not None and resume_from is not None:
            abandoned = self.store.adopt(info.name) if self.rank == 0 else []
            self._barrier()
        self._list_checkpoints_in_status()
        if info is not None:
            if resume_from is not None:
                self.reporter.event("rolled_back", checkpoint=info.name, step=self.step, abandoned=abandoned)
            self.reporter.event("resumed", checkpoint=info.name, step=self.step)

    def _pending_rollback(self) -> set[str]:
        """In a pod: the checkpoint a rollback asked for after this attempt began. The operator
        stops this pod and starts one that resumes from it; until then, this pod's own
        checkpoints must not prune it (it would fail the rollback it was asked for)."""
        sink = self.reporter.sink
        if not isinstance(sink, k8s_status.StatusPublisher):
            return set()
        return pending_rollback(sink.requested_rollback(), self.spec.resume_from, self.store.applied_rollback())

    def _list_checkpoints_in_status(self) -> None:
        """In a pod: status.checkpoints lists what the volume holds, earlier attempts' included
        (server-side apply drops what this manager leaves out) and pruned ones not (a rollback
        to one is refused by the operator, not failed by the runtime)."""
        if self.rank == 0 and isinstance(self.reporter.sink, k8s_status.StatusPublisher):
            self.reporter.sink.known([c.public() for c in self.store.list()])

    def _check_writable(self, directory: Path, field: str) -> None:
        """Fail before training, not hours in, when a checkpoint could never be written."""
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write-test-{os.getpid()}"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as err:
            raise RunFailed(
                f"{field} {directory} is not writable ({err.strerror}); choose a writable directory", ExitCode.BAD_INPUT
            ) from None

    def _state(self) -> dict[str, Any]:
        import numpy as np

        return {
            "step": self.step,
            "data_position": self.data_position,
            "skip_ranges": self.skip_ranges,
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
            "loss_history": list(self.divergence.history),
            "optimizer_steps": [state.get("step") for state in partition_states(self.engine)],
            "micro_steps": self.engine.micro_steps,
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": self.torch.get_rng_state(),
                "cuda": self.torch.cuda.get_rng_state_all() if self.plan.accelerator == "cuda" else None,
            },
        }

    def save_checkpoint(self, loss: float | None) -> None:
        """Begin a checkpoint of this step: what is small is written now, the tensors in the
        background while the next step's forward and backward run (`settle_checkpoint`)."""
        from spillway_runtime.ds_checkpoint import BackgroundWrite, without_swap_copy

        self.settle_checkpoint()
        background: list[BackgroundWrite] = []

        def write(staging: Path) -> Any:
            try:
                with without_swap_copy(self.engine), self.ckpt.deferring():
                    # LoRA: the frozen base is the model's own files, not part of any checkpoint
                    self.engine.save_checkpoint(str(staging), tag=DS_TAG, save_latest=False,
                                                exclude_frozen_parameters=self.spec.method.lora)
                self.torch.save(self._state(), staging / f"rank{self.rank}-{STATE_FILE}")
            finally:
                jobs = self.ckpt.take_jobs()  # a failed save leaves none queued for the next
            if self.swap_files is not None:
                jobs += self.swap_files.save_jobs(staging / DS_TAG, self.rank)
            background.append(BackgroundWrite(self.ckpt.io, jobs))
            return lambda: [(w.path, w.size, w.digest) for w in background[0].wait()]

        meta = {"loss": loss, "worldSize": self.world_size, "plan": self.plan.label,
                "dataPosition": self.data_position, "config": self.spec.model_dump(mode="json")}
        evaluated = getattr(self, "last_eval", None)
        if evaluated is not None and evaluated[0] == self.step:
            meta["evalLoss"] = evaluated[1]
        self.pending = self.store.begin(self.step, write, meta)
        self.pending_stall = time.monotonic() - self.pending.began
        self.pending_background = background

    def settle_checkpoint(self) -> CheckpointInfo | None:
        """Wait for the checkpoint in flight to be durable and commit it (every rank)."""
        pending, self.pending = getattr(self, "pending", None), None
        if pending is None:
            return None
        waited = time.monotonic()
        try:
            info = self.store.finish(pending)
        except CheckpointError as err:
            self.reporter.event("checkpoint_failed", step=pending.step, reason=str(err))
            raise RunFailed(str(err)) from None
        if self.swap_files is not None:
            self.swap_files.committed(pending.staging, info.path)
        stall = self.pending_stall + time.monotonic() - waited
        background = self.pending_background[0].seconds if self.pending_background else 0.0
        self.last_saved_step = pending.step
        self._list_checkpoints_in_status()
        self.reporter.event("checkpoint", **info.public(), stall_seconds=round(stall, 4),
                            background_seconds=round(background, 4))
        return info

    def _load_good(self, name: str | None) -> CheckpointInfo | None:
        """Load the named checkpoint, or the newest good one: a file found damaged as it is
        read rejects that checkpoint (on every rank) and the previous one is tried."""
        from spillway_runtime.ckpt_io import CheckpointIOError

        rejected: set[str] = set()
        while True:
            try:
                info = self.store.find_good(name, deep=False, rejected=rejected)
            except CheckpointError as err:
                raise RunFailed(str(err), ExitCode.BAD_INPUT) from None
            if info is None:
                return None
            problem: str | None = None
            try:
                self._load(info)
            except CheckpointIOError as err:
                problem = str(err)
            problem = self._first_failure(problem)
            if problem is None:
                return info
            if name is not None:
                raise RunFailed(f"resumeFrom: checkpoint {name} is damaged ({problem})", ExitCode.BAD_INPUT)
            self._log(f"checkpoint {info.name} rejected: {problem}; falling back to the previous one")
            rejected.add(info.name)

    def _load(self, info: CheckpointInfo) -> None:
        import numpy as np

        self.ckpt.expected = self.store.deferred(info.path)
        scratch = self.store.root / f"{STAGING}load-view-rank{self.rank}"
        view = contextlib.nullcontext(info.path) if self.swap_files is None else self.swap_files.load_view(
            self.ckpt.io, info.path, DS_TAG, scratch, self.rank, self.ckpt.expected)
        with view as root, load_with_parameters_on_nvme(self.engine), self.ckpt.reading():
            load_path, _ = self.engine.load_checkpoint(
                str(root), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
                load_module_strict=not self.spec.method.lora,  # the frozen base is not in it
            )
            if load_path is None:
                raise RunFailed(f"DeepSpeed could not load checkpoint {info.name} from {info.path}")
            state_file = info.path / f"rank{self.rank}-{STATE_FILE}"
            if not state_file.exists():
                written_by = (self.store.read_manifest(info.path) or {}).get("worldSize")
                raise RunFailed(
                    f"checkpoint {info.name} was written by {written_by} processes and holds no state for rank "
                    f"{self.rank}; resume with the same number of processes",
                    ExitCode.BAD_INPUT,
                )
            try:
                restore_in_memory_subgroups(self.engine, str(root), DS_TAG, self.ckpt.load)
            except OptimizerStateError as err:
                raise RunFailed(str(err), ExitCode.BAD_INPUT) from None
        state = self.torch.load(state_file, weights_only=False)
        steps = state.get("optimizer_steps", [])
        try:
            restore_swapped_state(self.engine, steps, self.swap_files.where if self.swap_files else None)
        except OptimizerStateError as err:
            raise RunFailed(str(err), ExitCode.BAD_INPUT) from None
        replay_adam_kernel(self.engine, max((s for s in steps if s is not None), default=0))
        self.engine.micro_steps = state.get("micro_steps", self.engine.micro_steps)
        self.step = state["step"]
        self.data_position = state["data_position"]
        self.skip_ranges = [tuple(r) for r in state["skip_ranges"]]
        self.rollbacks = state["rollbacks"]
        self.lr_scale = state["lr_scale"]
        self.divergence.history.clear()
        self.divergence.history.extend(state["loss_history"])
        rng = state["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        self.torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and self.plan.accelerator == "cuda":
            self.torch.cuda.set_rng_state_all(rng["cuda"])
        self.last_saved_step = self.step
