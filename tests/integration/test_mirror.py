"""Checkpoints mirrored to S3 (spec.checkpoint.mirror, issue 16), against a real SeaweedFS
on loopback: a run whose volume is lost resumes from the mirror bit-identically to the
uninterrupted run; the object store going away mid-run does not stop training, the uploads
retry and catch up when it is back; a mirror that cannot be used fails the run at start;
and a half-uploaded or abandoned checkpoint in the mirror is never restored."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import obstore
import pytest

from spillway_runtime import local
from spillway_runtime.checkpoints.mirror import Mirror, Mirrored
from spillway_runtime.checkpoints.store import LATEST, MANIFEST, checkpoint_name
from spillway_runtime.core.contract import ExitCode
from spillway_runtime.core.spec import SpecError
from spillway_runtime.local import prepare_local_run
from spillway_runtime.training.runconfig import FaultInjection

from .conftest import run_job
from .storage_fixtures import S3Server, s3_server, weed_server  # noqa: F401 -- the fixture, used by name

pytestmark = pytest.mark.integration

BUCKET = "mirror"
MAX_STEPS = 24
EVERY = 4
COMPARED = 20  # steps after the resume that must match the uninterrupted run's, bit for bit
SLOW = FaultInjection(step_sleep_seconds=0.3)  # room to act between steps


@pytest.fixture
def aws_env(s3_server: S3Server, monkeypatch) -> S3Server:  # noqa: F811
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    obstore.put(s3_server.store(BUCKET), "made", b"")  # the bucket (weed makes it on a first put)
    return s3_server


def _job(make_job, name: str, mirror: str, export: str | None = None) -> Path:
    return make_job(name, training={"maxSteps": MAX_STEPS}, offload={"optimizer": "cpu", "parameters": "gpu"},
                    checkpoint={"everySteps": EVERY, "keep": 2, "mirror": mirror},
                    export={"uri": export} if export else None)


def _mirrored(server: S3Server, prefix: str) -> dict[str, int]:
    """Key (under the prefix) -> size of every object in the mirror."""
    store = server.store(BUCKET)
    return {str(m["path"])[len(prefix) + 1:]: int(m["size"])
            for batch in obstore.list(store, prefix=prefix + "/") for m in batch}


def _same_tensors(one: Path, other: Path) -> bool:
    """The two exports' model.safetensors hold the same tensors, bit for bit."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(one / "model.safetensors"), load_file(other / "model.safetensors")
    return set(a) == set(b) and all(
        a[n].dtype == b[n].dtype and torch.equal(a[n].view(-1).view(torch.uint8), b[n].view(-1).view(torch.uint8))
        for n in a)


def _uploaded(step: int):
    return lambda events: any(e["event"] == "mirror" and e["step"] == step for e in events)


