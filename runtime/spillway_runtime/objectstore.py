"""s3:// sources for local mode: the objects under a bucket/prefix, downloaded once into a
cache keyed by their ETags.

Where this sits: `local.prepare_local_run` calls `fetch` for each s3:// URI of the spec
(model, tokenizer, dataset, validation file) before it plans, so a wrong credential, a
missing bucket or an empty prefix ends the run at start (exit 2), never after training
began. In a cluster the operator runs `spillway_runtime.s3_fetch` (which calls `fetch`) in a
short pod on each chosen node, into a node-local cache the training pods then mount
read-only; there the runtime only looks its inputs up (`cached`: the manifest and the
files, no listing and no download).

The client is obstore (the Rust `object_store` crate): boto3's botocore pins
python-dateutil<3, which the pinned kubernetes client (>=3) excludes from our one lock.
It reads the usual AWS variables itself (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3); profiles in
~/.aws are not read.

Cache layout, under $SPILLWAY_S3_CACHE (default ~/.cache/spillway/s3):
  <bucket>/<key>                   each object at its key
  .manifests/<bucket>.json         key -> {etag, size, sha256} of every complete file
An object is fetched again when its ETag or size differs from the manifest's, or its file
is gone; a pod reading a cache another process filled (`cached`) checks every file's
sha256 against the manifest's. A download goes to a temporary name beside its target and is renamed into place
before the manifest names it, so a killed download never looks complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

CACHE_ENV = "SPILLWAY_S3_CACHE"
MANIFESTS = ".manifests"
# Parallel object downloads: enough to keep a fast link busy with a model's many files.
DOWNLOAD_WORKERS = 8
CHUNK_BYTES = 8 << 20
# Objects above this are fetched as ranged parts in parallel.
PART_BYTES = 32 << 20


class ObjectStoreError(ValueError):
    """An s3:// source that cannot be read, with what to check."""


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str  # a single object's key or a prefix; "" for the whole bucket

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        if not uri.startswith("s3://"):
            raise ObjectStoreError(f"{uri!r} is not an s3:// URI")
        bucket, _, key = uri[len("s3://"):].partition("/")
        if not bucket:
            raise ObjectStoreError(f"{uri!r} names no bucket: write s3://BUCKET/PREFIX")
        return cls(bucket, key)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


@dataclass
class FetchResult:
    """What `fetch` found and did; its fields go into the run's `fetch` event."""

    uri: str
    path: Path
    objects: int = 0
    bytes_total: int = 0
    downloaded: int = 0
    bytes_downloaded: int = 0
    seconds: float = 0.0
    removed: int = 0

    def event_fields(self) -> dict[str, Any]:
        return {"uri": self.uri, "path": str(self.path), "objects": self.objects, "bytes": self.bytes_total,
                "downloaded": self.downloaded, "bytes_downloaded": self.bytes_downloaded,
                "cached": self.objects - self.downloaded, "removed": self.removed,
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class _Object:
    key: str
    etag: str
    size: int


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "spillway" / "s3").expanduser()


@dataclass(frozen=True)
class Endpoint:
    """Where the store is, when the spec says (spec.storage): otherwise the AWS variables."""

    url: str | None = None
    region: str | None = None
    secret: str | None = None  # in a pod: the Secret the credentials came from, for messages

    @classmethod
    def of(cls, storage: Any, *, in_pod: bool = False) -> Endpoint:
        """From a spec's `storage` block (None: the environment's)."""
        ref = getattr(storage, "secret_ref", None)
        return cls(getattr(storage, "endpoint_url", None), getattr(storage, "region", None),
                   ref.name if ref is not None and in_pod else None)


