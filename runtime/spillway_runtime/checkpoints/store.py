"""Atomic, verified checkpoints on a shared directory.

A checkpoint is written into `.staging-<name>/`, every file fsynced, a manifest
with each file's sha256 written last, the directory renamed into place and only
then the `latest` pointer replaced. A crash or ENOSPC at any point leaves the
previous good checkpoint and pointer untouched. On load a checksum mismatch
rejects that checkpoint and falls back to the previous good one, saying so.

Every rank writes its own shard (DeepSpeed does this inside `save_fn`); rank 0
writes the manifest, renames and prunes. Torch-free: callers pass `barrier`
and `broadcast` for multi-process runs.

A save may finish later (`begin`, then `finish`): `save_fn` returns a `wait` that blocks
until this rank's files are on disk and returns their checksums (computed as they were
written, see `tensor_io`), which the manifest takes instead of reading the files again.
Such files are checked on load as they are read (`deferred`), not beforehand.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spillway_runtime.checkpoints import unpickle
from spillway_runtime.checkpoints.tensor_io import BLOCK_HASH, chunked_digest

MANIFEST = "manifest.json"
LATEST = "latest"
ROLLBACK_MARKER = "rolled-back-to"
ABANDONED = "abandoned-"
PREFIX = "step-"
STAGING = ".staging-"
DIGESTS = ".digests-rank"  # a rank's checksums of what it wrote, read by rank 0's commit

# What `save_fn` may return: a wait for the rest of its files, returning (path, size, checksum) of each.
Wait = Callable[[], list[tuple[Path, int, str]]]


class CheckpointError(RuntimeError):
    pass


@dataclass
class PendingSave:
    """A checkpoint begun (`CheckpointStore.begin`) whose files may still be being written."""

    name: str
    step: int
    staging: Path
    meta: dict[str, Any]
    wait: Wait | None
    failure: str | None
    began: float  # time.monotonic() when the save was asked for


@dataclass
class CheckpointInfo:
    name: str
    step: int
    loss: float | None
    time: float
    size_bytes: int
    sha256: str  # digest of the manifest's file table: identifies the checkpoint as a whole
    path: Path
    eval_loss: float | None = None  # the held-out loss of these weights, when evaluated at this step

    def public(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "step": self.step,
            "loss": self.loss,
            "time": self.time,
            "sizeBytes": self.size_bytes,
            "sha256": self.sha256,
            **({"evalLoss": self.eval_loss} if self.eval_loss is not None else {}),
        }


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def write_problem(directory: Path) -> str | None:
    """Why nothing could be written in `directory` (created if missing), or None: a byte
    written and removed, so a run fails before training rather than at its first write."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".spillway-write-test-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as err:
        return err.strerror or str(err)
    return None


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that readers see the old or the new content, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _noop() -> None:
    return None


def _identity(value: Any) -> Any:
    return value