def test_a_lost_volume_resumes_from_the_mirror_bit_identically(tmp_path, make_job, aws_env):
    # each upload awaited: the mirror drops a checkpoint still waiting when a newer one comes,
    # which under the gate's load skipped step 8
    reference = run_job(_job(make_job, "reference", f"s3://{BUCKET}/reference", export=f"s3://{BUCKET}/exported"),
                        tmp_path / "reference", faults=FaultInjection(mirror_every_checkpoint=True))
    assert reference.returncode == ExitCode.OK, reference.log[-3000:]
    # the export went up too (spec.export.uri), file for file
    exported = tmp_path / "reference" / "final"
    files = {p.relative_to(exported).as_posix(): p.stat().st_size for p in exported.rglob("*") if p.is_file()}
    assert "model.safetensors" in files and _mirrored(aws_env, "exported") == files
    [uploaded] = reference.of("export_uploaded")
    assert uploaded["bytes"] == sum(files.values())
    # every checkpoint went up (its manifest last), the volume's `keep` is the mirror's too
    uploads = reference.of("mirror")
    assert [e["step"] for e in uploads] == list(range(EVERY, MAX_STEPS + 1, EVERY))
    objects = _mirrored(aws_env, "reference")
    final = checkpoint_name(MAX_STEPS)
    on_volume = tmp_path / "reference" / "checkpoints" / final
    manifest = json.loads((on_volume / MANIFEST).read_text())
    for rel, entry in manifest["files"].items():
        assert objects[f"{final}/{rel}"] == entry["size"] == (on_volume / rel).stat().st_size
    assert {key.split("/")[0] for key in objects} == {checkpoint_name(MAX_STEPS - EVERY), final, LATEST}
    assert bytes(obstore.get(aws_env.store(BUCKET), f"reference/{LATEST}").bytes()).decode() == final
    assert all(e["bytes"] > 0 and e["bytes_per_s"] > 0 for e in uploads)

    # `spillway export` of a mirrored checkpoint, the newest or one by name, writes the model its
    # copy on the volume gives, to the bit (the newest: the run's own export); a name the mirror
    # does not hold is refused by name
    def export(what: str, out: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "spillway_api.cli", "export", what, "--out", str(out)],
                              capture_output=True, text=True, timeout=300)

    newest = export(f"s3://{BUCKET}/reference", tmp_path / "from-mirror")
    assert newest.returncode == 0, newest.stderr[-3000:]
    assert f"{final} (step {MAX_STEPS})" in newest.stdout
    assert _same_tensors(tmp_path / "from-mirror", exported)
    earlier = checkpoint_name(MAX_STEPS - EVERY)
    named = export(f"s3://{BUCKET}/reference/{earlier}", tmp_path / "earlier-from-mirror")
    assert named.returncode == 0, named.stderr[-3000:]
    on_disk = export(str(tmp_path / "reference" / "checkpoints" / earlier), tmp_path / "earlier-from-volume")
    assert on_disk.returncode == 0, on_disk.stderr[-3000:]
    assert _same_tensors(tmp_path / "earlier-from-mirror", tmp_path / "earlier-from-volume")
    assert not _same_tensors(tmp_path / "earlier-from-mirror", exported)
    absent = export(f"s3://{BUCKET}/reference/{checkpoint_name(EVERY)}", tmp_path / "absent")  # pruned: keep 2
    assert absent.returncode == 2 and checkpoint_name(EVERY) in absent.stderr, absent.stderr[-3000:]

    # a new machine plans with the async-I/O block size the mirrored checkpoint was written under
    empty = tmp_path / "empty"
    assert local._checkpoints_block_size(empty, empty / "checkpoints", reference.config.job.spec) == (
        reference.config.plan.aio.block_size) == manifest["aioBlockSize"]

    # the same job on a node that dies once checkpoint 4 is in the mirror...
    job = _job(make_job, "lost", f"s3://{BUCKET}/lost")
    killed = run_job(job, tmp_path / "first-node", faults=SLOW, signal_when=_uploaded(EVERY))
    assert killed.returncode != ExitCode.OK
    killed_at = max(killed.losses())
    assert EVERY < killed_at < MAX_STEPS
    # ...taking its volume with it: a new node starts from an empty one and the mirror
    shutil.rmtree(tmp_path / "first-node")
    resumed = run_job(job, tmp_path / "second-node")
    assert resumed.returncode == ExitCode.OK, resumed.log[-3000:]
    [restored] = resumed.of("mirror_restored")
    assert restored["checkpoint"] == checkpoint_name(EVERY) and restored["bytes"] > 0
    assert [e["step"] for e in resumed.of("resumed")] == [EVERY]
    expected, got = reference.losses(), resumed.losses()
    assert sorted(got) == list(range(EVERY + 1, MAX_STEPS + 1)) and len(got) >= COMPARED
    mismatches = {s: (got[s], expected[s]) for s in got if got[s] != expected[s]}
    assert not mismatches, f"losses differ from the uninterrupted run: {mismatches}"
    assert _mirrored(aws_env, "lost")[f"{final}/{MANIFEST}"] > 0


def test_the_store_going_away_does_not_stop_training(tmp_path, make_job, monkeypatch):
    """Its own server, stopped after the first upload and started again (same address and
    data) a few steps later: every step trains, the failed uploads are reported and retried,
    and the last checkpoint reaches the mirror before the run ends."""
    root = tmp_path / "weed"
    stack = [weed_server(root)]
    server = stack[0].__enter__()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        obstore.put(server.store(BUCKET), "made", b"")
        job = make_job("flaky", training={"maxSteps": 16}, offload={"optimizer": "cpu", "parameters": "gpu"},
                       checkpoint={"everySteps": 2, "keep": 2, "mirror": f"s3://{BUCKET}/flaky"})
        state: dict[str, Any] = {"stopped_at": None}

        def outage(events: list[dict[str, Any]]) -> bool:
            steps = [e["step"] for e in events if e["event"] == "step"]
            if state["stopped_at"] is None and _uploaded(2)(events):
                stack.pop().__exit__(None, None, None)  # the store goes away
                state["stopped_at"] = max(steps)
            elif state["stopped_at"] is not None and not stack and any(
                    e["event"] == "mirror_failed" for e in events) and max(steps) >= state["stopped_at"] + 4:
                stack.append(weed_server(root, server.ports))  # and comes back where it was
                stack[0].__enter__()
                return True
            return False

        # signal 0: the run is only watched, not signalled, when the store comes back
        run = run_job(job, tmp_path / "run", faults=SLOW, signal_when=outage, sig=0)
    finally:
        for server_context in stack:
            server_context.__exit__(None, None, None)
    assert run.returncode == ExitCode.OK, run.log[-3000:]
    assert sorted(run.losses()) == list(range(1, 17))
    failed = run.of("mirror_failed")
    assert failed and [e["failures"] for e in failed] == list(range(1, len(failed) + 1))
    assert all(e["retry_in_seconds"] > 0 for e in failed)
    assert state["stopped_at"] is not None
    uploads = run.of("mirror")
    assert uploads[-1]["step"] == 16 and any(e["step"] > state["stopped_at"] for e in uploads)
    assert not run.of("mirror_behind")


