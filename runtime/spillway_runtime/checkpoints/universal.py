"""Resume across shapes: a Spillway checkpoint as DeepSpeed's universal checkpoint.

Sits between the recipe's load (`training.checkpointing.Checkpointing._load`, which calls
`write_universal` on rank 0 when the number of processes or the ZeRO stage changed since the
checkpoint) and DeepSpeed's converter (`deepspeed.checkpoint.ds_to_universal`). Our files are
DeepSpeed's with the large tensors split out (`engine.SpillwayCheckpointEngine`): they
are joined back into a native DeepSpeed checkpoint in scratch, DeepSpeed converts that into
one folder per parameter (fp32 master, both Adam moments, whole, not partitioned), and what
DeepSpeed 0.19's loaders need beyond what its converter writes is added (`_complete`).

The optimizer may be on NVMe on either side (ZeRO-3), the parameters not yet. Writing, a
swapped sub-group's state is not in the ZeRO files but in the checkpoint's swap files, which
DeepSpeed's converter never reads: it is put back from them into the joined files
(`_fill_from_swap_files`). Loading, DeepSpeed's own load skips the ZeRO state, and
`filling_swapped_state` fills each sub-group, swapped or not, from the universal files.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from spillway_runtime.checkpoints import unpickle

ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # what a ZeRO-3 engine's universal load reads
ZERO12_MODEL_STATES = "mp_rank_00_model_states.pt"  # and a ZeRO-1/2 engine's
GLOBAL_STATE = "optimizer_state.pt"
SWAP_SUFFIX = ".tensor.swp"


class UniversalError(RuntimeError):
    """The checkpoint cannot be converted; the message says why."""


def write_universal(checkpoint_dir: Path, tag: str, out_dir: Path, load: Callable[[str], Any],
                    read_swap: Callable[[Path], Any] | None = None) -> Path:
    """Write `checkpoint_dir/tag` (a Spillway checkpoint of any number of processes, ZeRO-1/2/3,
    the optimizer in memory or on NVMe) as a universal checkpoint `out_dir/tag`, which an
    engine with `checkpoint.load_universal` loads with `load_checkpoint(out_dir, tag=tag)`
    whatever its number of processes and ZeRO stage. `load` reads one of our files (the
    checkpoint engine's, which checks each tensor file against its recorded digest);
    `read_swap` reads an optimizer swap file's bytes (a uint8 tensor; checked the same way).
    Returns the folder."""
    source = checkpoint_dir / tag
    files = sorted(source.glob("*.pt"))
    if not any(f.name.endswith("optim_states.pt") for f in files):
        raise UniversalError(f"{source} holds no ZeRO optimizer state files")
    native = out_dir / "native" / tag
    target = out_dir / tag
    shutil.rmtree(out_dir, ignore_errors=True)
    native.mkdir(parents=True)
    _write_native(files, native, load, read_swap)
    _convert(native, target)
    shutil.rmtree(out_dir / "native")
    _complete(target)
    return target


def _write_native(files: list[Path], native: Path, load: Callable[[str], Any],
                  read_swap: Callable[[Path], Any] | None) -> None:
    """Our files as DeepSpeed wrote them before the tensors were split out, with the optimizer
    state of swapped sub-groups put back from the swap files: what its converter reads."""
    import torch

    from spillway_runtime.checkpoints.engine import OFFLOADED

    for path in files:
        state = load(str(path))
        if path.name.endswith("optim_states.pt") and (path.parent / OFFLOADED).is_dir():
            _fill_from_swap_files(state, path, load, read_swap or _read_file)
        torch.save(state, native / path.name)


def _fill_from_swap_files(state: dict[str, Any], optim_path: Path, load: Callable[[str], Any],
                          read_swap: Callable[[Path], Any]) -> None:
    """With the optimizer on NVMe, a ZeRO-3 file keeps empty fp32 masters and no Adam moments for
    each swapped sub-group (`optimizer_state.strip_swapped_subgroups`): they are in the
    checkpoint's copy of the rank's swap files, `<ds_id>.tensor.swp`, `exp_avg-<ds_id>...` and
    `exp_avg_sq-<ds_id>...`, where a sub-group's ds_id spans its parameters' ids, first to last.
    Sub-groups hold consecutive parameters, so the swapped ones, in order, are the swap files
    sorted by first id; each file is padded to the I/O alignment and cut to the sub-group's
    partition (ceil(numel / processes) elements of each of its parameters)."""
    from spillway_runtime.checkpoints.engine import saved_swap_dir

    inner = state["optimizer_state_dict"]
    flats, states = inner["fp32_flat_groups"], inner["optimizer_state_dict"]["state"]
    found = re.search(r"zero_pp_rank_(\d+)_", optim_path.name)
    if found is None:
        raise UniversalError(f"{optim_path}: no rank in the name of a ZeRO file")
    rank = int(found.group(1))
    # bf16 training names its optimizer files bf16_zero_pp_rank_..., its model files not
    model_name = optim_path.name.removeprefix("bf16_").replace("optim_states", "model_states")
    model_states = load(str(optim_path.with_name(model_name)))
    count = inner["partition_count"]
    processes = count if isinstance(count, int) else count[0]
    numels = [sum(-(-math.prod(shape) // processes) for shape in group.values())
              for group in model_states["param_shapes"]]
    swapped = [i for i, flat in enumerate(flats) if flat.numel() != numels[i]]
    swap_dir = saved_swap_dir(optim_path.parent, rank)
    ids = sorted((p.name.removesuffix(SWAP_SUFFIX) for p in swap_dir.glob(f"*{SWAP_SUFFIX}")
                  if not p.name.startswith("exp_avg")), key=lambda ds_id: int(ds_id.split("_")[0]))
    if len(ids) != len(swapped):
        raise UniversalError(f"{optim_path}: {len(swapped)} optimizer sub-groups are not in it and {swap_dir} holds "
                             f"swap files for {len(ids)}")
    for i, ds_id in zip(swapped, ids, strict=True):
        first, last = (int(n) for n in ds_id.split("_"))
        if last - first + 1 != len(model_states["param_shapes"][i]):
            raise UniversalError(f"{swap_dir}: swap files {ds_id} do not span sub-group {i}'s "
                                 f"{len(model_states['param_shapes'][i])} parameters")
        flats[i] = _swapped(read_swap, swap_dir / f"{ds_id}{SWAP_SUFFIX}", numels[i])
        for key in ("exp_avg", "exp_avg_sq"):
            states.setdefault(i, {})[key] = _swapped(read_swap, swap_dir / f"{key}-{ds_id}{SWAP_SUFFIX}", numels[i])


def _swapped(read_swap: Callable[[Path], Any], path: Path, numel: int) -> Any:
    import torch

    data = read_swap(path)
    if data.numel() < numel * 4:
        raise UniversalError(f"{path} holds {data.numel()} bytes, under its sub-group's {numel} fp32 elements")
    return data[:numel * 4].view(torch.float32).clone()


def _read_file(path: Path) -> Any:
    import torch

    return torch.from_file(str(path), size=path.stat().st_size, dtype=torch.uint8)


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
    state = unpickle.load(model_states[0])
    _shape_states(zero, {name: shape for group in state["param_shapes"] for name, shape in group.items()})
    _fill_module(state, zero)
    for name in (ZERO12_MODEL_STATES, ZERO3_MODEL_STATES):
        torch.save(state, target / name)

    global_state = unpickle.load(zero / GLOBAL_STATE)
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
            loaded = unpickle.load(path)
            if not isinstance(loaded, dict):
                torch.save({"param": loaded.reshape(tuple(shape)), "cat_dim": 0}, path)


def _fill_module(state: dict[str, Any], zero: Path) -> None:
    import torch

    module = state.get("module") or {}
    for name, tensor in module.items():
        fp32 = zero / name / "fp32.pt"
        if isinstance(tensor, torch.Tensor) and fp32.exists():
            whole = unpickle.load(fp32)["param"]
            if whole.numel() != tensor.numel():
                module[name] = whole.to(tensor.dtype)


def _step(global_state: dict[str, Any], zero: Path) -> Any:

    steps = sorted(zero.glob("*/step.pt"))
    if steps:
        return unpickle.load(steps[0])
    try:
        return global_state["optimizer_state_dict"]["state"][0]["step"]
    except (KeyError, IndexError, TypeError):
        raise UniversalError(f"{zero}: the converted checkpoint records no optimizer step") from None


@contextlib.contextmanager
def filling_swapped_state(zero: Any, target: Path) -> Iterator[None]:
    """A context for `engine.load_checkpoint` of the universal checkpoint `target` where ZeRO-3's
    optimizer state is on NVMe. There DeepSpeed 0.19's load skips the ZeRO state altogether
    (it copies the swap files a native checkpoint holds, then calls `reset_swap_buffers`),
    and its universal loader could not fill a swapped sub-group anyway: between steps its fp32
    masters and moments are empty placeholders. Inside, `reset_swap_buffers` fills every
    sub-group from the universal files instead (`load_swapped_zero3`)."""
    zero.reset_swap_buffers = lambda: load_swapped_zero3(zero, target)
    try:
        yield
    finally:
        del zero.reset_swap_buffers


def load_swapped_zero3(zero: Any, target: Path) -> None:
    """Fill a ZeRO-3 optimizer whose state is swapped to NVMe from the universal checkpoint at
    `target`: each swapped sub-group is swapped in, its fp32 masters and Adam moments are
    overwritten with this rank's partition of the whole tensors, its parameter partition is
    written from the masters and it is swapped out again (to this run's swap folder); a
    sub-group too small to swap is filled where it is. Then the step count and the
    hyperparameters, as DeepSpeed's ZeRO-3 universal load sets them."""

    zero_dir = target / "zero"
    global_state = unpickle.load(zero_dir / GLOBAL_STATE)
    inner = global_state["optimizer_state_dict"]
    step = inner["state"][0]["step"]
    zero._load_global_state_stage3(global_state)
    for i, params in enumerate(zero.fp16_groups):
        swapped = zero._swappable_optimizer_subgroup(i)
        if swapped:
            zero._optimizer_states_and_gradient_swap_in(i)
        masters = zero.fp32_partitioned_groups_flat[i]
        state = zero.optimizer.state[masters]
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            flat = _partition_of(zero, params, zero_dir, key, int(zero.fp16_partitioned_groups_flat_numel[i]))
            if key == "fp32":
                masters.data.copy_(flat)
            elif key in state and state[key].numel() == flat.numel():
                state[key].copy_(flat)  # swapped: the swap buffer that its swap-out writes
            else:
                state[key] = flat  # before the first step (a swap-out registers it then)
        state["step"] = step
        zero.fp16_partitioned_groups_flat[i].data.copy_(masters.data)  # before the swap-out frees the masters
        if swapped:
            zero._optimizer_states_and_gradient_swap_out(i)
        zero._unflatten_partitioned_parameters(i)
    hyperparameters = {k: v for k, v in inner["param_groups"][0].items() if k != "params"}
    for group in zero.optimizer.param_groups:
        group.update(hyperparameters)


def _partition_of(zero: Any, params: list[Any], zero_dir: Path, key: str, numel: int) -> Any:
    """This rank's partition of one state (`key`) of a sub-group's parameters, flat, as ZeRO-3 lays it out."""
    import torch

    flat = torch.zeros(numel, dtype=torch.float32)
    offset = 0
    for param in params:
        part = zero.load_hp_checkpoint_state(str(zero_dir / zero.param_names[param]), key, param=param)
        flat.narrow(0, offset, part.numel()).copy_(part)
        offset += part.numel()
    return flat
