"""The training run: one recipe with setup / train / cleanup, and its checkpoints as a part.

Runs in each training process (one per GPU, or one on a CPU accelerator), alone
or as one rank of several (see supervisor.py). DeepSpeed carries the offload; this
module owns the policy around it: the learning-rate schedule, checkpoint cadence, exact resume
(step, data position, RNG, rollback state), divergence rollback and preemption.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from spillway_runtime import library_output
from spillway_runtime.core.contract import STOP_GRACE_SECONDS_ENV, ExitCode
from spillway_runtime.core.hardware import memlock_limit
from spillway_runtime.core.memlock import MemlockError, Trainable, fit_swap_buffers_to_memlock, locked_swap_bytes
from spillway_runtime.core.spec import zenflow_settings
from spillway_runtime.core.units import format_bytes
from spillway_runtime.training import disk_usage, evaluation, exporting, k8s_status, startup
from spillway_runtime.training.checkpointing import Checkpointing
from spillway_runtime.training.data import CACHE_DIR_NAME, PackedDataset, sources_fingerprint, token_cache_path, tokenize_sources
from spillway_runtime.training.dataset_files import DatasetError
from spillway_runtime.training.dsconfig import reference_config
from spillway_runtime.training.lora import with_lora
from spillway_runtime.training.processes import free_port
from spillway_runtime.training.reporting import Reporter
from spillway_runtime.training.run import Ranks, RunFailed
from spillway_runtime.training.runconfig import RuntimeConfig
from spillway_runtime.training.schedule import DivergencePolicy, EarlyStopping, learning_rate
from spillway_runtime.training.step_times import StepClock
from spillway_runtime.training.tracking import build_listeners

# checkpoint.mirror: how long the end of training waits for the last upload (the object
# store away: the run still succeeds, with a mirror_behind event), and a stop's grace
# outside a pod (in one, the pod's own) less what the exit needs.
MIRROR_WAIT_SECONDS = 600.0
STOP_GRACE_SECONDS = 30.0
STOP_MARGIN_SECONDS = 10.0


class FineTuneRecipe:
    """One training run: set up, train, checkpoint (its `checkpoints` part), clean up."""

    def __init__(self, config: RuntimeConfig):
        self.cfg = config
        self.spec = config.job.spec
        self.plan = config.plan
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.ranks = Ranks(self.rank, self.world_size)
        self.step = 0
        self.data_position = 0  # global micro-batch index
        self.skip_ranges: list[tuple[int, int]] = []
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.stop_requested = False
        # offload.overlap zenflow: ZenFlow's update interval, on whose boundaries checkpoints fall (0: off)
        self.zenflow_interval = (zenflow_settings(self.spec.offload)["update_interval"]
                                 if self.spec.offload.overlap == "zenflow" else 0)
        self.last_saved_step = -1
        self.last_eval: tuple[int, float] | None = None  # (step, held-out loss)
        self.step_clock = StepClock(self.plan.predicted_step_seconds)  # measured against the plan
        self.checkpoints = Checkpointing(self)
        self.reporter = Reporter(
            Path(config.events_path), self.spec.training.max_steps, enabled=self.rank == 0,
            sink=k8s_status.sink_from_env(self.spec.training.max_steps),
        )
        if self.rank == 0:  # MLflow, TensorBoard, /metrics (spec.tracking): closed with the reporter
            self.reporter.listeners = build_listeners(config, self.reporter.warn_soon)
        # On a terminal, what DeepSpeed, transformers and Python's warnings print goes to the run's folder
        self.library_log = library_output.for_terminal(Path(config.run_dir), self.rank, self.reporter.interactive,
                                                       self.reporter.verbose)
        self.divergence = DivergencePolicy(self.spec.rollback.spike_factor, self.spec.rollback.window)
        stopping = self.spec.training.early_stopping
        self.early_stopping = EarlyStopping(stopping.patience, stopping.min_delta) if stopping else None
        # From construction on, not after set-up: a stop request during set-up is a stop, not a death
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)

    # --- setup ---------------------------------------------------------------------------

    def setup(self) -> None:
        self._setup_distributed()
        self._memory("runtime")
        self._setup_data()
        self._memory("dataset")
        self._setup_engine()
        from spillway_runtime.deepspeed_fixes import gradient_buffer_bytes

        self._memory("engine", gradient_buffer=gradient_buffer_bytes(self.engine), swap_locked=self.swap_locked)
        self.checkpoints.setup()

    def _memory(self, stage: str, **more: Any) -> None:
        """Where the resident memory goes during set-up (the plan's CPU figure covers all of it)."""
        disk_usage.release_free_heap()
        self.reporter.event("memory", stage=stage, bytes=disk_usage.tier_bytes(self.plan, self.cfg.nvme_dir, self.torch),
                            anonymous=disk_usage.status_bytes("RssAnon"), locked=disk_usage.status_bytes("VmLck"),
                            **more)

    def log(self, message: str) -> None:
        self.reporter.event("log", message=message)

    def _setup_distributed(self) -> None:
        if self.plan.accelerator == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # one process, no supervisor
            os.environ["MASTER_PORT"] = str(free_port())
        startup.ask_cpuinfo_once()
        startup.ask_numa_once()
        import deepspeed
        import numpy as np
        import torch

        with library_output.stdout_of(self.library_log):  # DeepSpeed prints which comm ops it built
            deepspeed.init_distributed(dist_backend="gloo" if self.plan.accelerator == "cpu" else "nccl")
        self.torch = torch
        self.dist = torch.distributed
        seed = self.spec.training.seed
        # Every generator a checkpoint restores is seeded, so that a fresh run and a resumed one
        # hold the same state whoever draws from it (numpy's was left to OS entropy).
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.log(f"rank {self.rank}/{self.world_size} on {self.plan.accelerator}, plan {self.plan.label}")

    def _setup_data(self) -> None:
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.tokenizer_dir)
        except (OSError, ValueError) as err:
            raise RunFailed(
                f"model.tokenizerUri/model.uri {self.cfg.tokenizer_dir}: cannot load a tokenizer ({err})",
                ExitCode.BAD_INPUT,
            ) from None
        cache = Path(self.cfg.checkpoint_dir) / CACHE_DIR_NAME
        mixture = [(Path(where), entry.weight, f"spec.dataset.mixture[{i}].uri")
                   for i, (where, entry) in enumerate(zip(self.cfg.mixture_paths, self.spec.dataset.mixture, strict=True))]
        self.dataset, built, path = self._cached_tokens(Path(self.cfg.dataset_path), cache, "spec.dataset.uri", mixture)
        self.held_out: PackedDataset | None = None
        validation = self.spec.dataset.validation
        if validation is not None and self.cfg.validation_path:
            self.held_out, _, _ = self._cached_tokens(Path(self.cfg.validation_path), cache / "validation",
                                                      "spec.dataset.validation.uri")
            self.log(f"validation: {len(self.held_out)} sequences from {self.cfg.validation_path}")
        elif validation is not None and validation.fraction is not None:
            try:
                self.dataset, self.held_out = self.dataset.split(validation.fraction, self.spec.training.seed)
            except DatasetError as err:
                raise RunFailed(str(err), ExitCode.BAD_INPUT) from None
            self.log(f"validation: {len(self.held_out)} sequences held out, {len(self.dataset)} to train on")
        self.log(
            f"dataset: {built}{self.dataset.tokens} tokens in {len(self.dataset)} sequences "
            f"({'written to' if built else 'mapped from'} {path})"
        )

    def _cached_tokens(self, source: Path, cache: Path, field: str,
                       mixture: list[tuple[Path, float, str]] | None = None) -> tuple[PackedDataset, str, Path]:
        """The tokens of ``source`` (with ``mixture``: of it, weighted, and of each (path, weight,
        field) mixed in): tokenized once, by rank 0, into a cache beside the checkpoints that the
        other ranks, restarts and resumes map instead of tokenizing again. (The dataset, what
        was built (for the log), the cache file.)"""
        sequence_length, seed = self.spec.training.sequence_length, self.spec.training.seed
        sources = [(source, self.spec.dataset.weight if mixture else 1.0, field), *(mixture or [])]
        failure, built = None, ""
        path = cache / "unset"
        try:
            path = token_cache_path(cache, sources_fingerprint(self.spec.dataset, sources, Path(self.cfg.tokenizer_dir),
                                                               sequence_length, seed))
            if self.rank == 0 and not path.is_file():
                _, built = tokenize_sources(self.spec.dataset, sources, self.tokenizer, sequence_length, seed, path)
        except DatasetError as err:
            failure = str(err)
        except OSError as err:
            failure = (
                f"checkpoint.path {self.cfg.checkpoint_dir}: cannot write the tokenized dataset "
                f"({err.strerror}); choose a writable directory with room for it"
            )
        failure = self.ranks.first_failure(failure)
        if failure is not None:
            raise RunFailed(failure, ExitCode.BAD_INPUT)
        return PackedDataset.load(path), built, path

    def _setup_engine(self) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM

        from spillway_runtime import deepspeed_fixes
        self.checkpoints.keep_share()
        deepspeed_fixes.apply(self.plan, whole_gradient_buffer=self.cfg.faults.whole_gradient_buffer)
        if self.plan.uses_nvme:
            self.log(f"up to {format_bytes(self.plan.bytes.nvme)} is written to NVMe swap files every step: "
                     "sustained offloading wears a consumer SSD's rated write endurance (TBW); datacenter SSDs "
                     "are made for it")
        ds_config = dict(self.cfg.deepspeed)
        self._fit_to_memlock(ds_config, None)  # the parameter swappers' buffers are locked as the model loads
        dtype = self.spec.model.dtype
        if dtype == "bf16" and self.plan.accelerator == "cuda" and not self.torch.cuda.is_bf16_supported():
            # Pre-Ampere GPUs (V100, T4) have no bf16: train in fp16 with dynamic loss scaling.
            dtype = "fp16"
            ds_config["bf16"] = {"enabled": False}
            ds_config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
            self.log("model.dtype bf16 is not supported by this GPU: training in fp16 with loss scaling")
        torch_dtype = {"bf16": self.torch.bfloat16, "fp16": self.torch.float16, "fp32": self.torch.float32}[dtype]
        self.torch_dtype = torch_dtype
        self._hf_ds_config = None
        if self.plan.zero_stage == 3:
            # Keeps transformers' zero.Init path on: from_pretrained partitions each layer as it
            # loads, so the whole model never sits in one process's RAM.
            from transformers.integrations.deepspeed import HfDeepSpeedConfig

            self._hf_ds_config = HfDeepSpeedConfig(ds_config)
        from safetensors import SafetensorError

        try:
            model = AutoModelForCausalLM.from_pretrained(self.cfg.model_dir, dtype=torch_dtype)
        except (OSError, ValueError, SafetensorError) as err:  # a weights file cut short: SafetensorError
            raise RunFailed(f"model.uri {self.cfg.model_dir}: cannot load the model ({err})", ExitCode.BAD_INPUT) from None
        if self.spec.training.activation_checkpointing == "on" or self.plan.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if self.spec.method.lora:
            model = self._with_lora(model)
        startup.import_muon_without_compiling()
        trainable = [p for p in model.parameters() if p.requires_grad]
        ds_config = self._fit_to_memlock(ds_config, Trainable(
            tuple(int(getattr(p, "ds_numel", p.numel())) for p in trainable), max(1, self.world_size)))
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=trainable,
                                                                 config=ds_config)
        self.log(
            f"engine: ZeRO-{self.plan.zero_stage}, optimizer {type(self.engine.optimizer).__name__}"
            f"/{type(getattr(self.engine.optimizer, 'optimizer', None)).__name__}"
        )
        placed = getattr(self.engine.optimizer, "subgroup_to_device", None)
        if self.plan.swap.gpu_resident_fraction and placed:
            kept = [i for i, device in placed.items() if device != "cpu"]
            self.log(f"Twin-Flow: {len(kept)} of {len(placed)} optimizer sub-groups kept and updated on "
                     f"{placed[kept[0]] if kept else 'the accelerator'} (torch AdamW), the rest by the CPU Adam")
        self.reference: Any = None  # DPO's: the base, as the policy was before training
        if self.spec.method.objective == "dpo":
            from spillway_runtime.training.dpo import adapters_off

            self.reference = (adapters_off(self.engine, self.engine.module.disable_adapter) if self.spec.method.lora
                              else self._frozen_reference(torch_dtype, ds_config))

    def _fit_to_memlock(self, ds_config: dict[str, Any], trainable: Trainable | None) -> dict[str, Any]:
        """`ds_config` with DeepSpeed's locked swap buffers fitted under RLIMIT_MEMLOCK (or a refusal,
        exit 2); `self.swap_locked`: what DeepSpeed will lock, byte for byte."""
        parameter_swappers = 2 if self.spec.method.objective == "dpo" and not self.spec.method.lora else 1
        try:
            fitted, why = fit_swap_buffers_to_memlock(ds_config, trainable, memlock_limit(), parameter_swappers)
        except MemlockError as err:
            raise RunFailed(str(err), ExitCode.BAD_INPUT) from None
        if why:
            self.log(why)
        self.swap_locked = locked_swap_bytes(fitted, trainable, parameter_swappers)
        return fitted

    def _frozen_reference(self, torch_dtype: Any, ds_config: dict[str, Any]) -> Any:
        from spillway_runtime.training.dpo import frozen_reference

        reference = frozen_reference(self.cfg.model_dir, torch_dtype, reference_config(ds_config), self._hf_ds_config)
        where = f"ZeRO-3, parameters on {self.plan.parameters}" if self.plan.zero_stage == 3 else "whole, on the device"
        self.log(f"DPO reference: a frozen copy of the base ({where})")
        return reference

    def _with_lora(self, model: Any) -> Any:
        """The model with PEFT's LoRA adapters on `method.targetModules`, everything else frozen."""
        method = self.spec.method
        try:
            model, trainable, total = with_lora(model, method)
        except ValueError as err:  # PEFT: "Target modules {...} not found in the base model"
            raise RunFailed(f"method.targetModules: {err}", ExitCode.BAD_INPUT) from None
        self.reporter.event("lora", trainable=trainable, total=total, rank=method.rank,
                            target_modules=method.target_modules)
        return model

    # --- training --------------------------------------------------------------------------

    def _on_stop_signal(self, signum: int, _frame: Any) -> None:
        if not self.stop_requested:
            self.stop_signalled_at = time.monotonic()
        self.stop_requested = True

    def _grace_left(self) -> float:
        """Seconds of the stop's grace left for the mirror, keeping a margin for the exit
        (a pod's terminationGracePeriodSeconds, in SPILLWAY_STOP_GRACE_SECONDS)."""
        grace = float(os.environ.get(STOP_GRACE_SECONDS_ENV, STOP_GRACE_SECONDS))
        since = time.monotonic() - getattr(self, "stop_signalled_at", time.monotonic())
        return max(0.0, grace - since - STOP_MARGIN_SECONDS)

    def _next_position(self) -> int:
        for start, end in self.skip_ranges:
            if start <= self.data_position < end:
                self.data_position = end
        return self.data_position

    def _micro_loss(self, position: int) -> Any:
        t = self.spec.training
        batch = self.dataset.micro_batch(position, self.rank, self.world_size, t.micro_batch_size, t.seed)
        if self.spec.method.objective == "dpo":
            loss = self._preference_loss(batch)
        else:
            loss = self.engine(**{k: v.to(self.engine.device) for k, v in batch.items()}).loss
        faults = self.cfg.faults
        if position in faults.nan_micro_batches:
            loss = loss * float("nan")
        elif position in faults.spike_micro_batches:
            loss = loss * 1000.0
        return loss

    def _preference_loss(self, batch: dict[str, Any]) -> Any:
        """DPO on a micro-batch of pairs; its statistics are added to the step's (`dpo.STATS`).
        The reference is the base model (`self.reference`)."""
        from spillway_runtime.training.dpo import preference_loss

        method = self.spec.method
        loss, stats = preference_loss(self.engine, self.reference,
                                      {k: v.to(self.engine.device) for k, v in batch.items()},
                                      method.beta, method.dpo_loss)
        self.preference_stats = stats.cpu() + getattr(self, "preference_stats", 0)
        return loss

    def _objective_metrics(self) -> dict[str, float]:
        """The step's DPO metrics as TRL names them (rewards/chosen, ...), over all ranks; none for sft."""
        if self.spec.method.objective != "dpo":
            return {}
        from spillway_runtime.training.dpo import step_metrics

        stats, self.preference_stats = self.preference_stats, 0
        if self.world_size > 1:
            self.dist.all_reduce(stats)
        return step_metrics(stats)

    def train_step(self) -> tuple[float, int, int]:
        """One optimizer step; returns (mean loss across ranks, first, end data position)."""
        t = self.spec.training
        lr = self.lr_scale * learning_rate(
            self.step, t.learning_rate, t.warmup_steps, t.max_steps, t.min_learning_rate_ratio
        )
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        first = self._next_position()
        self.preference_stats = 0  # a rolled-back step's statistics go with it
        total = 0.0
        for _ in range(t.gradient_accumulation):
            position = self._next_position()
            loss = self._micro_loss(position)
            if self.checkpoints.pending is not None and self.zenflow_interval:
                self.checkpoints.settle()  # ZenFlow's backward changes what it is writing (top-k step, fp32 sync)
            self.engine.backward(loss)
            if self.checkpoints.pending is not None and self.engine.is_gradient_accumulation_boundary():
                self.checkpoints.settle()  # the optimizer step changes what it is writing
            self.engine.step()
            total += float(loss.detach().float().item())
            self.data_position = position + 1
        self.current_lr = lr
        return self.ranks.mean(total / t.gradient_accumulation), first, self.data_position

    def train(self) -> int:
        t = self.spec.training
        every = self.spec.checkpoint.every_steps
        tokens_per_step = self.plan.tokens_per_step  # every rank's sequences (DPO: chosen and rejected)
        self.reporter.event("started", step=self.step, total_steps=t.max_steps, plan=self.plan.label,
                            world_size=self.world_size)
        started = time.monotonic()
        start_step = self.step
        # A restart from the checkpoint an early stop wrote (its export or upload failed) does
        # not train on: it ends as that run did
        stopped = self.early_stopping is not None and self.early_stopping.exhausted
        while self.step < t.max_steps and not stopped:
            # ZenFlow: on to its next update boundary first, where a checkpoint holds the whole state
            if self.ranks.any(self.stop_requested) and not (self.zenflow_interval and self.step % self.zenflow_interval):
                return self._preempt()
            step_started = time.monotonic()
            loss, first, end = self.train_step()
            if self.cfg.faults.step_sleep_seconds:
                time.sleep(self.cfg.faults.step_sleep_seconds)
            problem = self.divergence.check(loss) if self.spec.rollback.on_divergence else None
            if problem is not None:
                self._rollback(problem, first, end)
                continue
            self.divergence.record(loss)
            self.step += 1
            objective_metrics = self._objective_metrics()
            elapsed = time.monotonic() - step_started
            done = self.step - start_step
            rate = (time.monotonic() - started) / max(1, done)
            self.reporter.step(
                self.step,
                loss=loss,  # full precision: users check determinism with it
                lr=self.current_lr,
                step_seconds=round(elapsed, 4),
                **self.step_clock.record(elapsed),
                tokens_per_s=round(tokens_per_step / max(elapsed, 1e-9), 1),
                eta_seconds=round(rate * (t.max_steps - self.step), 1),
                data_position=self.data_position,
                bytes=disk_usage.tier_bytes(self.plan, self.cfg.nvme_dir, self.torch),
                disk=disk_usage.process_io_bytes(),  # so far: a step's swap traffic is the difference
                **objective_metrics,
            )
            self.last_loss = loss
            self.checkpoints.report_mirror()
            stop = False
            if self.held_out is not None and (self.step == t.max_steps or (
                    t.eval_every_steps and self.step % t.eval_every_steps == 0)):
                held_out = self.evaluate()
                stop = self.early_stopping is not None and self.early_stopping.record(self.step, held_out)
            if self.step % every == 0 or self.step == t.max_steps or stop:
                self.checkpoints.save(loss)
            if stop:
                break
        self.checkpoints.settle()
        early = self._early_stop_summary() if self.step < t.max_steps else None
        exporting.export(self)
        self.checkpoints.finish_mirror(float(os.environ.get("SPILLWAY_MIRROR_WAIT_SECONDS", MIRROR_WAIT_SECONDS)))
        self.reporter.event("finished", step=self.step, loss=getattr(self, "last_loss", None),
                            rollbacks=self.rollbacks, disk=disk_usage.process_io_bytes(), **(early or {}))
        if early is not None and self.rank == 0:
            k8s_status.termination_message(early["message"])  # the job's Succeeded message in a cluster
        return ExitCode.OK

    def _early_stop_summary(self) -> dict[str, Any]:
        """Why training stopped before maxSteps (training.earlyStopping), as the `early_stopped`
        event says it and the `finished` event carries it: the step, the best held-out loss and
        its step, and the checkpoint kept as the best: the lowest held-out loss on the volume, which
        may be a later one than the best step's when it improved by less than minDelta."""
        stopping = self.early_stopping
        assert stopping is not None
        best = self.checkpoints.store.best(self.checkpoints.store.list())
        early = {"stopped_early": True, "best_eval_loss": stopping.best, "best_step": stopping.best_step,
                 "best_checkpoint": best.name if best is not None else None, "patience": stopping.patience}
        kept = f"{best.name} (held-out loss {best.eval_loss:.4g})" if best is not None else "none"
        since = (f"gone below {stopping.best:.4g} (step {stopping.best_step}) by more than {stopping.min_delta:g}"
                 if stopping.best is not None else "been a finite number")
        early["message"] = (
            f"stopped early at step {self.step} of {self.spec.training.max_steps} (training.earlyStopping): the "
            f"held-out loss has not {since} for {stopping.patience} evaluation(s); best checkpoint {kept} is kept")
        self.reporter.event("early_stopped", step=self.step, **{k: v for k, v in early.items() if k != "stopped_early"})
        return early

    def evaluate(self) -> float:
        """The held-out loss of the weights now (with DPO: the held-out DPO loss and TRL's
        eval_ metrics), reported as an `eval` event. No gradient, no optimizer, no random
        state is touched, so training goes on exactly as without it."""
        assert self.held_out is not None
        t, method = self.spec.training, self.spec.method
        if method.objective == "dpo":
            value, pairs, metrics = evaluation.held_out_preferences(
                self.engine, self.reference, self.held_out, t, method, self.rank, self.world_size)
            self.reporter.event("eval", step=self.step, eval_loss=value, pairs=pairs, **metrics)
        else:
            value, tokens = evaluation.held_out_loss(self.engine, self.held_out, t, self.rank, self.world_size)
            self.reporter.event("eval", step=self.step, eval_loss=value,
                                perplexity=float(self.torch.tensor(value).exp()) if value == value else None,
                                tokens=tokens)
        self.last_eval = (self.step, value)
        return value

    def _preempt(self) -> int:
        self.checkpoints.settle()  # the checkpoint in flight first: SIGTERM waits for it
        if self.step > 0 and self.last_saved_step != self.step:  # at step 0 there is nothing to keep
            self.checkpoints.save(getattr(self, "last_loss", None))
            self.checkpoints.settle()
        self.checkpoints.finish_mirror(self._grace_left())
        self.reporter.event("preempted", step=self.step)
        return ExitCode.PREEMPTED

    def _rollback(self, problem: str, first: int, end: int) -> None:
        policy = self.spec.rollback
        self.rollbacks += 1
        if self.rollbacks > policy.max_rollbacks:
            self.reporter.event("diverged", step=self.step, reason=problem, rollbacks=self.rollbacks - 1)
            raise RunFailed(
                f"training diverged at step {self.step + 1} ({problem}) after {self.rollbacks - 1} rollbacks; "
                f"rollback.maxRollbacks is {policy.max_rollbacks}: lower training.learningRate or inspect the data",
                ExitCode.DIVERGED,
            )
        self.checkpoints.settle()
        rollbacks, skips = self.rollbacks, [*self.skip_ranges, (first, end)]
        lr_scale = self.lr_scale * policy.lr_backoff
        bad_step = self.step + 1
        info = self.checkpoints.load_good(None)
        if info is None:
            raise RunFailed(
                f"training diverged at step {self.step + 1} ({problem}) before the first checkpoint; "
                "lower checkpoint.everySteps so there is one to roll back to",
                ExitCode.DIVERGED,
            )
        # What happened since the checkpoint is kept: the count, the skipped batches, the lower LR.
        self.rollbacks, self.skip_ranges, self.lr_scale = rollbacks, skips, lr_scale
        self.reporter.event(
            "rollback", step=bad_step, reason=problem, checkpoint=info.name, to_step=self.step,
            skipped_micro_batches=[first, end], lr_scale=self.lr_scale, rollbacks=self.rollbacks,
        )

    # --- cleanup ---------------------------------------------------------------------------

    def cleanup(self) -> None:
        for write in self.checkpoints.pending_background:
            write.thread.join()  # a failed run's checkpoint in flight: its staging is swept later
        if getattr(self.checkpoints, "ckpt", None) is not None:  # a run that failed before setup has none
            self.checkpoints.ckpt.io.close()
        for engine in (getattr(self, "engine", None), getattr(self, "reference", None)):  # DPO's frozen copy too
            if engine is not None and hasattr(engine, "destroy"):
                engine.destroy()
        if self.cfg.remove_swap_at_exit and self.cfg.nvme_dir:
            removed = disk_usage.remove_swap_files(Path(self.cfg.nvme_dir), self.rank)
            self.reporter.event("swap_removed", bytes=removed, path=self.cfg.nvme_dir)
        library_log: library_output.LibraryLog | None = getattr(self, "library_log", None)
        if library_log is not None:
            with contextlib.suppress(OSError):  # a count the run could not make is no reason to stop cleaning up
                if (said := library_log.summary()) is not None:
                    self.log(said)
            library_log.close()
        self.reporter.close()
        if getattr(self, "dist", None) is not None and self.dist.is_initialized():
            self.dist.destroy_process_group()
