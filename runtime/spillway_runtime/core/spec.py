"""The FineTuneJob spec: the single source of truth for what a user may ask for.

The CRD's OpenAPI schema is generated from these models, the REST API validates
submissions with them, and the runtime reads its job from them. Field names are
camelCase on the wire (Kubernetes convention) and snake_case in Python.
Importable without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from spillway_runtime.core.spec_inputs import DatasetSource, ModelSource
from spillway_runtime.core.spec_types import (
    KIND,
    MAX_DNS_NAME,
    MAX_FIELD,
    MAX_ITEMS,
    MAX_LABEL_KEY,
    MAX_LABEL_VALUE,
    MAX_SECONDS,
    MAX_URI,
    ActivationCheckpointing,
    OffloadPolicy,
    Size,
    SpecModel,
    TierChoice,
    size_or_none,
)

MAX_STEPS = 2**31 - 1
GRADIENT_ACCUMULATION_MAX = 4096


class EarlyStopping(SpecModel):
    """Stop when the held-out loss has stopped improving (as transformers' EarlyStoppingCallback)."""

    patience: int = Field(ge=1, le=10_000, description="Evaluations in a row that do not improve the best held-out "
                          "loss by more than minDelta before training stops")
    min_delta: float = Field(0.0, ge=0, le=1e6, description="How much lower than the best a held-out loss must be "
                             "to count as an improvement")


class Training(SpecModel):
    """The optimization: steps, batch, sequence length, learning-rate schedule, evaluation."""

    max_steps: int = Field(100, ge=1, le=MAX_STEPS, description="Optimizer steps to run")
    micro_batch_size: int = Field(1, ge=1, le=4096, description="Sequences per GPU per forward pass")
    gradient_accumulation: int = Field(1, ge=1, le=GRADIENT_ACCUMULATION_MAX, description="Micro-batches per optimizer step")
    sequence_length: int = Field(512, ge=8, le=1_048_576, description="Tokens per packed sequence")
    learning_rate: float = Field(2e-5, gt=0, le=1.0, description="Peak learning rate (AdamW), reached after warmupSteps, then "
                                 "cosine decay to minLearningRateRatio x it at maxSteps")
    min_learning_rate_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor as a fraction of learningRate")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Steps of linear warmup to learningRate (at most maxSteps)")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW's decoupled weight decay")
    eval_every_steps: int = Field(
        0, ge=0, le=MAX_STEPS,
        description="Steps between evaluations of dataset.validation (0: at the end only); needs dataset.validation",
    )
    eval_batches: int | None = Field(
        None, ge=1, le=1_000_000, description="At most this many micro-batches per evaluation (none: all of it)"
    )
    early_stopping: EarlyStopping | None = Field(
        None, description="Stop before maxSteps when the held-out loss stops improving: the job succeeds, naming the "
        "step and the best checkpoint, which is kept; needs evalEverySteps, a multiple of checkpoint.everySteps")
    gradient_clipping: float = Field(1.0, ge=0, le=1e6, description="Max gradient norm; 0 disables clipping")
    activation_checkpointing: ActivationCheckpointing = Field(
        "auto", description="auto turns it on when activations would not fit next to the model state"
    )
    # numpy's generators take seeds below 2**32: a larger one would fail at the first step.
    seed: int = Field(1234, ge=0, le=2**32 - 1, description="Seeds every generator a run uses (data order, held-out "
                      "sequences, new weights, dropout): the same seed and spec give the same losses")

    @model_validator(mode="after")
    def _warmup_within_run(self) -> Training:
        if self.warmup_steps > self.max_steps:
            raise ValueError(
                f"warmupSteps ({self.warmup_steps}) exceeds maxSteps ({self.max_steps}); lower warmupSteps"
            )
        return self


# What `targetModules: all-linear` means, as PEFT reads it: every linear layer but the output head.
ALL_LINEAR = "all-linear"


# What the training minimises, orthogonal to which weights train (method.type): the next
# token's loss (sft), or Direct Preference Optimization against a frozen reference (dpo).
Objective = Literal["sft", "dpo"]
DpoLoss = Literal["sigmoid", "ipo"]


