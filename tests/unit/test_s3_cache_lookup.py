"""The cache-only lookup a training pod makes of its s3:// inputs (objectstore.cached,
runconfig.check_cached_inputs): the manifest and the files, no listing, no download; and
the path the operator names for each URI before anything is fetched (cache_path) is the
one the lookup returns. Filling the cache from a real server is tests/integration/test_s3_sources.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from spillway_runtime.objectstore import ObjectStoreError, cache_path, cached
from spillway_runtime.training.runconfig import resolve_uri


def _cache(root: Path, bucket: str, files: dict[str, bytes]) -> None:
    (root / ".manifests").mkdir(parents=True, exist_ok=True)
    for key, data in files.items():
        (root / bucket / key).parent.mkdir(parents=True, exist_ok=True)
        (root / bucket / key).write_bytes(data)
    entries = {key: {"etag": f'"{i}"', "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
               for i, (key, data) in enumerate(files.items())}
    (root / ".manifests" / f"{bucket}.json").write_text(json.dumps(entries))


def test_a_prefix_and_a_single_object_are_found_where_the_operator_said(tmp_path: Path) -> None:
    _cache(tmp_path, "models", {"tiny/config.json": b"{}", "tiny/model.safetensors": b"x" * 10, "data.jsonl": b"1"})
    for uri in ("s3://models/tiny", "s3://models/tiny/", "s3://models/data.jsonl", "s3://models/tiny/config.json"):
        assert cached(uri, tmp_path) == cache_path(uri, tmp_path) == resolve_uri(uri, Path("/"), tmp_path)
    assert cached("s3://models/tiny", tmp_path) == tmp_path / "models" / "tiny"
    assert cached("s3://models", tmp_path) == tmp_path / "models"


def test_what_the_cache_does_not_hold_is_refused_with_the_uri(tmp_path: Path) -> None:
    _cache(tmp_path, "models", {"tiny/config.json": b"{}", "tiny/model.safetensors": b"x" * 10})
    with pytest.raises(ObjectStoreError, match=r"s3://models/other is not in the cache"):
        cached("s3://models/other", tmp_path)
    with pytest.raises(ObjectStoreError, match=r"s3://nobucket/tiny is not in the cache"):
        cached("s3://nobucket/tiny", tmp_path)
    (tmp_path / "models" / "tiny" / "model.safetensors").write_bytes(b"short")  # not the size fetched
    with pytest.raises(ObjectStoreError, match=r"1 of its 2 cached files are gone .*model.safetensors"):
        cached("s3://models/tiny", tmp_path)
    (tmp_path / "models" / "tiny" / "model.safetensors").unlink()
    with pytest.raises(ObjectStoreError, match=r"1 of its 2 cached files are gone"):
        cached("s3://models/tiny", tmp_path)


def test_without_a_cache_s3_is_refused_by_resolve_uri() -> None:
    with pytest.raises(ValueError, match="unsupported URI scheme 's3'"):
        resolve_uri("s3://models/tiny", Path("/"))
    with pytest.raises(ValueError, match="names no bucket"):
        resolve_uri("s3:///tiny", Path("/"), Path("/cache"))



def test_a_cached_file_whose_content_changed_at_its_size_is_refused_naming_it(tmp_path: Path) -> None:
    """What another writer of the node's cache could leave (a file of the right size, not the
    bytes downloaded): the pod checks every file's sha256 against the manifest's."""
    _cache(tmp_path, "models", {"tiny/config.json": b"{}", "tiny/model.safetensors": b"x" * 10})
    assert cached("s3://models/tiny", tmp_path) == tmp_path / "models" / "tiny"
    (tmp_path / "models" / "tiny" / "model.safetensors").write_bytes(b"y" * 10)  # same size, other bytes
    with pytest.raises(ObjectStoreError, match=r"1 of its 2 cached files differ from what was downloaded "
                                               r"\(sha256 of .*model.safetensors\)"):
        cached("s3://models/tiny", tmp_path)
    # A manifest entry without a checksum (an older cache) is not trusted either: fetched again
    entries = json.loads((tmp_path / ".manifests" / "models.json").read_text())
    for entry in entries.values():
        entry.pop("sha256")
    (tmp_path / ".manifests" / "models.json").write_text(json.dumps(entries))
    (tmp_path / "models" / "tiny" / "model.safetensors").write_bytes(b"x" * 10)
    with pytest.raises(ObjectStoreError, match=r"2 of its 2 cached files are gone"):
        cached("s3://models/tiny", tmp_path)
