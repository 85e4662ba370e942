"""LoRA with PEFT: the adapters' configuration of a job's `method`, and the merged model
written beside an exported adapter. Training (`recipe`) and `spillway export` (`export`)
share them, so that both build the same adapters and write the same bits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spillway_runtime.core.spec import Method

MERGED_DIR = "merged"  # LoRA with export.merge: the merged model, beside the adapter


def lora_config(method: Any) -> Any:
    """PEFT's LoraConfig of a job's `method` (training and `spillway export` alike)."""
    from peft import LoraConfig

    return LoraConfig(r=method.rank, lora_alpha=method.alpha, lora_dropout=method.dropout,
                      target_modules=method.peft_targets, task_type="CAUSAL_LM")


def save_merged(base_dir: Path, adapter: Path, target: Path, dtype: Any, tokenizer: Any) -> None:
    """The base model read again on the CPU, the exported adapter merged in by PEFT, saved with
    the tokenizer (the end of a run and `spillway export` alike: the same bits)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


def with_lora(model: Any, method: Method) -> tuple[Any, int, int]:
    """The model with PEFT's LoRA adapters on `method.targetModules`, everything else frozen,
    and its trainable and total parameter counts. The adapters take the model's dtype
    (DeepSpeed keeps their fp32 masters). Raises PEFT's ValueError for a module it lacks."""
    from peft import get_peft_model

    model = get_peft_model(model, lora_config(method), autocast_adapter_dtype=False)

    def numel(p: Any) -> int:
        return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3 has partitioned the base already

    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    return model, trainable, sum(numel(p) for p in model.parameters())
