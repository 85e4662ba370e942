"""Dataset loading, tokenization and packing, with a position that a checkpoint can hold.

Texts are read from .jsonl, .parquet, .arrow or .txt files (`dataset_files`), tokenized once,
joined with EOS and cut into fixed-length sequences, kept as uint32 in a cache file
beside the checkpoints that every rank maps and every restart reuses. Batches are a pure function of
(seed, micro-batch index, rank), so resuming needs only the index: no iterator state.

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
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spillway_runtime.core.spec_inputs import DatasetSource
from spillway_runtime.training.dataset_files import (
    TEXT_SUFFIXES,
    DatasetError,
    RecordError,
    dataset_files,
    decode_utf8,
    kind,
    read_bytes,
    records,
)


def read_texts(source: DatasetSource, path: Path) -> list[str]:
    """The texts of a text dataset: a .txt file's paragraphs (split at blank lines), each
    record's `dataset.textField` of JSON lines, Parquet and Arrow files."""
    texts: list[str] = []
    files = dataset_files(path, source.format)
    for file in files:
        if source.format == "text" or (source.format == "auto" and kind(file) in TEXT_SUFFIXES):
            texts.extend(chunk for chunk in decode_utf8(file, read_bytes(file)).split("\n\n") if chunk.strip())
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
            texts.append(value)
    if not texts:
        raise DatasetError(f"dataset.uri {path}: no text found")
    return texts


TOKEN_DTYPE = "<u4"  # 4 B/token: every vocabulary in use fits; int64 only per micro-batch
TOKENIZE_BATCH = 1000  # texts per call: fast tokenizers encode a batch on all cores
CACHE_DIR_NAME = ".tokens"


def token_cache_path(cache_dir: Path, fingerprint: str) -> Path:
    return cache_dir / f"tokens-{fingerprint}.npy"


# Bumped when how records become tokens and masks changes: older caches are not reused.
DOCUMENTS_VERSION = 1


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
                     seed: int) -> tuple[PackedDataset, str]:
    """Each source read, tokenized and packed on its own in `source`'s format, then (several)
    mixed per weight (`PackedDataset.mixed`): the dataset and what was built, for the log."""
    parts = []
    for where, weight, spec_field in sources:
        try:
            parts.append((*_tokenized(source, where, tokenizer, sequence_length), weight, spec_field))
        except DatasetError as err:
            raise _named(spec_field, err) from None
    if len(parts) == 1:
        return parts[0][0], parts[0][1]
    dataset = PackedDataset.mixed([(part, weight) for part, _, weight, _ in parts], seed)
    built = "mixture: " + "; ".join(f"{name.removeprefix('spec.')} {len(part)} sequences x {weight:g} "
                                    f"({described.rstrip(', ')})" for part, described, weight, name in parts)
    return dataset, f"{built}, {len(dataset)} sequences in all, "


def _tokenized(source: DatasetSource, path: Path, tokenizer: Any, sequence_length: int) -> tuple[PackedDataset, str]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if source.format == "preference":
        pairs = read_pairs(source, path, tokenizer, sequence_length)
        skipped = f", {pairs.skipped} bad records skipped (first: {pairs.first_skipped})" if pairs.skipped else ""
        return (PackedDataset.build_pairs(pairs.pairs, int(pad or 0), sequence_length),
                f"{len(pairs.pairs)} preference pairs tokenized{skipped}, ")
    if source.format not in ("chat", "completion"):
        texts = read_texts(source, path)
        build = PackedDataset.build_text_documents if source.text_packing == "apart" else PackedDataset.build
        return build(texts, tokenizer, sequence_length), f"{len(texts)} texts tokenized, "
    read = read_documents(source, path, tokenizer, sequence_length)
    learned = sum(sum(learn) for _, learn in read.docs)
    skipped = f", {read.skipped} bad records skipped (first: {read.first_skipped})" if read.skipped else ""
    return (PackedDataset.build_documents(read.docs, int(pad or 0), sequence_length, source.packing),
            f"{len(read.docs)} {source.format} records tokenized ({learned} tokens learned){skipped}, ")


def read_documents(source: DatasetSource, path: Path, tokenizer: Any, sequence_length: int) -> Any:
    """The chat or completion records of ``path`` as documents (`sft.Documents`)."""
    from spillway_runtime.training.sft import read_documents as read

    return read(source, dataset_files(path, source.format), tokenizer, sequence_length)


