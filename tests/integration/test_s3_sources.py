"""`spillway run` with its model and dataset in S3 (issue 16, local mode), against a real
SeaweedFS server on loopback: it trains from s3://, a second run downloads nothing, a
changed object is fetched again, and a wrong secret or a missing bucket ends the run at
start with exit 2 and a message that names the bucket."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from spillway_api.cli import build_app
from spillway_runtime import objectstore
from spillway_runtime.local import prepare_local_run
from spillway_runtime.objectstore import CACHE_ENV, MANIFESTS, cached, fetch

from .conftest import job_document
from .storage_fixtures import S3Server, s3_server  # noqa: F401 -- the fixture, used by name

pytestmark = pytest.mark.integration

BUCKET = "models"


@pytest.fixture(scope="module")
def uploaded(s3_server: S3Server, tiny_model) -> dict[str, str]:  # noqa: F811
    s3_server.upload(BUCKET, "tiny", tiny_model["model"])
    s3_server.upload(BUCKET, "data/train.jsonl", tiny_model["data"])
    return {"model": f"s3://{BUCKET}/tiny", "data": f"s3://{BUCKET}/data/train.jsonl"}


@pytest.fixture
def s3_env(s3_server: S3Server, tmp_path, monkeypatch) -> dict[str, str]:  # noqa: F811
    env = {**s3_server.env(), CACHE_ENV: str(tmp_path / "s3-cache"),
           "SPILLWAY_DATABASE_URL": f"sqlite:///{tmp_path / 'spillway.db'}"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def _job(tmp_path: Path, name: str, model: str, data: str) -> Path:
    doc = job_document(name, Path("unused"), Path("unused"), training={"maxSteps": 4})
    doc["spec"]["model"]["uri"] = model
    doc["spec"]["dataset"]["uri"] = data
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _fetches(run_dir: Path) -> dict[str, dict]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return {e["field"]: e for e in events if e["event"] == "fetch"}


def test_trains_from_s3_then_reuses_the_cache_and_refetches_a_changed_object(
        tmp_path, s3_env, uploaded, s3_server: S3Server, tiny_model):  # noqa: F811
    job = _job(tmp_path, "from-s3", uploaded["model"], uploaded["data"])
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "spillway_api.cli", "run", str(job), "--run-dir", str(run_dir)],
                            capture_output=True, text=True, env={**os.environ, **s3_env}, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert all(0 < e["loss"] < 20 for e in steps), steps
    model_files = sorted(p.name for p in tiny_model["model"].iterdir() if p.is_file())
    first = _fetches(run_dir)
    assert first["spec.model.uri"]["objects"] == len(model_files)
    assert first["spec.model.uri"]["downloaded"] == len(model_files)
    assert first["spec.dataset.uri"]["downloaded"] == 1
    cache = Path(s3_env[CACHE_ENV])
    assert (cache / BUCKET / "data" / "train.jsonl").read_bytes() == tiny_model["data"].read_bytes()
    assert sorted(p.name for p in (cache / BUCKET / "tiny").iterdir()) == model_files
    manifest = json.loads((cache / MANIFESTS / f"{BUCKET}.json").read_text())
    assert set(manifest) == {f"tiny/{name}" for name in model_files} | {"data/train.jsonl"}
    # each file's checksum, as downloaded (what a pod reading this cache checks it against)
    assert manifest["data/train.jsonl"]["sha256"] == hashlib.sha256(tiny_model["data"].read_bytes()).hexdigest()
    assert cached(uploaded["model"], cache) == cache / BUCKET / "tiny"

    # A second run of the same job: planned again from the cache, nothing downloaded.
    again = tmp_path / "again"
    config = prepare_local_run(job, run_dir=again)
    assert Path(config.model_dir) == cache / BUCKET / "tiny"
    second = _fetches(again)
    assert second["spec.model.uri"]["downloaded"] == 0
    assert second["spec.model.uri"]["cached"] == len(model_files)
    assert second["spec.dataset.uri"]["downloaded"] == 0

    # The dataset changes in the bucket: only it is fetched again, and the cache holds the new bytes.
    changed = tmp_path / "changed.jsonl"
    changed.write_text('{"text": "1 + 1 = 2"}\n' * 50)
    s3_server.upload(BUCKET, "data/train.jsonl", changed)
    third_dir = tmp_path / "third"
    prepare_local_run(job, run_dir=third_dir)
    third = _fetches(third_dir)
    assert third["spec.dataset.uri"]["downloaded"] == 1
    assert third["spec.model.uri"]["downloaded"] == 0
    assert (cache / BUCKET / "data" / "train.jsonl").read_bytes() == changed.read_bytes()
    s3_server.upload(BUCKET, "data/train.jsonl", tiny_model["data"])  # as the other tests expect it


def test_a_damaged_cached_file_is_fetched_again_in_parts_and_no_partial_file_is_left(
        tmp_path, s3_env, uploaded, tiny_model, monkeypatch):
    # parts of 256 KiB: the tiny weights go as several ranged GETs written at their offsets
    monkeypatch.setattr(objectstore, "PART_BYTES", 256 << 10)
    root = tmp_path / "cache"
    first = fetch(uploaded["model"], root=root)
    weights = next(p for p in first.path.iterdir() if p.suffix == ".safetensors")
    original = (tiny_model["model"] / weights.name).read_bytes()
    assert len(original) > 3 * objectstore.PART_BYTES
    assert weights.read_bytes() == original
    weights.write_bytes(original[: len(original) // 2])  # as a copy cut short outside our control would
    second = fetch(uploaded["model"], root=root)
    assert second.downloaded == 1 and second.bytes_downloaded == len(original)
    assert weights.read_bytes() == original
    assert not [p for p in root.rglob("*") if ".part-" in p.name]


def _run_in_process(job: Path, tmp_path: Path) -> tuple[int, str]:
    result = CliRunner().invoke(build_app(), ["run", str(job), "--run-dir", str(tmp_path / "refused")],
                                env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_a_wrong_secret_key_ends_the_run_at_start_naming_the_bucket(tmp_path, s3_env, uploaded, s3_server,  # noqa: F811
                                                                     monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    code, output = _run_in_process(_job(tmp_path, "bad-secret", uploaded["model"], uploaded["data"]), tmp_path)
    assert code == 2, output
    text = " ".join(output.split())
    assert "spec.model.uri" in text and f"s3://{BUCKET}/tiny" in text, text
    assert "AWS_SECRET_ACCESS_KEY" in text, text
    assert not (tmp_path / "refused" / "events.jsonl").exists()  # nothing planned, nothing trained


def test_a_missing_bucket_ends_the_run_at_start_naming_it(tmp_path, s3_env, uploaded):
    code, output = _run_in_process(_job(tmp_path, "no-bucket", uploaded["model"], "s3://no-such-bucket/train.jsonl"),
                                   tmp_path)
    assert code == 2, output
    text = " ".join(output.split())
    assert "spec.dataset.uri" in text and "no-such-bucket" in text and "does not exist" in text, text
    assert not (tmp_path / "refused" / "events.jsonl").exists()


def test_an_empty_prefix_ends_the_run_at_start(tmp_path, s3_env, uploaded):
    code, output = _run_in_process(_job(tmp_path, "empty", f"s3://{BUCKET}/nothing-here", uploaded["data"]), tmp_path)
    assert code == 2, output
    text = " ".join(output.split())
    assert f"s3://{BUCKET}/nothing-here holds no objects" in text, text
