"""Which files a dataset is, and its records one by one, whatever the files hold.

A dataset's URI (after an s3:// or pvc:// one is made local) is a file or a folder. Records
come from JSON lines (`.jsonl`), Parquet (`.parquet`, as Hugging Face Hub datasets and most
data tools write them) and Arrow (`.arrow`: the IPC file or stream format, as `datasets`'
`save_to_disk` writes them); plain text (`.txt`) is read a paragraph at a time by the text
format. JSON lines and text may be gzip'ed (`.jsonl.gz`, `.txt.gz`), read as they are
decompressed. Nothing here holds more than a batch of rows or a block of text at once: a
dataset larger than RAM is read through. A folder
that `datasets` saved is read as `datasets` would: a `DatasetDict`'s `train` split, a
`Dataset`'s files in the order its `state.json` lists them. Every record is named by where it
came from (`file:line` for JSON lines, `file: row N` for columnar files), so a bad one is
refused by name whatever the format.

Where this sits: below `data`, `sft` and `dpo`, which turn records into tokens. pyarrow is
imported only when a Parquet or Arrow file is read.
"""

from __future__ import annotations

import codecs
import gzip
import json
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file (and line or row) and the fix."""


class RecordError(ValueError):
    """One record that cannot be used; its message names the field."""


COLUMNAR = (".parquet", ".arrow")
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", *COLUMNAR)
TEXT_SUFFIXES = (".txt", ".txt.gz")
ROWS_PER_BATCH = 1024  # rows of a columnar file in memory at once
TEXT_BLOCK = 1 << 20  # bytes of a text file in memory at once


def kind(path: Path) -> str:
    """A dataset file's suffix, with the compression: `.jsonl.gz` for `a.jsonl.gz`."""
    return "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix


def paragraphs(file: Path, block: int = TEXT_BLOCK) -> Iterator[str]:
    """A text file's paragraphs (split at blank lines, `\\n\\n`; the blank ones dropped), read a
    block at a time, decompressed when it is gzip'ed: what `str.split("\\n\\n")` of the whole
    file gives, without the whole file in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry, offset = "", 0
    try:
        with gzip.open(file, "rb") if file.suffix == ".gz" else file.open("rb") as fh:
            while True:
                data = fh.read(block)
                try:
                    text = decoder.decode(data, final=not data)
                except UnicodeDecodeError as err:  # err.object: the bytes the decoder held, then data
                    at = offset - (len(err.object) - len(data)) + err.start
                    raise DatasetError(f"{file}: not UTF-8 (byte 0x{err.object[err.start]:02x} at offset {at}); "
                                       f"{REENCODE}") from None
                offset += len(data)
                *done, carry = (carry + text).split("\n\n")
                yield from (chunk for chunk in done if chunk.strip())
                if not data:
                    break
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise _bad_gzip(file, err) from None
    if carry.strip():
        yield carry


def _bad_gzip(file: Path, err: Exception) -> DatasetError:
    return DatasetError(f"{file}: cannot be read as gzip ({err or type(err).__name__}); compress it again "
                        "(gzip -k), or give it uncompressed")


def suffixes_for(fmt: str) -> tuple[str, ...]:
    """The file suffixes a folder is searched for, by dataset.format."""
    if fmt == "text":
        return TEXT_SUFFIXES
    if fmt == "auto":
        return (*RECORD_SUFFIXES, *TEXT_SUFFIXES)
    return RECORD_SUFFIXES


def dataset_files(root: Path, fmt: str) -> list[Path]:
    """The files of a dataset URI, in a fixed order: the file itself; a `datasets` folder's data
    files; else every file of the format's suffixes under the folder, sorted."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DatasetError(f"dataset.uri {root}: no such file or directory")
    saved = _saved_by_datasets(root)
    if saved is not None:
        return saved
    suffixes = suffixes_for(fmt)
    found = sorted(p for p in root.rglob("*") if kind(p) in suffixes and p.is_file())
    if found:
        return found
    raise DatasetError(f"dataset.uri {root}: directory holds no {' or '.join(sorted(suffixes))} files")