class CheckpointStore:
    def __init__(
        self,
        root: Path,
        keep: int,
        *,
        rank: int = 0,
        barrier: Callable[[], None] = _noop,
        broadcast: Callable[[Any], Any] = _identity,
        first_failure: Callable[[str | None], str | None] = _identity,
        log: Callable[[str], None] = print,
        pinned: Callable[[], set[str]] = set,
        keep_best: bool = False,
        digest: Callable[[Path], str] = chunked_digest,
    ):
        self.root = Path(root)
        self.keep = keep
        self.keep_best = keep_best  # also spare the checkpoint with the lowest held-out loss
        self.pinned = pinned  # names pruning must spare (a rollback asked for, not yet begun)
        self.rank = rank
        self.barrier = barrier
        self.broadcast = broadcast  # rank 0's value to every rank
        self.first_failure = first_failure  # the first non-None value across ranks, to every rank
        self.log = log
        self.digest = digest  # a file's chunked checksum (BLOCK_HASH entries)

    # --- writing ----------------------------------------------------------------------

    def save(self, step: int, save_fn: Callable[[Path], Wait | None], meta: dict[str, Any]) -> CheckpointInfo:
        """`save_fn(staging_dir)` writes this rank's files; returns the committed checkpoint."""
        return self.finish(self.begin(step, save_fn, meta))

    def begin(self, step: int, save_fn: Callable[[Path], Wait | None], meta: dict[str, Any]) -> PendingSave:
        """Start a checkpoint: `save_fn` writes what it must now and may return a wait for
        the rest. Every rank calls `finish` with the result, even when this failed."""
        began = time.monotonic()
        name = checkpoint_name(step)
        staging = self.root / f"{STAGING}{name}"
        failure: str | None = None
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir()
            except OSError as err:
                failure = self._describe(err)
        failure = self.broadcast(failure)
        wait: Wait | None = None
        if failure is None:
            try:
                wait = save_fn(staging)
            except (OSError, RuntimeError) as err:  # torch.save reports ENOSPC as RuntimeError
                failure = self._describe(err)
        return PendingSave(name, step, staging, meta, wait, failure, began)

    def finish(self, pending: PendingSave) -> CheckpointInfo:
        """Wait for this rank's files, then commit (rank 0) once every rank has written."""
        name, staging, final = pending.name, pending.staging, self.root / pending.name
        failure = pending.failure
        if failure is None and pending.wait is not None:
            try:
                written = pending.wait()
                sums = {str(path.relative_to(staging)): {"sha256": digest, "size": size, "hash": BLOCK_HASH}
                        for path, size, digest in written}
                write_atomic(staging / f"{DIGESTS}{self.rank}.json", json.dumps(sums).encode())
            except (OSError, RuntimeError) as err:
                failure = self._describe(err)
        failure = self.first_failure(failure)
        public: dict[str, Any] | None = None
        if self.rank == 0 and failure is None:
            try:
                public = self._commit(name, pending.step, staging, final, pending.meta).public()
            except OSError as err:
                failure = self._describe(err)
        if self.rank == 0 and failure is not None:
            shutil.rmtree(staging, ignore_errors=True)
        failure, public = self.broadcast((failure, public))
        if failure is not None:
            raise CheckpointError(f"checkpoint {name} was not written: {failure}; the last good checkpoint is intact")
        if self.rank == 0:
            self._prune()
        self.barrier()
        return self._info_from(public, final)

    def _describe(self, err: BaseException) -> str:
        code = getattr(err, "errno", None)
        with contextlib.suppress(OSError):
            if code is None and shutil.disk_usage(self.root).free < (1 << 20):
                code = errno.ENOSPC
        if code == errno.ENOSPC:
            return f"no space left on {self.root}: free space or point the checkpoint path at a larger volume"
        if code in (errno.EACCES, errno.EROFS, errno.EPERM):
            return f"cannot write to {self.root} ({os.strerror(code)}): make it writable or change the checkpoint path"
        return str(err)

    def _commit(self, name: str, step: int, staging: Path, final: Path, meta: dict[str, Any]) -> CheckpointInfo:
        known: dict[str, dict[str, Any]] = {}
        for sums in sorted(staging.glob(f"{DIGESTS}*.json")):
            known.update(json.loads(sums.read_text()))
            sums.unlink()
        files: dict[str, dict[str, Any]] = {}
        size = 0
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):
            rel = str(path.relative_to(staging))
            nbytes = path.stat().st_size
            entry = known.get(rel)
            if entry is None or entry["size"] != nbytes:
                entry = {"sha256": _sha256(path), "size": nbytes}
            files[rel] = entry
            size += nbytes
        _fsync_tree(staging)
        digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
        manifest = {"name": name, "step": step, "time": time.time(), "sizeBytes": size, "sha256": digest,
                    "files": files, **meta}
        write_atomic(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
        if final.exists():
            # Re-saving the same step (after a rollback) replaces the old copy.
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(self.root)
        write_atomic(self.root / LATEST, name.encode())
        return CheckpointInfo(name, step, meta.get("loss"), manifest["time"], size, digest, final,
                              meta.get("evalLoss"))

    def _prune(self) -> None:
        good = self.list()
        doomed_infos = good[: max(0, len(good) - self.keep)]
        if doomed_infos:
            spared = self.pinned() & {info.name for info in doomed_infos}
            if spared:
                self.log(f"keeping {', '.join(sorted(spared))} past checkpoint.keep: a rollback to it is pending")
            best = self.best(good) if self.keep_best else None
            if best is not None and best.name in {info.name for info in doomed_infos}:
                spared.add(best.name)
                self.log(f"keeping {best.name} past checkpoint.keep: the lowest held-out loss ({best.eval_loss})")
            doomed_infos = [info for info in doomed_infos if info.name not in spared]
        for info in doomed_infos:
            # Out of sight in one rename, then deleted: a kill mid-delete leaves a staging
            # leftover (swept below next time), never a half-deleted checkpoint that lists.
            doomed = self.root / f"{STAGING}pruned-{info.name}"
            with contextlib.suppress(OSError):
                os.replace(info.path, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
        for stale in self.root.glob(f"{STAGING}*"):
            shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def best(infos: builtins.list[CheckpointInfo]) -> CheckpointInfo | None:
        """The checkpoint with the lowest held-out loss (the earliest of equals), if any was evaluated."""
        scored = [info for info in infos if info.eval_loss is not None]
        return min(scored, key=lambda info: (info.eval_loss, info.step)) if scored else None

    # --- reading ----------------------------------------------------------------------

    def _info_from(self, public: dict[str, Any] | None, path: Path) -> CheckpointInfo:
        if public is None:
            raise CheckpointError(f"checkpoint at {path} has no manifest")
        return CheckpointInfo(
            public["name"], public["step"], public.get("loss"), public["time"], public["sizeBytes"],
            public["sha256"], path, public.get("evalLoss"),
        )

    def read_manifest(self, path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads((path / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints (manifest present), oldest first. Not verified."""
        out: list[CheckpointInfo] = []
        if not self.root.is_dir():
            return out
        for path in self.root.glob(f"{PREFIX}*"):
            manifest = self.read_manifest(path)
            if manifest:
                out.append(self._info_from(manifest, path))
        return sorted(out, key=lambda c: c.step)

    def verify(self, path: Path, *, deep: bool = True) -> str | None:
        """None when every file matches its manifest entry, else what is wrong. With
        `deep=False`, files with a chunked checksum are only checked for presence and size:
        the caller checks them as it reads them (`deferred`)."""
        manifest = self.read_manifest(path)
        if manifest is None:
            return "manifest missing or unreadable"
        for rel, entry in manifest["files"].items():
            file = path / rel
            if not file.is_file():
                return f"{rel} is missing"
            if file.stat().st_size != entry["size"]:
                return f"{rel} does not match its size"
            if entry.get("hash") == BLOCK_HASH:
                if deep and self.digest(file) != entry["sha256"]:
                    return f"{rel} does not match its checksum"
            elif _sha256(file) != entry["sha256"]:
                return f"{rel} does not match its sha256"
            # A manifest is no proof of origin (whoever writes the bucket writes it too): a
            # pickle that names anything but data is refused before any file is loaded.
            if unpickle.is_pickle(file) and (bad := unpickle.unsafe_globals(file)):
                return f"{rel} holds Python objects a checkpoint never holds ({', '.join(bad)})"
        return None

    def deferred(self, path: Path) -> dict[Path, str]:
        """The files of a checkpoint that `verify(deep=False)` left to be checked as they are
        read: resolved path -> chunked checksum."""
        manifest = self.read_manifest(path) or {"files": {}}
        return {(path / rel).resolve(): entry["sha256"] for rel, entry in manifest["files"].items()
                if entry.get("hash") == BLOCK_HASH}

    def find_good(self, name: str | None = None, *, deep: bool = True,
                  rejected: set[str] | None = None) -> CheckpointInfo | None:
        """The named checkpoint, or the newest good one not `rejected`; verified on rank 0
        (see `verify` for `deep`), agreed by all."""
        chosen: dict[str, Any] | None = None
        if self.rank == 0:
            candidates = [c for c in self.list() if c.name not in (rejected or set())]
            if name is not None:
                candidates = [c for c in candidates if c.name == name]
                if not candidates:
                    known = ", ".join(c.name for c in self.list()) or "none"
                    raise CheckpointError(f"resumeFrom: no checkpoint named {name!r} (have: {known})")
            else:
                latest = self._latest_name()
                if latest:
                    # the pointer wins over directory order, newer dirs without it are ignored
                    candidates = [c for c in candidates if c.name <= latest] or candidates
            for info in reversed(candidates):
                problem = self.verify(info.path, deep=deep)
                if problem is None:
                    chosen = info.public()
                    break
                self.log(f"checkpoint {info.name} rejected: {problem}; falling back to the previous one")
                if name is not None:
                    raise CheckpointError(f"resumeFrom: checkpoint {name} is damaged ({problem})")
        chosen = self.broadcast(chosen)
        if chosen is None:
            return None
        return self._info_from(chosen, self.root / chosen["name"])

    def adopt(self, name: str) -> builtins.list[str]:
        """Make `name` the head of the timeline after a rollback (rank 0 only).

        Newer checkpoints belong to the abandoned timeline: they are renamed out of the way
        (kept, never deleted, so a mistaken rollback can be undone by hand), the `latest`
        pointer is moved, and a marker records that this rollback has been applied.
        """
        target = self.root / name
        if self.read_manifest(target) is None:
            raise CheckpointError(f"cannot adopt {name}: no such checkpoint")
        step = int(self.read_manifest(target)["step"])  # type: ignore[index]
        newer = [info for info in self.list() if info.step > step]
        for info in newer:
            info.path.rename(self.root / f"{ABANDONED}{int(time.time())}-{info.name}")
        write_atomic(self.root / LATEST, name.encode())
        write_atomic(self.root / ROLLBACK_MARKER, name.encode())
        return [info.name for info in newer]

    def applied_rollback(self) -> str | None:
        """The checkpoint the last applied rollback went to, if any."""
        with contextlib.suppress(OSError):
            return (self.root / ROLLBACK_MARKER).read_text().strip() or None
        return None

    def _latest_name(self) -> str | None:
        with contextlib.suppress(OSError):
            return (self.root / LATEST).read_text().strip() or None
        return None


def pending_rollback(requested: str | None, own: str | None, applied: str | None) -> set[str]:
    """What a running attempt's pruning must spare: the checkpoint the job's spec.resumeFrom
    names now (`requested`), unless it is the rollback this attempt was started to apply
    (`own`) or one already applied (`applied`, the volume's marker): a rollback asked for
    after this attempt began, that the next attempt resumes from."""
    if requested is None or requested in (own, applied):
        return set()
    return {requested}
