"""Resume across shapes: a Spillway checkpoint as DeepSpeed's universal checkpoint.

Sits between the recipe's load (`recipe_checkpoints.Checkpointing._load`, which calls
`write_universal` on rank 0 when the number of processes or the ZeRO stage changed since the
checkpoint) and DeepSpeed's converter (`deepspeed.checkpoint.ds_to_universal`). Our files are
DeepSpeed's with the large tensors split out (`ds_checkpoint.SpillwayCheckpointEngine`): they
are joined back into a native DeepSpeed checkpoint in scratch, DeepSpeed converts that into
one folder per parameter (fp32 master, both Adam moments, whole, not partitioned), and what
DeepSpeed 0.19's loaders need beyond what its converter writes is added (`_complete`).

Only optimizer state in memory (CPU or accelerator) on the writing side: with the optimizer
on NVMe, swapped sub-groups are not in the ZeRO files but in swap files beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # what a ZeRO-3 engine's universal load reads
ZERO12_MODEL_STATES = "mp_rank_00_model_states.pt"  # and a ZeRO-1/2 engine's
GLOBAL_STATE = "optimizer_state.pt"


class UniversalError(RuntimeError):
    """The checkpoint cannot be converted; the message says why."""


def write_universal(checkpoint_dir: Path, tag: str, out_dir: Path, load: Callable[[str], Any]) -> Path:
    """Write `checkpoint_dir/tag` (a Spillway checkpoint of any number of processes, ZeRO-1/2/3,
    optimizer state in memory) as a universal checkpoint `out_dir/tag`, which an engine with
    `checkpoint.load_universal` loads with `load_checkpoint(out_dir, tag=tag)` whatever its
    number of processes and ZeRO stage. `load` reads one of our files (the checkpoint
    engine's, which checks each tensor file against its recorded digest). Returns the folder."""
    from spillway_runtime.ds_checkpoint import OFFLOADED

    source = checkpoint_dir / tag
    if (source / OFFLOADED).exists():
        raise UniversalError(f"{source} keeps optimizer state in NVMe swap files; converting it is not supported yet")
    files = sorted(source.glob("*.pt"))
    if not any(f.name.endswith("optim_states.pt") for f in files):
        raise UniversalError(f"{source} holds no ZeRO optimizer state files")
    native = out_dir / "native" / tag
    target = out_dir / tag
    shutil.rmtree(out_dir, ignore_errors=True)
    native.mkdir(parents=True)
    _write_native(files, native, load)
    _convert(native, target)
    shutil.rmtree(out_dir / "native")
    _complete(target)
    return target


def _write_native(files: list[Path], native: Path, load: Callable[[str], Any]) -> None:
    """Our files as DeepSpeed wrote them before the tensors were split out: what its converter reads."""
    import torch

    for path in files:
        torch.save(load(str(path)), native / path.name)


def _convert(native: Path, target: Path) -> None:
    from deepspeed.checkpoint.ds_to_universal import main

    # One worker: DeepSpeed's converter then runs in this process (no pool to spawn inside a
    # training process); its progress prints are kept out of the run's log.
    args = argparse.Namespace(input_folder=str(native), output_folder=str(target), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):
        main(args)


def _complete(target: Path) -> None:
    """What DeepSpeed 0.19's universal loaders read beyond what its converter writes:
    - each state as `{"param": tensor of the parameter's shape}`, which ZeRO-1/2 reads and
      ZeRO-3 accepts (DeepSpeed writes a ZeRO-3 checkpoint's as bare flat tensors);
    - both names of the model-states file (a ZeRO-3 engine reads the ZeRO-3 one, a ZeRO-1/2
      engine the other), with whole weights in the module (a ZeRO-3 checkpoint's are empty
      partitions, which a ZeRO-1/2 engine's strict load would refuse);
    - the step twice: ZeRO-3 reads it from `zero/optimizer_state.pt`, ZeRO-1/2 from each
      parameter's `step.pt`;
    - `ds_version` in the global state, which ZeRO-1/2 asserts (a ZeRO-3 source has none)."""
    import torch

    zero = target / "zero"
    model_states = [target / name for name in (ZERO12_MODEL_STATES, ZERO3_MODEL_STATES) if (target / name).exists()]
    if not model_states:
        raise UniversalError(f"{target}: DeepSpeed's conversion wrote no model-states file")
    state = torch.load(model_states[0], weights_only=False)
    _shape_states(zero, {name: shape for group in state["param_shapes"] for name, shape in group.items()})
    _fill_module(state, zero)
    for name in (ZERO12_MODEL_STATES, ZERO3_MODEL_STATES):
        torch.save(state, target / name)

    global_state = torch.load(zero / GLOBAL_STATE, weights_only=False)
    step = _step(global_state, zero)
    inner = global_state.setdefault("optimizer_state_dict", {})
    inner.setdefault("state", {}).setdefault(0, {})["step"] = step
    inner.setdefault("param_groups", global_state["param_groups"])
    global_state.setdefault("ds_version", state.get("ds_version"))
    torch.save(global_state, zero / GLOBAL_STATE)
    for folder in (p for p in zero.iterdir() if p.is_dir()):
        if not (folder / "step.pt").exists():
            torch.save(step, folder / "step.pt")


def _shape_states(zero: Path, shapes: dict[str, Any]) -> None:
    import torch

    for name, shape in shapes.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            path = zero / name / f"{key}.pt"
            loaded = torch.load(path, weights_only=False)
            if not isinstance(loaded, dict):
                torch.save({"param": loaded.reshape(tuple(shape)), "cat_dim": 0}, path)


def _fill_module(state: dict[str, Any], zero: Path) -> None:
    import torch

    module = state.get("module") or {}
    for name, tensor in module.items():
        fp32 = zero / name / "fp32.pt"
        if isinstance(tensor, torch.Tensor) and fp32.exists():
            whole = torch.load(fp32, weights_only=False)["param"]
            if whole.numel() != tensor.numel():
                module[name] = whole.to(tensor.dtype)


def _step(global_state: dict[str, Any], zero: Path) -> Any:
    import torch

    steps = sorted(zero.glob("*/step.pt"))
    if steps:
        return torch.load(steps[0], weights_only=False)
    try:
        return global_state["optimizer_state_dict"]["state"][0]["step"]
    except (KeyError, IndexError, TypeError):
        raise UniversalError(f"{zero}: the converted checkpoint records no optimizer step") from None