def endpoint(where: Endpoint | None = None) -> str:
    """The endpoint in use, for messages ('' for AWS's own)."""
    return ((where.url if where else None) or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL") or "")


def open_store(bucket: str, where: Endpoint | None = None) -> Any:
    """An obstore S3Store for `bucket` from the environment (and spec.storage's endpoint and
    region over it), with short retries: a wrong endpoint should fail the run at start
    within seconds, not after object_store's 3 minutes."""
    from obstore.store import S3Store

    overrides: dict[str, Any] = {}
    if where and where.url:
        overrides["endpoint"] = where.url
    if where and where.region:
        overrides["region"] = where.region
    return S3Store(
        bucket,
        **overrides,
        client_options={"allow_http": endpoint(where).startswith("http://"), "connect_timeout": timedelta(seconds=10)},
        retry_config={"max_retries": 2, "retry_timeout": timedelta(seconds=20),
                      "backoff": {"init_backoff": timedelta(milliseconds=200), "max_backoff": timedelta(seconds=2),
                                  "base": 2}},
    )


def fetch(uri: str, *, root: Path | None = None, store: Any = None, where: Endpoint | None = None) -> FetchResult:
    """Make the objects of `uri` present under the cache and return where they are: the
    object's file for a single object's key, else the prefix's directory."""
    loc = S3Location.parse(uri)
    store = store if store is not None else open_store(loc.bucket, where)
    root = root or cache_root()
    start = time.monotonic()
    objects, single = _listing(store, loc, where)
    base = root / loc.bucket
    path = base / loc.key if single else base / loc.key.rstrip("/")
    result = FetchResult(uri=uri, path=path, objects=len(objects), bytes_total=sum(o.size for o in objects))
    with _locked_manifest(root, loc.bucket) as manifest:
        if not single:
            result.removed = _drop_vanished(manifest, base, _dir_prefix(loc.key), {o.key for o in objects})
        wanted = [o for o in objects if not _is_cached(manifest.entries, base, o)]
        for obj in wanted:  # stale entries go first: a file being replaced is never listed as complete
            manifest.entries.pop(obj.key, None)
        manifest.save()
        if wanted:
            def record(obj: _Object, sha256: str) -> None:  # each complete file at once: a killed run keeps it
                manifest.entries[obj.key] = {"etag": obj.etag, "size": obj.size, "sha256": sha256}
                manifest.save()

            download_objects(store, loc, base, wanted, record, at=where, digests=True)
    result.downloaded = len(wanted)
    result.bytes_downloaded = sum(o.size for o in wanted)
    result.seconds = time.monotonic() - start
    return result


def cache_path(uri: str, root: Path) -> Path:
    """Where `fetch` puts `uri` under `root`: the object's file, or the prefix's directory
    (the same path either way, so the operator can name it before anything is fetched)."""
    loc = S3Location.parse(uri)
    return root / loc.bucket / loc.key.rstrip("/") if loc.key.rstrip("/") else root / loc.bucket


def cached(uri: str, root: Path) -> Path:
    """The cache-only lookup, for a pod that mounts a cache some other process filled: the
    path of `uri` when the bucket's manifest names its objects and every one of their files
    is present at its size. No listing, no download; ObjectStoreError otherwise."""
    loc = S3Location.parse(uri)
    path = root / MANIFESTS / f"{loc.bucket}.json"
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    if not isinstance(entries, dict):
        entries = {}
    base = root / loc.bucket
    if loc.key and not loc.key.endswith("/") and loc.key in entries:
        keys = [loc.key]
    else:
        prefix = _dir_prefix(loc.key)
        keys = [key for key in entries if key.startswith(prefix)]
    if not keys:
        raise ObjectStoreError(f"{loc} is not in the cache at {root} ({path} names none of its objects): "
                               "it is fetched before the training pods start; run the job again to fetch it")
    missing = [key for key in keys if not _is_cached(entries, base, _Object(key, str(entries[key].get("etag")),
                                                                              int(entries[key].get("size", -1))))]
    if missing:
        raise ObjectStoreError(f"{loc}: {len(missing)} of its {len(keys)} cached files are gone from {base} "
                               f"or were cached without a checksum (e.g. {missing[0]}); run the job again to "
                               "fetch them")
    # Each file's content, not just its size: what the training reads is what was downloaded
    with ThreadPoolExecutor(max_workers=DOWNLOAD_WORKERS) as pool:  # hashlib lets go of the GIL
        digests = dict(zip(keys, pool.map(lambda key: file_sha256(base / key), keys), strict=True))
    changed = [key for key in keys if digests[key] != entries[key].get("sha256")]
    if changed:
        raise ObjectStoreError(f"{loc}: {len(changed)} of its {len(keys)} cached files differ from what was "
                               f"downloaded (sha256 of {base / changed[0]}); run the job again to fetch them")
    return cache_path(uri, root)


def file_sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _dir_prefix(key: str) -> str:
    return key.rstrip("/") + "/" if key.rstrip("/") else ""


def _listing(store: Any, loc: S3Location, at: Endpoint | None = None) -> tuple[list[_Object], bool]:
    """The objects to fetch and whether the key named one object (rather than a prefix)."""
    import obstore

    if loc.key and not loc.key.endswith("/"):
        try:
            meta = obstore.head(store, loc.key)
            return [_object(meta)], True
        except Exception as err:  # sorted into "not an object" and real failures
            if not _is_not_found(err):
                raise _explain(loc, err, at) from None
    prefix = _dir_prefix(loc.key)
    found: list[_Object] = []
    try:
        for batch in obstore.list(store, prefix=prefix or None, chunk_size=1000):
            found.extend(_object(meta) for meta in batch if not str(meta["path"]).endswith("/"))
    except Exception as err:  # every failure becomes one message naming the bucket
        raise _explain(loc, err, at) from None
    if not found:
        raise ObjectStoreError(f"{loc} holds no objects: check the bucket and prefix "
                               f"(prefixes are listed as {prefix or '(the whole bucket)'}…)")
    for obj in found:
        _check_key(loc, obj.key)
    return found, False


def _object(meta: Any) -> _Object:
    return _Object(key=str(meta["path"]), etag=str(meta.get("e_tag") or ""), size=int(meta["size"]))


def _check_key(loc: S3Location, key: str) -> None:
    parts = key.split("/")
    if key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ObjectStoreError(f"{loc}: object key {key!r} cannot be a local file name "
                               "(empty, '.' or '..' parts); keep such objects out of the prefix")


def _is_not_found(err: Exception) -> bool:
    """No such object (obstore raises the built-in FileNotFoundError), as opposed to no such bucket."""
    return isinstance(err, FileNotFoundError) and "NoSuchBucket" not in str(err)


def _explain(loc: S3Location, err: Exception, at: Endpoint | None = None, verb: str = "read") -> ObjectStoreError:
    """One line that names the bucket and prefix and says what to check."""
    from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

    text = str(err)
    url = endpoint(at)
    where = f"endpoint {url}" if url else "AWS's endpoint (AWS_ENDPOINT_URL unset)"
    endpoint_field = "spec.storage.endpointUrl" if at and at.url else "AWS_ENDPOINT_URL"
    keys = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    if at and at.secret:
        keys = f"the Secret {at.secret!r} (spec.storage.secretRef: {keys})"
    if "NoSuchBucket" in text or isinstance(err, FileNotFoundError):
        return ObjectStoreError(f"cannot {verb} {loc}: bucket {loc.bucket!r} does not exist at {where}; "
                                f"check the bucket name and {endpoint_field}")
    credentials = ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "403", "401")
    if isinstance(err, PermissionDeniedError | UnauthenticatedError) or any(c in text for c in credentials):
        return ObjectStoreError(f"cannot {verb} {loc}: the object store at {where} refused the credentials "
                                f"for bucket {loc.bucket!r}; check {keys} (and the key's access to this bucket)")
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return ObjectStoreError(f"cannot {verb} {loc} at {where}: {first}; check {endpoint_field}, the network "
                            "and the credentials")


