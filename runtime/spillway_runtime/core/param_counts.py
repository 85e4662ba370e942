# mypy: disallow-untyped-defs, disallow-incomplete-defs, disallow-any-generics, warn-return-any
# mypy: no-implicit-reexport, strict-equality, disallow-untyped-calls
# (strict like the modules pyproject.toml lists: set here because any change to pyproject.toml
# rebuilds the training image's DeepSpeed layer, 20+ minutes on two cores)
"""A decoder's parameter counts from its Hugging Face `config.json`, by arithmetic.

Where this sits: below the planner and the spec, importing only the standard library,
because the operator's image has neither torch nor transformers and plans a cluster job
from `spec.model.config` alone, and `spillway run` and `spillway plan` plan with it too
(`meta_shape.model_shape`). `meta_shape.shape_from_config` counts the same things by
building the model on torch's meta device (local runs of a family not named here use it);
the unit tests hold the two equal for every family named here, as transformers 5 builds
them, with and without the keys transformers fills in from its config classes' defaults:
mixture-of-experts layers keep all experts in two 3-D tensors (gate_up_proj, down_proj), so
the largest single tensor of a MoE model is an experts tensor, not a matrix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# A bias flag is fixed by the family (bool) or read from a config key with its default.
BiasRule = bool | tuple[str, bool]


@dataclass(frozen=True)
class Family:
    """How one `model_type` lays out its parameters (what transformers' modeling file builds)."""

    label: str
    tied_default: bool = False
    head_dim_default: int | None = None  # None: hidden_size // num_attention_heads
    # A config.json without num_key_value_heads gets its class's default (None: as many as
    # num_attention_heads): a hand-written Mistral config without it has 8, not 32
    kv_heads_default: int | None = None
    qkv_bias: BiasRule = False
    o_bias: BiasRule = False
    mlp_bias: BiasRule = False
    qk_norm: bool = False  # RMSNorm over head_dim on queries and keys (Qwen3, Gemma 3)
    norms_per_layer: int = 2
    fused: bool = False  # Phi-3: one qkv_proj and one gate_up_proj
    expert_keys: tuple[str, ...] = ()  # MoE: the keys that may give the expert count
    expert_size_key: str = "intermediate_size"
    shared_expert: bool = False  # Qwen2-MoE: one always-on MLP and its sigmoid gate per layer
    sparse_step: bool = False  # Qwen-MoE: decoder_sparse_step and mlp_only_layers pick the MoE layers


_ATTENTION_BIAS = ("attention_bias", False)
FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS, mlp_bias=("mlp_bias", False)),
    "mistral": Family("Mistral", kv_heads_default=8),
    "qwen2": Family("Qwen2", qkv_bias=True, kv_heads_default=32),
    "qwen3": Family("Qwen3", head_dim_default=128, kv_heads_default=32, qkv_bias=_ATTENTION_BIAS,
                    o_bias=_ATTENTION_BIAS, qk_norm=True),
    "gemma": Family("Gemma", tied_default=True, head_dim_default=256, kv_heads_default=16,
                    qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS),
    "gemma2": Family("Gemma 2", tied_default=True, head_dim_default=256, kv_heads_default=4,
                     qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS, norms_per_layer=4),
    "gemma3_text": Family("Gemma 3", tied_default=True, head_dim_default=256, kv_heads_default=4,
                          qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS, qk_norm=True, norms_per_layer=4),
    "phi3": Family("Phi-3", fused=True),
    "mixtral": Family("Mixtral", kv_heads_default=8, expert_keys=("num_local_experts", "num_experts")),
    "qwen2_moe": Family("Qwen2-MoE", qkv_bias=("qkv_bias", True), kv_heads_default=16, expert_keys=("num_experts",),
                        expert_size_key="moe_intermediate_size", shared_expert=True, sparse_step=True),
    "qwen3_moe": Family("Qwen3-MoE", qkv_bias=_ATTENTION_BIAS, o_bias=_ATTENTION_BIAS, qk_norm=True, kv_heads_default=4,
                        expert_keys=("num_experts", "num_local_experts"), expert_size_key="moe_intermediate_size",
                        sparse_step=True),
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


class HFConfigError(ValueError):
    """A config.json the analytic shape cannot read; `field` names the key at fault."""

    def __init__(self, field: str, message: str, value: object = None):
        self.field = field
        self.message = message
        self.value = value
        super().__init__(f"{field}: {message}" + ("" if value is None else f" (got {value!r})"))


@dataclass
class DecoderCounts:
    """What `planner.ModelShape` needs, counted from a config (see that class for each field)."""

    model_type: str
    params: int
    largest_layer_params: int
    largest_param_numel: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    experts: int = 0
    tied_embeddings: bool = False
    linear_in_out: dict[str, int] = field(default_factory=dict)


def _positive_int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if value is None:
        raise HFConfigError(key, "missing; the config.json of this model family has it")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HFConfigError(key, "must be a positive integer", value)
    return value


def _optional_int(config: Mapping[str, Any], key: str, default: int) -> int:
    return default if config.get(key) is None else _positive_int(config, key)


def _flag(config: Mapping[str, Any], rule: BiasRule) -> bool:
    if isinstance(rule, bool):
        return rule
    key, default = rule
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise HFConfigError(key, "must be true or false", value)
    return value


