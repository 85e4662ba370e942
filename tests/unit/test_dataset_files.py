"""The data formats users keep: Parquet, Arrow, gzip'ed JSON lines and text, and folders that
Hugging Face `datasets` saved read as the same records as JSON lines (written here by pyarrow and by `datasets` itself, not
by us), and a bad row or file refused by name."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet
import pytest

from spillway_runtime.core.spec_inputs import DatasetSource
from spillway_runtime.training.data import PackedDataset, dataset_fingerprint, read_documents, read_pairs, read_texts
from spillway_runtime.training.dataset_files import DatasetError, dataset_files

from .conftest import write_jsonl

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHATS = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                       {"role": "assistant", "content": f"{2 * i}."}]} for i in range(7)]
TEXTS = [{"text": f"document number {i} says something about {i * 3}", "source": "web"} for i in range(9)]
PAIRS = [{"prompt": f"Add {i} and 1.", "chosen": f" {i + 1}", "rejected": f" {i + 2}"} for i in range(5)]


def parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int = 3) -> Path:
    pyarrow.parquet.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def saved_dataset(path: Path, rows: list[dict[str, Any]], **splits: list[dict[str, Any]]) -> Path:
    """A folder as `datasets`' save_to_disk writes it: one Dataset, or a DatasetDict of `splits`."""
    import datasets

    if splits:
        datasets.DatasetDict({name: datasets.Dataset.from_list(r) for name, r in splits.items()}).save_to_disk(path)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(path, num_shards=2)
    return path


def test_chat_records_from_parquet_and_a_datasets_folder_are_the_jsonl_s(tokenizer: Any, tmp_path: Path) -> None:
    source = DatasetSource(uri="x", format="chat", chatTemplate=TEMPLATE)
    want = list(read_documents(source, write_jsonl(tmp_path / "chat.jsonl", CHATS), tokenizer, 64))
    assert len(want) == len(CHATS)
    (tmp_path / "pq").mkdir()
    parquet(tmp_path / "pq" / "part-0.parquet", CHATS[:4])
    parquet(tmp_path / "pq" / "part-1.parquet", CHATS[4:])
    for uri in (tmp_path / "pq", saved_dataset(tmp_path / "ds", CHATS),
                saved_dataset(tmp_path / "dd", [], train=CHATS, test=CHATS[:1])):
        assert list(read_documents(source, uri, tokenizer, 64)) == want, uri


def test_text_and_preference_records_read_the_same_from_every_format(tokenizer: Any, tmp_path: Path) -> None:
    jsonl = DatasetSource(uri="x", format="jsonl")
    want = list(read_texts(jsonl, write_jsonl(tmp_path / "t.jsonl", TEXTS)))
    assert list(read_texts(jsonl, parquet(tmp_path / "t.parquet", TEXTS))) == want
    assert list(read_texts(DatasetSource(uri="x"), saved_dataset(tmp_path / "t-ds", TEXTS))) == want  # format auto
    table = pa.Table.from_pylist(TEXTS)
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pyarrow.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=4)  # the IPC file format, as pyarrow writes it
    assert list(read_texts(jsonl, tmp_path / "t.arrow")) == want
    packed = PackedDataset.build(read_texts(jsonl, tmp_path / "t.parquet"), tokenizer, 16)
    assert np.array_equal(packed.tokens, PackedDataset.build(want, tokenizer, 16).tokens)

    preference = DatasetSource(uri="x", format="preference")
    pairs = list(read_pairs(preference, write_jsonl(tmp_path / "p.jsonl", PAIRS), tokenizer, 64))
    assert list(read_pairs(preference, parquet(tmp_path / "p.parquet", PAIRS), tokenizer, 64)) == pairs
    assert list(read_pairs(preference, saved_dataset(tmp_path / "p-ds", PAIRS), tokenizer, 64)) == pairs


def test_a_datasets_folder_is_read_as_datasets_reads_it(tmp_path: Path) -> None:
    one = saved_dataset(tmp_path / "one", TEXTS)
    assert [p.name for p in dataset_files(one, "auto")] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    both = saved_dataset(tmp_path / "both", [], train=TEXTS, validation=TEXTS[:2])
    assert {p.parent.name for p in dataset_files(both, "jsonl")} == {"train"}
    no_train = saved_dataset(tmp_path / "no-train", [], test=TEXTS)
    with pytest.raises(DatasetError, match=r"without a 'train' split \(it has test\); point dataset.uri at the "
                                           r"split's folder, e.g. .*no-train/test"):
        dataset_files(no_train, "jsonl")


