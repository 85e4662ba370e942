"""Checkpoints are data, never code: a checkpoint whose pickle would call a Python function as
it loads is refused before anything of it is loaded, naming the file, and the previous good
checkpoint is used; the real files of a run load with torch's weights_only unpickler."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from spillway_runtime.checkpoints import unpickle
from spillway_runtime.checkpoints.store import CheckpointStore
from spillway_runtime.checkpoints.tensor_io import TensorRef, split_state


class Payload:
    """What an attacker who can write the bucket puts in a .pt file: unpickling it runs a command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def saver(state):
    def save(staging: Path) -> None:
        torch.save(state, staging / "rank0-spillway_state.pt")
    return save


def test_a_checkpoint_carrying_a_pickled_call_is_refused_and_the_previous_one_is_used(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    logs: list[str] = []
    store = CheckpointStore(tmp_path / "checkpoints", keep=3, log=logs.append)
    store.save(5, saver({"step": 5, "weights": torch.ones(3)}), {})
    # Its manifest matches its bytes: the manifest is written by whoever wrote the bucket.
    store.save(10, saver({"step": 10, "payload": Payload(marker)}), {})
    good = store.find_good()
    assert good is not None and good.name == "step-00000005"
    assert any("step-00000010 rejected" in line and "rank0-spillway_state.pt" in line and "posix.system" in line
               for line in logs), logs
    with pytest.raises(unpickle.UnsafePickleError, match=r"rank0-spillway_state\.pt"):
        unpickle.load(tmp_path / "checkpoints" / "step-00000010" / "rank0-spillway_state.pt")
    assert not marker.exists()


def test_what_the_runtime_and_deepspeed_write_loads_back(tmp_path: Path) -> None:
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    skeleton, _ = split_state({"big": torch.zeros(1 << 19), "small": torch.ones(2)})
    state = {"rng": np.random.get_state(), "stage": ZeroStageEnum.weights,
             "scaler": DynamicLossScaler(2.0**16, 1000, 1.0, 2, False), "skeleton": skeleton}
    torch.save(state, tmp_path / "state.pt")
    assert unpickle.unsafe_globals(tmp_path / "state.pt") == []
    loaded = unpickle.load(tmp_path / "state.pt")
    assert isinstance(loaded["skeleton"]["big"], TensorRef) and loaded["stage"] == ZeroStageEnum.weights
    assert np.array_equal(loaded["rng"][1], state["rng"][1]) and loaded["scaler"].cur_scale == 2.0**16


def test_a_file_that_is_no_torch_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(b"not a checkpoint")
    [problem] = unpickle.unsafe_globals(path)
    assert problem.startswith("<unreadable")


def test_an_int_enum_is_saved_as_its_value_and_loads_where_python_would_pickle_it_by_name(tmp_path: Path) -> None:
    """Python 3.12 and Debian's 3.11.2 pickle DeepSpeed's ZeroStageEnum(int, Enum) as
    getattr(ZeroStageEnum, 'weights'), which a weights-only load refuses: the checkpoint
    engine's skeleton holds the plain value instead (the real-pod resumes failed on it)."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    skeleton, _ = split_state({"zero_stage": ZeroStageEnum.weights, "nested": [ZeroStageEnum.gradients]})
    assert type(skeleton["zero_stage"]) is int and skeleton["zero_stage"] == ZeroStageEnum.weights == 3
    assert type(skeleton["nested"][0]) is int
    torch.save(skeleton, tmp_path / "optim_states.pt")
    assert unpickle.unsafe_globals(tmp_path / "optim_states.pt") == []
    # What those Pythons write for the member itself, which the scan refuses.

    class ByName:
        def __reduce__(self):
            return (getattr, (ZeroStageEnum, "weights"))

    torch.save({"zero_stage": ByName()}, tmp_path / "by_name.pt")
    assert unpickle.unsafe_globals(tmp_path / "by_name.pt") == ["builtins.getattr"]


def test_a_checkpoint_written_before_the_modules_moved_still_loads(tmp_path: Path, monkeypatch) -> None:
    # What an earlier release's split state dict holds: a TensorRef pickled as
    # spillway_runtime.ckpt_io.TensorRef, the module it lived in then.
    import sys
    import types

    former = types.ModuleType("spillway_runtime.ckpt_io")
    former.TensorRef = TensorRef  # type: ignore[attr-defined]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "spillway_runtime.ckpt_io", former)
        m.setattr(TensorRef, "__module__", "spillway_runtime.ckpt_io")
        torch.save({"w": TensorRef(offset=8, nbytes=12, dtype="float32", shape=(3,))}, tmp_path / "old.pt")
    assert "spillway_runtime.ckpt_io" not in sys.modules
    assert b"spillway_runtime.ckpt_io" in (tmp_path / "old.pt").read_bytes()
    assert unpickle.unsafe_globals(tmp_path / "old.pt") == []
    loaded = unpickle.load(tmp_path / "old.pt")
    assert loaded == {"w": TensorRef(offset=8, nbytes=12, dtype="float32", shape=(3,))}
    assert type(loaded["w"]) is TensorRef
