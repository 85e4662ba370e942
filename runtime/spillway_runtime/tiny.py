"""Tiny models, tokenizers and datasets made locally, for the demo and the tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on the given
text with the `tokenizers` library, the model a small Llama built from a config
with a fixed seed. The dataset is synthetic arithmetic prose, which a tiny model
learns visibly within a few dozen steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def synthetic_texts(count: int = 2000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        op = rng.choice(["plus", "times", "minus"])
        value = {"plus": a + b, "times": a * b, "minus": a - b}[op]
        texts.append(
            f"Question: what is {_NUMBER_WORDS[a]} {op} {_NUMBER_WORDS[b]}? "
            f"Answer: {a} {op} {b} is {value}. So {_NUMBER_WORDS[a]} {op} {_NUMBER_WORDS[b]} makes {value}."
        )
    return texts


def write_dataset(path: Path, count: int = 2000, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for text in synthetic_texts(count, seed):
            fh.write(json.dumps({"text": text}) + "\n")
    return path


def write_chat_dataset(path: Path, count: int = 2000, seed: int = 0) -> Path:
    """The same arithmetic as `write_dataset`, as chat records: the user asks, the assistant answers."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for _ in range(count):
            a, b = rng.randint(0, 10), rng.randint(0, 10)
            op = rng.choice(["plus", "times", "minus"])
            value = {"plus": a + b, "times": a * b, "minus": a - b}[op]
            messages = [{"role": "system", "content": "Answer with the number."},
                        {"role": "user", "content": f"what is {_NUMBER_WORDS[a]} {op} {_NUMBER_WORDS[b]}?"},
                        {"role": "assistant", "content": f"{a} {op} {b} is {value}."}]
            fh.write(json.dumps({"messages": messages}) + "\n")
    return path


def tiny_llama_config(hidden_size: int = 128, layers: int = 4, heads: int = 4, vocab_size: int = 512,
                      **extra: Any) -> Any:
    """The tiny models' `LlamaConfig` (`build_tiny_model`'s; `engine_probe`'s micro model is the
    default one, bench_offload_overhead's --model tiny: 39 tensors, 0.75M parameters)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **extra,
    )


def build_tiny_model(
    out_dir: Path,
    *,
    texts: list[str] | None = None,
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """A Llama-architecture causal LM and its tokenizer in Hugging Face format."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = texts or synthetic_texts(500, seed)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.save_pretrained(out_dir)

    torch.manual_seed(seed)
    config = tiny_llama_config(hidden_size, layers, heads, len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
