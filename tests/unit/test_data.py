"""Tokenizing, packing and the token cache, with a real (locally trained) tokenizer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillway_runtime.core.spec_inputs import DatasetSource
from spillway_runtime.tiny import build_tiny_model, synthetic_texts, write_dataset
from spillway_runtime.training.data import DatasetError, PackedDataset, dataset_fingerprint, read_texts, token_cache_path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", hidden_size=32, layers=1, heads=2)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_packing_is_every_text_then_eos_cut_into_rows(tokenizer: Any) -> None:
    texts = synthetic_texts(2500)  # more than one tokenizer batch
    reference: list[int] = []
    for text in texts:
        reference += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    packed = PackedDataset.build(texts, tokenizer, 64)
    rows = len(reference) // 64
    assert packed.rows.dtype == np.uint32 and packed.rows.shape == (rows, 64)
    assert packed.tokens == rows * 64
    assert packed.rows.reshape(-1).tolist() == reference[: rows * 64]


def test_texts_kept_apart_are_whole_documents_and_a_long_one_is_cut(tokenizer: Any) -> None:
    """dataset.textPacking: apart: each text and its EOS a document, packed whole in order,
    one longer than a row cut into row-long pieces; nothing is learned across a boundary."""
    texts = ["one two three", "four five", "six seven eight nine ten eleven twelve thirteen fourteen fifteen"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    length = max(len(ids[0]) + len(ids[1]), 4)
    assert len(ids[2]) > length  # the third is cut
    packed = PackedDataset.build_text_documents(texts, tokenizer, length)
    pieces = [ids[2][at:at + length] for at in range(0, len(ids[2]), length)]
    pieces = [p for p in pieces if len(p) > 1]
    assert len(packed) == 1 + len(pieces) and packed.tokens == len(ids[0]) + len(ids[1]) + sum(map(len, pieces))
    assert packed.rows[0].tolist() == ids[0] + ids[1]
    assert packed.meta[0, 1].tolist() == [1] * len(ids[0]) + [2] * len(ids[1])
    assert packed.meta[0, 0].tolist() == [0] + [1] * (len(ids[0]) - 1) + [0] + [1] * (len(ids[1]) - 1)
    assert [packed.rows[1 + i, :len(p)].tolist() for i, p in enumerate(pieces)] == pieces


def test_a_batch_of_texts_kept_apart_has_the_texts_loss_one_by_one(model_dir: Path, tokenizer: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM


    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = ["the cat sat on the mat", "two plus two is four", "a b c d e"]
    packed = PackedDataset.build_text_documents(texts, tokenizer, 64)
    assert len(packed) == 1
    batch = packed.micro_batch(0, rank=0, world_size=1, micro_batch_size=1, seed=0)
    with torch.no_grad():
        together = model(**batch).loss.item()
        sums, counts = 0.0, 0
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            one = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids]))
            sums += one.loss.item() * (len(ids) - 1)
            counts += len(ids) - 1
        joined = PackedDataset.build(texts * 4, tokenizer, 64).micro_batch(0, 0, 1, 1, seed=0)
        leaky = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
    assert together == pytest.approx(sums / counts, rel=1e-5)  # each text alone, as if unpacked
    assert abs(leaky - together) > 1e-3 and "attention_mask" not in joined  # joined: one causal run


def test_text_packing_is_a_text_setting_and_keys_the_cache(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"textPacking applies to formats text, jsonl and auto, not 'chat'"):
        DatasetSource(uri="x", format="chat", textPacking="apart")
    data = write_dataset(tmp_path / "d.jsonl", count=20)
    joined = dataset_fingerprint(DatasetSource(uri="x", format="jsonl"), data, model_dir, 32)
    assert dataset_fingerprint(DatasetSource(uri="x", format="jsonl", textPacking="apart"), data, model_dir, 32) != joined


def test_too_little_text_names_the_setting_to_change(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match=r"lower training\.sequenceLength"):
        PackedDataset.build(["two words"], tokenizer, 4096)


def test_cache_round_trip_is_mapped_and_batches_match(tokenizer: Any, tmp_path: Path) -> None:
    packed = PackedDataset.build(synthetic_texts(300), tokenizer, 32)
    old = token_cache_path(tmp_path, "old")
    old.write_bytes(b"stale")
    old.with_suffix(".ids").write_bytes(b"stale")
    path = token_cache_path(tmp_path, "new")
    packed.save(path)
    # the stale cache and the temp files gone: the index and its tokens (no meta for joined texts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens-new.ids", "tokens-new.json"]
    loaded = PackedDataset.load(path)
    assert isinstance(loaded.rows, np.memmap) and not loaded.rows.flags.writeable
    assert loaded.tokens == packed.tokens and np.array_equal(loaded.rows, packed.rows)
    for index in (0, 7, len(packed) // 2):  # the third wraps into the second epoch
        a = packed.micro_batch(index, rank=1, world_size=2, micro_batch_size=4, seed=3)["input_ids"]
        b = loaded.micro_batch(index, rank=1, world_size=2, micro_batch_size=4, seed=3)["input_ids"]
        assert str(a.dtype) == "torch.int64" and a.shape == (4, 32)
        assert a.equal(b)


def test_fingerprint_follows_what_the_tokens_depend_on(model_dir: Path, tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "train.jsonl", count=50)
    source = DatasetSource(uri=str(data))
    first = dataset_fingerprint(source, data, model_dir, 64)
    assert dataset_fingerprint(source, data, model_dir, 64) == first
    assert dataset_fingerprint(source, data, model_dir, 128) != first
    assert dataset_fingerprint(DatasetSource(uri=str(data), textField="body"), data, model_dir, 64) != first
    with data.open("a") as fh:
        fh.write('{"text": "one more"}\n')
    assert dataset_fingerprint(source, data, model_dir, 64) != first
    second = dataset_fingerprint(source, data, model_dir, 64)
    tokenizer_file = model_dir / "tokenizer.json"
    saved = tokenizer_file.read_bytes()
    try:
        tokenizer_file.write_bytes(saved.replace(b'"</s>"', b'"</eos>"', 1))
        assert dataset_fingerprint(source, data, model_dir, 64) != second
    finally:
        tokenizer_file.write_bytes(saved)
    os.utime(data, ns=(0, 0))
    assert dataset_fingerprint(source, data, model_dir, 64) != second
    assert len(list(read_texts(source, data))) == 51


@pytest.mark.parametrize(("content", "message"), [
    (b'{"text": "ok"}\n{"text": \n', "bad.jsonl:2: not valid JSON"),
    (b'{"body": "ok"}\n', "bad.jsonl:1: no field 'text'; set dataset.textField"),
    (b'{"text": 3}\n', "bad.jsonl:1: field 'text' is int, not text"),
    (b"", "no text found"),
], ids=["a line that is not JSON", "a line without the text field", "a text that is a number", "an empty file"])
def test_a_malformed_jsonl_dataset_is_refused_naming_file_and_line(tmp_path: Path, content: bytes,
                                                                   message: str) -> None:
    """What `spillway run` reports with exit 2 (the path from here to the exit code is
    tests/integration/test_run_bad_input.py's)."""
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(DatasetError) as err:
        list(read_texts(DatasetSource(uri=str(tmp_path / "bad.jsonl")), tmp_path / "bad.jsonl"))
    assert message in str(err.value)


@pytest.mark.parametrize("fmt", ["jsonl", "text"])
def test_a_file_that_is_not_utf8_is_refused_with_file_line_and_byte(tmp_path: Path, fmt: str) -> None:
    name = "data.jsonl" if fmt == "jsonl" else "data.txt"
    good = '{"text": "fine"}\n' if fmt == "jsonl" else "fine\n\n"
    bad = '{"text": "caf\u00e9"}\n' if fmt == "jsonl" else "caf\u00e9\n"
    (tmp_path / name).write_bytes(good.encode() + bad.encode("latin-1"))
    where = f"{name}:2" if fmt == "jsonl" else name
    with pytest.raises(DatasetError, match=rf"{where}: not UTF-8 \(byte 0xe9 at offset \d+\); re-encode"):
        list(read_texts(DatasetSource(uri=str(tmp_path / name), format=fmt), tmp_path / name))


def test_held_out_rows_are_never_trained_on_and_the_split_is_fixed_by_the_seed(tokenizer: Any) -> None:
    packed = PackedDataset.build(synthetic_texts(300), tokenizer, 32)
    train, held = packed.split(0.1, seed=5)
    assert len(held) == round(len(packed) * 0.1) and len(train) + len(held) == len(packed)
    assert set(train.index.tolist()).isdisjoint(held.index.tolist())
    again = packed.split(0.1, seed=5)[1]
    assert again.index.tolist() == held.index.tolist()
    assert packed.split(0.1, seed=6)[1].index.tolist() != held.index.tolist()
    seen = set()
    for i in range(3 * len(train)):  # three epochs of training batches
        rows = train.micro_batch(i, rank=0, world_size=1, micro_batch_size=1, seed=1)["input_ids"]
        seen.add(tuple(rows[0].tolist()))
    held_rows = {tuple(packed.rows[r].astype("int64").tolist()) for r in held.index}
    assert seen.isdisjoint(held_rows) and len(seen) == len(train)
    with pytest.raises(DatasetError, match="leaves none to train on"):
        PackedDataset(rows=np.zeros((1, 8), dtype=np.uint32), tokens=8).split(0.5, seed=1)


def test_an_evaluation_batch_past_the_end_counts_nothing(tokenizer: Any) -> None:
    packed = PackedDataset.build(synthetic_texts(300), tokenizer, 32)
    _, held = packed.split(0.05, seed=1)
    n = len(held)
    per = 2 * 3  # world size 2, micro-batch 3
    last = (n - 1) // per
    counted = 0
    for index in range(last + 1):
        for rank in (0, 1):
            labels = held.eval_batch(index, rank, 2, 3)["labels"]
            counted += int((labels[:, 0] != -100).sum())
    assert counted == n  # every held-out row once, the repeats none


def test_a_mixture_takes_weight_times_each_sources_rows_chosen_by_the_seed() -> None:
    """dataset.mixture: each source packed on its own; weight 1 is each row once, 2 each twice,
    0.5 a seeded half without repeats, 1.5 each once and a seeded half again; meta comes along."""
    def part(first: int, rows: int, meta: bool = False) -> PackedDataset:
        tokens = np.arange(first, first + rows * 4, dtype=np.uint32).reshape(rows, 4)
        extra = np.stack([np.ones_like(tokens), np.full_like(tokens, 1)], axis=1) if meta else None
        return PackedDataset(rows=tokens, tokens=int(tokens.size), meta=extra)

    a, b, c = part(0, 10), part(1000, 8), part(5000, 4)
    mixed = PackedDataset.mixed([(a, 1.0), (b, 0.5), (c, 2.0)], seed=3)
    firsts = [int(r[0]) for r in mixed.rows]
    from_a = [f for f in firsts if f < 1000]
    from_b = [f for f in firsts if 1000 <= f < 5000]
    from_c = [f for f in firsts if f >= 5000]
    assert from_a == [int(r[0]) for r in a.rows]  # each row once, in order
    assert len(from_b) == 4 and len(set(from_b)) == 4  # half of 8, no repeats
    assert sorted(from_c) == sorted([int(r[0]) for r in c.rows] * 2)
    assert len(mixed) == 10 + 4 + 8 and mixed.tokens == mixed.rows.size
    again = PackedDataset.mixed([(a, 1.0), (b, 0.5), (c, 2.0)], seed=3)
    other = [PackedDataset.mixed([(a, 1.0), (b, 0.5), (c, 2.0)], seed=s) for s in range(4, 9)]
    assert np.array_equal(again.rows, mixed.rows) and any(not np.array_equal(o.rows, mixed.rows) for o in other)
    one_and_a_half = PackedDataset.mixed([(b, 1.5)], seed=0)
    counts = np.unique(one_and_a_half.rows[:, 0], return_counts=True)[1]
    assert len(one_and_a_half) == 12 and sorted(counts.tolist()) == [1] * 4 + [2] * 4

    documents = PackedDataset.mixed([(part(0, 3, meta=True), 1.0), (part(100, 2, meta=True), 1.0)], seed=0)
    assert documents.meta is not None and documents.meta.shape == (5, 2, 4) and documents.tokens == 20
    with pytest.raises(DatasetError, match=r"every source must be in dataset\.format's shape"):
        PackedDataset.mixed([(part(0, 3, meta=True), 1.0), (part(100, 2), 1.0)], seed=0)


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64, 1 << 20])
def test_a_text_file_read_a_block_at_a_time_gives_the_paragraphs_of_the_whole(tmp_path: Path, block: int) -> None:
    """.txt is read in blocks (`paragraphs`): whatever the block size, its paragraphs are the
    whole file's split at blank lines, a character of several bytes cut by a block boundary
    included; a byte that is not UTF-8 is named at its offset in the file."""
    import gzip

    from spillway_runtime.training.dataset_files import paragraphs

    text = "caf\u00e9 \u4e2d\u6587\n\nsecond\n\n\nthird \U0001f600 line\nstill third\n\n\n\n  \n\nlast\n"
    want = [chunk for chunk in text.split("\n\n") if chunk.strip()]
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "t.txt.gz", "wt", encoding="utf-8") as fh:
        fh.write(text)
    assert list(paragraphs(tmp_path / "t.txt", block)) == want
    assert list(paragraphs(tmp_path / "t.txt.gz", block)) == want
    bad = text.encode()[:40] + b"\xff" + text.encode()[40:]
    (tmp_path / "bad.txt").write_bytes(bad)
    with pytest.raises(DatasetError, match=r"bad\.txt: not UTF-8 \(byte 0xff at offset 40\)"):
        list(paragraphs(tmp_path / "bad.txt", block))