class Method(SpecModel):
    """Full fine-tuning or LoRA adapters (PEFT) on a frozen base, on the next token (sft) or preferences (dpo)."""

    type: Literal["full", "lora"] = Field("full", description="full: every weight trains; lora: PEFT adapters on a frozen base")
    objective: Objective = Field(
        "sft",
        description="sft: learn the next token of the data; dpo: Direct Preference Optimization on "
        "dataset.format preference, the reference being the base model (with LoRA: the adapters switched off; "
        "with full fine-tuning: a frozen copy, placed with the parameters)",
    )
    beta: float = Field(0.1, gt=0, le=100, description="dpo: strength of the pull toward the reference model "
                        "(TRL's beta; IPO's tau)")
    dpo_loss: DpoLoss = Field(
        "sigmoid",
        description="dpo: sigmoid (the DPO paper's loss, TRL's default) or ipo (squared, length-normalised as TRL "
        "does)",
    )
    rank: int = Field(16, ge=1, le=4096, description="LoRA: rank r of each adapter")
    alpha: int = Field(32, ge=1, le=65536, description="LoRA: scaling numerator (the update is scaled by alpha/rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA: dropout on the adapters' input")
    target_modules: list[Annotated[str, Field(max_length=MAX_FIELD)]] = Field(
        default_factory=lambda: [ALL_LINEAR], max_length=MAX_ITEMS,
        description="LoRA: names of the linear layers to adapt (q_proj, v_proj, ...); [all-linear]: every one "
        "but the output head",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: list[str]) -> list[str]:
        if not value or any(not name.strip() for name in value):
            raise ValueError("targetModules must name at least one module (e.g. [q_proj, v_proj]) or be [all-linear]")
        if ALL_LINEAR in value and len(value) > 1:
            raise ValueError("targetModules: all-linear stands alone (it already means every linear layer)")
        return value

    @property
    def peft_targets(self) -> list[str] | str:
        """As PEFT's LoraConfig takes them: the string all-linear, or the names."""
        return ALL_LINEAR if self.target_modules == [ALL_LINEAR] else self.target_modules

    @property
    def lora(self) -> bool:
        return self.type == "lora"


S3_URI = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$"


class Export(SpecModel):
    """The model written when training ends, as a Hugging Face directory (`spillway run`: <run dir>/final;
    a cluster: export/ on the checkpoint volume)."""

    merge: bool = Field(False, description="LoRA: also write the base model with the adapters merged in (merged/)")
    uri: str | None = Field(
        None, pattern=S3_URI, max_length=MAX_URI,
        description="Also upload the exported model to this s3://BUCKET/PREFIX when training ends (credentials: "
        "spec.storage)",
    )


class NvmeVolume(SpecModel):
    """The NVMe space for swap files."""

    path: str | None = Field(None, max_length=MAX_URI,
                             description="Local mode: directory on a local NVMe drive for swap files")
    host_path: str | None = Field(
        None, max_length=MAX_URI,
        description="Refused: a job never chooses a node directory (it would be mounted read-write on the node). "
        "In a cluster each job gets its own directory under the NVMe root the cluster admin declared, or a "
        "volume of storageClassName",
    )
    storage_class_name: str | None = Field(
        None, max_length=MAX_DNS_NAME,
        description="Cluster mode: StorageClass of a generic ephemeral volume (local, WaitForFirstConsumer)",
    )
    size: Size = Field(None, description="Volume size (e.g. 500Gi); omitted or 'auto' sizes it from the plan")

    _parse_size = field_validator("size", mode="before")(size_or_none)

    @model_validator(mode="after")
    def _one_source(self) -> NvmeVolume:
        if self.host_path and self.storage_class_name:
            raise ValueError("set either hostPath or storageClassName, not both")
        return self


# The tiers each offload policy allows for the optimizer state and the parameters.
POLICY_TIERS: dict[str, tuple[str, ...]] = {
    "none": ("auto", "gpu"),
    "cpu": ("auto", "cpu", "gpu"),
    "nvme": ("auto", "cpu", "gpu", "nvme"),
    "auto": ("auto", "cpu", "gpu", "nvme"),
}


