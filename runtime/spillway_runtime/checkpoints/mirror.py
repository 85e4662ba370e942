"""Checkpoints mirrored to object storage (spec.checkpoint.mirror: s3://BUCKET/PREFIX), so
that they outlive the node and its volume.

After each local atomic checkpoint commits, rank 0 hands it to `CheckpointMirror`, whose
thread uploads it while training goes on. Layout under the prefix:

  step-00000040/<file>...          the checkpoint's files, as on the volume
  step-00000040/manifest.json      uploaded last: a checkpoint without it is incomplete
  latest                           the name of the newest complete one, put after its manifest

A checkpoint uploaded again under the same name (after a rollback) loses its manifest
first, so a half-replaced copy never looks complete. Only the newest committed checkpoint
is wanted: one committed while an older is still uploading replaces it in the queue.
Failures (the store away, a timeout) are retried with backoff; training never waits on
the mirror except at the end (`drain`) and within a stop's grace.

`restore` brings the newest complete checkpoint (or a named one) from the mirror onto an
empty volume, into a staging directory renamed into place, so a killed download never
looks like a checkpoint; the runtime then verifies it against its manifest's checksums
as for any checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spillway_runtime.checkpoints.store import LATEST, MANIFEST, PREFIX, STAGING, _fsync_dir, write_atomic
from spillway_runtime.objectstore import (
    Endpoint,
    ObjectStoreError,
    S3Location,
    _Object,
    download_objects,
    explain,
    open_store,
)

UPLOAD_WORKERS = 4  # files in parallel; each large file is also a parallel multipart upload
PART_BYTES = 16 << 20
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0


def _prefix(loc: S3Location) -> str:
    return loc.key.rstrip("/") + "/" if loc.key.rstrip("/") else ""


@dataclass(frozen=True)
class Mirrored:
    """A checkpoint in the mirror: its name, step and whether its manifest is there."""

    name: str
    step: int
    complete: bool


@dataclass
class MirrorState:
    """What the uploader has done, read by the training thread for events and status."""

    uploaded: str | None = None
    uploaded_step: int | None = None
    failures: int = 0  # consecutive
    last_error: str | None = None
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def check_writable(store: Any, loc: S3Location, where: Endpoint | None = None) -> None:
    """List the prefix (a missing bucket fails here, where a put might create it), then put
    and delete a probe object; any failure is one ObjectStoreError naming the bucket."""
    import obstore

    prefix = _prefix(loc)
    try:
        for _batch in obstore.list(store, prefix=prefix or None, chunk_size=1):
            break
        probe = f"{prefix}.spillway-write-test-{os.getpid()}"
        obstore.put(store, probe, b"x")
        obstore.delete(store, probe)
    except Exception as err:  # every failure becomes one message naming the bucket
        raise explain(loc, err, where, verb="write") from None


def upload_directory(uri: str, path: Path, where: Endpoint | None = None, store: Any = None) -> int:
    """Every file under `path` to `uri`/its relative path (files in parallel, large ones in
    multipart parts); returns the bytes. For the export (spec.export.uri)."""
    import obstore

    loc = S3Location.parse(uri)
    store = store if store is not None else open_store(loc.bucket, where)
    prefix = _prefix(loc)
    files = sorted(p for p in path.rglob("*") if p.is_file())

    def put(file: Path) -> None:
        obstore.put(store, prefix + file.relative_to(path).as_posix(), file, chunk_size=PART_BYTES,
                    max_concurrency=8)

    try:
        with ThreadPoolExecutor(max_workers=UPLOAD_WORKERS) as pool:
            for future in [pool.submit(put, file) for file in files]:
                future.result()
    except Exception as err:  # reported with the bucket and what to check
        raise explain(loc, err, where, verb="write") from None
    return sum(file.stat().st_size for file in files)


class Mirror:
    """The mirror's objects: listing, upload of one checkpoint, pruning, restore."""

    def __init__(self, uri: str, *, where: Endpoint | None = None, store: Any = None):
        self.uri = uri
        self.loc = S3Location.parse(uri)
        self.where = where
        self.store = store if store is not None else open_store(self.loc.bucket, where)
        self.prefix = _prefix(self.loc)

    def key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def check(self) -> None:
        """Fail now, naming the bucket, if the mirror cannot be listed and written: a wrong
        credential or a missing bucket ends the job at start, never after hours of training."""
        check_writable(self.store, self.loc, self.where)

    def objects(self) -> list[_Object]:
        import obstore

        found: list[_Object] = []
        for batch in obstore.list(self.store, prefix=self.prefix or None, chunk_size=1000):
            for meta in batch:
                found.append(_Object(key=str(meta["path"]), etag=str(meta.get("e_tag") or ""),
                                     size=int(meta["size"])))
        return found

    def listing(self) -> dict[str, Mirrored]:
        """The checkpoints under the prefix by name, complete or not."""
        names: dict[str, bool] = {}
        for obj in self.objects():
            rest = obj.key[len(self.prefix):]
            name, _, rel = rest.partition("/")
            if name.startswith(PREFIX) and rel:
                names[name] = names.get(name, False) or rel == MANIFEST
        out = {}
        for name, complete in names.items():
            try:
                out[name] = Mirrored(name, int(name[len(PREFIX):]), complete)
            except ValueError:
                continue
        return out

    def latest(self) -> str | None:
        import obstore

        try:
            return bytes(obstore.get(self.store, self.key(LATEST)).bytes()).decode().strip() or None
        except FileNotFoundError:
            return None

    def manifest(self, name: str) -> dict[str, Any] | None:
        import obstore

        try:
            data = json.loads(bytes(obstore.get(self.store, self.key(name, MANIFEST)).bytes()))
        except (FileNotFoundError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    # --- upload ---------------------------------------------------------------------------

    def upload(self, path: Path) -> int:
        """One committed checkpoint directory, its manifest last, then the `latest` pointer.
        Returns the bytes uploaded."""
        import obstore

        name = path.name
        manifest = json.loads((path / MANIFEST).read_text())
        files = sorted(manifest["files"])
        obstore.delete(self.store, self.key(name, MANIFEST))  # a copy being replaced is incomplete from now on

        def put(rel: str) -> None:
            obstore.put(self.store, self.key(name, rel), path / rel, chunk_size=PART_BYTES, max_concurrency=8)

        with ThreadPoolExecutor(max_workers=UPLOAD_WORKERS) as pool:
            for future in [pool.submit(put, rel) for rel in files]:
                future.result()
        obstore.put(self.store, self.key(name, MANIFEST), (path / MANIFEST).read_bytes())
        obstore.put(self.store, self.key(LATEST), name.encode())
        return sum(int(entry["size"]) for entry in manifest["files"].values()) + (path / MANIFEST).stat().st_size

    def point_to(self, name: str) -> None:
        """After a rollback: the mirror's newest is the checkpoint rolled back to."""
        import obstore

        obstore.put(self.store, self.key(LATEST), name.encode())

    def prune(self, uploaded: Mirrored, keep: int, spared: set[str]) -> list[str]:
        """Drop what the volume would not keep: all but the newest `keep` complete
        checkpoints up to `uploaded` (and `spared`), anything newer than `uploaded` (an
        abandoned timeline's, after a rollback) and incomplete copies of older steps.
        Each goes manifest first, so it is never seen complete and half deleted."""
        import obstore

        listing = self.listing()
        complete = sorted((m for m in listing.values() if m.complete and m.step <= uploaded.step),
                          key=lambda m: m.step)
        kept = {m.name for m in complete[-keep:]} | spared | {uploaded.name}
        doomed = [m for m in listing.values() if m.name not in kept and (m.step != uploaded.step)]
        if not doomed:
            return []
        objects = self.objects()
        for m in sorted(doomed, key=lambda m: m.step):
            keys = [o.key for o in objects if o.key.startswith(self.key(m.name) + "/")]
            manifest = self.key(m.name, MANIFEST)
            if manifest in keys:
                obstore.delete(self.store, manifest)
            rest = [k for k in keys if k != manifest]
            if rest:
                obstore.delete(self.store, rest)
        return [m.name for m in doomed]

    # --- restore --------------------------------------------------------------------------

    def newest(self, name: str | None = None) -> str | None:
        """The checkpoint to restore: `name` if given and complete, else the one `latest`
        names, else the newest complete one."""
        listing = self.listing()
        if name is not None:
            return name if name in listing and listing[name].complete else None
        pointer = self.latest()
        if pointer in listing and listing[pointer].complete:
            return pointer
        complete = sorted((m for m in listing.values() if m.complete), key=lambda m: m.step)
        if pointer in listing:  # a pointer to a half-uploaded one: the newest before it
            complete = [m for m in complete if m.step < listing[pointer].step]
        return complete[-1].name if complete else None

    def restore(self, name: str, root: Path) -> tuple[Path, int]:
        """Download checkpoint `name` into `root` (a staging directory renamed into place)
        and point `latest` at it. Returns its path and bytes."""
        manifest = self.manifest(name)
        if manifest is None:
            raise ObjectStoreError(f"{self.uri}: {name} has no readable manifest")
        staging = root / f"{STAGING}mirror-{name}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        sizes = {self.key(name, rel): int(entry["size"]) for rel, entry in manifest["files"].items()}
        present = {o.key: o for o in self.objects() if o.key in sizes}
        missing = sorted(set(sizes) - set(present))
        wrong = sorted(k for k, o in present.items() if o.size != sizes[k])
        if missing or wrong:
            raise ObjectStoreError(f"{self.uri}: {name} is incomplete in the mirror (missing {missing[:3]}, "
                                   f"wrong size {wrong[:3]})")
        download_objects(self.store, self.loc, staging, list(present.values()), strip=self.key(name) + "/",
                         at=self.where)
        write_atomic(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(root)
        write_atomic(root / LATEST, name.encode())
        return final, sum(sizes.values())


class CheckpointMirror:
    """The background uploader (rank 0): `submit` after each commit, `take_events` from the
    training loop, `drain` at the end and within a stop's grace."""

    def __init__(self, mirror: Mirror, keep: int, spared: Callable[[], set[str]] = set,
                 clock: Callable[[], float] = time.monotonic):
        self.mirror = mirror
        self.keep = keep
        self.spared = spared  # names the volume still keeps past `keep` (best, pinned)
        self.clock = clock
        self.state = MirrorState()
        self._cond = threading.Condition()
        self._pending: tuple[str, int, Path] | None = None
        self._pointer: str | None = None
        self._busy: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="checkpoint-mirror", daemon=True)
        self._thread.start()

    def submit(self, name: str, step: int, path: Path) -> None:
        with self._cond:
            self._pending = (name, step, path)
            self._cond.notify_all()

    def point_to(self, name: str) -> None:
        with self._cond:
            self._pointer = name
            self._pending = None  # an older timeline's checkpoint is no longer wanted
            self._cond.notify_all()

    def in_flight(self) -> set[str]:
        """What the volume's pruning must spare: the checkpoints being or waiting to be uploaded."""
        with self._cond:
            return {n for n in (self._busy, self._pending[0] if self._pending else None) if n}

    def take_events(self) -> list[tuple[str, dict[str, Any]]]:
        with self._cond:
            events, self.state.events = self.state.events, []
            return events

    def idle(self) -> bool:
        with self._cond:
            return self._pending is None and self._pointer is None and self._busy is None

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every submitted checkpoint to be up; True when it is."""
        deadline = self.clock() + timeout
        with self._cond:
            while self._pending is not None or self._pointer is not None or self._busy is not None:
                left = deadline - self.clock()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                if backoff:
                    self._cond.wait(backoff)  # a close or a newer checkpoint wakes it early
                while not self._closed and self._pending is None and self._pointer is None:
                    self._cond.wait()
                if self._closed:
                    return
                pointer, self._pointer = self._pointer, None
                job, self._pending = self._pending, None
                self._busy = job[0] if job else pointer
            try:
                if pointer is not None:
                    self.mirror.point_to(pointer)
                if job is not None:
                    self._upload(*job)
                backoff = 0.0
                with self._cond:
                    self.state.failures = 0
            except Exception as err:  # any failure: counted, reported, retried later
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                with self._cond:
                    self.state.failures += 1
                    self.state.last_error = reason
                    backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self.state.failures - 1))
                    if self._pending is None and job is not None:
                        self._pending = job  # retried unless a newer one came meanwhile
                    if self._pointer is None and pointer is not None:
                        self._pointer = pointer
                    self.state.events.append(("mirror_failed", {
                        "checkpoint": job[0] if job else pointer, "reason": reason,
                        "failures": self.state.failures, "retry_in_seconds": backoff}))
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _upload(self, name: str, step: int, path: Path) -> None:
        started = self.clock()
        nbytes = self.mirror.upload(path)
        seconds = self.clock() - started
        pruned = self.mirror.prune(Mirrored(name, step, True), self.keep, self.spared())
        with self._cond:
            self.state.uploaded, self.state.uploaded_step = name, step
            self.state.last_error = None
            self.state.events.append(("mirror", {
                "checkpoint": name, "step": step, "bytes": nbytes, "seconds": round(seconds, 3),
                "bytes_per_s": round(nbytes / max(seconds, 1e-6)), "pruned": pruned}))
