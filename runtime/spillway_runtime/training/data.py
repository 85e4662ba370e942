"""Dataset loading, tokenization and packing, with a position that a checkpoint can hold.

Texts are read from .jsonl, .parquet, .arrow or .txt files (`dataset_files`), tokenized once,
joined with EOS and cut into fixed-length sequences, kept as uint32 in a cache file
beside the checkpoints that every rank maps and every restart reuses. Batches are a pure function of
(seed, micro-batch index, rank), so resuming needs only the index: no iterator state.

Building the cache streams: records are read, tokenized and packed a batch at a time, and each
chunk of rows is appended to the cache's files (`ROWS_PER_CHUNK`), so that a dataset larger
than RAM is tokenized and trained on: what stays in memory is one batch of records, one chunk
of rows, and an index of 8 B per row (a mixture's picks, an epoch's permutation). The cache is
raw arrays (`.ids`, `.meta`) that numpy maps, and a JSON index written last (`tokens-*.json`:
their shapes and the token count), so a cache whose index exists is complete.

Chat and completion records (`sft`) are documents with a loss mask: packed whole, kept
apart (each document's positions restart, and no token attends to another document's),
or one per sequence with `packing: false`. Their mask and document ids are a second
array beside the tokens, [rows, 2, sequence_length].

Preference records (`dpo`) are pairs: one row per record holding its chosen and its rejected
sequence, [rows, 2, sequence_length], each padded on the right, with the same second array per
sequence, [rows, 2 (learn, real), 2 (chosen, rejected), sequence_length]. A micro-batch of them
is laid out as TRL does: the chosen sequences, then the rejected ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spillway_runtime.core.spec_inputs import DatasetSource
from spillway_runtime.training.dataset_files import (
    TEXT_SUFFIXES,
    DatasetError,
    RecordError,
    dataset_files,
    kind,
    paragraphs,
    records,
)
from spillway_runtime.training.packing import (
    ROWS_PER_CHUNK,
    TOKEN_DTYPE,
    Chunk,
    Document,
    document_rows,
    joined_rows,
    pad_id,
    pair_rows,
    text_documents,
    token_count,
    write_cache,
)


def read_texts(source: DatasetSource, path: Path) -> Iterator[str]:
    """The texts of a text dataset, as they are read: a .txt file's paragraphs (split at blank
    lines), each record's `dataset.textField` of JSON lines, Parquet and Arrow files."""
    found = False
    for file in dataset_files(path, source.format):
        if source.format == "text" or (source.format == "auto" and kind(file) in TEXT_SUFFIXES):
            for text in paragraphs(file):
                found = True
                yield text
            continue
        for where, record in records([file]):
            if isinstance(record, RecordError):
                raise DatasetError(f"{where}: {record}")
            if not isinstance(record, dict) or source.text_field not in record:
                raise DatasetError(
                    f"{where}: no field {source.text_field!r}; set dataset.textField to the field holding the text"
                )
            value = record[source.text_field]
            if not isinstance(value, str):
                raise DatasetError(f"{where}: field {source.text_field!r} is {type(value).__name__}, not text")
            found = True
            yield value
    if not found:
        raise DatasetError(f"dataset.uri {path}: no text found")


CACHE_DIR_NAME = ".tokens"


def token_cache_path(cache_dir: Path, fingerprint: str) -> Path:
    """The cache's index; its arrays are beside it (`.ids`, `.meta`)."""
    return cache_dir / f"tokens-{fingerprint}.json"


# Bumped when how records become tokens and masks, or the cache's files, change: older caches
# are not reused. 2: the cache streamed into raw arrays and an index.
DOCUMENTS_VERSION = 2