class Offload(SpecModel):
    """Where the training state lives: GPU memory, CPU RAM or NVMe (see docs/one-machine.md)."""

    # The policy rule in the JSON Schema too (the OpenAPI); the CRD states it in CEL (crd.py).
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"required": ["policy"], "properties": {"policy": {"const": policy}}},
         "then": {"properties": {"optimizer": {"enum": list(tiers)}, "parameters": {"enum": list(tiers)}}}}
        for policy, tiers in POLICY_TIERS.items() if tiers != POLICY_TIERS["auto"]
    ]})

    policy: OffloadPolicy = Field(
        "auto", description="auto: the planner picks; none: keep everything on GPU; cpu: never use NVMe; nvme: allow NVMe"
    )
    optimizer: TierChoice = Field("auto", description="Where Adam moments and fp32 master weights live")
    parameters: TierChoice = Field("auto", description="Where the (partitioned) model parameters live")
    cpu_resident_fraction: float | None = Field(
        None, ge=0, le=1,
        description="With the optimizer on NVMe: the share of its sub-groups (fp32 masters and Adam moments) "
        "kept in CPU RAM, never swapped; the rest on NVMe. Omitted: when the planner chose NVMe "
        "(optimizer auto), the largest share the node's RAM holds; when optimizer is nvme, 0 (all on NVMe)",
    )
    gpu_resident_fraction: float | None = Field(
        None, gt=0, lt=1,
        description="With the optimizer in CPU RAM under ZeRO-3: the share of its sub-groups (fp32 masters and "
        "Adam moments) kept and updated on the GPU, 16 B/param there, the rest on the CPU (DeepSpeed's "
        "Twin-Flow, offload_optimizer.ratio = 1 - share). DeepSpeed keeps the first int(share x sub-groups) "
        "of each process. Omitted: none (a ZeRO-3 plan's reasons name the largest share that fits). Full "
        "fine-tuning (sft or dpo)",
    )
    overlap: Literal["none", "zenflow"] = Field(
        "none",
        description="zenflow: DeepSpeed's ZenFlow on a ZeRO-2 plan with the optimizer in CPU RAM: each step the "
        "top 10% of gradient columns are updated on the GPU, the rest accumulate and the CPU updates them every "
        "4 steps (zero_optimization.zenflow.update_interval in offload.deepspeed), so the CPU step is paid once "
        "per interval. Not the same losses as plain ZeRO-Offload (most gradients are applied late); a resume "
        "is bit-identical to an uninterrupted ZenFlow run. Needs training.gradientAccumulation 1 (ZenFlow "
        "accumulates), checkpoint.everySteps and training.maxSteps multiples of the interval, "
        "rollback.onDivergence false; full fine-tuning, objective sft",
    )
    nvme: NvmeVolume = Field(default_factory=lambda: NvmeVolume())
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="Raw DeepSpeed config overrides, merged last and validated"
    )

    @model_validator(mode="after")
    def _consistent_with_policy(self) -> Offload:
        for field in ("optimizer", "parameters"):
            choice = getattr(self, field)
            if choice not in POLICY_TIERS[self.policy]:
                raise ValueError(
                    f"{field}: {choice!r} contradicts policy {self.policy!r}; "
                    f"with that policy {field} may be one of {sorted(POLICY_TIERS[self.policy])}"
                )
        if self.cpu_resident_fraction is not None and self.optimizer not in ("auto", "nvme"):
            raise ValueError(
                f"cpuResidentFraction is the share of an NVMe optimizer kept in RAM; with optimizer "
                f"{self.optimizer!r} it means nothing: remove it or set optimizer to nvme"
            )
        if self.cpu_resident_fraction is not None and "nvme" not in POLICY_TIERS[self.policy]:
            raise ValueError(
                f"cpuResidentFraction applies to an optimizer on NVMe, which policy {self.policy!r} excludes: "
                "remove it or set policy to nvme or auto"
            )
        if self.overlap == "zenflow" and (self.optimizer not in ("auto", "cpu") or self.parameters not in ("auto", "gpu")
                                          or "cpu" not in POLICY_TIERS[self.policy]):
            raise ValueError(
                f"overlap zenflow runs with the optimizer in CPU RAM and the parameters on the GPU (ZeRO-2); "
                f"optimizer {self.optimizer!r}, parameters {self.parameters!r}, policy {self.policy!r} exclude it: "
                "set optimizer cpu (or auto) and parameters gpu (or auto), or remove overlap"
            )
        if self.overlap == "zenflow":
            zenflow_settings(self)  # raises naming the override it cannot use
        if self.gpu_resident_fraction is not None:
            self._twin_flow_fits()
        zero = self.deepspeed.get("zero_optimization")
        block = zero.get("offload_optimizer") if isinstance(zero, dict) else None
        block = block if isinstance(block, dict) else {}
        if "ratio" in block:
            raise ValueError("offload.deepspeed: zero_optimization.offload_optimizer.ratio is set from "
                             "offload.gpuResidentFraction (ratio = 1 - share), where Spillway plans the GPU bytes and "
                             "checkpoints the GPU share's Adam moments: remove the ratio and set gpuResidentFraction")
        superoffload = [key for key in ("super_offload", "cpuadam_cores_perc") if key in block]
        if superoffload:
            raise ValueError(f"offload.deepspeed: zero_optimization.offload_optimizer.{superoffload[0]} is not "
                             "supported: DeepSpeed's SuperOffload needs a CUDA GPU and steps the CPU Adam in a worker "
                             "process whose state Spillway's checkpoints do not hold, so a resume would not be exact: "
                             f"remove {' and '.join(superoffload)} (docs/one-machine.md, SuperOffload)")
        if self.optimizer == "gpu" and self.parameters in ("cpu", "nvme"):
            raise ValueError(
                "parameters offloaded while the optimizer stays on GPU is not a useful placement: "
                "set optimizer to cpu or nvme, or parameters to gpu"
            )
        return self

    def _twin_flow_fits(self) -> None:
        """gpuResidentFraction: ZeRO-3 with the optimizer in CPU RAM (`twin_flow_placement`), no
        ZenFlow, no NVMe share, nothing in offload.deepspeed that moves the optimizer elsewhere."""
        if self.optimizer not in ("auto", "cpu") or self.parameters not in ("auto", "gpu", "cpu") \
                or "cpu" not in POLICY_TIERS[self.policy] or self.overlap != "none" \
                or self.cpu_resident_fraction is not None:
            raise ValueError(
                "offload.gpuResidentFraction is the share of a CPU-RAM optimizer kept on the GPU (ZeRO-3, parameters "
                f"on the GPU or in CPU RAM, no overlap, no cpuResidentFraction); optimizer {self.optimizer!r}, "
                f"parameters {self.parameters!r}, policy {self.policy!r}, overlap {self.overlap!r} exclude it: set "
                "optimizer cpu (or auto), parameters gpu, cpu or auto and overlap none, remove cpuResidentFraction, "
                "or remove gpuResidentFraction")
        zero = self.deepspeed.get("zero_optimization")
        zero = zero if isinstance(zero, dict) else {}
        stage = zero.get("stage")
        if stage is not None and stage != 3:
            raise ValueError(f"offload.gpuResidentFraction needs ZeRO-3 (DeepSpeed's Twin-Flow); offload.deepspeed "
                             f"sets zero_optimization.stage {stage}: remove one of them")
        block = zero.get("offload_optimizer")
        if zero.get("super_offload") or (isinstance(block, dict) and block.get("device") not in (None, "cpu")):
            raise ValueError("offload.gpuResidentFraction with offload.deepspeed's zero_optimization.super_offload or "
                             "offload_optimizer.device: Twin-Flow steps the rest of the optimizer on the CPU; remove "
                             "those overrides")