explain = _explain


def _is_cached(entries: dict[str, dict[str, Any]], base: Path, obj: _Object) -> bool:
    entry = entries.get(obj.key)
    # (an entry without a checksum, from before they were kept, is fetched again once)
    if not entry or entry.get("etag") != obj.etag or entry.get("size") != obj.size or not entry.get("sha256"):
        return False
    file = base / obj.key
    return file.is_file() and file.stat().st_size == obj.size


def _drop_vanished(manifest: _Manifest, base: Path, prefix: str, present: set[str]) -> int:
    """Forget and delete cached files of this prefix whose objects are gone, so that a model
    directory holds exactly what the prefix holds."""
    gone = [key for key in manifest.entries if key.startswith(prefix) and key not in present]
    for key in gone:
        manifest.entries.pop(key)
        (base / key).unlink(missing_ok=True)
    return len(gone)


def download_objects(store: Any, loc: S3Location, base: Path, wanted: list[_Object],
                     done: Callable[[_Object, str], None] = lambda obj, sha256: None, *, strip: str = "",
                     at: Endpoint | None = None, digests: bool = False) -> None:
    """Every wanted object to `base`/its key (less `strip`), as parts of at most PART_BYTES
    fetched in parallel (a model's one big weights file keeps every worker busy, as
    boto3's download_file does); `done` is called, one at a time, as each file is in place,
    with its sha256 when `digests` (computed by the worker that wrote its last part)."""
    guard = threading.Lock()
    downloads = [_Download(store, loc, base / obj.key.removeprefix(strip), obj, at) for obj in wanted]

    def part(job: _Download, span: tuple[int, int] | None) -> None:
        if job.write(span):
            sha256 = file_sha256(job.target) if digests else ""
            with guard:
                done(job.obj, sha256)

    try:
        with ThreadPoolExecutor(max_workers=DOWNLOAD_WORKERS) as pool:
            futures = [pool.submit(part, job, span) for job in downloads for span in job.spans()]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    finally:
        for job in downloads:
            job.abandon()