def dataset_fingerprint(source: DatasetSource, path: Path, tokenizer_dir: Path, sequence_length: int) -> str:
    """What the packed tokens depend on, cheaply: every dataset file's path, size and mtime,
    the dataset settings (format, fields, chat template, packing, bad records), the
    tokenizer's files, the sequence length."""
    h = hashlib.sha256()
    settings = source.model_dump(mode="json", exclude={"uri", "mixture", "weight"})  # one source's tokens
    h.update(json.dumps([settings, sequence_length, TOKEN_DTYPE, DOCUMENTS_VERSION], sort_keys=True).encode())
    for file in dataset_files(path, source.format):
        st = file.stat()
        h.update(f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    if tokenizer_dir.is_dir():
        for file in sorted(p for p in tokenizer_dir.iterdir() if p.is_file() and "token" in p.name):
            h.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return h.hexdigest()[:32]


# A dataset's sources: (path, weight, the spec field it came from): dataset.uri alone (weight
# 1), or with dataset.mixture's; validation.uri alone.
Sources = list[tuple[Path, float, str]]


def _named(field: str, err: DatasetError) -> DatasetError:
    """`err` naming the field its source came from (the readers say dataset.uri)."""
    return DatasetError(str(err).replace("dataset.uri", field.removeprefix("spec."), 1))


def sources_fingerprint(source: DatasetSource, sources: Sources, tokenizer_dir: Path, sequence_length: int,
                        seed: int) -> str:
    """What the tokens of `sources` depend on: one source's `dataset_fingerprint`; a mixture's
    sources', their weights and the seed that chooses the rows of a fractional weight."""
    fingerprints = []
    for where, _, spec_field in sources:
        try:
            fingerprints.append(dataset_fingerprint(source, where, tokenizer_dir, sequence_length))
        except DatasetError as err:
            raise _named(spec_field, err) from None
    if len(sources) == 1:
        return fingerprints[0]
    weights = [weight for _, weight, _ in sources]
    return hashlib.sha256(json.dumps([fingerprints, weights, seed]).encode()).hexdigest()[:32]


def tokenize_sources(source: DatasetSource, sources: Sources, tokenizer: Any, sequence_length: int,
                     seed: int, into: Path) -> tuple[PackedDataset, str]:
    """Each source read, tokenized and packed on its own in `source`'s format, then (several)
    mixed per weight (`PackedDataset.mixed`), streamed into the cache at `into`: the dataset
    (mapped from it) and what was built, for the log. A mixture's sources are packed into a
    folder beside `into` first, removed once they are mixed."""
    if len(sources) == 1:
        where, _, spec_field = sources[0]
        try:
            return _tokenized(source, where, tokenizer, sequence_length, into)
        except DatasetError as err:
            raise _named(spec_field, err) from None
    parts_dir = into.parent / f".parts-{os.getpid()}"
    try:
        parts = []
        for i, (where, weight, spec_field) in enumerate(sources):
            try:
                part, described = _tokenized(source, where, tokenizer, sequence_length, parts_dir / f"part-{i}.json")
            except DatasetError as err:
                raise _named(spec_field, err) from None
            parts.append((part, described, weight, spec_field))
        dataset = PackedDataset.mixed([(part, weight) for part, _, weight, _ in parts], seed, into=into)
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)
    built = "mixture: " + "; ".join(f"{name.removeprefix('spec.')} {len(part)} sequences x {weight:g} "
                                    f"({described.rstrip(', ')})" for part, described, weight, name in parts)
    return dataset, f"{built}, {len(dataset)} sequences in all, "


def _tokenized(source: DatasetSource, path: Path, tokenizer: Any, sequence_length: int,
               into: Path | None) -> tuple[PackedDataset, str]:
    pad = pad_id(tokenizer)
    if source.format == "preference":
        pairs = read_pairs(source, path, tokenizer, sequence_length)
        packed = PackedDataset.build_pairs(pairs, pad, sequence_length, into=into)
        return packed, f"{len(packed)} preference pairs tokenized{pairs.skipped_note()}, "
    if source.format not in ("chat", "completion"):
        count = _Counted(read_texts(source, path))
        build = PackedDataset.build_text_documents if source.text_packing == "apart" else PackedDataset.build
        return build(count, tokenizer, sequence_length, into=into), f"{count.seen} texts tokenized, "
    read = read_documents(source, path, tokenizer, sequence_length)
    learned = _Counted(read, size=lambda doc: sum(doc[1]))
    packed = PackedDataset.build_documents(learned, pad, sequence_length, source.packing, into=into)
    return (packed, f"{learned.seen} {source.format} records tokenized ({learned.total} tokens learned)"
                    f"{read.skipped_note()}, ")