@pytest.mark.parametrize(("field", "problem"), [("spec.checkpoint.mirror", "missing bucket"),
                                              ("spec.checkpoint.mirror", "wrong secret"),
                                              ("spec.export.uri", "missing bucket")])
def test_a_mirror_that_cannot_be_used_fails_the_run_at_start(tmp_path, make_job, aws_env, monkeypatch, field, problem):
    bucket = "no-such-bucket" if problem == "missing bucket" else BUCKET
    if problem == "wrong secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    if field == "spec.export.uri":
        job = _job(make_job, "refused", f"s3://{BUCKET}/ckpt", export=f"s3://{bucket}/exported")
    else:
        job = _job(make_job, "refused", f"s3://{bucket}/ckpt")
    with pytest.raises(SpecError) as refused:
        prepare_local_run(job, run_dir=tmp_path / "run")
    [reason] = refused.value.problems
    assert reason.startswith(f"{field}: ") and repr(bucket) in reason
    assert ("does not exist" if problem == "missing bucket" else "refused the credentials") in reason
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_runtime_checks_the_mirror_too(tmp_path, make_job, aws_env, monkeypatch):
    """In a pod nothing ran `spillway run`'s check: the runtime's own ends the run with exit 2
    before the first step, naming the bucket (here with `spillway run`'s check skipped)."""
    monkeypatch.setattr(local, "_check_mirror", lambda spec, job_path: None)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    run = run_job(_job(make_job, "unchecked", f"s3://{BUCKET}/ckpt"), tmp_path / "run")
    assert run.returncode == ExitCode.BAD_INPUT, run.log[-3000:]
    assert not run.of("step")
    [failed] = run.of("failed")
    assert failed["reason"].startswith("checkpoint.mirror: ") and "refused the credentials" in failed["reason"]
    assert repr(BUCKET) in failed["reason"]


def _checkpoint(root: Path, step: int, payload: bytes) -> Path:
    path = root / checkpoint_name(step)
    path.mkdir(parents=True)
    (path / "state.pt").write_bytes(payload)
    manifest = {"name": path.name, "step": step, "files": {"state.pt": {"size": len(payload), "sha256": "x"}}}
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def test_only_a_complete_checkpoint_of_the_current_timeline_is_restored(tmp_path, aws_env):
    mirror = Mirror(f"s3://{BUCKET}/timeline", store=aws_env.store(BUCKET))
    mirror.check()
    volume = tmp_path / "volume"
    for step in (2, 4, 6):
        mirror.upload(_checkpoint(volume, step, bytes([step]) * (1000 + step)))
    assert mirror.newest() == checkpoint_name(6)
    # a rollback to step 4: the mirror's newest is 4 from then on, not the abandoned 6
    mirror.point_to(checkpoint_name(4))
    assert mirror.newest() == checkpoint_name(4)
    # the new timeline's step 6 going up: its old copy loses its manifest first, so a
    # kill mid-upload leaves an incomplete 6, and the restore takes 4
    obstore.delete(mirror.store, mirror.key(checkpoint_name(6), MANIFEST))
    assert not mirror.listing()[checkpoint_name(6)].complete
    obstore.put(mirror.store, mirror.key(LATEST), checkpoint_name(6).encode())  # pointer ahead of the manifest
    assert mirror.newest() == checkpoint_name(4)
    path, nbytes = mirror.restore(mirror.newest() or "", tmp_path / "new-volume")
    assert (path / "state.pt").read_bytes() == bytes([4]) * 1004 and nbytes == 1004
    assert (tmp_path / "new-volume" / LATEST).read_text() == checkpoint_name(4)
    assert not [p for p in (tmp_path / "new-volume").iterdir() if p.name.startswith(".")]
    # pruning after the new 6 is up: keep 2 of the complete ones up to it, drop the rest
    shutil.rmtree(volume / checkpoint_name(6))
    mirror.upload(_checkpoint(volume, 6, b"new" * 10))
    assert mirror.prune(Mirrored(checkpoint_name(6), 6, True), keep=2, spared=set()) == [checkpoint_name(2)]
    assert set(mirror.listing()) == {checkpoint_name(4), checkpoint_name(6)}
    assert os.path.basename(mirror.newest() or "") == checkpoint_name(6)
