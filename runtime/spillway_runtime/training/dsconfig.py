"""DeepSpeed config from an `OffloadPlan`, with the user's raw overrides merged last.

The known traps are handled here rather than left to users:
- `aio` is a top-level block (nested inside `zero_optimization` it fails validation);
- current DeepSpeed reads `aio.intra_op_parallelism`; `thread_count` is silently ignored,
  so an override that uses it is translated;
- `offload_param.buffer_size` must cover the largest parameter or the swapper fails;
- parameters on NVMe need enough swap buffers for every parameter alive at once: more
  buffers than DeepSpeed's 5 and no reuse-distance caching (see `build_deepspeed_config`);
- NVMe offload (and any parameter offload) needs ZeRO stage 3;
- what DeepSpeed locks for its swap must fit under RLIMIT_MEMLOCK (`core.memlock`).
Pure apart from `validate_deepspeed_config`, which imports DeepSpeed.
"""

from __future__ import annotations

import copy
from typing import Any

from spillway_runtime.core.estimates import twin_flow_ratio
from spillway_runtime.core.memlock import merge_settings as _merge
from spillway_runtime.core.planner import OffloadPlan
from spillway_runtime.core.spec import FineTuneJobSpec, zenflow_settings


class DeepSpeedConfigError(ValueError):
    pass


# DeepSpeed's batch settings, which Spillway derives from spec.training (and the number of
# processes); DeepSpeed asserts they agree only once the engine starts.
BATCH_SETTINGS = {
    "train_batch_size": "training.microBatchSize x training.gradientAccumulation (x processes)",
    "train_micro_batch_size_per_gpu": "training.microBatchSize",
    "gradient_accumulation_steps": "training.gradientAccumulation",
}


REFERENCE_DIR = "reference"  # under the NVMe folder: DPO's frozen reference's parameter swap files


