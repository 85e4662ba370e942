"""Chat and completion data: what is learned (assistant turns, the completion) and what is
context, documents packed without seeing each other, malformed records named by file:line,
and the token cache keyed by every setting that changes the tokens. Real tokenizer, real
tiny Llama on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillway_runtime.core.spec_inputs import DatasetSource
from spillway_runtime.training.data import (
    DatasetError,
    PackedDataset,
    dataset_fingerprint,
    document_inputs,
    read_documents,
    token_cache_path,
)

from .conftest import write_jsonl

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT = {"messages": [{"role": "system", "content": "You add numbers."},
                     {"role": "user", "content": "What is 2 plus 3?"},
                     {"role": "assistant", "content": "2 plus 3 is 5."},
                     {"role": "user", "content": "And 4 plus 4?"},
                     {"role": "assistant", "content": "8."}]}


def _chat(**extra: Any) -> DatasetSource:
    return DatasetSource(uri="x", format="chat", chatTemplate=TEMPLATE, **extra)


def _learned(tokenizer: Any, ids: list[int], learn: list[int]) -> list[str]:
    """The learned spans, decoded."""
    spans, current = [], []
    for token, flag in zip(ids, learn, strict=True):
        if flag:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def test_chat_learns_the_assistants_turns_only(tokenizer: Any, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    [(ids, learn)] = list(read_documents(_chat(), data, tokenizer, 512))
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CHAT["messages"], tokenize=False)
    assert _learned(tokenizer, ids, learn) == ["2 plus 3 is 5.<|end|>\n", "8.<|end|>\n"]


def test_completion_learns_the_completion_and_its_end(tokenizer: Any, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"question": "Capital of France?", "answer": " Paris"}])
    source = DatasetSource(uri="x", format="completion", promptField="question", completionField="answer")
    [(ids, learn)] = list(read_documents(source, data, tokenizer, 512))
    assert _learned(tokenizer, ids, learn) == [" Paris</s>"]
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.decode(ids[: learn.index(1)]) == "Capital of France?"


BAD = [
    ({"text": "hi"}, "chat", "no field 'messages'; set dataset.messagesField"),
    ({"messages": []}, "chat", "field 'messages' is not a non-empty list"),
    ({"messages": [{"role": "robot", "content": "beep"}]}, "chat", "messages[0].role is 'robot'"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "chat", "messages[0].content is list, not text"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "chat", "no assistant message"),
    ({"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]}, "chat",
     "nothing to learn within training.sequenceLength (256 tokens)"),
    ("{not json", "chat", "not valid JSON"),
    ({"prompt": "p"}, "completion", "no field 'completion' (set dataset.completionField"),
    ({"prompt": 3, "completion": "c"}, "completion", "field 'prompt' is int, not text"),
    ({"prompt": "p", "completion": "  "}, "completion", "field 'completion' is empty"),
]


@pytest.mark.parametrize(("record", "fmt", "message"), BAD, ids=[m for _, _, m in BAD])
def test_a_malformed_record_is_named_by_file_and_line(tokenizer: Any, tmp_path: Path, record: Any, fmt: str,
                                                       message: str) -> None:
    good = CHAT if fmt == "chat" else {"prompt": "p", "completion": " c"}
    data = write_jsonl(tmp_path / "d.jsonl", [good, record, good])
    source = _chat() if fmt == "chat" else DatasetSource(uri="x", format=fmt)
    with pytest.raises(DatasetError) as err:
        list(read_documents(source, data, tokenizer, 256))
    assert str(err.value).startswith(f"{data}:2: ") and message in str(err.value)
    assert str(err.value).endswith("or set dataset.onBadRecord: skip")
    skipping = source.model_copy(update={"on_bad_record": "skip"})
    read = read_documents(skipping, data, tokenizer, 256)
    assert (len(list(read)), read.skipped) == (2, 1) and read.first_skipped and message in read.first_skipped


def test_a_tokenizer_without_a_template_and_a_template_that_rewrites_turns_are_refused(
        tokenizer: Any, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    with pytest.raises(DatasetError, match=r"no chat template; give one in dataset\.chatTemplate"):
        read_documents(DatasetSource(uri="x", format="chat"), data, tokenizer, 512)
    rewrites = "{% for m in messages %}{{ m.content }} ({{ loop.length }} turns)\n{% endfor %}"
    with pytest.raises(DatasetError, match="rewrites earlier turns"):
        list(read_documents(DatasetSource(uri="x", format="chat", chatTemplate=rewrites), data, tokenizer, 512))


def test_documents_pack_whole_and_apart_or_one_per_row(tokenizer: Any) -> None:
    docs = [([5, 6, 7], [0, 1, 1]), ([8, 9], [0, 1]), ([10, 11, 12, 13], [0, 0, 1, 1])]
    packed = PackedDataset.build_documents(docs, pad_id=0, sequence_length=6, packing=True)
    assert packed.rows.tolist() == [[5, 6, 7, 8, 9, 0], [10, 11, 12, 13, 0, 0]]
    assert packed.meta[:, 1].tolist() == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]]
    assert packed.tokens == 9
    inputs = document_inputs(*(__import__("torch").from_numpy(a.astype("int64")) for a in
                               (packed.rows, packed.meta[:, 0], packed.meta[:, 1])))
    assert inputs["labels"].tolist() == [[-100, 6, 7, -100, 9, -100], [-100, -100, 12, 13, -100, -100]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    mask = inputs["attention_mask"][0, 0].int().tolist()
    assert mask[4] == [0, 0, 0, 1, 1, 0] and mask[2] == [1, 1, 1, 0, 0, 0] and mask[5] == [0, 0, 0, 0, 0, 1]
    single = PackedDataset.build_documents(docs, pad_id=0, sequence_length=6, packing=False)
    assert single.rows.tolist() == [[5, 6, 7, 0, 0, 0], [8, 9, 0, 0, 0, 0], [10, 11, 12, 13, 0, 0]]


def test_a_packed_batchs_loss_is_the_documents_loss_one_by_one(model_dir: Path, tokenizer: Any,
                                                                tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    records = [{"prompt": f"{a} plus {b} is", "completion": f" {a + b}"} for a, b in [(2, 3), (10, 7), (40, 4)]]
    records.append({"messages": []})  # skipped: a bad record changes nothing for the others
    data = write_jsonl(tmp_path / "pairs.jsonl", records)
    read = read_documents(DatasetSource(uri="x", format="completion", onBadRecord="skip"), data, tokenizer, 64)
    packed = PackedDataset.build_documents(read, tokenizer.pad_token_id, 64, packing=True)
    assert len(packed) == 1  # all three in one row
    batch = packed.micro_batch(0, rank=0, world_size=1, micro_batch_size=1, seed=0)
    with torch.no_grad():
        together = model(**batch).loss.item()
        sums, counts = 0.0, 0
        for ids, learn in read:
            one = document_inputs(torch.tensor([ids]), torch.tensor([[0, *learn[1:]]]),
                                  torch.ones(1, len(ids), dtype=torch.long))
            n = int((one["labels"][0, 1:] != -100).sum())
            sums += model(**one).loss.item() * n
            counts += n
    assert together == pytest.approx(sums / counts, rel=1e-5)
    # Without the mask the documents would see each other: the loss differs.
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
    assert abs(leaky - together) > 1e-3


def test_the_cache_keeps_masks_and_follows_the_settings(model_dir: Path, tokenizer: Any, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", [CHAT] * 3)
    source = _chat()
    read = read_documents(source, data, tokenizer, 128)
    packed = PackedDataset.build_documents(read, tokenizer.pad_token_id, 128, packing=True)
    path = token_cache_path(tmp_path / "cache", dataset_fingerprint(source, data, model_dir, 128))
    packed.save(path)
    loaded = PackedDataset.load(path)
    assert np.array_equal(loaded.meta, packed.meta) and loaded.tokens == packed.tokens
    a = packed.micro_batch(0, 0, 1, 1, seed=1)
    b = loaded.micro_batch(0, 0, 1, 1, seed=1)
    assert all(a[k].equal(b[k]) for k in a)
    first = dataset_fingerprint(source, data, model_dir, 128)
    for changed in (_chat(packing=False), _chat(onBadRecord="skip"), _chat(messagesField="conversation"),
                    DatasetSource(uri="x", format="chat", chatTemplate=TEMPLATE.replace("<|end|>", "<|eot|>"))):
        assert dataset_fingerprint(changed, data, model_dir, 128) != first