def test_a_bad_row_or_file_is_refused_by_file_and_row(tokenizer: Any, tmp_path: Path) -> None:
    rows = [*TEXTS[:4], {"text": None, "source": "web"}, *TEXTS[4:]]
    data = parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DatasetError, match=r"bad\.parquet: row 5: field 'text' is NoneType, not text"):
        list(read_texts(DatasetSource(uri="x", format="jsonl"), data))
    with pytest.raises(DatasetError, match=r"bad\.parquet: row 1: no field 'body'; set dataset.textField"):
        list(read_texts(DatasetSource(uri="x", format="jsonl", textField="body"), data))

    chats = [*CHATS[:2], {"messages": None}, *CHATS[2:]]
    chat = DatasetSource(uri="x", format="chat", chatTemplate=TEMPLATE)
    with pytest.raises(DatasetError, match=r"chats\.parquet: row 3: .*fix the record, or set dataset.onBadRecord: skip"):
        list(read_documents(chat, parquet(tmp_path / "chats.parquet", chats), tokenizer, 64))
    skipped = read_documents(chat.model_copy(update={"on_bad_record": "skip"}), tmp_path / "chats.parquet", tokenizer, 64)
    assert len(list(skipped)) == len(CHATS) and skipped.skipped == 1 and "row 3" in str(skipped.first_skipped)

    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match=r"broken\.parquet: cannot be read as Parquet .*convert it to JSON lines"):
        list(read_texts(DatasetSource(uri="x", format="jsonl"), tmp_path / "broken.parquet"))


def gzipped(path: Path) -> Path:
    """`path` compressed as `gzip -k` would, beside it."""
    target = path.with_name(path.name + ".gz")
    with path.open("rb") as src, gzip.open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return target


def test_gzipped_json_lines_and_text_and_a_folder_of_mixed_shards_read_as_uncompressed(
        tokenizer: Any, tmp_path: Path) -> None:
    jsonl = DatasetSource(uri="x", format="jsonl")
    plain = write_jsonl(tmp_path / "t.jsonl", TEXTS)
    want = list(read_texts(jsonl, plain))
    assert list(read_texts(jsonl, gzipped(plain))) == want
    assert list(read_texts(DatasetSource(uri="x"), tmp_path / "t.jsonl.gz")) == want  # format auto

    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "part-0.jsonl", TEXTS[:3])
    gzipped(write_jsonl(shards / "part-1.jsonl", TEXTS[3:6])).rename(shards / "part-1.jsonl.gz")
    (shards / "part-1.jsonl").unlink()
    parquet(shards / "part-2.parquet", TEXTS[6:])
    assert [p.name for p in dataset_files(shards, "jsonl")] == ["part-0.jsonl", "part-1.jsonl.gz", "part-2.parquet"]
    assert list(read_texts(jsonl, shards)) == want

    text = tmp_path / "book.txt"
    text.write_text("A first paragraph.\n\nA second one.\n")
    assert list(read_texts(DatasetSource(uri="x", format="text"), gzipped(text))) == ["A first paragraph.", "A second one.\n"]
    assert list(read_texts(DatasetSource(uri="x"), tmp_path / "book.txt.gz")) == list(read_texts(DatasetSource(uri="x"), text))

    preference = DatasetSource(uri="x", format="preference")
    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    assert (list(read_pairs(preference, gzipped(pairs), tokenizer, 64))
            == list(read_pairs(preference, pairs, tokenizer, 64)))


def test_a_damaged_gzip_file_is_refused_by_name(tmp_path: Path) -> None:
    whole = gzipped(write_jsonl(tmp_path / "t.jsonl", TEXTS)).read_bytes()
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DatasetError, match=r"cut\.jsonl\.gz: cannot be read as gzip .*compress it again"):
        list(read_texts(DatasetSource(uri="x", format="jsonl"), tmp_path / "cut.jsonl.gz"))
    (tmp_path / "not.txt.gz").write_bytes(b"plain text, never compressed")
    with pytest.raises(DatasetError, match=r"not\.txt\.gz: cannot be read as gzip"):
        list(read_texts(DatasetSource(uri="x", format="text"), tmp_path / "not.txt.gz"))


def test_the_token_cache_follows_a_parquet_file(model_dir: Path, tmp_path: Path) -> None:
    source = DatasetSource(uri="x", format="jsonl")
    data = parquet(tmp_path / "t.parquet", TEXTS)
    before = dataset_fingerprint(source, data, model_dir, 32)
    parquet(data, TEXTS[:5])
    assert dataset_fingerprint(source, data, model_dir, 32) != before