def family_of(config: Mapping[str, Any]) -> Family:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise HFConfigError("model_type", "missing; is this a Hugging Face config.json?", model_type)
    family = FAMILIES.get(model_type)
    if family is None:
        raise HFConfigError(
            "model_type",
            f"no analytic shape for this model type (known: {', '.join(sorted(FAMILIES))}); "
            "give spec.model.parameterCount instead to plan with a Llama-shaped guess",
            model_type,
        )
    return family


def _sparse_layers(config: Mapping[str, Any], family: Family, layers: int, experts: int) -> list[bool]:
    """Which decoder layers carry experts (transformers' Qwen2MoeDecoderLayer rule)."""
    if not experts:
        return [False] * layers
    if not family.sparse_step:
        return [True] * layers
    step = _optional_int(config, "decoder_sparse_step", 1)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise HFConfigError("mlp_only_layers", "must be a list of layer indices", dense)
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


class _Tally:
    """Parameters, per-module sums (DeepSpeed's L, as meta_shape finds it) and the largest tensor."""

    def __init__(self) -> None:
        self.params = 0
        self.largest_module = 0
        self.largest_tensor = 0
        self.linear_in_out: dict[str, int] = {}

    def module(self, *tensors: int, linears: Mapping[str, int] | None = None) -> None:
        self.params += sum(tensors)
        self.largest_module = max(self.largest_module, sum(tensors))
        self.largest_tensor = max(self.largest_tensor, *tensors)
        for name, in_out in (linears or {}).items():
            self.linear_in_out[name] = self.linear_in_out.get(name, 0) + in_out


def _mlp(tally: _Tally, h: int, inner: int, bias: bool, fused: bool) -> None:
    """A gated MLP: gate and up (h -> inner), down (inner -> h)."""
    if fused:
        tally.module(2 * inner * h, inner * h, linears={"gate_up_proj": h + 2 * inner, "down_proj": inner + h})
        return
    b = (inner, inner, h) if bias else ()
    tally.module(inner * h, inner * h, h * inner, *b,
                 linears={"gate_proj": h + inner, "up_proj": h + inner, "down_proj": inner + h})


def count_decoder(config: Mapping[str, Any]) -> DecoderCounts:
    """Count a decoder-only causal LM's parameters from its config, as transformers builds it."""
    family = family_of(config)
    vocab, h, layers, heads = (_positive_int(config, key) for key in _REQUIRED)
    kv_heads = _optional_int(config, "num_key_value_heads", family.kv_heads_default or heads)
    if config.get("head_dim") is None and family.head_dim_default is None and h % heads:
        # transformers refuses it too (its validate_architecture), when the model is built
        raise HFConfigError("num_attention_heads", f"must divide hidden_size ({h}) where head_dim is not given",
                            heads)
    head_dim = _optional_int(config, "head_dim", family.head_dim_default or h // heads)
    tied = _flag(config, ("tie_word_embeddings", family.tied_default))
    qkv_bias, o_bias, mlp_bias = (_flag(config, r) for r in (family.qkv_bias, family.o_bias, family.mlp_bias))
    experts = 0
    for key in family.expert_keys:
        if config.get(key) is not None:
            experts = _positive_int(config, key)
            break
    else:
        if family.expert_keys:
            _positive_int(config, family.expert_keys[0])  # raises: missing
    sparse = _sparse_layers(config, family, layers, experts)
    inner = _positive_int(config, "intermediate_size") if not all(sparse) else 0
    expert_inner = _positive_int(config, family.expert_size_key) if any(sparse) else 0
    shared_inner = _positive_int(config, "shared_expert_intermediate_size") if family.shared_expert and any(sparse) else 0

    t = _Tally()
    t.module(vocab * h)  # embed_tokens
    if not tied:
        t.module(vocab * h)  # lm_head (not a LoRA target: PEFT's all-linear skips the output head)
    t.module(h)  # final norm
    q, kv = heads * head_dim, kv_heads * head_dim
    for sparse_layer in sparse:
        if family.fused:
            t.module(q * h + 2 * kv * h, q * h, linears={"qkv_proj": h + q + 2 * kv, "o_proj": q + h})
        else:
            qkv_b = (q, kv, kv) if qkv_bias else ()
            t.module(q * h, kv * h, kv * h, q * h, *qkv_b, *((h,) if o_bias else ()),
                     *((head_dim, head_dim) if family.qk_norm else ()),
                     linears={"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h})
        for _ in range(family.norms_per_layer):
            t.module(h)
        if not sparse_layer:
            _mlp(t, h, inner, mlp_bias, family.fused)
            continue
        # The MoE block's children are not all leaves (experts holds its activation module),
        # so, as meta_shape counts, the router, the experts and the shared MLP are each a module.
        t.module(experts * h)  # router
        t.module(experts * 2 * expert_inner * h, experts * h * expert_inner)  # experts: gate_up, down
        if family.shared_expert:
            _mlp(t, h, shared_inner, False, False)
            t.module(h, linears={"shared_expert_gate": h + 1})
    return DecoderCounts(
        model_type=str(config["model_type"]), params=t.params,
        largest_layer_params=max(t.largest_module, t.largest_tensor), largest_param_numel=t.largest_tensor,
        hidden_size=h, num_layers=layers, vocab_size=vocab, num_attention_heads=heads, experts=experts,
        tied_embeddings=tied, linear_in_out=t.linear_in_out,
    )


def config_problems(config: Mapping[str, Any]) -> list[HFConfigError]:
    """What keeps the analytic shape from reading `config` (empty: it can)."""
    try:
        count_decoder(config)
    except HFConfigError as err:
        return [err]
    return []
