"""Tokens packed into rows, a chunk of rows at a time, and the token cache those chunks are
appended to.

Where this sits: under `data`, which reads the records, chooses the packing and maps the cache
(`PackedDataset`). Every producer here is a generator of `Chunk`s of at most about
`ROWS_PER_CHUNK` rows (a joined batch of texts may make more), so a dataset is packed in the
memory of one batch, whatever its size.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from spillway_runtime.training.dataset_files import DatasetError

TOKEN_DTYPE = "<u4"  # 4 B/token: every vocabulary in use fits; int64 only per micro-batch
TOKENIZE_BATCH = 1000  # texts per call: fast tokenizers encode a batch on all cores
ROWS_PER_CHUNK = 256  # rows packed in memory at once before they are appended to the cache
Chunk = tuple[Any, Any]  # rows packed at once: (tokens [k, ...], meta [k, 2, ...] or None), numpy uint32
Document = tuple[list[int], list[int]]  # token ids, 1 where the loss is learned


def pad_id(tokenizer: Any) -> int:
    """The id a row is padded with: the tokenizer's pad token, else its EOS, else 0."""
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0)


def _batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def joined_rows(texts: Iterable[str], tokenizer: Any, sequence_length: int) -> Iterator[Chunk]:
    """Texts tokenized in batches, joined with EOS, cut into rows (the tail shorter than a row
    is dropped). Never holds the tokens as Python ints: 4 B/token, not ~36."""
    import numpy as np

    eos = tokenizer.eos_token_id
    tail = [] if eos is None else [eos]
    carry = np.zeros(0, dtype=TOKEN_DTYPE)
    seen = made = 0
    for batch in _batched(texts, TOKENIZE_BATCH):
        encoded = tokenizer(batch, add_special_tokens=False)["input_ids"]
        count = sum(len(ids) + len(tail) for ids in encoded)
        flat_ids = itertools.chain.from_iterable(itertools.chain(ids, tail) for ids in encoded)
        flat = np.concatenate([carry, np.fromiter(flat_ids, dtype=TOKEN_DTYPE, count=count)])
        seen += count
        rows = len(flat) // sequence_length
        if rows:
            yield flat[: rows * sequence_length].reshape(rows, sequence_length), None
            made += rows
        carry = flat[rows * sequence_length :]
    if not made:
        raise DatasetError(
            f"the dataset has {seen} tokens, fewer than one sequence of {sequence_length}; "
            "add data or lower training.sequenceLength"
        )


def text_documents(texts: Iterable[str], tokenizer: Any, sequence_length: int) -> Iterator[Document]:
    """Each text and its EOS a document, every token learned; one longer than a row cut into
    row-long pieces, each its own document."""
    eos = tokenizer.eos_token_id
    tail = [] if eos is None else [eos]
    found = False
    for batch in _batched(texts, TOKENIZE_BATCH):
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            ids = [*ids, *tail]
            for at in range(0, len(ids), sequence_length):
                piece = ids[at : at + sequence_length]
                if len(piece) > 1:
                    found = True
                    yield piece, [1] * len(piece)
    if not found:
        raise DatasetError("the dataset has no text of two tokens or more; add data")


def document_rows(docs: Iterable[Document], pad_id: int, sequence_length: int, packing: bool) -> Iterator[Chunk]:
    """Documents (each at most a sequence long) into rows, in order: with `packing`, as many
    whole documents as fit in a row, else one per row; the rest of a row is padding."""
    rows: list[list[Document]] = []
    used = sequence_length
    for ids, learn in docs:
        if not packing or used + len(ids) > sequence_length:
            if len(rows) == ROWS_PER_CHUNK:
                yield _document_chunk(rows, pad_id, sequence_length)
                rows = []
            rows.append([])
            used = 0
        rows[-1].append((ids, learn))
        used += len(ids)
    if rows:
        yield _document_chunk(rows, pad_id, sequence_length)


def _document_chunk(rows: list[list[Document]], pad_id: int, sequence_length: int) -> Chunk:
    import numpy as np

    tokens = np.full((len(rows), sequence_length), pad_id, dtype=TOKEN_DTYPE)
    meta = np.zeros((len(rows), 2, sequence_length), dtype=TOKEN_DTYPE)
    for r, row in enumerate(rows):
        at = 0
        for d, (ids, learn) in enumerate(row, 1):
            end = at + len(ids)
            tokens[r, at:end] = ids
            meta[r, 0, at:end] = learn
            meta[r, 0, at] = 0  # a document's first token is never predicted (from the one before it)
            meta[r, 1, at:end] = d
            at = end
    return tokens, meta


def pair_rows(pairs: Iterable[tuple[Document, Document]], pad_id: int, sequence_length: int) -> Iterator[Chunk]:
    """(chosen, rejected) pairs, each sequence at most `sequence_length`, one pair per row."""
    import numpy as np

    for batch in _batched(pairs, ROWS_PER_CHUNK):
        tokens = np.full((len(batch), 2, sequence_length), pad_id, dtype=TOKEN_DTYPE)
        meta = np.zeros((len(batch), 2, 2, sequence_length), dtype=TOKEN_DTYPE)
        for r, pair in enumerate(batch):
            for side, (ids, learn) in enumerate(pair):
                tokens[r, side, : len(ids)] = ids
                meta[r, 0, side, : len(ids)] = learn
                meta[r, 1, side, : len(ids)] = 1
        yield tokens, meta


def token_count(rows: Any, meta: Any) -> int:
    """The tokens of rows that are not padding: all of them without `meta`, else those of a
    document (chat, completion, texts kept apart) or of a real sequence (pairs)."""
    return int(rows.size) if meta is None else int((meta[:, 1] > 0).sum())


def write_cache(path: Path, chunks: Iterable[Chunk]) -> None:
    """The rows of `chunks` appended to the cache's arrays as they come (aside, fsynced,
    renamed), then its index `path` (the same, last: a cache whose index exists is complete);
    older caches in the same directory go (one dataset per job: an edited dataset replaces its
    tokens)."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    final = {"ids": path.with_suffix(".ids"), "meta": path.with_suffix(".meta")}
    aside = {key: file.parent / f".{file.name}.{os.getpid()}.tmp" for key, file in final.items()}
    shapes: dict[str, list[int]] = {}
    tokens = 0
    try:
        with contextlib.ExitStack() as files:
            out: dict[str, Any] = {}
            for rows, meta in chunks:
                for key, array in (("ids", rows), ("meta", meta)):
                    if array is None:
                        continue
                    if key not in out:
                        out[key] = files.enter_context(aside[key].open("wb"))
                        shapes[key] = [0, *array.shape[1:]]
                    np.ascontiguousarray(array, dtype=TOKEN_DTYPE).tofile(out[key])
                    shapes[key][0] += len(array)
                tokens += token_count(rows, meta)
            for fh in out.values():
                fh.flush()
                os.fsync(fh.fileno())
        if not shapes.get("ids", [0])[0]:
            raise DatasetError("the dataset has no sequences; add data")
        for key in shapes:
            os.replace(aside[key], final[key])
        index = {"dtype": TOKEN_DTYPE, "ids": shapes["ids"], "meta": shapes.get("meta"), "tokens": tokens}
        aside["index"] = path.parent / f".{path.name}.{os.getpid()}.tmp"
        with aside["index"].open("w") as fh:
            json.dump(index, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(aside["index"], path)
    finally:
        for file in aside.values():
            file.unlink(missing_ok=True)
    for stale in path.parent.glob("tokens-*"):
        if stale.is_file() and stale.name.split(".")[0] != path.name.split(".")[0]:
            stale.unlink(missing_ok=True)