class _Download:
    """One object into a temporary file beside its target, part by part (pwrite at each
    part's offset), renamed into place after the last part and an fsync: never a partial
    file at the target."""

    def __init__(self, store: Any, loc: S3Location, target: Path, obj: _Object, at: Endpoint | None = None) -> None:
        self.store, self.loc, self.target, self.obj, self.at = store, loc, target, obj, at
        target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = target.parent / f".{target.name}.part-{os.getpid()}-{threading.get_ident()}"
        self.fd: int | None = None  # opened by the first part to run: a model's thousand files are not all open at once
        self.lock = threading.Lock()
        self.left = len(self.spans())
        self.done = False

    def spans(self) -> list[tuple[int, int] | None]:
        """None: the whole object in one GET; else (start, end) byte ranges."""
        size = self.obj.size
        if size <= PART_BYTES:
            return [None]
        return [(start, min(start + PART_BYTES, size)) for start in range(0, size, PART_BYTES)]

    def write(self, span: tuple[int, int] | None) -> bool:
        """Fetch one part; True when it was the last and the file is now in place."""
        import obstore

        start, end = span or (0, self.obj.size)
        # if_match: an object replaced while we read it fails the read rather than mixing two versions
        options: dict[str, Any] = {"if_match": self.obj.etag} if self.obj.etag else {}
        if span is not None:
            options["range"] = span
        offset = start
        with self.lock:
            if self.fd is None:
                self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fd = self.fd
        try:
            result = obstore.get(self.store, self.obj.key, options=options)  # type: ignore[arg-type]
            for chunk in result.stream(min_chunk_size=CHUNK_BYTES):
                offset += os.pwrite(fd, chunk, offset)
        except Exception as err:  # reported with the bucket and key
            raise ObjectStoreError(f"{_explain(self.loc, err, self.at)} (while downloading {self.obj.key})") from None
        if offset != end:
            raise ObjectStoreError(f"{self.loc}: {self.obj.key} bytes {start}-{end} ended at {offset}; run again")
        with self.lock:
            self.left -= 1
            if self.left:
                return False
        os.fsync(fd)
        os.close(fd)
        self.fd = None
        os.replace(self.tmp, self.target)
        self.done = True
        return True

    def abandon(self) -> None:
        """After a failure: no temporary file is left behind."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if not self.done:
            self.tmp.unlink(missing_ok=True)


@dataclass
class _Manifest:
    path: Path
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)

    def save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.entries, indent=0, sort_keys=True))
        os.replace(tmp, self.path)


@contextmanager
def _locked_manifest(root: Path, bucket: str) -> Iterator[_Manifest]:
    """The bucket's manifest, held under a file lock: two runs filling the same cache take
    turns, and the second finds the first one's files."""
    folder = root / MANIFESTS
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{bucket}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = folder / f"{bucket}.json"
        try:
            entries = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            entries = {}  # unreadable: everything is fetched again, which is always safe
        yield _Manifest(path, entries if isinstance(entries, dict) else {})
