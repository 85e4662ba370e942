"""What the tier planner sizes one placement from: the model's shape, the swap settings
chosen for it, and the placement itself (stage, tiers, node, processes, training).

Where this sits: `planner` builds these and keeps the fastest placement; `tier_sizing`
works out each placement's bytes from them and `estimates` its bytes and seconds. Records
only, with no arithmetic of the planner's: `estimates` and `tier_sizing` import this and
nothing here imports them. No torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from spillway_runtime.core.hardware import NodeHardware
from spillway_runtime.core.param_counts import count_decoder
from spillway_runtime.core.spec import Training
from spillway_runtime.core.spec_types import DType, Tier
from spillway_runtime.core.units import format_count

# The optimizer swapper needs one pinned buffer per swapped tensor (param, 2 moments, grad);
# the pipelined swapper has three sub-groups in flight (the one stepped, the next one read
# ahead, the last one still being written) and needs three times that: with 8, as planned
# until bench_tier_curve.py ran one, a step with 3 or more swapped sub-groups died in its
# first step ("PipelinedOptimizerSwapper ran out of swap buffers").
OPTIMIZER_SWAP_BUFFERS = 4
OPTIMIZER_SWAP_BUFFERS_PIPELINED = 12
# Parameter swapper: buffers of 1e8 elements (DeepSpeed's default size), but 16 of them, not
# DeepSpeed's 5: a Llama layer gathers 7 swappable matrices at once and prefetches the next
# layer's, and with 5 the swapper fails ("Not enough buffers 0 for swapping 1").
PARAM_SWAP_BUFFER_COUNT = 16
PARAM_SWAP_BUFFER_SIZE = 100_000_000


class ModelShape(BaseModel):
    """What the planner needs to know about a model; from config.json or a parameter count."""

    name: str = "model"
    params: int = Field(gt=0)
    largest_layer_params: int = Field(gt=0, description="Parameters of the largest module (DeepSpeed's L)")
    largest_param_numel: int = Field(gt=0, description="Elements of the largest single tensor")
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    linear_in_out: dict[str, int] = Field(
        default_factory=dict,
        description="Per linear-layer name (q_proj, down_proj, ...; not the output head): in+out features summed "
        "over the model's layers of that name. A LoRA adapter of rank r on them has r times that many parameters",
    )
    trainable_params: int | None = Field(None, description="Parameters that train (LoRA's adapters); none: all")
    adapter_tensors: tuple[int, ...] | None = Field(
        None, exclude=True, description="LoRA's trainable tensors' elements in the order DeepSpeed gets them "
        "(`estimates.lora_tensors`): what the optimizer's sub-groups are cut from; not kept in a stored plan")
    tied_embeddings: bool | None = Field(
        None, description="The output head is the embedding (config.json's tie_word_embeddings); none: not known "
        "(a shape from a parameter count), guessed from the count")

    @property
    def trainable(self) -> int:
        return self.params if self.trainable_params is None else self.trainable_params

    @property
    def parameter_tensors(self) -> int:
        """Parameter tensors of a dense Llama-like decoder: per layer four attention and three
        MLP matrices and two norms; the embedding, the final norm and the output head. What
        ZeRO-3 gathers and releases one by one (`estimates.GATHER_SECONDS_PER_TENSOR`)."""
        return 9 * self.num_layers + 3

    def tensor_numels(self) -> tuple[int, ...]:
        """The parameter tensors' elements in the order transformers registers them in a
        Llama-like decoder, which is the order DeepSpeed cuts them into optimizer sub-groups:
        the embedding; per layer its matrices in `linear_in_out`'s order (each in x out, from
        in + out per layer less the hidden size, which is one side of every one of them), then
        its two norms; the final norm; the output head unless the embeddings are tied (where
        that is not known, where the count holds one). What the count has beyond these (biases, more norms, MoE experts and
        routers) is one tensor per layer after its matrices, so the elements add up to
        `params`. Exact for Llama, Mistral and Gemma (tensor by tensor, against the model
        transformers builds: tests/unit/test_param_counts.py); the full model's, LoRA or not."""
        h, layers = self.hidden_size, self.num_layers
        embed = self.vocab_size * h
        matrices = [h * (in_out // layers - h) for in_out in self.linear_in_out.values() if in_out // layers > h]
        rest = self.params - (embed + layers * (sum(matrices) + 2 * h) + h)
        head = embed if rest >= embed and not self.tied_embeddings else 0
        extra, odd = divmod(max(0, rest - head), layers)
        layer = (*matrices, *((extra,) if extra else ()), h, h)
        return (embed, *(layer * layers), h + odd, *((head,) if head else ()))

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None) -> ModelShape:
        """The shape of a decoder from its Hugging Face config.json, by arithmetic (no torch):
        large vocabularies, GQA, tied embeddings and every MoE expert counted as transformers
        builds them. Raises `param_counts.HFConfigError` naming the key it cannot use."""
        counts = count_decoder(config)
        return cls(
            name=name or str(config.get("_name_or_path") or counts.model_type),
            params=counts.params,
            largest_layer_params=counts.largest_layer_params,
            largest_param_numel=counts.largest_param_numel,
            hidden_size=counts.hidden_size,
            num_layers=counts.num_layers,
            vocab_size=counts.vocab_size,
            num_attention_heads=counts.num_attention_heads,
            linear_in_out=counts.linear_in_out,
            tied_embeddings=counts.tied_embeddings,
        )

    @classmethod
    def from_param_count(cls, params: int, vocab_size: int = 32000) -> ModelShape:
        """A Llama-shaped decoder of about `params` parameters (num_layers = hidden/128).

        Used when only a count is known (`--params 13B`): P = 12 L h^2 + 2 V h.
        """
        hidden = 128
        for h in range(128, 65536 + 1, 128):
            if 12 * (h // 128) * h * h + 2 * vocab_size * h > params:
                break
            hidden = h
        layers = max(1, hidden // 128)
        embed = vocab_size * hidden
        inner = int(hidden * 8 / 3)
        mlp = 3 * hidden * inner
        return cls(
            name=format_count(params),
            params=params,
            largest_layer_params=max(embed, mlp + 4 * hidden * hidden),
            largest_param_numel=max(embed, hidden * int(hidden * 8 / 3)),
            hidden_size=hidden,
            num_layers=layers,
            vocab_size=vocab_size,
            num_attention_heads=max(1, hidden // 128),
            linear_in_out={**{name: layers * 2 * hidden for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
                           **{name: layers * (hidden + inner) for name in ("gate_proj", "up_proj", "down_proj")}},
        )


class SwapSettings(BaseModel):
    """DeepSpeed's swappers as `tier_sizing` sets them for one placement."""

    sub_group_size: int
    optimizer_buffer_count: int = OPTIMIZER_SWAP_BUFFERS
    pipeline: bool = False
    param_buffer_count: int = PARAM_SWAP_BUFFER_COUNT
    param_buffer_size: int = PARAM_SWAP_BUFFER_SIZE
    pin_memory: bool = True
    cpu_resident_fraction: float = Field(
        0.0, description="With the optimizer on NVMe: the share of each rank's optimizer sub-groups kept in CPU "
        "RAM and never swapped (the first ones); the runtime keeps floor(share x sub-groups)")
    gpu_resident_fraction: float = Field(
        0.0, description="With the optimizer in CPU RAM under ZeRO-3: the share of each rank's optimizer sub-groups "
        "kept and updated on the GPU (Twin-Flow; DeepSpeed keeps the first int(share x sub-groups))")


@dataclass(frozen=True)
class PlacementInputs:
    """One placement on one node with everything that sizes it: what `tier_sizing` sizes,
    `planner` scores and `estimates.step_time` times."""

    shape: ModelShape
    hw: NodeHardware
    training: Training
    dtype: DType
    stage: int
    optimizer: Tier
    parameters: Tier
    gpus_per_node: int  # 0: the CPU accelerator
    ranks_per_node: int  # training processes: one per GPU, or the CPU processes
    nodes: int = 1
    price_per_hour: float | None = None
    # With the optimizer on NVMe, the share of its sub-groups kept in RAM: a number (the job's,
    # or 0 when the job asked for NVMe), or None: the largest share the RAM holds.
    cpu_resident: float | None = 0.0
    sub_group_size: int | None = None  # the job's own (offload.deepspeed), which DeepSpeed uses
    reference_forwards: int = 0  # DPO: forward passes of a frozen reference per micro-batch, no gradient
    reference_params: int = 0  # DPO with full fine-tuning: the frozen copy's parameters, beside the model's
    # offload.overlap zenflow: the CPU step every this many steps, the top `zenflow_topk` of the
    # gradient columns updated on the accelerator every step (0: plain ZeRO-Offload)
    zenflow_interval: int = 0
    zenflow_topk: float = 0.0
    # offload.gpuResidentFraction: the share of a CPU-RAM optimizer's sub-groups on the GPU (0: none)
    gpu_resident: float = 0.0
    # the job's offload.deepspeed, merged over the config the plan makes: what DeepSpeed's swap locks
    # depends on its buffer counts and sizes, aio block and threads, and fast_init
    deepspeed: Mapping[str, Any] = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def parameter_swappers(self) -> int:
        """DeepSpeed's parameter swappers in a process: the model's, and full DPO's frozen copy's."""
        return 2 if self.reference_params else 1

    @property
    def ranks(self) -> int:
        return self.ranks_per_node * self.nodes

