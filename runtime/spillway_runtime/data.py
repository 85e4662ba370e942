"""Dataset loading, tokenization and packing, with a position that a checkpoint can hold.

Texts are read from a .jsonl or .txt file (or a directory of them), tokenized once,
joined with EOS and cut into fixed-length sequences. Batches are a pure function of
(seed, micro-batch index, rank), so resuming needs only the index: no iterator state.
"""

from __future__ import annotations

import json
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


def read_texts(source: DatasetSource, path: Path) -> list[str]:
    texts: list[str] = []
    for file in _files(path, source.format):
        fmt = source.format if source.format != "auto" else ("jsonl" if file.suffix == ".jsonl" else "text")
        if fmt == "text":
            texts.extend(chunk for chunk in file.read_text(errors="replace").split("\n\n") if chunk.strip())
            continue
        with file.open() as fh:
            for lineno, line in enumerate(fh, 1):
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


@dataclass
class PackedDataset:
    """Token ids packed into rows of `sequence_length`, as a 2-D LongTensor."""

    rows: Any  # torch.Tensor [num_rows, sequence_length]
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
        import torch

        eos = tokenizer.eos_token_id
        ids: list[int] = []
        for text in texts:
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if eos is not None:
                ids.append(eos)
        rows = len(ids) // sequence_length
        if rows == 0:
            raise DatasetError(
                f"the dataset has {len(ids)} tokens, fewer than one sequence of {sequence_length}; "
                "add data or lower training.sequenceLength"
            )
        tensor = torch.tensor(ids[: rows * sequence_length], dtype=torch.long).view(rows, sequence_length)
        return cls(rows=tensor, tokens=rows * sequence_length)

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
            out.append(self.rows[self._permutation(seed, epoch)[offset]])
        return torch.stack(out)
