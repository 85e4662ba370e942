"""RLIMIT_MEMLOCK, shared out: what the checkpoint's I/O buffers may lock, what DeepSpeed 0.19.8
locks for its NVMe swap (counted byte for byte), and the fit of its buffers under the rest.

DeepSpeed mlock()s its swap buffers whatever `pin_memory` says (its async I/O's
`new_cpu_locked_tensor`: page-aligned `posix_memalign` + `mlock`); when that exceeds the limit
it prints "mlock failed" and dies of SIGSEGV. A container run as a non-root uid gets its
runtime's limit (8 MiB under systemd's default) and no CAP_IPC_LOCK to ignore it. The runtime
fits a pod's swap to the limit it finds (`core.hardware.memlock_limit`) and the tensors it
trains; the planner, to the limit the node probe found (`NodeHardware.memlock_bytes`) and the
model's shape. Pure arithmetic.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from spillway_runtime.core.estimates import MIN_AIO_BYTES, sub_groups
from spillway_runtime.core.placement_inputs import OPTIMIZER_SWAP_BUFFERS

PROBE_SHARE = 0.75  # of RLIMIT_MEMLOCK, what the node probe's async I/O sweep may lock (no training beside it)
CHUNK = 32 << 20  # the checkpoint's bytes per I/O and per hashed block (`checkpoints.tensor_io`)
READ_AHEAD = 4  # a checkpoint read's buffers: reads in flight while earlier chunks are copied and hashed
# Of RLIMIT_MEMLOCK, what the checkpoint's I/O buffers (two to write, READ_AHEAD to read) may
# lock together; DeepSpeed's swap buffers are fitted under the rest (`fit_swap_buffers_to_memlock`).
CHECKPOINT_SHARE = 0.15
MIN_CHUNK = 1 << 20  # under it, no buffers are locked: the checkpoint's I/O goes through the page cache
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")  # mlock() locks whole pages; DeepSpeed's allocations start on one
MASTER_BYTES = 4  # the optimizer swapper's element: fp32 masters, moments and gradients
# DeepSpeed's defaults where the config leaves a setting out
DEFAULT_SUB_GROUP = 1_000_000_000
DEFAULT_PARAM_BUFFERS = 5
DEFAULT_PARAM_BUFFER_SIZE = 100_000_000


def merge_settings(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed settings with `override` merged in last, block by block: what
    `training.dsconfig` does with a job's offload.deepspeed, and the planner to count the
    swap those settings lock."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_settings(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class MemlockError(ValueError):
    """DeepSpeed's swap buffers cannot fit under the limit, or the config contradicts itself."""


