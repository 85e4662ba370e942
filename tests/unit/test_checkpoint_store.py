"""The atomic checkpoint store on a real filesystem (no DeepSpeed)."""

import errno
import json

import pytest

from spillway_runtime.checkpoints.store import CheckpointError, CheckpointStore, pending_rollback, write_problem


def writer(payload: bytes):
    def save(staging):
        (staging / "shard").mkdir()
        (staging / "shard" / "weights.bin").write_bytes(payload)
    return save


def test_save_commits_manifest_pointer_and_prunes(tmp_path):
    logs = []
    store = CheckpointStore(tmp_path, keep=2, log=logs.append)
    for step in (10, 20, 30):
        info = store.save(step, writer(bytes([step]) * 100), {"loss": 1.0 / step})
    assert info.name == "step-00000030"
    assert (tmp_path / "latest").read_text() == "step-00000030"
    assert [c.step for c in store.list()] == [20, 30]
    manifest = json.loads((tmp_path / "step-00000030" / "manifest.json").read_text())
    assert manifest["files"]["shard/weights.bin"]["size"] == 100
    assert manifest["loss"] == pytest.approx(1 / 30)
    assert not list(tmp_path.glob(".staging-*"))


def test_corrupt_checkpoint_falls_back_to_previous_and_says_so(tmp_path):
    logs = []
    store = CheckpointStore(tmp_path, keep=3, log=logs.append)
    store.save(1, writer(b"a" * 10), {})
    store.save(2, writer(b"b" * 10), {})
    (tmp_path / "step-00000002" / "shard" / "weights.bin").write_bytes(b"c" * 10)
    good = store.find_good()
    assert good is not None and good.name == "step-00000001"
    assert any("step-00000002 rejected" in line and "sha256" in line for line in logs)


def test_named_checkpoint_must_exist(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, writer(b"a"), {})
    with pytest.raises(CheckpointError, match=r"no checkpoint named 'step-00000099' \(have: step-00000001\)"):
        store.find_good("step-00000099")


def test_failed_write_leaves_last_good_checkpoint_and_pointer(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, writer(b"good"), {})

    def fails(staging):
        (staging / "partial").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match=r"no space left.*last good checkpoint is intact"):
        store.save(2, fails, {})
    assert (tmp_path / "latest").read_text() == "step-00000001"
    assert [c.name for c in store.list()] == ["step-00000001"]
    assert not list(tmp_path.glob(".staging-*"))
    assert store.verify(tmp_path / "step-00000001") is None


def test_half_written_staging_dir_is_ignored_and_cleaned(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, writer(b"good"), {})
    (tmp_path / ".staging-step-00000002").mkdir()
    (tmp_path / "step-00000003").mkdir()  # renamed dir without a manifest cannot happen, but is ignored
    assert store.find_good().name == "step-00000001"
    store.save(4, writer(b"next"), {})
    assert not (tmp_path / ".staging-step-00000002").exists()


def test_adopt_moves_newer_checkpoints_aside_and_marks_the_rollback(tmp_path):
    store = CheckpointStore(tmp_path, keep=10)
    for step in (1, 2, 3):
        store.save(step, writer(bytes([step])), {})
    assert store.applied_rollback() is None
    assert store.adopt("step-00000001") == ["step-00000002", "step-00000003"]
    assert [c.name for c in store.list()] == ["step-00000001"]
    assert (tmp_path / "latest").read_text() == "step-00000001"
    assert store.applied_rollback() == "step-00000001"
    assert len(list(tmp_path.glob("abandoned-*"))) == 2


def test_pruning_spares_a_checkpoint_a_pending_rollback_names(tmp_path):
    logs = []
    wanted: set[str] = set()
    store = CheckpointStore(tmp_path, keep=2, log=logs.append, pinned=lambda: set(wanted))
    store.save(1, writer(b"a"), {})
    store.save(2, writer(b"b"), {})
    wanted.add("step-00000001")  # a rollback to it is asked for while this attempt runs
    for step in (3, 4):
        store.save(step, writer(bytes([step])), {})
    assert [c.step for c in store.list()] == [1, 3, 4]
    assert store.find_good("step-00000001") is not None
    assert any("keeping step-00000001 past checkpoint.keep" in line for line in logs)
    wanted.clear()  # applied (or withdrawn): the usual keep again
    store.save(5, writer(b"e"), {})
    assert [c.step for c in store.list()] == [4, 5]


@pytest.mark.parametrize(("requested", "own", "applied", "spared"), [
    (None, None, None, set()),
    ("step-00000003", None, None, {"step-00000003"}),  # asked for after this attempt began
    ("step-00000003", "step-00000003", None, set()),  # this attempt applies it
    ("step-00000003", None, "step-00000003", set()),  # a later attempt of the rolled-back timeline
    ("step-00000006", "step-00000003", "step-00000003", {"step-00000006"}),  # a second rollback
])
def test_pending_rollback_is_only_one_not_yet_begun(requested, own, applied, spared):
    assert pending_rollback(requested, own, applied) == spared


def test_keep_best_spares_the_lowest_held_out_loss_outside_keep(tmp_path):
    logs = []
    store = CheckpointStore(tmp_path, keep=1, log=logs.append, keep_best=True)
    for step, held_out in [(1, 3.0), (2, 1.0), (3, None), (4, 2.0), (5, 1.0)]:
        meta = {"loss": 9.0} | ({"evalLoss": held_out} if held_out is not None else {})
        store.save(step, writer(b"x"), meta)
    # step 2 is the best (the earlier of two equal ones), step 5 the latest
    assert [(c.name, c.eval_loss) for c in store.list()] == [("step-00000002", 1.0), ("step-00000005", 1.0)]
    assert store.list()[0].public()["evalLoss"] == 1.0
    assert any("step-00000002 past checkpoint.keep: the lowest held-out loss (1.0)" in line for line in logs)
    plain = CheckpointStore(tmp_path / "plain", keep=1)
    for step, held_out in [(1, 1.0), (2, 2.0)]:
        plain.save(step, writer(b"x"), {"evalLoss": held_out})
    assert [c.step for c in plain.list()] == [2]


def test_write_problem_names_why_a_directory_takes_no_file_and_leaves_nothing(tmp_path):
    assert write_problem(tmp_path / "new" / "dir") is None  # created, written, cleaned up
    assert list((tmp_path / "new" / "dir").iterdir()) == []
    (tmp_path / "a-file").write_text("")
    assert write_problem(tmp_path / "a-file" / "sub") == "Not a directory"