def twin_flow_placement(stage: int, optimizer: str, parameters: str) -> bool:
    """Where DeepSpeed 0.19.8's Twin-Flow (offload.gpuResidentFraction) runs: ZeRO-3, the optimizer
    in CPU RAM, the parameters on the accelerator or in CPU RAM (not in swap files)."""
    return stage == 3 and optimizer == "cpu" and parameters in ("gpu", "cpu")


# ZenFlow as Spillway runs it (`offload.overlap: zenflow`): the top 10% of gradient columns,
# chosen again and updated on the GPU every step, the rest applied by the CPU every 4 steps, in
# the step (overlap_step false: an overlapped CPU update is in flight when a checkpoint is taken
# and in none, so a resume drifted from the uninterrupted run by up to 4e-4 after the first
# interval, measured on the CPU). Fixed intervals so that checkpoints fall on a boundary, where
# the state is whole (the selection is made afresh, nothing is accumulated).
ZENFLOW_MAX_INTERVAL = 32  # steps a suspend may train on for (its grace period is finite)
ZENFLOW_DEFAULTS: dict[str, Any] = {"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 4,
                                    "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": False}


def zenflow_settings(offload: Offload) -> dict[str, Any]:
    """DeepSpeed's `zero_optimization.zenflow` for `offload.overlap: zenflow`: ZENFLOW_DEFAULTS
    with the job's overrides (offload.deepspeed) merged, each checked; raises ValueError naming
    one Spillway cannot keep a resume bit-identical with."""
    zero = offload.deepspeed.get("zero_optimization")
    given = zero.get("zenflow") if isinstance(zero, dict) else None
    if given is not None and not isinstance(given, dict):
        raise ValueError("offload.deepspeed.zero_optimization.zenflow must be a mapping of ZenFlow settings")
    given = given or {}
    settings = {**ZENFLOW_DEFAULTS, **given}
    interval = settings["update_interval"]
    if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= ZENFLOW_MAX_INTERVAL:
        raise ValueError(
            f"zero_optimization.zenflow.update_interval must be a whole number of steps from 1 to "
            f"{ZENFLOW_MAX_INTERVAL} (got {interval!r}): checkpoints, and a suspend, wait for its boundary "
            "(auto moves it)")
    ratio = settings["topk_ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio < 1:
        raise ValueError(f"zero_optimization.zenflow.topk_ratio must be a share of the columns above 0 and below 1 "
                         f"(got {ratio!r})")
    if "select_interval" not in given:
        settings["select_interval"] = interval  # chosen afresh at every update boundary
    fixed = {"select_strategy": "step", "select_interval": interval, "full_warm_up_rounds": 0, "overlap_step": False}
    for key, value in fixed.items():
        if settings[key] != value:
            raise ValueError(
                f"zero_optimization.zenflow.{key} must be {value!r} with overlap zenflow (got {settings[key]!r}): "
                "Spillway checkpoints on ZenFlow's update boundaries, where a resume is bit-identical; "
                + ("an overlapped CPU update is in flight there and in no checkpoint" if key == "overlap_step"
                   else f"set it to {value!r} or remove it from offload.deepspeed"))
    return settings


class Toleration(SpecModel):
    """A Kubernetes toleration for the job's pods (control-plane taints are refused at admission)."""

    key: str | None = Field(None, max_length=MAX_LABEL_KEY, description="The taint's key")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Kubernetes' default: Equal")
    value: str | None = Field(None, max_length=MAX_LABEL_VALUE, description="The taint's value (operator Equal)")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="The taint's effect (none: every effect)")
    toleration_seconds: int | None = Field(None, ge=0, le=MAX_SECONDS,
                                           description="NoExecute: how long the pod stays once tainted")


