"""Dataset loading, tokenization and packing, with a position that a checkpoint can hold.

Texts are read from a .jsonl or .txt file (or a directory of them), tokenized once,
joined with EOS and cut into fixed-length sequences, kept as uint32 in a cache file
beside the checkpoints that every rank maps and every restart reuses. Batches are a pure function of
(seed, micro-batch index, rank), so resuming needs only the index: no iterator state.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spillway_runtime.spec import DatasetSource


class DatasetError(ValueError):
    pass


def _files(root: Path, fmt: str) -> list[Path]:
    if root.is_file():
        return [root]
    if root.is_dir():
        suffixes = {"jsonl": {".jsonl"}, "text": {".txt"}}.get(fmt, {".jsonl", ".txt"})
        found = sorted(p for p in root.rglob("*") if p.suffix in suffixes and p.is_file())
        if found:
            return found
        raise DatasetError(f"dataset.uri {root}: directory holds no {' or '.join(sorted(suffixes))} files")
    raise DatasetError(f"dataset.uri {root}: no such file or directory")


def _utf8(file: Path, data: bytes, lineno: int | None = None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        where = f"{file}:{lineno}" if lineno is not None else str(file)
        raise DatasetError(
            f"{where}: not UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}); "
            "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def read_texts(source: DatasetSource, path: Path) -> list[str]:
    texts: list[str] = []
    for file in _files(path, source.format):
        fmt = source.format if source.format != "auto" else ("jsonl" if file.suffix == ".jsonl" else "text")
        if fmt == "text":
            texts.extend(chunk for chunk in _utf8(file, file.read_bytes()).split("\n\n") if chunk.strip())
            continue
        with file.open("rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                line = _utf8(file, raw, lineno)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DatasetError(f"{file}:{lineno}: not valid JSON ({err.msg}); each line must be one object") from None
                if not isinstance(record, dict) or source.text_field not in record:
                    raise DatasetError(
                        f"{file}:{lineno}: no field {source.text_field!r}; set dataset.textField to the field holding the text"
                    )
                value = record[source.text_field]
                if not isinstance(value, str):
                    raise DatasetError(f"{file}:{lineno}: field {source.text_field!r} is {type(value).__name__}, not text")
                texts.append(value)
    if not texts:
        raise DatasetError(f"dataset.uri {path}: no text found")
    return texts


TOKEN_DTYPE = "<u4"  # 4 B/token: every vocabulary in use fits; int64 only per micro-batch
TOKENIZE_BATCH = 1000  # texts per call: fast tokenizers encode a batch on all cores
CACHE_DIR_NAME = ".tokens"


def token_cache_path(cache_dir: Path, fingerprint: str) -> Path:
    return cache_dir / f"tokens-{fingerprint}.npy"


def dataset_fingerprint(source: DatasetSource, path: Path, tokenizer_dir: Path, sequence_length: int) -> str:
    """What the packed tokens depend on, cheaply: every dataset file's path, size and mtime,
    the dataset settings, the tokenizer's files, the sequence length."""
    h = hashlib.sha256()
    h.update(json.dumps([source.format, source.text_field, sequence_length, TOKEN_DTYPE]).encode())
    for file in _files(path, source.format):
        st = file.stat()
        h.update(f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    if tokenizer_dir.is_dir():
        for file in sorted(p for p in tokenizer_dir.iterdir() if p.is_file() and "token" in p.name):
            h.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return h.hexdigest()[:32]


@dataclass
class PackedDataset:
    """Token ids packed into rows of `sequence_length`: a 2-D uint32 array, in RAM or mapped
    from the token cache (pages shared by every rank on the node and dropped under pressure)."""

    rows: Any  # numpy [num_rows, sequence_length], uint32
    tokens: int
    _perms: dict[tuple[int, int], Any] = field(default_factory=dict)

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

    def save(self, path: Path) -> None:
        """Write the rows as .npy atomically (aside, fsynced, renamed); older caches in the
        same directory go (one dataset per job: an edited dataset replaces its tokens)."""
        import numpy as np

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
        try:
            with tmp.open("wb") as fh:
                np.save(fh, np.ascontiguousarray(self.rows))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        for stale in path.parent.glob("tokens-*.npy"):
            if stale != path:
                stale.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> PackedDataset:
        """The rows memory-mapped read-only: pages shared by the node's ranks, never copied."""
        import numpy as np

        rows = np.load(path, mmap_mode="r")
        return cls(rows=rows, tokens=int(rows.size))

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def micro_batch(self, index: int, rank: int, world_size: int, micro_batch_size: int, seed: int) -> Any:
        """Rows for global micro-batch `index` on `rank`. Epochs reshuffle with seed + epoch."""
        import torch

        n = len(self)
        per_micro = micro_batch_size * world_size
        start = index * per_micro + rank * micro_batch_size
        positions = [start + i for i in range(micro_batch_size)]
        out = []
        for pos in positions:
            epoch, offset = divmod(pos, n)
            row = self.rows[int(self._permutation(seed, epoch)[offset])]
            out.append(torch.from_numpy(row.astype("int64")))
        return torch.stack(out)