def read_pairs(source: DatasetSource, path: Path, tokenizer: Any, sequence_length: int) -> Any:
    """The preference records of ``path`` as (chosen, rejected) pairs (`dpo.Pairs`)."""
    from spillway_runtime.training.dpo import read_pairs as read

    return read(source, dataset_files(path, source.format), tokenizer, sequence_length)


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
        if self.meta is None:
            return int(len(rows) * self.rows.shape[1])
        return int(sum(int((self.meta[r, 1] > 0).sum()) for r in rows))

    def _row(self, logical: int) -> int:
        return int(self.index[logical]) if self.index is not None else logical

    @classmethod
    def build_documents(cls, docs: list[tuple[list[int], list[int]]], pad_id: int, sequence_length: int,
                        packing: bool) -> PackedDataset:
        """Documents (each at most a sequence long) into rows, in order: with `packing`, as many
        whole documents as fit in a row, else one per row; the rest of a row is padding."""
        import numpy as np

        rows: list[list[tuple[list[int], list[int]]]] = []
        used = sequence_length
        for ids, learn in docs:
            if not packing or used + len(ids) > sequence_length:
                rows.append([])
                used = 0
            rows[-1].append((ids, learn))
            used += len(ids)
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
        return cls(rows=tokens, tokens=int(sum(len(ids) for ids, _ in docs)), meta=meta)

    @classmethod
    def build_pairs(cls, pairs: list[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]], pad_id: int,
                    sequence_length: int) -> PackedDataset:
        """(chosen, rejected) pairs, each sequence at most `sequence_length`, one pair per row."""
        import numpy as np

        tokens = np.full((len(pairs), 2, sequence_length), pad_id, dtype=TOKEN_DTYPE)
        meta = np.zeros((len(pairs), 2, 2, sequence_length), dtype=TOKEN_DTYPE)
        for r, pair in enumerate(pairs):
            for side, (ids, learn) in enumerate(pair):
                tokens[r, side, : len(ids)] = ids
                meta[r, 0, side, : len(ids)] = learn
                meta[r, 1, side, : len(ids)] = 1
        return cls(rows=tokens, tokens=int(meta[:, 1].sum()), meta=meta)

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
    def build(cls, texts: list[str], tokenizer: Any, sequence_length: int) -> PackedDataset:
        """Tokenize in batches, join with EOS, cut into rows (the tail shorter than a row is
        dropped). Never holds the tokens as Python ints: 4 B/token, not ~36."""
        import numpy as np

        eos = tokenizer.eos_token_id
        chunks = []
        for start in range(0, len(texts), TOKENIZE_BATCH):
            encoded = tokenizer(texts[start : start + TOKENIZE_BATCH], add_special_tokens=False)["input_ids"]
            tail = [] if eos is None else [eos]
            count = sum(len(ids) + len(tail) for ids in encoded)
            flat_ids = itertools.chain.from_iterable(itertools.chain(ids, tail) for ids in encoded)
            chunks.append(np.fromiter(flat_ids, dtype=TOKEN_DTYPE, count=count))
        flat = np.concatenate(chunks) if chunks else np.zeros(0, dtype=TOKEN_DTYPE)
        rows = len(flat) // sequence_length
        if rows == 0:
            raise DatasetError(
                f"the dataset has {len(flat)} tokens, fewer than one sequence of {sequence_length}; "
                "add data or lower training.sequenceLength"
            )
        packed = flat[: rows * sequence_length].reshape(rows, sequence_length)
        return cls(rows=packed, tokens=rows * sequence_length)

    @classmethod
    def build_text_documents(cls, texts: list[str], tokenizer: Any, sequence_length: int) -> PackedDataset:
        """Texts kept apart (`dataset.textPacking: apart`): each text and its EOS is a document,
        one longer than a row is cut into row-long pieces (each its own document), and whole
        documents are packed into rows in order, the rest of a row padding: the same rows and
        4-D mask as chat records, every token learned but each document's first."""
        eos = tokenizer.eos_token_id
        tail = [] if eos is None else [eos]
        docs: list[tuple[list[int], list[int]]] = []
        for start in range(0, len(texts), TOKENIZE_BATCH):
            for ids in tokenizer(texts[start : start + TOKENIZE_BATCH], add_special_tokens=False)["input_ids"]:
                ids = [*ids, *tail]
                pieces = (ids[at : at + sequence_length] for at in range(0, len(ids), sequence_length))
                docs.extend((piece, [1] * len(piece)) for piece in pieces if len(piece) > 1)
        if not docs:
            raise DatasetError("the dataset has no text of two tokens or more; add data")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        return cls.build_documents(docs, int(pad or 0), sequence_length, packing=True)

    @classmethod
    def mixed(cls, parts: list[tuple[PackedDataset, float]], seed: int) -> PackedDataset:
        """Datasets (`dataset.uri` and `dataset.mixture`), each already packed, as one: from each,
        weight x its rows (every row `floor(weight)` times, then a share of them chosen with
        `seed` without repeats, at least one row), in order; training shuffles them together."""
        import numpy as np

        rng = np.random.Generator(np.random.PCG64(seed * 104_729 + 3))
        rows, metas = [], []
        for part, weight in parts:
            n = len(part)
            whole, rest = divmod(max(1, round(weight * n)), n)
            picks = np.concatenate([np.tile(np.arange(n), whole),
                                    np.sort(rng.choice(n, size=rest, replace=False))]).astype(np.int64)
            rows.append(np.asarray(part.rows)[picks])
            if part.meta is not None:
                metas.append(np.asarray(part.meta)[picks])
        if metas and len(metas) != len(parts):
            raise DatasetError("dataset.mixture: every source must be in dataset.format's shape")
        meta = np.concatenate(metas) if metas else None
        joined = np.concatenate(rows)
        return cls(rows=joined, tokens=int((meta[:, 1] > 0).sum()) if meta is not None else int(joined.size), meta=meta)

    def save(self, path: Path) -> None:
        """Write the rows as .npy atomically (aside, fsynced, renamed); older caches in the
        same directory go (one dataset per job: an edited dataset replaces its tokens)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.meta is not None:  # first: a cache whose tokens exist is complete
            _save_atomically(_meta_path(path), self.meta)
        _save_atomically(path, self.rows)
        for stale in path.parent.glob("tokens-*.npy"):
            if stale not in (path, _meta_path(path)):
                stale.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> PackedDataset:
        """The rows memory-mapped read-only: pages shared by the node's ranks, never copied."""
        import numpy as np

        rows = np.load(path, mmap_mode="r")
        meta_path = _meta_path(path)
        if not meta_path.is_file():
            return cls(rows=rows, tokens=int(rows.size))
        meta = np.load(meta_path, mmap_mode="r")
        return cls(rows=rows, tokens=int((meta[:, 1] > 0).sum()), meta=meta)

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


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name.replace(".npy", ".meta.npy"))


def _save_atomically(path: Path, array: Any) -> None:
    import numpy as np

    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        with tmp.open("wb") as fh:
            np.save(fh, np.ascontiguousarray(array))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
