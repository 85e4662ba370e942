"""The fetch pod's command (`python -m spillway_runtime.s3_fetch`) against a real SeaweedFS
server on loopback, as a process with the AWS variables a pod gets from its Secret: it fills
the cache, a second run downloads nothing (one JSON line per URI in its termination
message says so), the training pod's cache-only lookup then finds every input, and a wrong
secret fails with a message that names the Secret. On real nodes: tests/e2e/realnode/test_real_pods_s3.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from spillway_runtime import s3_fetch
from spillway_runtime.objectstore import cached

from .storage_fixtures import S3Server, s3_server  # noqa: F401 -- the fixture, used by name

pytestmark = pytest.mark.integration
RUNTIME_UID = 1000


def _fetch(server: S3Server, root: Path, out: Path, *uris: str, secret_key: str | None = None
           ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **server.env(secret_key=secret_key)}
    env.pop("AWS_ENDPOINT_URL")  # the pod passes spec.storage.endpointUrl on the command line too
    return subprocess.run([sys.executable, "-m", "spillway_runtime.s3_fetch", "--root", str(root),
                           "--endpoint", server.endpoint, "--secret", "s3-keys", "--out", str(out), *uris],
                          capture_output=True, text=True, env=env, timeout=120)


def test_fetch_fills_the_cache_once_and_the_lookup_finds_it(s3_server: S3Server, tmp_path: Path) -> None:  # noqa: F811
    source = tmp_path / "src"
    (source / "model").mkdir(parents=True)
    (source / "model" / "config.json").write_text("{}")
    (source / "model" / "weights.bin").write_bytes(os.urandom(1 << 20))
    (source / "train.jsonl").write_text('{"text": "a"}\n')
    s3_server.upload("fetch", "m", source / "model")
    s3_server.upload("fetch", "d/train.jsonl", source / "train.jsonl")
    uris = ("s3://fetch/m", "s3://fetch/d/train.jsonl")
    root, out = tmp_path / "cache", tmp_path / "termination-log"
    first = _fetch(s3_server, root, out, *uris)
    assert first.returncode == 0, first.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["uri"], r["objects"], r["downloaded"]) for r in lines] == [(uris[0], 2, 2), (uris[1], 1, 1)]
    second = _fetch(s3_server, root, out, *uris)
    assert second.returncode == 0, second.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["downloaded"], r["cached"]) for r in lines] == [(0, 2), (0, 1)]
    assert (cached(uris[0], root) / "weights.bin").read_bytes() == (source / "model" / "weights.bin").read_bytes()
    assert cached(uris[1], root).read_text() == '{"text": "a"}\n'


def test_a_wrong_secret_or_a_missing_bucket_fails_naming_it(s3_server: S3Server, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "termination-log"
    wrong = _fetch(s3_server, tmp_path / "cache", out, "s3://fetch/m", secret_key="not-the-key")
    assert wrong.returncode == 2
    text = out.read_text()
    assert text.startswith("error: cannot read s3://fetch/m") and "check the Secret 's3-keys'" in text, text
    missing = _fetch(s3_server, tmp_path / "cache", out, "s3://no-such-bucket/m")
    assert missing.returncode == 2 and "bucket 'no-such-bucket' does not exist" in out.read_text(), out.read_text()


def test_a_cache_root_the_training_uid_cannot_write_fails_naming_the_chart_setting() -> None:
    """What a node the chart's probe did not prepare gives the fetch pod (uid 1000, no root
    init container): the kubelet's root-owned 0755 directory. The fetch says so and what to
    do. (A forked child as uid 1000: this checkout's Python lies under root's 0700 home.)"""
    work = Path(tempfile.mkdtemp(prefix="spillway-s3-fetch-", dir="/tmp"))
    try:
        work.chmod(0o755)
        cache, out = work / "cache", work / "termination-log"
        cache.mkdir(mode=0o755)
        out.touch(mode=0o666)
        out.chmod(0o666)
        pid = os.fork()
        if pid == 0:  # the child: drop to the training uid, run the command's main, exit with its code
            code = 3
            try:
                os.setgroups([])
                os.setgid(RUNTIME_UID)
                os.setuid(RUNTIME_UID)
                code = s3_fetch.main(["--root", str(cache), "--out", str(out), "s3://fetch/m"])
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 2
        text = out.read_text()
        assert "not writable by uid 1000" in text and "operator.s3CacheHostPath" in text and "1777" in text, text
        assert list(cache.iterdir()) == []
    finally:
        shutil.rmtree(work)