def chunk_under(memlock: int | None) -> int:
    """The checkpoint's I/O chunk where this process may lock `memlock` bytes (None: no limit)."""
    return CHUNK if memlock is None else min(CHUNK, int(memlock * CHECKPOINT_SHARE) // (2 + READ_AHEAD))


def checkpoint_locked_bytes(memlock: int | None) -> int:
    """The most the checkpoint's buffers lock at once under RLIMIT_MEMLOCK `memlock`."""
    chunk = chunk_under(memlock)
    return (2 + READ_AHEAD) * chunk if chunk >= MIN_CHUNK else 0


def swap_budget(memlock: int | None) -> int | None:
    """What DeepSpeed's swap buffers may lock under `memlock` (None: no limit), beside the checkpoint's."""
    return None if memlock is None else memlock - checkpoint_locked_bytes(memlock)


@dataclass(frozen=True)
class Trainable:
    """What DeepSpeed cuts its optimizer sub-groups from: the trainable tensors' whole elements,
    in the order the optimizer gets them, and the processes that share each."""

    tensors: tuple[int, ...]
    ranks: int

    def groups(self, sub_group_size: int) -> tuple[tuple[int, ...], ...]:
        return sub_groups(self.tensors, self.ranks, max(1, sub_group_size))

    def share(self, group: tuple[int, ...]) -> int:
        """A rank's elements of a sub-group (each tensor's ceil(elements / ranks))."""
        return sum(-(-n // self.ranks) for n in group)

    def largest_share(self, sub_group_size: int) -> int:
        return max(self.share(g) for g in self.groups(sub_group_size))


def _aligned(elements: int, element_bytes: int, intra_op: int) -> int:
    align = max(1, 1024 * intra_op // element_bytes)
    return -(-elements // align) * align


def _locked(elements: int, element_bytes: int, intra_op: int) -> int:
    """Bytes one locked allocation of `elements` takes: DeepSpeed aligns each swapped tensor to
    1 KiB per intra-op thread (`_io_aligned_numel`), and mlock() whole pages."""
    nbytes = _aligned(elements, element_bytes, intra_op) * element_bytes
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


@dataclass(frozen=True)
class SwapLocks:
    """The settings of a DeepSpeed config that decide what its NVMe swap locks, read once."""

    sub_group_size: int
    optimizer_device: str
    optimizer_buffers: int
    fast_init: bool
    param_device: str
    param_buffers: int
    param_buffer_size: int
    intra_op: int
    dtype_bytes: int  # the model's dtype, in which the parameter swapper holds it
    min_swap: int  # DeepSpeed's minimum swap size in elements: under it, the state stays in RAM
    pipeline_off: bool = False  # the fit took DeepSpeed's fewest optimizer buffers: no pipelined swap I/O

    @classmethod
    def of(cls, config: dict[str, Any]) -> SwapLocks:
        zero = config.get("zero_optimization") or {}
        optimizer, param = zero.get("offload_optimizer") or {}, zero.get("offload_param") or {}
        aio = config.get("aio") or {}
        return cls(
            sub_group_size=int(zero.get("sub_group_size", DEFAULT_SUB_GROUP)),
            optimizer_device=str(optimizer.get("device", "none")),
            optimizer_buffers=int(optimizer.get("buffer_count", OPTIMIZER_SWAP_BUFFERS)),
            fast_init=bool(optimizer.get("fast_init")),
            param_device=str(param.get("device", "none")),
            param_buffers=int(param.get("buffer_count", DEFAULT_PARAM_BUFFERS)),
            param_buffer_size=int(param.get("buffer_size", DEFAULT_PARAM_BUFFER_SIZE)),
            intra_op=int(aio.get("intra_op_parallelism", 1)),
            dtype_bytes=2 if any((config.get(k) or {}).get("enabled") for k in ("bf16", "fp16")) else 4,
            min_swap=max(MIN_AIO_BYTES, int(aio.get("block_size", 0))) // MASTER_BYTES,
        )

    def locked(self, trainable: Trainable | None, parameter_swappers: int = 1) -> int:
        """See `locked_swap_bytes`."""
        locked = 0
        if self.param_device == "nvme":
            buffers = self.param_buffers * _aligned(self.param_buffer_size, self.dtype_bytes, self.intra_op)
            locked += parameter_swappers * _locked(buffers, self.dtype_bytes, self.intra_op)
        if trainable is None or not trainable.tensors:
            return locked
        groups = trainable.groups(self.sub_group_size)
        largest = max(groups, key=trainable.share)  # the first of the largest, as DeepSpeed picks it
        if self.param_device == "nvme":
            whole = sum(_aligned(n, self.dtype_bytes, self.intra_op) for n in largest)
            locked += _locked(whole, self.dtype_bytes, self.intra_op)
        if self.optimizer_device == "nvme":
            locked += self.optimizer_buffers * _locked(trainable.share(largest), MASTER_BYTES, self.intra_op)
        return locked

    def holds_sub_groups(self, trainable: Trainable) -> bool:
        """With the parameters and the optimizer on NVMe and `offload_optimizer.fast_init` (an
        override: Spillway does not set it), DeepSpeed first builds the fp32 state by reading each
        sub-group's 16-bit share through the parameter swapper's buffers, and asserts that each
        holds the largest (`_initialize_from_swapped_fp16_params`); without it, one parameter at
        a time."""
        if self.optimizer_device != "nvme" or self.param_device != "nvme" or not self.fast_init:
            return True
        buffer = _aligned(self.param_buffer_size, self.dtype_bytes, self.intra_op)
        return buffer >= _aligned(trainable.largest_share(self.sub_group_size), MASTER_BYTES, self.intra_op)


def locked_swap_bytes(config: dict[str, Any], trainable: Trainable | None, parameter_swappers: int = 1) -> int:
    """What DeepSpeed 0.19.8 locks in RAM (mlock, its async I/O's `new_cpu_locked_tensor`) for
    the NVMe swap of `config`, byte for byte:
    - each parameter swapper's buffers (`AsyncPartitionedParameterSwapper`, made by zero.Init as
      the model loads): buffer_count x buffer_size elements of the model's dtype, each aligned,
      in one allocation; DPO's frozen reference of a full fine-tune has its own
      (`parameter_swappers` 2);
    - with the optimizer built, the partitioned swap buffer the updated 16-bit parameters leave
      through (`reserve_partitioned_swap_space`): the whole tensors, not a rank's share, of the
      sub-group whose share is largest;
    - the optimizer swapper's buffers (`SwapBufferManager`): buffer_count allocations of the
      largest sub-group's share in fp32 (the gradient being swapped takes one of them).
    `trainable` None: what is locked before the optimizer is built (the parameter swappers')."""
    return SwapLocks.of(config).locked(trainable, parameter_swappers)


def fit_swap_buffers_to_memlock(
    config: dict[str, Any], trainable: Trainable | None, limit: int | None, parameter_swappers: int = 1
) -> tuple[dict[str, Any], str | None]:
    """`fit_swap` on a DeepSpeed config: the config to use (a copy where it changed) and what
    changed."""
    given = SwapLocks.of(config)
    fitted, why = fit_swap(given, trainable, limit, parameter_swappers)
    if fitted == given:
        return config, why
    out = copy.deepcopy(config)
    out["zero_optimization"]["sub_group_size"] = fitted.sub_group_size
    if fitted.pipeline_off:
        out["zero_optimization"]["offload_optimizer"].update(
            {"buffer_count": fitted.optimizer_buffers, "pipeline_read": False, "pipeline_write": False})
    return out, why


def fit_swap(given: SwapLocks, trainable: Trainable | None, limit: int | None,
             parameter_swappers: int = 1) -> tuple[SwapLocks, str | None]:
    """Fit what DeepSpeed locks (`locked_swap_bytes`) under RLIMIT_MEMLOCK `limit`, beside the
    checkpoint's own locked buffers: DeepSpeed's fewest optimizer buffers (no pipelined I/O),
    then smaller sub-groups (the optimizer's buffers and the parameters' partitioned swap buffer
    hold the largest; Adam is elementwise: the same numbers in smaller pieces), with the
    optimizer on NVMe never below DeepSpeed's minimum swap size, under which it would silently
    keep the state in RAM. A sub-group runs to the end of a tensor, so the largest tensor bounds
    the fit. Where even that cannot fit, `MemlockError` says so by name. Sub-groups are also cut
    finer, limit or none, where the parameter swapper's buffers must hold them
    (`holds_sub_groups`). `trainable` None: before the model is built, the parameter swappers'
    buffers only (they are locked as it loads). `limit` None: no limit applies. Returns the
    settings to use and what changed."""
    budget = swap_budget(limit)

    def fits(settings: SwapLocks) -> bool:
        return ((budget is None or settings.locked(trainable, parameter_swappers) <= budget)
                and (trainable is None or settings.holds_sub_groups(trainable)))

    if fits(given):
        return given, None
    need = given.locked(trainable, parameter_swappers)
    over_limit = budget is not None and need > budget
    checkpoint = f", of which the checkpoint takes {_mib(limit - budget)}" if limit and budget and limit > budget else ""
    refusal = (f"DeepSpeed locks {_mib(need)} of NVMe swap buffers in RAM (mlock) but this process may lock "
               f"{_mib(limit or 0)} (RLIMIT_MEMLOCK{checkpoint})" if over_limit else
               "offload.deepspeed: zero_optimization.offload_param.buffer_size holds no optimizer sub-group, which "
               "offload_optimizer.fast_init reads through it")
    remedy = ("raise the limit where the run starts (`ulimit -l unlimited`; in a cluster, the node's container "
              "runtime, e.g. LimitMEMLOCK=infinity in containerd's systemd unit), or keep the state in CPU RAM "
              "(offload.optimizer/parameters: cpu)" if over_limit else "remove fast_init or raise buffer_size")
    if trainable is None or "nvme" not in (given.optimizer_device, given.param_device):
        swappers = (f"the parameter swapper's {given.param_buffers} buffers of {given.param_buffer_size:,} elements"
                    if given.param_device == "nvme" else "")
        raise MemlockError(f"{refusal}{': ' + swappers if trainable is None and swappers else ''}: {remedy}")
    fewest = (dataclasses.replace(given, optimizer_buffers=OPTIMIZER_SWAP_BUFFERS, pipeline_off=True)
              if over_limit and given.optimizer_device == "nvme" else given)

    def at(sub_group_size: int) -> SwapLocks:
        return dataclasses.replace(fewest, sub_group_size=sub_group_size)

    if not fits(at(1)):  # every tensor a sub-group of its own: the largest still cannot fit
        largest = max(trainable.tensors)
        raise MemlockError(
            f"{refusal}: even with every tensor a sub-group of its own DeepSpeed's swap buffers lock "
            f"{_mib(at(1).locked(trainable, parameter_swappers))}, as each holds a whole one (the largest: "
            f"{largest:,} elements, {-(-largest // trainable.ranks):,} a process); {remedy}")
    low, high = 1, min(given.sub_group_size, trainable.share(trainable.tensors))  # the largest that fits, by bisection
    while low < high:  # (the cut is not monotone in the size everywhere: a size that fits, maybe not the largest)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(at(mid)) else (low, mid - 1)
    largest_share = trainable.largest_share(given.sub_group_size)
    if given.optimizer_device == "nvme" and low < min(given.min_swap, largest_share):
        raise MemlockError(
            f"{refusal}: sub-groups small enough to fit ({low:,} elements) are under DeepSpeed's minimum swap "
            f"size ({given.min_swap:,}), where it would keep the state in RAM unplanned; {remedy}")
    fitted = at(low)
    why = (f"DeepSpeed locks {_mib(fitted.locked(trainable, parameter_swappers))} of swap buffers and RLIMIT_MEMLOCK "
           f"is {_mib(limit or 0)} (raise it for larger, pipelined swap I/O)" if over_limit else
           "the parameter swapper's buffers, through which fast_init reads each sub-group, hold no more")
    if given.optimizer_device != "nvme":
        return fitted, (f"optimizer sub-groups of {low:,} elements, not {given.sub_group_size:,}: the parameters' "
                        f"partitioned swap buffer holds the largest whole; {why}")
    return fitted, (f"optimizer swap: {fitted.optimizer_buffers} buffers of {trainable.largest_share(low):,} elements "
                    f"(sub-groups of {low:,}), not {given.optimizer_buffers} of {largest_share:,}: {why}")


def floor_locked(given: SwapLocks, trainable: Trainable, parameter_swappers: int = 1) -> int:
    """The least DeepSpeed can lock for `given`'s swap: its fewest optimizer buffers, with
    sub-groups as small as `fit_swap` cuts them (every tensor its own; with the optimizer on
    NVMe, none under the minimum swap size)."""
    smallest = 1
    if given.optimizer_device == "nvme":
        smallest = max(1, min(given.min_swap, trainable.largest_share(given.sub_group_size)))
        given = dataclasses.replace(given, optimizer_buffers=OPTIMIZER_SWAP_BUFFERS)
    return dataclasses.replace(given, sub_group_size=smallest).locked(trainable, parameter_swappers)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