class _Counted:
    """An iterable passed through, counting its items (`seen`) and summing `size` of them (`total`)."""

    def __init__(self, items: Iterable[Any], size: Any = None):
        self.items, self.size = items, size
        self.seen = self.total = 0

    def __iter__(self) -> Iterator[Any]:
        for item in self.items:
            self.seen += 1
            if self.size is not None:
                self.total += self.size(item)
            yield item


def read_documents(source: DatasetSource, path: Path, tokenizer: Any, sequence_length: int) -> Any:
    """The chat or completion records of ``path`` as documents, made as they are iterated (`sft.Documents`)."""
    from spillway_runtime.training.sft import Documents

    return Documents(source, dataset_files(path, source.format), tokenizer, sequence_length)


def read_pairs(source: DatasetSource, path: Path, tokenizer: Any, sequence_length: int) -> Any:
    """The preference records of ``path`` as (chosen, rejected) pairs, made as they are iterated (`dpo.Pairs`)."""
    from spillway_runtime.training.dpo import Pairs

    return Pairs(source, dataset_files(path, source.format), tokenizer, sequence_length)


def mixed_rows(parts: list[tuple[PackedDataset, float]], seed: int) -> Iterator[Chunk]:
    """From each dataset, weight x its rows (every row `floor(weight)` times, then a share of
    them chosen with `seed` without repeats, at least one row), in order."""
    import numpy as np

    if len({part.meta is None for part, _ in parts}) > 1:
        raise DatasetError("dataset.mixture: every source must be in dataset.format's shape")
    rng = np.random.Generator(np.random.PCG64(seed * 104_729 + 3))
    for part, weight in parts:
        n = len(part)
        whole, rest = divmod(max(1, round(weight * n)), n)
        picks = np.concatenate([np.tile(np.arange(n), whole),
                                np.sort(rng.choice(n, size=rest, replace=False))]).astype(np.int64)
        for at in range(0, len(picks), ROWS_PER_CHUNK):
            chosen = picks[at : at + ROWS_PER_CHUNK]
            yield part.rows[chosen], None if part.meta is None else part.meta[chosen]


