"""What a checkpoint's pickles may hold: data, never code.

Where this sits: under every load of a checkpoint file (ours, DeepSpeed's, a universal
conversion's) and under `CheckpointStore.verify`, which every restore passes first. A
checkpoint may come back from a volume another process could write or from a bucket
(`checkpoint.mirror`): a pickle can name any Python callable and run it as it loads, in a
trainer that holds the job's S3 keys. So every `.pt` file is read with torch's
`weights_only` unpickler, which builds only tensors, containers, numbers and strings plus
the few classes listed here (each is plain data that DeepSpeed or this runtime writes), and
a checkpoint whose pickles name anything else is refused before any of it is loaded.
Imports torch lazily.
"""

from __future__ import annotations

import importlib
from functools import cache
from pathlib import Path
from typing import Any

# The globals beyond torch's own weights_only set that real checkpoints of every placement
# hold (read off them with torch.serialization.get_unsafe_globals_in_checkpoint): DeepSpeed's
# optimizer states record the ZeRO stage, the loss scaler and each fp32 fragment's address;
# this runtime's state files the numpy generator's state; its split state dicts TensorRefs.
ALLOWED_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    "spillway_runtime.checkpoints.tensor_io.TensorRef",
)

# Where those globals were when an earlier release wrote its checkpoints: its checkpoints still
# load (the runtime's modules moved into subpackages; a pickle names a class by its module).
FORMER_NAMES = {
    "spillway_runtime.ckpt_io.TensorRef": "spillway_runtime.checkpoints.tensor_io.TensorRef",
}


class UnsafePickleError(ValueError):
    """A checkpoint file names a Python global outside ALLOWED_GLOBALS."""


def _named(name: str) -> Any:
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


@cache
def _allowed() -> list[Any]:
    found: list[Any] = [_named(name) for name in ALLOWED_GLOBALS]
    return found + [(_named(now), former) for former, now in FORMER_NAMES.items()]


def is_pickle(path: Path) -> bool:
    """The checkpoint files torch.save wrote (DeepSpeed's and ours end in .pt)."""
    return path.suffix == ".pt"


def unsafe_globals(path: Path) -> list[str]:
    """The globals `path`'s pickle names that neither torch's weights_only unpickler nor
    ALLOWED_GLOBALS admit; read from the pickle's opcodes, nothing is executed."""
    import torch

    try:
        named = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as err:  # not a torch.save file at all: refused as unreadable
        return [f"<unreadable: {type(err).__name__}>"]
    return sorted(set(named) - set(ALLOWED_GLOBALS) - set(FORMER_NAMES))


def load(path: str | Path, map_location: Any = None) -> Any:
    """`torch.load` of a checkpoint file with the weights_only unpickler and ALLOWED_GLOBALS."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(_allowed()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafePickleError(f"{Path(path).name}: refused unread, as data that could run code ({err})") from None