def _saved_by_datasets(root: Path) -> list[Path] | None:
    """A folder written by `datasets`' save_to_disk: a DatasetDict's `train` split, or a
    Dataset's data files as its state.json lists them. None for any other folder."""
    splits = root / "dataset_dict.json"
    if splits.is_file():
        names = _json(splits).get("splits") or sorted(p.name for p in root.iterdir() if p.is_dir())
        if "train" not in names:
            raise DatasetError(f"dataset.uri {root}: a datasets DatasetDict without a 'train' split (it has "
                               f"{', '.join(map(str, names))}); point dataset.uri at the split's folder, "
                               f"e.g. {root / str(names[0])}")
        return _saved_by_datasets(root / "train") or dataset_files(root / "train", "jsonl")
    state = root / "state.json"
    if not state.is_file():
        return None
    files = [root / entry["filename"] for entry in _json(state).get("_data_files", []) if "filename" in entry]
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise DatasetError(f"dataset.uri {root}: a datasets folder whose state.json lists "
                           f"{'no data files' if not files else 'missing files ' + ', '.join(missing)}; save it again")
    return files


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DatasetError(f"{path}: cannot be read as JSON ({err})") from None
    if not isinstance(value, dict):
        raise DatasetError(f"{path}: not a JSON object")
    return value


def decode_utf8(file: Path, data: bytes, lineno: int | None = None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        where = f"{file}:{lineno}" if lineno is not None else str(file)
        raise DatasetError(
            f"{where}: not UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}); {REENCODE}"
        ) from None


REENCODE = "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"


class Records(ABC, Generic[T]):
    """The records of `files`, each turned into a `T` by `convert` as they are iterated: one
    pass reads, checks and converts each record once and keeps none. A record that is not
    JSON, or that `convert` refuses (a RecordError), is a DatasetError naming file:line (or
    row), or with `dataset.onBadRecord: skip` counted (`skipped`, `first_skipped`) and left
    out. A pass that converts none raises, naming `what`."""

    what = "records"

    def __init__(self, files: list[Path], on_bad_record: str):
        self.files = files
        self.on_bad_record = on_bad_record
        self.skipped = 0
        self.first_skipped: str | None = None

    @abstractmethod
    def convert(self, record: Any) -> T:
        """One record as a `T`, or a RecordError naming what is wrong with it."""

    def __iter__(self) -> Iterator[T]:
        self.skipped, self.first_skipped = 0, None
        made = 0
        for where, record in records(self.files):
            try:
                if isinstance(record, RecordError):
                    raise record
                item = self.convert(record)
            except RecordError as err:
                if self.on_bad_record == "fail":
                    raise DatasetError(f"{where}: {err}; fix the record, or set dataset.onBadRecord: skip") from None
                self.skipped += 1
                self.first_skipped = self.first_skipped or f"{where}: {err}"
                continue
            made += 1
            yield item
        if not made:
            raise DatasetError(f"dataset.uri: no usable {self.what}"
                               + (f" ({self.skipped} skipped; first: {self.first_skipped})" if self.skipped else ""))

    def skipped_note(self) -> str:
        """What the last pass left out, for the log ('' when nothing)."""
        return f", {self.skipped} bad records skipped (first: {self.first_skipped})" if self.skipped else ""


def records(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(where, record) of every record of the files: a JSON line's parsed value (a line that is
    not JSON as a RecordError, for the caller to refuse or skip), a columnar row as a dict."""
    for file in files:
        if file.suffix in COLUMNAR:
            yield from _columnar_rows(file)
        else:
            yield from _json_lines(file)


def _json_lines(file: Path) -> Iterator[tuple[str, Any]]:
    """Line by line, so that a file larger than RAM is read (a gzip'ed one as it decompresses)."""
    try:
        with gzip.open(file, "rb") if file.suffix == ".gz" else file.open("rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                line = decode_utf8(file, raw, lineno)
                if not line.strip():
                    continue
                where = f"{file}:{lineno}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as err:
                    yield where, RecordError(f"not valid JSON ({err.msg}); each line must be one object")
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise _bad_gzip(file, err) from None


def _columnar_rows(file: Path) -> Iterator[tuple[str, Any]]:
    row = 0
    for batch in _batches(file):
        for record in batch.to_pylist():
            row += 1
            yield f"{file}: row {row}", record


def _batches(file: Path) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.ipc
    import pyarrow.parquet

    try:
        if file.suffix == ".parquet":
            yield from pyarrow.parquet.ParquetFile(file).iter_batches(batch_size=ROWS_PER_BATCH)
            return
        with pa.memory_map(str(file)) as source:
            try:
                reader: Any = pyarrow.ipc.open_file(source)
                batches: Iterator[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # datasets' save_to_disk writes the IPC stream format
                source.seek(0)
                batches = iter(pyarrow.ipc.open_stream(source))
            yield from batches
    except (pa.ArrowException, OSError) as err:
        what = "Parquet" if file.suffix == ".parquet" else "Arrow IPC"
        raise DatasetError(f"{file}: cannot be read as {what} ({err}); write it again, or convert it to JSON lines") from None