class Resources(SpecModel):
    """The nodes, GPUs and processes a job runs on."""

    # cpuProcesses above 1 only without GPUs, in the JSON Schema too (the CRD: CEL, crd.py).
    model_config = ConfigDict(json_schema_extra={
        "if": {"required": ["cpuProcesses"], "properties": {"cpuProcesses": {"minimum": 2}}},
        "then": {"anyOf": [{"not": {"required": ["gpusPerNode"]}},
                           {"properties": {"gpusPerNode": {"enum": [0, None]}}}]},
    })

    nodes: int = Field(1, ge=1, le=1024, description="Nodes the job runs on, a pod each (ZeRO across all their processes)")
    gpus_per_node: int | None = Field(None, ge=0, le=64, description="Omitted: every GPU of the chosen node")
    node_selector: dict[Annotated[str, Field(max_length=MAX_LABEL_KEY)],
                        Annotated[str, Field(max_length=MAX_LABEL_VALUE)]] = Field(
        default_factory=dict, max_length=MAX_ITEMS,
        description="Node labels the job's pods require (and the planner plans for: only nodes that match)")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_ITEMS,
                                          description="Taints the job's pods tolerate")
    placement: Literal["cheapest", "fastest"] = Field(
        "cheapest", description="How to choose among node shapes that fit"
    )
    cpu_processes: int = Field(
        1, ge=1, le=64,
        description="Training processes per node with gpusPerNode 0 (DeepSpeed's CPU accelerator); "
        "with GPUs it is one process per GPU",
    )

    @model_validator(mode="after")
    def _cpu_processes_without_gpus(self) -> Resources:
        if self.cpu_processes > 1 and self.gpus_per_node:
            raise ValueError(
                f"resources.cpuProcesses is {self.cpu_processes} with gpusPerNode {self.gpus_per_node}: "
                "GPU nodes run one process per GPU; set gpusPerNode to 0 or drop cpuProcesses"
            )
        return self


