"""Model shape from a Hugging Face `config.json`, without loading weights.

`model_shape` is what `spillway run` and `spillway plan` use: arithmetic from the config
(`ModelShape.from_hf_config`, as the operator plans a cluster job) for every family
`core.param_counts` knows, and otherwise `shape_from_config`, which instantiates the model
on torch's meta device, so a 70B config costs no memory, and counts parameters per module to
find DeepSpeed's "largest layer". That one imports torch and transformers (lazily: the
planner itself does not need them), about 4 s of CPU before anything else happens.
"""

from __future__ import annotations

import json
from pathlib import Path

from spillway_runtime.core.param_counts import HFConfigError
from spillway_runtime.core.planner import ModelShape


class ModelConfigError(ValueError):
    pass


def _read_config(model_dir: Path) -> dict[str, object]:
    config_path = model_dir / "config.json" if model_dir.is_dir() else model_dir
    if not config_path.is_file():
        raise ModelConfigError(
            f"{config_path}: no config.json; model.uri must point at a Hugging Face model directory"
        )
    try:
        data = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelConfigError(f"{config_path}: missing model_type; is this a Hugging Face config.json?")
    return data


def model_shape(model_dir: str | Path) -> ModelShape:
    """The planner's shape of the model in `model_dir` (or of that config.json): counted from
    the config where its family is one `param_counts` knows (the unit tests hold the count
    equal to the model transformers builds, family by family), built on the meta device where
    it is not, or where a key the count needs is missing or odd (transformers then says
    whether it can build the model at all)."""
    path = Path(model_dir)
    raw = _read_config(path)
    try:
        return ModelShape.from_hf_config(raw, name=str(raw.get("_name_or_path") or path.name or "model"))
    except HFConfigError:
        return shape_from_config(path)


def shape_from_config(model_dir: str | Path) -> ModelShape:
    """Count parameters and find the largest module on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_dir)
    raw = _read_config(path)
    config_path = path / "config.json" if path.is_dir() else path
    try:
        config = AutoConfig.from_pretrained(str(config_path.parent))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as err:  # huggingface_hub's StrictDataclassError is no ValueError
        # transformers' own words, which name neither the file nor what to change (a config
        # class's validator says what it refused on the last of its lines).
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        first = (lines[-1] if len(lines) > 1 and "validation error" in lines[0] else lines[0]) if lines else (
            type(err).__name__)
        raise ModelConfigError(
            f"{config_path}: transformers cannot build a causal language model from it ({first}); "
            "model.uri must point at a Hugging Face causal LM directory"
        ) from None
    seen: set[int] = set()
    total = 0
    largest_param = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        largest_param = max(largest_param, p.numel())
    # DeepSpeed's L: the largest leaf-ish module's own parameters (an embedding, an MLP).
    largest_layer = 0
    for module in model.modules():
        own = sum(p.numel() for p in module.parameters(recurse=False))
        children = list(module.children())
        if children and own == 0:
            # A container (decoder layer): count its direct leaves together, as ZeRO-3
            # gathers a whole layer's parameters for its forward.
            own = sum(p.numel() for p in module.parameters()) if not any(
                list(c.children()) for c in children
            ) else 0
        largest_layer = max(largest_layer, own)
    # What a LoRA adapter on each linear layer name costs (PEFT's all-linear skips the output head).
    linear_in_out: dict[str, int] = {}
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            leaf = name.rsplit(".", 1)[-1]
            linear_in_out[leaf] = linear_in_out.get(leaf, 0) + module.in_features + module.out_features
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text_cfg, "hidden_size", 0) or 1)
    return ModelShape(
        name=str(raw.get("_name_or_path") or path.name or "model"),
        params=total,
        largest_layer_params=max(largest_layer, largest_param),
        largest_param_numel=largest_param,
        hidden_size=hidden,
        num_layers=int(getattr(text_cfg, "num_hidden_layers", 0) or 1),
        vocab_size=int(getattr(text_cfg, "vocab_size", 0) or 1),
        num_attention_heads=int(getattr(text_cfg, "num_attention_heads", 0) or 1),
        linear_in_out=linear_in_out,
    )