def test_a_dataset_streamed_into_its_cache_equals_one_built_in_memory(model_dir: Path, tokenizer: Any,
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache is written a chunk of rows at a time (here 3 rows, so that every format spans
    many chunks): texts joined and kept apart, and a mixture of them (through the parts folder,
    removed after), map to the rows, meta and token count that the same build in memory has."""
    from spillway_runtime.training import packing
    from spillway_runtime.training.data import tokenize_sources

    monkeypatch.setattr(packing, "ROWS_PER_CHUNK", 3)
    texts = synthetic_texts(500)
    data = write_dataset(tmp_path / "train.jsonl", count=500)
    other = write_dataset(tmp_path / "other.jsonl", count=120, seed=9)
    for packing_mode, build in (("joined", PackedDataset.build), ("apart", PackedDataset.build_text_documents)):
        source = DatasetSource(uri=str(data), textPacking=packing_mode)
        cache = tmp_path / packing_mode / "tokens-x.json"
        streamed, built = tokenize_sources(source, [(data, 1.0, "spec.dataset.uri")], tokenizer, 32, 0, cache)
        memory = build(texts, tokenizer, 32)
        assert isinstance(streamed.rows, np.memmap) and built.startswith("500 texts tokenized")
        assert np.array_equal(streamed.rows, memory.rows) and streamed.tokens == memory.tokens
        assert (streamed.meta is None) == (memory.meta is None) == (packing_mode == "joined")
        if memory.meta is not None:
            assert np.array_equal(streamed.meta, memory.meta)

        sources = [(data, 1.0, "spec.dataset.uri"), (other, 0.5, "spec.dataset.mixture[0].uri")]
        mixed, built = tokenize_sources(source, sources, tokenizer, 32, 4, tmp_path / f"mix-{packing_mode}" / "tokens-m.json")
        want = PackedDataset.mixed([(memory, 1.0), (build(synthetic_texts(120, seed=9), tokenizer, 32), 0.5)], seed=4)
        assert np.array_equal(mixed.rows, want.rows) and mixed.tokens == want.tokens and "in all" in built
        assert sorted(p.name for p in (tmp_path / f"mix-{packing_mode}").iterdir()) == (
            ["tokens-m.ids", "tokens-m.json"] + (["tokens-m.meta"] if packing_mode == "apart" else []))
