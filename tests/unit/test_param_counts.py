"""The analytic model shape (config.json arithmetic, no torch) against the model transformers
builds from the same config, and against the parameter counts the model makers publish."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spillway_runtime.core.param_counts import HFConfigError, config_problems
from spillway_runtime.core.planner import ModelShape

# The shapes the issue names, scaled down (hidden, layers, experts) but keeping each family's
# quirks: GQA, a 128k-262k vocabulary, qkv bias, tied embeddings, head_dim != hidden/heads,
# q/k norms, Phi-3's fused projections, experts in 3-D tensors, shared experts, dense layers.
SMALL: dict[str, dict[str, Any]] = {
    "llama3-gqa-128k": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 256, "intermediate_size": 896,
                        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2},
    "llama-biases": {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "attention_bias": True, "mlp_bias": True},
    "mistral": {"model_type": "mistral", "vocab_size": 32768, "hidden_size": 128, "intermediate_size": 448,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 48},
    "qwen2-152k-qkv-bias": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 224,
                            "intermediate_size": 1184, "num_hidden_layers": 2, "num_attention_heads": 7,
                            "num_key_value_heads": 1, "tie_word_embeddings": False},
    "qwen3-tied": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 128, "intermediate_size": 384,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                   "tie_word_embeddings": True},
    "gemma-256k-tied": {"model_type": "gemma", "vocab_size": 256000, "hidden_size": 192, "intermediate_size": 768,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                        "head_dim": 64},
    "gemma2": {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 128, "intermediate_size": 512,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 48},
    "gemma3-262k": {"model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 128, "intermediate_size": 512,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32},
    "phi3-fused": {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 128, "intermediate_size": 320,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "pad_token_id": 0, "eos_token_id": 0, "bos_token_id": 1},
    "mixtral-moe": {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 128, "intermediate_size": 448,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2-moe-shared": {"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 128,
                         "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
                         "num_key_value_heads": 4, "num_experts": 6, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 64, "shared_expert_intermediate_size": 256,
                         "decoder_sparse_step": 1, "mlp_only_layers": [0]},
    "qwen3-moe": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 128, "intermediate_size": 384,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
}

# Full-size configs (from the models' config.json) and the parameter counts their makers and
# the Hugging Face Hub publish for them.
FULL: dict[str, tuple[dict[str, Any], int]] = {
    "Meta-Llama-3-8B": ({"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                         "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                         "num_key_value_heads": 8, "tie_word_embeddings": False}, 8_030_261_248),
    "Qwen2-7B": ({"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                  "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                  "tie_word_embeddings": False}, 7_615_616_512),
    "gemma-7b": ({"model_type": "gemma", "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
                  "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "head_dim": 256}, 8_537_680_896),
    "Mixtral-8x7B-v0.1": ({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
                           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                           "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
                          46_702_792_704),
    "Qwen1.5-MoE-A2.7B": ({"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
                           "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
                           "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
                           "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                           "decoder_sparse_step": 1, "tie_word_embeddings": False}, 14_315_784_192),
}


@pytest.mark.parametrize("name", sorted(FULL))
def test_full_size_configs_count_the_published_parameters(name: str) -> None:
    config, published = FULL[name]
    assert ModelShape.from_hf_config(config).params == published


def test_the_largest_tensor_is_the_embedding_or_an_experts_tensor() -> None:
    llama3 = ModelShape.from_hf_config(FULL["Meta-Llama-3-8B"][0])
    assert llama3.largest_param_numel == 128256 * 4096
    assert llama3.largest_param_numel > ModelShape.from_param_count(llama3.params).largest_param_numel * 3
    mixtral = ModelShape.from_hf_config(FULL["Mixtral-8x7B-v0.1"][0])
    # All eight experts' gate and up projections of a layer sit in one tensor in transformers 5.
    assert mixtral.largest_param_numel == 8 * 2 * 14336 * 4096


@pytest.mark.parametrize(("config", "field", "words"), [
    ({"vocab_size": 10}, "model_type", "missing"),
    ({"model_type": "bert"}, "model_type", "parameterCount"),
    ({**SMALL["mistral"], "num_hidden_layers": None}, "num_hidden_layers", "missing"),
    ({**SMALL["mistral"], "hidden_size": "4096"}, "hidden_size", "positive integer"),
    ({k: v for k, v in SMALL["mixtral-moe"].items() if k != "num_local_experts"}, "num_local_experts", "missing"),
    ({**SMALL["qwen2-moe-shared"], "mlp_only_layers": "0"}, "mlp_only_layers", "list"),
    ({**SMALL["llama-biases"], "hidden_size": 100, "num_attention_heads": 3}, "num_attention_heads", "must divide"),
])
def test_an_unusable_config_names_the_key(config: dict[str, Any], field: str, words: str) -> None:
    problems = config_problems(config)
    assert [p.field for p in problems] == [field]
    assert words in str(problems[0])
    with pytest.raises(HFConfigError):
        ModelShape.from_hf_config(config)


# Keys a hand-written config.json may leave out, which transformers then fills in from its
# config class (Mistral's 8 key/value heads, Qwen3's head_dim of 128), not from the others
DEFAULTED = ("num_key_value_heads", "head_dim")


@pytest.mark.parametrize("keys", ["as given", "defaulted"])
@pytest.mark.parametrize("name", sorted(SMALL))
def test_analytic_shape_equals_the_model_transformers_builds(name: str, keys: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from spillway_runtime.meta_shape import shape_from_config

    config = SMALL[name] if keys == "as given" else {k: v for k, v in SMALL[name].items() if k not in DEFAULTED}
    (tmp_path / "config.json").write_text(json.dumps(config))
    built = shape_from_config(tmp_path)
    ours = ModelShape.from_hf_config(config)
    assert ours.params == built.params
    assert ours.largest_param_numel == built.largest_param_numel
    assert ours.largest_layer_params == built.largest_layer_params
    assert ours.linear_in_out == built.linear_in_out
    assert (ours.hidden_size, ours.num_layers, ours.vocab_size, ours.num_attention_heads) == (
        built.hidden_size, built.num_layers, built.vocab_size, built.num_attention_heads)


SHAPE_AND_IMPORTS = """
import sys
from spillway_runtime.meta_shape import model_shape
shape = model_shape(sys.argv[1])
print(shape.model_dump_json())
print(sorted(m for m in ("torch", "transformers", "deepspeed") if m in sys.modules))
"""


def test_spillway_run_shapes_a_known_family_by_arithmetic_and_another_on_the_meta_device(tmp_path: Path) -> None:
    """`spillway run` and `spillway plan` shape a job's model with `meta_shape.model_shape`: a
    family the count knows without importing torch or transformers (about 4 s of CPU before
    each run), the same shape as the model transformers builds with the output head's tying
    known; a family it does not know (GPT-2) on the meta device, as every run did before."""
    pytest.importorskip("transformers")
    from spillway_runtime.meta_shape import ModelConfigError, model_shape, shape_from_config

    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(SMALL["llama3-gqa-128k"]))
    child = subprocess.run([sys.executable, "-c", SHAPE_AND_IMPORTS, str(llama)], capture_output=True, text=True,
                           check=True)
    shape_json, imported = child.stdout.splitlines()
    assert imported == "[]", child.stdout
    counted = ModelShape.model_validate_json(shape_json)
    built = shape_from_config(llama)
    assert counted.tied_embeddings is False and built.tied_embeddings is None  # the config says; the build does not
    assert counted.model_copy(update={"tied_embeddings": None}) == built

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 1000, "n_embd": 64,
                                                  "n_layer": 2, "n_head": 4, "n_positions": 128}))
    with pytest.raises(HFConfigError):
        ModelShape.from_hf_config(json.loads((gpt2 / "config.json").read_text()))
    assert model_shape(gpt2) == shape_from_config(gpt2) and model_shape(gpt2).params > 64 * 1000

    # a config of a known family that transformers refuses is refused before a run, naming the
    # file and transformers' reason (its validator's error is no ValueError)
    (llama / "config.json").write_text(json.dumps({**SMALL["llama-biases"], "hidden_size": 100,
                                                   "num_attention_heads": 3}))
    with pytest.raises(ModelConfigError, match=r"config\.json: transformers cannot build .*hidden size \(100\) is not "
                                               r"a multiple of the number of attention heads \(3\)"):
        model_shape(llama)


# Families whose tensors the shape lists exactly, in order: no biases, two norms a layer, no experts.
EXACT_TENSORS = {"llama3-gqa-128k", "mistral", "gemma-256k-tied"}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_tensors_listed_are_those_deepspeed_cuts_into_sub_groups(name: str) -> None:
    """`ModelShape.tensor_numels` is the order DeepSpeed cuts the optimizer's sub-groups in:
    the model's own tensors for the plain families, and for the others (biases, extra norms,
    experts) the same elements with DeepSpeed's cut at an eighth of the model within one
    sub-group of it."""
    transformers = pytest.importorskip("transformers")
    import torch

    from spillway_runtime.core.estimates import sub_group_cut

    config = transformers.AutoConfig.for_model(**SMALL[name])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    built = tuple(p.numel() for p in model.parameters())  # shared (tied) tensors once
    shape = ModelShape.from_hf_config(SMALL[name])
    listed = shape.tensor_numels()
    assert sum(listed) == sum(built) == shape.params
    if name in EXACT_TENSORS:
        assert listed == built
    size = shape.params // 8
    ours, real = sub_group_cut(shape, 1, size, 0).sizes, _deepspeed_cut(built, size)
    if name in EXACT_TENSORS:
        assert ours == real
    assert abs(len(ours) - len(real)) <= 1
    assert abs(max(ours) - max(real)) <= size
    head = shape.vocab_size * shape.hidden_size
    assert (listed[-1] == head) == (built[-1] == head)  # an output head last where transformers has one


def test_a_tied_moe_has_no_output_head_in_its_sub_groups() -> None:
    """Experts make the count hold more than an embedding beyond the dense tensors, which a
    count alone reads as an untied output head: the config's tie_word_embeddings says there is
    none, and the last tensor is the final norm, as transformers builds it."""
    transformers = pytest.importorskip("transformers")
    import torch

    tied = {**SMALL["mixtral-moe"], "tie_word_embeddings": True, "vocab_size": 1000}  # experts outweigh it
    config = transformers.AutoConfig.for_model(**tied)
    with torch.device("meta"):
        built = tuple(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    shape = ModelShape.from_hf_config(tied)
    listed = shape.tensor_numels()
    assert shape.tied_embeddings and sum(listed) == sum(built) == shape.params
    assert listed[0] == built[0] == shape.vocab_size * shape.hidden_size
    assert listed[-1] == built[-1] == shape.hidden_size
    guessed = shape.model_copy(update={"tied_embeddings": None}).tensor_numels()
    assert guessed[-1] == shape.vocab_size * shape.hidden_size  # what the count alone made of it


def _deepspeed_cut(tensors: tuple[int, ...], size: int) -> tuple[int, ...]:
    """DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups on one rank, as written there."""
    groups, current = [], 0
    for i, n in enumerate(tensors):
        current += n
        if current >= size or i == len(tensors) - 1:
            groups.append(current)
            current = 0
    return tuple(groups)