class CheckpointPolicy(SpecModel):
    """When checkpoints are written, how many are kept, where, and their mirror in object storage."""

    every_steps: int = Field(50, ge=1, le=MAX_STEPS, description="Checkpoint every N optimizer steps (and on SIGTERM)")
    keep: int = Field(3, ge=1, le=1000, description="Keep the last K good checkpoints")
    keep_best: bool = Field(
        False,
        description="Also keep the checkpoint with the lowest held-out loss, even outside `keep` (needs "
        "dataset.validation; a checkpoint counts when its step was evaluated: evalEverySteps a multiple of "
        "everySteps, or the end)",
    )
    path: str | None = Field(None, max_length=MAX_URI,
                             description="Local mode: checkpoint directory (default: <run dir>/checkpoints)")
    size: Size = Field(None, description="Cluster mode: checkpoint PVC size; auto from the plan")
    storage_class_name: str | None = Field(
        None, max_length=MAX_DNS_NAME,
        description="Cluster mode: StorageClass of the checkpoint PVC (default: the operator's checkpoint "
        "StorageClass setting, else the cluster's default)")
    mirror: str | None = Field(
        None, pattern=S3_URI, max_length=MAX_URI,
        description="s3://BUCKET/PREFIX: upload every checkpoint there in the background (its manifest last); "
        "a job whose checkpoint volume is empty resumes from the newest complete one there (credentials: "
        "spec.storage)",
    )

    _parse_size = field_validator("size", mode="before")(size_or_none)


class RollbackPolicy(SpecModel):
    """What a diverging loss does: roll back to the last good checkpoint, with a lower learning rate."""

    on_divergence: bool = Field(True, description="Reload the last good checkpoint on NaN/Inf or a loss spike")
    max_rollbacks: int = Field(3, ge=0, le=100, description="Rollbacks allowed in one run; one more ends it as diverged "
                               "(exit code 4, not retried)")
    spike_factor: float = Field(
        4.0, gt=1, le=1e6, description="A loss above this multiple of the running average counts as divergence"
    )
    window: int = Field(20, ge=2, le=10_000, description="Steps in the running loss average")
    lr_backoff: float = Field(0.5, gt=0, le=1, description="Learning rate multiplier applied after each rollback")


class SecretRef(SpecModel):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253, description="The Secret's name")


class Storage(SpecModel):
    """Where s3:// URIs of the spec are read and written."""

    secret_ref: SecretRef | None = Field(
        None,
        description="Cluster mode: a Secret in the job's namespace with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
        "(optionally AWS_SESSION_TOKEN, AWS_REGION); local mode reads the usual AWS variables instead",
    )
    endpoint_url: str | None = Field(
        None, pattern=r"^https?://[^\s/]+(/.*)?$", max_length=MAX_URI,
        description="The S3 endpoint of a non-AWS server (MinIO, Ceph, SeaweedFS), e.g. http://seaweedfs.storage:8333",
    )
    region: str | None = Field(None, min_length=1, max_length=MAX_FIELD,
                               description="The bucket's region (default: AWS_REGION, else us-east-1)")


