"""The recipe's checkpoints: set-up and resume, save in the background, settle, load.

A part of `recipe.FineTuneRecipe` (which holds it as `checkpoints`), kept apart because it is the part that
decides what "exact resume" means: what a checkpoint holds beyond DeepSpeed's own state
(step, data position, RNG, rollback and divergence state: `_state`), when it becomes
durable (`settle`, before the next optimizer step), and which checkpoint a
restart trusts (`load_good`: a damaged file rejects its checkpoint on every rank). A
checkpoint written by another number of processes or ZeRO stage is loaded through DeepSpeed's
universal checkpoint (`_load_resharded`, `universal.write_universal`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spillway_runtime.checkpoints import unpickle
from spillway_runtime.checkpoints.optimizer_state import (
    OptimizerStateError,
    load_with_parameters_on_nvme,
    partition_states,
    replay_adam_kernel,
    restore_in_memory_subgroups,
    restore_swapped_state,
    restore_zenflow,
    strip_swapped_subgroups,
    zenflow_state,
)
from spillway_runtime.checkpoints.store import (
    STAGING,
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    PendingSave,
    pending_rollback,
    write_problem,
)
from spillway_runtime.core.contract import ExitCode
from spillway_runtime.core.hardware import memlock_limit
from spillway_runtime.training import k8s_status, mirroring
from spillway_runtime.training.resharding import Shape, refuse_reshard, rescaled, written_shape
from spillway_runtime.training.run import RunFailed, TrainingRun

STATE_FILE = "spillway_state.pt"
DS_TAG = "ds"

if TYPE_CHECKING:
    from spillway_runtime.checkpoints.engine import BackgroundWrite, SpillwayCheckpointEngine, SwapFiles
    from spillway_runtime.checkpoints.mirror import CheckpointMirror


class Checkpointing:
    """The recipe's checkpoints, a part the recipe holds (`recipe.checkpoints`): `keep_share`
    before the engine is built, `setup` (and resume) after, then `save` and `settle` at each
    checkpoint step, `load_good` on a rollback."""

    ckpt: SpillwayCheckpointEngine  # from setup on
    store: CheckpointStore

    def __init__(self, run: TrainingRun):
        self.run = run
        self.pending: PendingSave | None = None
        self.pending_stall = 0.0
        self.pending_background: list[BackgroundWrite] = []
        self.mirror: CheckpointMirror | None = None
        self.swap_files: SwapFiles | None = None

    def setup(self) -> None:
        """Once the engine is built: the checkpoint engine, the store, the mirror; then resume
        from the newest good checkpoint (or the one `resumeFrom` names)."""
        from spillway_runtime.checkpoints.engine import SpillwayCheckpointEngine, SwapFiles, direct_io

        self.swap_files = SwapFiles.of(self.run.engine)  # the optimizer's, on NVMe
        io = direct_io(self.run.plan.aio, memlock_limit(), Path(self.run.cfg.checkpoint_dir))
        if io.fallback and self.run.rank == 0:
            self.run.log(f"checkpoints are written through the page cache: {io.fallback}")
        self.ckpt = SpillwayCheckpointEngine(io, functools.partial(strip_swapped_subgroups, self.run.engine))
        self.run.engine.checkpoint_engine = self.ckpt
        self.store = CheckpointStore(
            Path(self.run.cfg.checkpoint_dir),
            self.run.spec.checkpoint.keep,
            rank=self.run.rank,
            barrier=self.run.ranks.barrier,
            broadcast=self.run.ranks.broadcast,
            first_failure=self.run.ranks.first_failure,
            log=self.run.log,
            pinned=self._pinned,
            # early stopping names the best checkpoint: it is kept
            keep_best=self.run.spec.checkpoint.keep_best or self.run.spec.training.early_stopping is not None,
            digest=self.ckpt.io.digest,
        )
        if self.run.rank == 0:
            self._check_writable(Path(self.run.cfg.checkpoint_dir), "checkpoint.path")
        self.mirror = mirroring.open_mirror(self.run, self.store)
        # resumeFrom rolls back once: later restarts of the same job (preemption, node loss)
        # continue from the newest checkpoint of the new timeline, not from the rollback point.
        resume_from = self.run.spec.resume_from
        if resume_from is not None and self.store.applied_rollback() == resume_from:
            resume_from = None
        info = self.load_good(resume_from)
        abandoned: list[str] = []
        if info is not None and resume_from is not None:
            abandoned = self.store.adopt(info.name) if self.run.rank == 0 else []
            if self.mirror is not None:
                self.mirror.point_to(info.name)
            self.run.ranks.barrier()
        self._list_checkpoints_in_status()
        if info is not None:
            if resume_from is not None:
                self.run.reporter.event("rolled_back", checkpoint=info.name, step=self.run.step, abandoned=abandoned)
            self.run.reporter.event("resumed", checkpoint=info.name, step=self.run.step)

    def keep_share(self) -> None:
        """Before the engine is built: when the planner chose the share of an NVMe optimizer kept
        in RAM (the job did not pin `offload.cpuResidentFraction`), a restart keeps the share its
        checkpoint was written with, not the one that this attempt's free RAM gave: the share
        moves with free RAM from run to run, and another one costs a conversion at every
        restart, or (parameters on NVMe) cannot be converted at all. A larger share than planned
        is kept only where it cannot be converted (it is what the job ran with before); else
        the load converts it to the planned one."""
        from spillway_runtime.checkpoints.store import LATEST, MANIFEST

        if self.run.plan.optimizer != "nvme" or self.run.spec.offload.cpu_resident_fraction is not None:
            return
        root = Path(self.run.cfg.checkpoint_dir)
        try:
            name = self.run.spec.resume_from or (root / LATEST).read_text().strip()
            manifest = json.loads((root / name / MANIFEST).read_text())
        except (OSError, ValueError):
            return  # nothing to resume from here (or a mirror's, restored later: converted then)
        written = manifest.get("cpuResidentFraction") if isinstance(manifest, dict) else None
        if (not isinstance(written, int | float) or written == self.run.plan.swap.cpu_resident_fraction
                or manifest.get("plan") != self.run.plan.label or manifest.get("worldSize") != self.run.world_size):
            return
        if written > self.run.plan.swap.cpu_resident_fraction and self.run.plan.parameters != "nvme":
            return  # more than this attempt's RAM holds: converted to the planned share on load
        self.run.log(f"optimizer: {written:.0%} of its sub-groups kept in RAM as checkpoint {name} was written, "
                     f"not the {self.run.plan.swap.cpu_resident_fraction:.0%} planned")
        self.run.plan.swap.cpu_resident_fraction = float(written)

    def _pinned(self) -> set[str]:
        """What pruning the volume must spare: a pending rollback's target and what the
        mirror is still uploading."""
        return self._pending_rollback() | (self.mirror.in_flight() if self.mirror is not None else set())

    def report_mirror(self) -> None:
        """The uploader's news since the last call, as events (the training thread's, so
        the events file and the status are written from one thread)."""
        if self.mirror is None:
            return
        for kind, fields in self.mirror.take_events():
            self.run.reporter.event(kind, uri=self.mirror.mirror.uri, **fields)

    def finish_mirror(self, budget_seconds: float) -> None:
        """Wait for the uploads (the end of training, a stop's grace), then stop the uploader."""
        if self.mirror is None:
            return
        if not self.mirror.drain(budget_seconds):
            state = self.mirror.state
            self.run.reporter.event("mirror_behind", uri=self.mirror.mirror.uri, uploaded=state.uploaded,
                                    waited_seconds=round(budget_seconds, 1), reason=state.last_error)
        self.report_mirror()
        self.mirror.close()

    def _pending_rollback(self) -> set[str]:
        """In a pod: the checkpoint a rollback asked for after this attempt began. The operator
        stops this pod and starts one that resumes from it; until then, this pod's own
        checkpoints must not prune it (it would fail the rollback it was asked for)."""
        sink = self.run.reporter.sink
        if not isinstance(sink, k8s_status.StatusPublisher):
            return set()
        return pending_rollback(sink.requested_rollback(), self.run.spec.resume_from, self.store.applied_rollback())

    def _list_checkpoints_in_status(self) -> None:
        """In a pod: status.checkpoints lists what the volume holds, earlier attempts' included
        (server-side apply drops what this manager leaves out) and pruned ones not (a rollback
        to one is refused by the operator, not failed by the runtime)."""
        if self.run.rank == 0 and isinstance(self.run.reporter.sink, k8s_status.StatusPublisher):
            self.run.reporter.sink.known([c.public() for c in self.store.list()])

    def _check_writable(self, directory: Path, field: str) -> None:
        """Fail before training, not hours in, when a checkpoint could never be written."""
        problem = write_problem(directory)
        if problem:
            raise RunFailed(f"{field} {directory} is not writable ({problem}); choose a writable directory",
                            ExitCode.BAD_INPUT)

    def _state(self) -> dict[str, Any]:
        import numpy as np

        return {
            "step": self.run.step,
            "data_position": self.run.data_position,
            "skip_ranges": self.run.skip_ranges,
            "rollbacks": self.run.rollbacks,
            "lr_scale": self.run.lr_scale,
            "loss_history": list(self.run.divergence.history),
            "early_stopping": self.run.early_stopping.state() if self.run.early_stopping is not None else None,
            "optimizer_steps": [state.get("step") for state in partition_states(self.run.engine)],
            "micro_steps": self.run.engine.micro_steps,
            "zenflow": zenflow_state(self.run.engine),
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": self.run.torch.get_rng_state(),
                "cuda": self.run.torch.cuda.get_rng_state_all() if self.run.plan.accelerator == "cuda" else None,
            },
        }

    def save(self, loss: float | None) -> None:
        """Begin a checkpoint of this step: what is small is written now, the tensors in the
        background while the next step's forward and backward run (`settle`)."""
        from spillway_runtime.checkpoints.engine import BackgroundWrite, without_swap_copy

        self.settle()
        background: list[BackgroundWrite] = []

        def write(staging: Path) -> Any:
            try:
                with without_swap_copy(self.run.engine), self.ckpt.deferring():
                    # LoRA: the frozen base is the model's own files, not part of any checkpoint
                    self.run.engine.save_checkpoint(str(staging), tag=DS_TAG, save_latest=False,
                                                    exclude_frozen_parameters=self.run.spec.method.lora)
                self.run.torch.save(self._state(), staging / f"rank{self.run.rank}-{STATE_FILE}")
            finally:
                jobs = self.ckpt.take_jobs()  # a failed save leaves none queued for the next
            if self.swap_files is not None:
                jobs += self.swap_files.save_jobs(staging / DS_TAG, self.run.rank)
            background.append(BackgroundWrite(self.ckpt.io, jobs))
            return lambda: [(w.path, w.size, w.digest) for w in background[0].wait()]

        meta = {"loss": loss, "worldSize": self.run.world_size, "plan": self.run.plan.label,
                "dataPosition": self.run.data_position, "config": self.run.spec.model_dump(mode="json"),
                # what a resume elsewhere must plan with (local.py, from a mirrored checkpoint)
                "aioBlockSize": self.run.plan.aio.block_size, "cpuResidentFraction": self._shape().resident,
                # the base model and tokenizer as this run found them (a job file's relative
                # model.uri resolved), for `spillway export` (export.py)
                "modelDir": self.run.cfg.model_dir, "tokenizerDir": self.run.cfg.tokenizer_dir}
        evaluated = self.run.last_eval
        if evaluated is not None and evaluated[0] == self.run.step:
            meta["evalLoss"] = evaluated[1]
        self.pending = self.store.begin(self.run.step, write, meta)
        self.pending_stall = time.monotonic() - self.pending.began
        self.pending_background = background

    def settle(self) -> CheckpointInfo | None:
        """Wait for the checkpoint in flight to be durable and commit it (every rank)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        waited = time.monotonic()
        try:
            info = self.store.finish(pending)
        except CheckpointError as err:
            self.run.reporter.event("checkpoint_failed", step=pending.step, reason=str(err))
            raise RunFailed(str(err)) from None
        if self.swap_files is not None:
            self.swap_files.committed(pending.staging, info.path)
        if self.mirror is not None:
            self.mirror.submit(info.name, info.step, info.path)
            if self.run.cfg.faults.mirror_every_checkpoint and not self.mirror.drain(timeout=300):
                raise RunFailed(f"fault injection: {info.name} was not uploaded within 300 s")
        stall = self.pending_stall + time.monotonic() - waited
        background = self.pending_background[0].seconds if self.pending_background else 0.0
        self.run.last_saved_step = pending.step
        self._list_checkpoints_in_status()
        self.run.reporter.event("checkpoint", **info.public(), stall_seconds=round(stall, 4),
                                background_seconds=round(background, 4))
        self.report_mirror()
        return info

    def load_good(self, name: str | None) -> CheckpointInfo | None:
        """Load the named checkpoint, or the newest good one: a file found damaged as it is
        read rejects that checkpoint (on every rank) and the previous one is tried."""
        from spillway_runtime.checkpoints.tensor_io import CheckpointIOError

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
            problem = self.run.ranks.first_failure(problem)
            if problem is None:
                return info
            if name is not None:
                raise RunFailed(f"resumeFrom: checkpoint {name} is damaged ({problem})", ExitCode.BAD_INPUT)
            self.run.log(f"checkpoint {info.name} rejected: {problem}; falling back to the previous one")
            rejected.add(info.name)

    def _load(self, info: CheckpointInfo) -> None:
        written = written_shape(self.store, info)
        resharded = written is not None and written.layout != self._shape().layout
        # With the optimizer moved to or from NVMe alone, or another share of it kept in RAM, a
        # sub-group's state is in swap files on one side and in the ZeRO file on the other: the
        # load below would take the checkpoint for damaged and fall back, where the universal
        # checkpoint carries it across.
        universal = resharded or (written is not None and written.swapped != self._shape().swapped)
        self._refuse_other_order(info, resharded)
        self._refuse_twin_flow_through_universal(info, universal)
        if universal and written is not None:
            self._load_resharded(info, written)
            return
        self.ckpt.expected = self.store.deferred(info.path)
        scratch = self.store.root / f"{STAGING}load-view-rank{self.run.rank}"
        view = contextlib.nullcontext(info.path) if self.swap_files is None else self.swap_files.load_view(
            self.ckpt.io, info.path, DS_TAG, scratch, self.run.rank, self.ckpt.expected)
        with view as root, load_with_parameters_on_nvme(self.run.engine), self.ckpt.reading():
            load_path, _ = self.run.engine.load_checkpoint(
                str(root), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
                load_module_strict=not self.run.spec.method.lora,  # the frozen base is not in it
            )
            if load_path is None:
                raise RunFailed(f"DeepSpeed could not load checkpoint {info.name} from {info.path}")
            state_file = info.path / f"rank{self.run.rank}-{STATE_FILE}"
            if not state_file.exists():
                written_by = (self.store.read_manifest(info.path) or {}).get("worldSize")
                raise RunFailed(
                    f"checkpoint {info.name} was written by {written_by} processes and holds no state for rank "
                    f"{self.run.rank}; resume with the same number of processes",
                    ExitCode.BAD_INPUT,
                )
            try:
                restore_in_memory_subgroups(self.run.engine, str(root), DS_TAG, self.ckpt.load)
            except OptimizerStateError as err:
                raise RunFailed(str(err), ExitCode.BAD_INPUT) from None
        state = unpickle.load(state_file)
        steps = state.get("optimizer_steps", [])
        try:
            restore_swapped_state(self.run.engine, steps, self.swap_files.where if self.swap_files else None)
        except OptimizerStateError as err:
            raise RunFailed(str(err), ExitCode.BAD_INPUT) from None
        replay_adam_kernel(self.run.engine, max((s for s in steps if s is not None), default=0))
        self.run.engine.micro_steps = state.get("micro_steps", self.run.engine.micro_steps)
        self._restore_zenflow(info, state)
        self._restore_progress(state)
        self._restore_rng(state["rng"])

    def _refuse_other_order(self, info: CheckpointInfo, resharded: bool) -> None:
        """ZenFlow stores each matrix's optimizer state column by column (DeepSpeed's ZeRO-2 flat
        buffers in its order), every other placement row by row, and DeepSpeed's load and its
        universal checkpoint map neither onto the other: refused with BAD_INPUT, naming what to
        change, where loading would scramble the weights."""
        config = (self.store.read_manifest(info.path) or {}).get("config") or {}
        written = (config.get("offload") or {}).get("overlap", "none")
        planned = self.run.spec.offload.overlap
        if written != planned:
            raise RunFailed(
                f"checkpoint {info.name} was written with offload.overlap {written}, this run has {planned}: "
                "ZenFlow keeps the optimizer state column by column and the others row by row, and DeepSpeed "
                f"cannot load one as the other; resume with offload.overlap {written}", ExitCode.BAD_INPUT)
        if planned == "zenflow" and resharded:
            raise RunFailed(
                f"checkpoint {info.name} was written by another number of processes or placement, and DeepSpeed's "
                "universal checkpoint maps ZenFlow's column-ordered state wrongly: resume with the processes and "
                "placement that wrote it, or without offload.overlap from a checkpoint written without it",
                ExitCode.BAD_INPUT)

    def _refuse_twin_flow_through_universal(self, info: CheckpointInfo, universal: bool) -> None:
        """DeepSpeed's universal checkpoint load gives every sub-group's Adam moments to the CPU
        Adam, Twin-Flow's GPU share's too, where its AdamW never reads them (it would restart Adam
        from zero and hold both copies on the GPU): refused with BAD_INPUT when either side of a
        resume through it has offload.gpuResidentFraction."""
        if not universal:
            return
        config = (self.store.read_manifest(info.path) or {}).get("config") or {}
        written = (config.get("offload") or {}).get("gpuResidentFraction")
        planned = self.run.spec.offload.gpu_resident_fraction
        if written or planned:
            raise RunFailed(
                f"checkpoint {info.name} was written by another number of processes or with the optimizer in "
                "another tier, which DeepSpeed's universal checkpoint carries across; it does not carry the Adam "
                "moments of Twin-Flow's GPU share (offload.gpuResidentFraction): resume with the processes and "
                "optimizer tier that wrote it (offload.optimizer: cpu), then change them at a checkpoint written "
                "without gpuResidentFraction", ExitCode.BAD_INPUT)

    def _restore_zenflow(self, info: CheckpointInfo, state: dict[str, Any]) -> None:
        if self.run.zenflow_interval and not restore_zenflow(self.run.engine, state.get("zenflow"), state["step"],
                                                              self.run.zenflow_interval):
            self.run.log(f"checkpoint {info.name} (step {state['step']}) is not on a ZenFlow update boundary (every "
                         f"{self.run.zenflow_interval} steps): ZenFlow starts afresh from it, so the steps after it "
                         "are not those of an uninterrupted run")

    def _restore_progress(self, state: dict[str, Any], samples_scale: tuple[int, int] = (1, 1)) -> None:
        """Step, data position, skipped batches, rollback state from a state file. A data
        position counts global micro-batches (`micro_batch_size` x processes samples): written by
        `old` processes, it is `old / new` times as many for `new` (`samples_scale`)."""
        self.run.step = state["step"]
        self.run.data_position = rescaled(state["data_position"], samples_scale, "the data position")
        self.run.skip_ranges = [(rescaled(a, samples_scale, "a skipped range"), rescaled(b, samples_scale, "a skipped range"))
                                for a, b in state["skip_ranges"]]
        self.run.rollbacks = state["rollbacks"]
        self.run.lr_scale = state["lr_scale"]
        self.run.divergence.history.clear()
        self.run.divergence.history.extend(state["loss_history"])
        if self.run.early_stopping is not None:
            self.run.early_stopping.restore(state.get("early_stopping"))
        self.run.last_saved_step = self.run.step

    def _restore_rng(self, rng: dict[str, Any]) -> None:
        import numpy as np

        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        self.run.torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and self.run.plan.accelerator == "cuda":
            self.run.torch.cuda.set_rng_state_all(rng["cuda"])

    # --- resume across shapes ------------------------------------------------------------

    def _shape(self) -> Shape:
        resident = self.run.plan.swap.cpu_resident_fraction if self.run.plan.optimizer == "nvme" else 0.0
        return Shape(self.run.world_size, self.run.plan.zero_stage, self.run.plan.optimizer, self.run.plan.parameters, resident)

    def _load_resharded(self, info: CheckpointInfo, written: Shape) -> None:
        """Resume from a checkpoint of another number of processes or ZeRO stage, or whose
        optimizer moved to or from NVMe: rank 0 converts it into DeepSpeed's universal form
        (`universal.write_universal`), every rank loads that (its swapped optimizer state
        through `universal.filling_swapped_state`), and our own state comes from rank 0's state
        file, its data positions rescaled to the new number of processes. With the same number
        of processes and ZeRO stage (only where the optimizer state lives changed), each rank takes
        its own state file, random generators included: the run goes on as if uninterrupted."""
        import numpy as np

        refuse_reshard(info, written, self._shape(), self.run.spec.method.lora)
        scratch = self.store.root / f"{STAGING}universal-{info.name}"
        try:
            self._load_universal(info, scratch)
        finally:
            self.run.ranks.barrier()  # every rank has read the converted files before rank 0 removes them
            if self.run.rank == 0:
                shutil.rmtree(scratch, ignore_errors=True)
        same_layout = written.layout == self._shape().layout
        state = unpickle.load(info.path / f"rank{self.run.rank if same_layout else 0}-{STATE_FILE}")
        replay_adam_kernel(self.run.engine, max((s for s in state.get("optimizer_steps", []) if s is not None),
                                                default=state["step"]))
        self.run.engine.micro_steps = self.run.engine.global_steps * self.run.engine.gradient_accumulation_steps()
        self._restore_progress(state, (written.world_size, self.run.world_size))
        if same_layout:
            self._restore_rng(state["rng"])
        else:
            # Each rank's generators cannot be mapped onto another number of ranks: seeded from
            # the step instead, the same way on every attempt that makes this change.
            seed = self.run.spec.training.seed + self.run.step + self.run.rank
            random.seed(seed)
            np.random.seed(seed)
            self.run.torch.manual_seed(seed)
        if self.run.rank == 0:
            self.run.log(f"checkpoint {info.name} resharded from {written.describe()} to {self._shape().describe()}"
                         + ("" if same_layout else "; random generators reseeded from the step"))
        self.run.reporter.event("resharded", checkpoint=info.name, step=self.run.step,
                                **{"from": written.public(), "to": self._shape().public()})

    def _load_universal(self, info: CheckpointInfo, scratch: Path) -> None:
        from spillway_runtime.checkpoints.engine import read_swap_file
        from spillway_runtime.checkpoints.tensor_io import CheckpointIOError
        from spillway_runtime.checkpoints.universal import UniversalError, write_universal

        damaged: str | None = None
        problem: str | None = None
        if self.run.rank == 0:
            self.ckpt.expected = self.store.deferred(info.path)
            try:
                write_universal(info.path, DS_TAG, scratch, self.ckpt.load,
                                functools.partial(read_swap_file, self.ckpt))
            except CheckpointIOError as err:  # on every rank below: `load_good` tries the previous checkpoint
                damaged = str(err)
            except (UniversalError, OSError, RuntimeError, KeyError, IndexError, TypeError, ValueError,
                    AssertionError) as err:
                problem = f"checkpoint {info.name} could not be converted for another shape: {err}"
        damaged = self.run.ranks.first_failure(damaged)
        if damaged is not None:
            raise CheckpointIOError(damaged)
        problem = self.run.ranks.first_failure(problem)
        if problem is not None:
            raise RunFailed(problem, ExitCode.BAD_INPUT)
        swapped: Any = contextlib.nullcontext()
        if self.swap_files is not None:
            from spillway_runtime.checkpoints.engine import saved_swap_dir
            from spillway_runtime.checkpoints.universal import filling_swapped_state

            # an empty folder of swap files for DeepSpeed's NVMe load to copy: the state comes
            # from the universal files, filled in where it calls `reset_swap_buffers`
            saved_swap_dir(scratch / DS_TAG, self.run.rank).mkdir(parents=True, exist_ok=True)
            swapped = filling_swapped_state(self.run.engine.optimizer, scratch / DS_TAG)
        config = self.run.engine._config
        config.load_universal_checkpoint = True  # read by load_checkpoint only: set for this load alone
        try:
            with swapped:
                load_path, _ = self.run.engine.load_checkpoint(
                    str(scratch), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=False)
        finally:
            config.load_universal_checkpoint = False
        if load_path is None:
            raise RunFailed(f"DeepSpeed could not load checkpoint {info.name} converted in {scratch}")