def reference_config(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's config for DPO's frozen reference, an engine that only runs forward (TRL's
    `prepare_deepspeed`): no optimizer and no scheduler. ZeRO-3 keeps its parameter partitioning
    and offload, with parameters on NVMe in a folder of their own (`REFERENCE_DIR`), so that the
    two engines' swap files never meet; the other stages become stage 0, the whole model on
    the device."""
    out = copy.deepcopy(config)
    out.pop("optimizer", None)
    out.pop("scheduler", None)
    zero = dict(out.get("zero_optimization") or {})
    if zero.get("stage") != 3:
        out["zero_optimization"] = {"stage": 0}
        return out
    zero.pop("offload_optimizer", None)
    param = dict(zero.get("offload_param") or {})
    if param.get("device") == "nvme" and param.get("nvme_path"):
        param["nvme_path"] = f"{str(param['nvme_path']).rstrip('/')}/{REFERENCE_DIR}"
        zero["offload_param"] = param
    out["zero_optimization"] = zero
    return out


def _offload_block(device: str, nvme_path: str | None, plan: OffloadPlan) -> dict[str, Any]:
    block: dict[str, Any] = {"device": device, "pin_memory": plan.swap.pin_memory}
    if device == "nvme":
        if not nvme_path:
            raise DeepSpeedConfigError("the plan puts state on NVMe but no NVMe directory was given (offload.nvme.path)")
        block["nvme_path"] = nvme_path
    return block


def build_deepspeed_config(
    plan: OffloadPlan, spec: FineTuneJobSpec, *, nvme_path: str | None = None, world_size: int = 1
) -> dict[str, Any]:
    training = spec.training
    dtype = spec.model.dtype
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation,
        "train_batch_size": training.micro_batch_size * training.gradient_accumulation * world_size,
        "gradient_clipping": training.gradient_clipping,
        "steps_per_print": 10**9,  # progress is ours to report
        "wall_clock_breakdown": False,
        "zero_optimization": _zero_block(plan, nvme_path),
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": training.learning_rate,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": training.weight_decay,
            },
        },
        "aio": {
            "block_size": plan.aio.block_size,
            "queue_depth": plan.aio.queue_depth,
            "intra_op_parallelism": plan.aio.intra_op_parallelism,
            "single_submit": plan.aio.single_submit,
            "overlap_events": plan.aio.overlap_events,
        },
    }
    if spec.offload.overlap == "zenflow":  # the plan is ZeRO-2 with the optimizer in CPU RAM (planner._allowed)
        config["zero_optimization"]["zenflow"] = zenflow_settings(spec.offload)
    return apply_overrides(config, spec.offload.deepspeed, plan)


def _zero_block(plan: OffloadPlan, nvme_path: str | None) -> dict[str, Any]:
    """zero_optimization: the stage, its buckets, and where the optimizer state and the
    parameters are offloaded."""
    zero: dict[str, Any] = {
        "stage": plan.zero_stage,
        "contiguous_gradients": True,
        "overlap_comm": plan.accelerator == "cuda",
        "sub_group_size": plan.swap.sub_group_size,
    }
    h = plan.model.hidden_size
    if plan.zero_stage == 3:
        # Hugging Face's "auto" values, derived from the hidden size (0.9 h^2, 10 h, h^2).
        zero.update(
            {
                "reduce_bucket_size": h * h,
                "stage3_prefetch_bucket_size": int(0.9 * h * h),
                "stage3_param_persistence_threshold": 10 * h,
                "stage3_gather_16bit_weights_on_model_save": False,
            }
        )
    else:
        # Hugging Face's "auto" (h^2). Buckets of 5e7 elements made ZeRO-2 steps of a 6.5M-parameter
        # model 2.7x slower on a CPU accelerator (895 -> 335 ms, benchmarks/bench_offload_overhead.py).
        zero.update({"reduce_bucket_size": h * h, "allgather_bucket_size": h * h})
    if plan.optimizer != "gpu":
        block = _offload_block(plan.optimizer, nvme_path, plan)
        if plan.optimizer == "nvme":
            block.update(
                {
                    "buffer_count": plan.swap.optimizer_buffer_count,
                    "pipeline_read": plan.swap.pipeline,
                    "pipeline_write": plan.swap.pipeline,
                }
            )
        elif plan.swap.gpu_resident_fraction:  # Twin-Flow: the first sub-groups on the accelerator
            block["ratio"] = twin_flow_ratio(plan.swap.gpu_resident_fraction)
        zero["offload_optimizer"] = block
    if plan.parameters != "gpu":
        block = _offload_block(plan.parameters, nvme_path, plan)
        if plan.parameters == "nvme":
            # max_in_cpu=0: DeepSpeed's default keeps up to 1e9 parameters' 16-bit copy in RAM
            # as well, which is what putting parameters on NVMe was meant to avoid.
            block.update({"buffer_count": plan.swap.param_buffer_count, "buffer_size": plan.swap.param_buffer_size,
                          "max_in_cpu": 0})
            # Every swapped-in parameter holds one whole pinned buffer until released; with the
            # default reuse distance (1e9) nothing is released before the backward pass and the
            # swapper runs dry ("Not enough buffers 0 for swapping 1") on any model deeper than
            # buffer_count matrices. Release after use: the plan already counts the re-read.
            zero["stage3_max_reuse_distance"] = 0
        zero["offload_param"] = block
    return zero


# The blocks `build_deepspeed_config` always writes: an override must give each as a mapping.
SETTINGS_BLOCKS = ("zero_optimization", "bf16", "fp16", "optimizer", "aio")


def _refuse_contradictions(config: dict[str, Any], overrides: dict[str, Any]) -> None:
    """A block given as a scalar, or a batch setting that disagrees with `config`'s (those
    `config` has: before a plan, train_batch_size may not be known)."""
    for key, value in overrides.items():
        if isinstance(config.get(key), dict) and not isinstance(value, dict):
            raise DeepSpeedConfigError(
                f"offload.deepspeed.{key} is {type(value).__name__} {value!r}; it is a block of settings: "
                f"give a mapping (e.g. {key}: {{...}}) or leave it out"
            )
    for key, field in BATCH_SETTINGS.items():
        if key in overrides and key in config and overrides[key] != config[key]:
            raise DeepSpeedConfigError(
                f"offload.deepspeed.{key} is {overrides[key]!r} but the training settings give {config[key]!r}: "
                f"set the batch with {field} and leave {key} out of offload.deepspeed"
            )


def check_overrides(spec: FineTuneJobSpec, world_size: int | None) -> None:
    """What can be said of offload.deepspeed before there is a plan (the admission webhook):
    a block given as a scalar, a batch setting that contradicts spec.training
    (train_batch_size only when the number of processes is known), a ZeRO stage that is not
    one of DeepSpeed's. The rest waits for the plan (`apply_overrides`) and for DeepSpeed's
    own validation."""
    training = spec.training
    skeleton: dict[str, Any] = {key: {} for key in SETTINGS_BLOCKS}
    skeleton["train_micro_batch_size_per_gpu"] = training.micro_batch_size
    skeleton["gradient_accumulation_steps"] = training.gradient_accumulation
    if world_size:
        skeleton["train_batch_size"] = training.micro_batch_size * training.gradient_accumulation * world_size
    overrides = spec.offload.deepspeed
    _refuse_contradictions(skeleton, overrides)
    stage = (overrides.get("zero_optimization") or {}).get("stage")
    if stage is not None and (type(stage) is not int or stage not in range(4)):
        raise DeepSpeedConfigError(
            f"offload.deepspeed.zero_optimization.stage is {stage!r}: DeepSpeed's ZeRO stages are the "
            "integers 0, 1, 2 and 3; leave it out and the plan chooses"
        )


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any], plan: OffloadPlan) -> dict[str, Any]:
    """Merge raw overrides, then repair or refuse what DeepSpeed would trip over."""
    overrides = copy.deepcopy(overrides)
    _refuse_contradictions(config, overrides)
    zero_override = overrides.get("zero_optimization", {})
    if isinstance(zero_override, dict) and "aio" in zero_override:
        # Nested aio fails DeepSpeed's validation; the user meant the top-level block.
        overrides["aio"] = _merge(overrides.get("aio", {}), zero_override.pop("aio"))
    aio_override = overrides.get("aio")
    if isinstance(aio_override, dict) and "thread_count" in aio_override:
        aio_override.setdefault("intra_op_parallelism", aio_override.pop("thread_count"))
        aio_override.pop("thread_count", None)
    merged = _merge(config, overrides)

    zero = merged.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device == "nvme" and stage != 3:
            raise DeepSpeedConfigError(
                f"offload.deepspeed: zero_optimization.{key}.device is nvme but stage is {stage}; "
                "NVMe offload needs zero_optimization.stage 3"
            )
    if (zero.get("offload_param") or {}).get("device", "none") != "none" and stage != 3:
        raise DeepSpeedConfigError(
            f"offload.deepspeed: parameter offload needs zero_optimization.stage 3, got {stage}"
        )
    param_block = zero.get("offload_param") or {}
    if param_block.get("device") == "nvme":
        need = plan.model.largest_param_numel
        if int(param_block.get("buffer_size", 0)) < need:
            raise DeepSpeedConfigError(
                f"offload.deepspeed: zero_optimization.offload_param.buffer_size "
                f"{param_block.get('buffer_size')} is smaller than the largest parameter ({need:,} elements); "
                f"set it to at least {need}"
            )
    opt_block = zero.get("offload_optimizer") or {}
    if opt_block.get("device") == "nvme" and int(opt_block.get("buffer_count", 4)) < 4:
        raise DeepSpeedConfigError(
            "offload.deepspeed: zero_optimization.offload_optimizer.buffer_count must be >= 4 "
            "(one per Adam state plus the gradient)"
        )
    return merged


def validate_deepspeed_config(config: dict[str, Any]) -> None:
    """Run DeepSpeed's own pydantic validation of the zero and aio blocks (DeepSpeed imported
    as the runtime imports it, without the mlflow its autotuner would pull in: 1 s less)."""
    from spillway_runtime.training.startup import import_deepspeed

    import_deepspeed()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        DeepSpeedZeroConfig(**config.get("zero_optimization", {}))
    except Exception as err:  # DeepSpeed raises pydantic.ValidationError; keep the message
        raise DeepSpeedConfigError(f"offload.deepspeed: DeepSpeed rejects zero_optimization: {err}") from None
    allowed_aio = {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events", "use_gds"}
    unknown = set(config.get("aio", {})) - allowed_aio
    if unknown:
        raise DeepSpeedConfigError(f"offload.deepspeed: unknown aio keys {sorted(unknown)}; allowed {sorted(allowed_aio)}")