class MlflowTracking(SpecModel):
    tracking_uri: str = Field(min_length=1, max_length=MAX_URI,
                              description="The MLflow tracking server, e.g. http://mlflow.tracking:5000")
    experiment: str | None = Field(None, min_length=1, max_length=MAX_FIELD,
                                   description="Experiment name (default: the job's namespace)")


class Tracking(SpecModel):
    """Experiment tracking: MLflow, TensorBoard."""

    mlflow: MlflowTracking | None = Field(
        None, description="Log the plan, the spec and per-step metrics from rank 0 to this MLflow server; an "
        "unreachable server warns once and never stops training",
    )
    tensorboard: bool = Field(False, description="Write TensorBoard event files beside the checkpoints (tensorboard/)")


class Budget(SpecModel):
    """A spending limit."""

    max_cost_usd: float | None = Field(
        None, gt=0, le=1e9, alias="maxCostUSD",
        description="Cluster mode: once the job's cost (GPU hours x the chart's price per node shape) reaches this, "
        "its pods checkpoint and stop, and it ends BudgetExceeded")


class FineTuneJobSpec(SpecModel):
    model: ModelSource
    dataset: DatasetSource
    training: Training = Field(default_factory=lambda: Training())
    method: Method = Field(default_factory=lambda: Method())
    export: Export = Field(default_factory=lambda: Export())
    offload: Offload = Field(default_factory=lambda: Offload())
    resources: Resources = Field(default_factory=lambda: Resources())
    checkpoint: CheckpointPolicy = Field(default_factory=lambda: CheckpointPolicy())
    rollback: RollbackPolicy = Field(default_factory=lambda: RollbackPolicy())
    resume_from: str | None = Field(None, max_length=MAX_DNS_NAME,
                                    description="Checkpoint name to restart from; setting it rolls the job back")
    budget: Budget = Field(default_factory=lambda: Budget())
    storage: Storage = Field(default_factory=lambda: Storage())
    tracking: Tracking = Field(default_factory=lambda: Tracking())
    suspend: bool = Field(False, description="true: the pods checkpoint and stop (no failure counted); false again: "
                          "it resumes from that checkpoint")
    queue_name: str | None = Field(
        None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="A Kueue LocalQueue in the job's namespace: no pod starts until Kueue admits the job's "
        "Workload; an eviction or preemption by Kueue suspends it (checkpoint, no failure counted) until it is "
        "admitted again. The label kueue.x-k8s.io/queue-name does the same. Ignored by `spillway run`",
    )
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, le=MAX_SECONDS,
        description="Cluster mode: delete the finished FineTuneJob (and its children) this many seconds after it ends")
    backoff_limit: int = Field(3, ge=0, le=100, description="Failed attempts retried before the job ends Failed "
                               "(preemptions, evictions and replans do not count)")

    @model_validator(mode="after")
    def _evaluation_has_data(self) -> FineTuneJobSpec:
        if (self.method.objective == "dpo") != (self.dataset.format == "preference"):
            raise ValueError(f"method.objective {self.method.objective} with dataset.format {self.dataset.format}: "
                             "objective dpo trains on preference data and preference data trains only with dpo; "
                             "set both (method.objective: dpo, dataset.format: preference) or neither")
        if self.export.merge and not self.method.lora:
            raise ValueError("export.merge applies to method.type lora (a full fine-tune exports the whole model); "
                             "remove it or set method.type: lora")
        if self.training.eval_every_steps and self.dataset.validation is None:
            raise ValueError("training.evalEverySteps needs dataset.validation (e.g. validation: {fraction: 0.05}); "
                             "add it or remove evalEverySteps")
        stopping = self.training.early_stopping
        if stopping is not None and (not self.training.eval_every_steps
                                     or self.training.eval_every_steps % self.checkpoint.every_steps):
            raise ValueError(
                f"training.earlyStopping needs training.evalEverySteps ({self.training.eval_every_steps}) set to a "
                f"multiple of checkpoint.everySteps ({self.checkpoint.every_steps}), so that every evaluation has "
                "a checkpoint to keep as the best; set evalEverySteps (and dataset.validation) or remove earlyStopping")
        if self.offload.overlap == "zenflow":
            self._zenflow_fits()
        if self.offload.gpu_resident_fraction is not None and self.method.lora:
            raise ValueError(
                "offload.gpuResidentFraction is for full fine-tuning (not yet tested with LoRA, whose optimizer "
                "state is the adapters' alone): remove gpuResidentFraction or set method.type full")
        if self.checkpoint.keep_best and self.dataset.validation is None:
            raise ValueError("checkpoint.keepBest needs dataset.validation to tell the best checkpoint; add it or "
                             "remove keepBest")
        return self

    def _zenflow_fits(self) -> None:
        interval = zenflow_settings(self.offload)["update_interval"]
        if self.training.gradient_accumulation != 1:
            raise ValueError(
                f"offload.overlap zenflow with training.gradientAccumulation {self.training.gradient_accumulation}: "
                f"ZenFlow accumulates the gradients it applies late itself (every {interval} steps); set "
                "gradientAccumulation to 1 and raise microBatchSize, or remove overlap")
        if self.method.lora or self.method.objective != "sft":
            raise ValueError(
                "offload.overlap zenflow is for full fine-tuning with objective sft (not yet tested with LoRA or DPO): "
                "remove overlap or set method.type full and objective sft")
        for field, steps in (("checkpoint.everySteps", self.checkpoint.every_steps),
                             ("training.maxSteps", self.training.max_steps)):
            if steps % interval:
                raise ValueError(
                    f"{field} {steps} with offload.overlap zenflow: a checkpoint (the last one too) must fall on "
                    f"ZenFlow's update boundary (every {interval} steps), where nothing is accumulated; set "
                    f"{field.split('.')[1]} to a multiple of {interval}")
        if self.rollback.on_divergence:
            raise ValueError(
                "offload.overlap zenflow with rollback.onDivergence: a rollback in the same process would keep the "
                "gradients ZenFlow accumulated in the discarded steps; set rollback.onDivergence: false (a "
                "diverged run then fails, and resumes from its last checkpoint when restarted)")


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    namespace: str = "default"