@dataclass
class PackedDataset:
    """Token ids packed into rows of `sequence_length`: a 2-D uint32 array, in RAM or mapped
    from the token cache (pages shared by every rank on the node and dropped under pressure).
    With `meta` (chat and completion data): per token, whether its loss is learned and its
    document's id in the row (0: padding). Preference pairs: a third dimension (chosen, rejected)."""

    rows: Any  # numpy [num_rows, sequence_length] uint32; pairs: [num_rows, 2, sequence_length]
    tokens: int
    meta: Any = None  # numpy [num_rows, 2, sequence_length], uint32: (learn, document)
    index: Any = None  # numpy int64: the rows of `rows` this dataset is (a split), None: all
    _perms: dict[tuple[int, int], Any] = field(default_factory=dict)

    def split(self, fraction: float, seed: int) -> tuple[PackedDataset, PackedDataset]:
        """(training, held out): ``fraction`` of the rows, at least one, chosen with ``seed``;
        both share the (mapped) arrays."""
        import numpy as np
        import torch

        n = len(self)
        held = max(1, round(n * fraction))
        if held >= n:
            raise DatasetError(f"dataset.validation.fraction {fraction} of {n} sequences leaves none to train on; "
                               "lower it or add data")
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7_919 + 17)).numpy()
        base = self.index if self.index is not None else np.arange(n)
        parts = np.sort(base[order[held:]]), np.sort(base[order[:held]])
        return tuple(PackedDataset(rows=self.rows, meta=self.meta, index=p, tokens=self._tokens(p))  # type: ignore[return-value]
                     for p in parts)

    def _tokens(self, rows: Any) -> int:
        return sum(token_count(self.rows[rows[at : at + ROWS_PER_CHUNK]],
                                None if self.meta is None else self.meta[rows[at : at + ROWS_PER_CHUNK]])
                   for at in range(0, len(rows), ROWS_PER_CHUNK))

    def _row(self, logical: int) -> int:
        return int(self.index[logical]) if self.index is not None else logical

    @property
    def pairs(self) -> bool:
        return len(self.rows.shape) == 3

    def _permutation(self, seed: int, epoch: int) -> Any:
        import torch

        key = (seed, epoch)
        if key not in self._perms:
            self._perms.clear()  # one epoch at a time is all a run needs
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            self._perms[key] = torch.randperm(len(self), generator=g)
        return self._perms[key]

    @classmethod
    def build(cls, texts: Iterable[str], tokenizer: Any, sequence_length: int,
              into: Path | None = None) -> PackedDataset:
        """Texts joined with EOS and cut into rows (`joined_rows`): in memory, or streamed `into` a cache."""
        return cls.made(joined_rows(texts, tokenizer, sequence_length), into)

    @classmethod
    def build_text_documents(cls, texts: Iterable[str], tokenizer: Any, sequence_length: int,
                             into: Path | None = None) -> PackedDataset:
        """Texts kept apart (`dataset.textPacking: apart`): each text and its EOS is a document,
        one longer than a row is cut into row-long pieces (each its own document), and whole
        documents are packed into rows in order, the rest of a row padding: the same rows and
        4-D mask as chat records, every token learned but each document's first."""
        docs = text_documents(texts, tokenizer, sequence_length)
        return cls.made(document_rows(docs, pad_id(tokenizer), sequence_length, packing=True), into)

    @classmethod
    def build_documents(cls, docs: Iterable[Document], pad_id: int, sequence_length: int, packing: bool,
                        into: Path | None = None) -> PackedDataset:
        """Documents packed into rows (`document_rows`): in memory, or streamed `into` a cache."""
        return cls.made(document_rows(docs, pad_id, sequence_length, packing), into)

    @classmethod
    def build_pairs(cls, pairs: Iterable[tuple[Document, Document]], pad_id: int, sequence_length: int,
                    into: Path | None = None) -> PackedDataset:
        """(chosen, rejected) pairs, one per row (`pair_rows`): in memory, or streamed `into` a cache."""
        return cls.made(pair_rows(pairs, pad_id, sequence_length), into)

    @classmethod
    def mixed(cls, parts: list[tuple[PackedDataset, float]], seed: int, into: Path | None = None) -> PackedDataset:
        """Datasets (`dataset.uri` and `dataset.mixture`), each already packed, as one
        (`mixed_rows`); training shuffles them together."""
        return cls.made(mixed_rows(parts, seed), into)

    @classmethod
    def made(cls, chunks: Iterable[Chunk], into: Path | None) -> PackedDataset:
        """The rows of `chunks`: appended to the cache at `into` as they come, and mapped from
        it; or, without `into`, joined in memory."""
        import numpy as np

        if into is not None:
            write_cache(into, chunks)
            return cls.load(into)
        tokens, metas, count = [], [], 0
        for rows, meta in chunks:
            tokens.append(rows)
            metas.append(meta)
            count += token_count(rows, meta)
        if not tokens:
            raise DatasetError("the dataset has no sequences; add data")
        return cls(rows=np.concatenate(tokens), tokens=count,
                   meta=None if metas[0] is None else np.concatenate(metas))

    def save(self, path: Path) -> None:
        """Write the rows as a cache at `path` (`write_cache`)."""
        write_cache(path, [(self.rows, self.meta)])

    @classmethod
    def load(cls, path: Path) -> PackedDataset:
        """The cache at `path` memory-mapped read-only: pages shared by the node's ranks, never copied."""
        import numpy as np

        index = json.loads(path.read_text())
        rows = np.memmap(path.with_suffix(".ids"), dtype=index["dtype"], mode="r", shape=tuple(index["ids"]))
        meta = (None if index["meta"] is None else
                np.memmap(path.with_suffix(".meta"), dtype=index["dtype"], mode="r", shape=tuple(index["meta"])))
        return cls(rows=rows, tokens=int(index["tokens"]), meta=meta)

    def __len__(self) -> int:
        return int(self.rows.shape[0]) if self.index is None else len(self.index)

    def micro_batch(self, index: int, rank: int, world_size: int, micro_batch_size: int, seed: int) -> dict[str, Any]:
        """The model's inputs for global micro-batch `index` on `rank` (input_ids and labels;
        for documents also position_ids and a 4-D attention mask that keeps them apart).
        Epochs reshuffle with seed + epoch."""
        n = len(self)
        per_micro = micro_batch_size * world_size
        start = index * per_micro + rank * micro_batch_size
        picked = []
        for pos in range(start, start + micro_batch_size):
            epoch, offset = divmod(pos, n)
            picked.append(self._row(int(self._permutation(seed, epoch)[offset])))
        return self._inputs(picked)

    def eval_batch(self, index: int, rank: int, world_size: int, micro_batch_size: int) -> dict[str, Any]:
        """Held-out micro-batch `index` on `rank`, in order. Past the end the rows repeat
        (every rank runs as many forwards, as ZeRO-3 needs) with no labels, so they count
        for nothing."""
        start = (index * world_size + rank) * micro_batch_size
        rows = [self._row(pos % len(self)) for pos in range(start, start + micro_batch_size)]
        inputs = self._inputs(rows)
        counted = max(0, min(micro_batch_size, len(self) - start))
        inputs["labels"] = inputs["labels"].clone()
        if self.pairs:  # the chosen rows, then the rejected ones
            inputs["labels"].view(2, micro_batch_size, -1)[:, counted:] = -100
        else:
            inputs["labels"][counted:] = -100
        return inputs

    def _inputs(self, picked: list[int]) -> dict[str, Any]:
        import torch

        ids = torch.stack([torch.from_numpy(self.rows[i].astype("int64")) for i in picked])
        if self.meta is None:
            return {"input_ids": ids, "labels": ids}
        meta = torch.stack([torch.from_numpy(self.meta[i].astype("int64")) for i in picked])
        if self.pairs:
            return pair_inputs(ids, meta[:, 0], meta[:, 1])
        return document_inputs(ids, meta[:, 0], meta[:, 1])


def document_inputs(ids: Any, learn: Any, documents: Any) -> dict[str, Any]:
    """input_ids, labels (-100 where nothing is learned), position_ids restarting at each
    document, and a boolean [batch, 1, seq, seq] mask: causal, within a document (padding,
    document 0, attends causally among itself so that no row is all masked)."""
    import torch

    length = ids.shape[1]
    labels = ids.masked_fill(learn == 0, -100)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    index = torch.arange(length).expand_as(documents)
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    same = documents[:, :, None] == documents[:, None, :]
    return {"input_ids": ids, "labels": labels, "position_ids": index - first,
            "attention_mask": (causal & same)[:, None]}


def pair_inputs(ids: Any, learn: Any, real: Any) -> dict[str, Any]:
    """input_ids, labels (-100 but on the answers) and the padding mask of [pairs, 2, seq]
    arrays, as TRL lays a preference batch out: the chosen sequences, then the rejected ones,
    cut to the longest of them (padding on the right)."""
    import torch

    ids, learn, real = (torch.cat([t[:, 0], t[:, 1]]) for t in (ids, learn, real))
    width = max(1, int(real.sum(dim=1).max()))
    ids, learn, real = ids[:, :width], learn[:, :width], real[:, :width]
    return {"input_ids": ids, "labels": ids.masked_fill(learn == 0, -100), "attention_mask": real}