class FineTuneJob(SpecModel):
    api_version: Literal["spillway.dev/v1alpha1"] = "spillway.dev/v1alpha1"
    kind: Literal["FineTuneJob"] = "FineTuneJob"
    metadata: ObjectMeta
    spec: FineTuneJobSpec
    status: dict[str, Any] | None = None


class SpecError(ValueError):
    """A job description that cannot be used, with one line per problem naming the field."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: cannot use this FineTuneJob\n" + "\n".join(f"  - {p}" for p in problems))


def describe_validation_error(err: ValidationError) -> list[str]:
    """One line per error: dotted camelCase field path, the message, and the rejected value."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(document)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling against the FineTuneJob reference"
        got = e.get("input")
        shown = "" if e["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{path}: {msg}{shown}")
    return lines


def parse_job(document: dict[str, Any], source: str = "<job>") -> FineTuneJob:
    if not isinstance(document, dict):
        raise SpecError(source, ["(document): expected a mapping with apiVersion, kind, metadata and spec"])
    try:
        return FineTuneJob.model_validate(document)
    except ValidationError as err:
        raise SpecError(source, describe_validation_error(err)) from None


def load_job(path: str | Path) -> FineTuneJob:
    """Read a finetune.yaml (the same file works with kubectl apply and spillway run)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise SpecError(str(path), [f"cannot read the file: {err.strerror}"]) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise SpecError(str(path), [f"not valid YAML: {err}"]) from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise SpecError(str(path), [f"expected exactly one document of kind {KIND}, found {len(jobs)}"])
    return parse_job(jobs[0], str(path))
