"""The count of what DeepSpeed locks for its NVMe swap, and its fit under RLIMIT_MEMLOCK
(`core.memlock`); the same under a real 8 MiB limit: tests/integration/test_memlock_fit.py."""

import pytest

from spillway_runtime.core.memlock import (
    MemlockError,
    Trainable,
    checkpoint_locked_bytes,
    fit_swap_buffers_to_memlock,
    locked_swap_bytes,
)


def test_what_deepspeed_locks_is_counted_as_deepspeed_allocates_it():
    config = {"bf16": {"enabled": True}, "aio": {"intra_op_parallelism": 2},
              "zero_optimization": {"sub_group_size": 1000,
                                    "offload_optimizer": {"device": "nvme", "buffer_count": 4},
                                    "offload_param": {"device": "nvme", "buffer_count": 5, "buffer_size": 100_000}}}
    # Two ranks' shares: 300, 150, 1000, 5, 3. The first sub-group closes at 1,450 (past 1,000).
    trainable = Trainable((600, 300, 2000, 10, 5), ranks=2)
    # The parameter swapper: 5 buffers of 100,000 bf16 elements, each aligned to 1 KiB per intra-op
    # thread (100,352), in one allocation of 1,003,520 bytes (245 pages).
    parameters = 1_003_520
    # The partitioned swap buffer: the largest sub-group's whole tensors, each aligned (1,024 +
    # 1,024 + 2,048 elements), 8,192 bytes. The optimizer's: 4 buffers of its 1,450-element
    # share in fp32, aligned to 1,536 elements (6,144 bytes), each locked as 2 pages.
    assert locked_swap_bytes(config, trainable) == parameters + 8_192 + 4 * 8_192
    assert locked_swap_bytes(config, trainable, parameter_swappers=2) == 2 * parameters + 8_192 + 4 * 8_192
    assert locked_swap_bytes(config, None) == parameters  # before the optimizer is built
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    assert locked_swap_bytes(config, trainable) == 4 * 8_192
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert locked_swap_bytes(config, trainable) == 0


def many(count: int, elements: int) -> Trainable:
    """A rank's partition of many equal tensors."""
    return Trainable((elements,) * count, ranks=1)


def test_swap_buffers_are_fitted_under_the_memlock_limit_or_refused_by_name():
    config = {"zero_optimization": {"sub_group_size": 1_000_000_000,
                                    "offload_optimizer": {"device": "nvme", "buffer_count": 4}}}
    model = many(100, 7_528)  # 752,800 elements
    # No limit (root's CAP_IPC_LOCK, or unlimited): nothing changes.
    assert fit_swap_buffers_to_memlock(config, model, None) == (config, None)
    # A container's 8 MiB: 8 pipelined buffers of 752,800 fp32 elements (23 MiB) would kill DeepSpeed.
    config["zero_optimization"]["offload_optimizer"].update({"buffer_count": 8, "pipeline_read": True})
    fitted, why = fit_swap_buffers_to_memlock(config, model, 8 << 20)
    sub_group = fitted["zero_optimization"]["sub_group_size"]
    swap = fitted["zero_optimization"]["offload_optimizer"]
    assert (swap["buffer_count"], swap["pipeline_read"], swap["pipeline_write"]) == (4, False, False)
    assert locked_swap_bytes(fitted, model) <= 8 << 20  # the checkpoint locks nothing under 40 MiB
    # the largest size that fits: one tensor more in each sub-group would not
    larger = {**fitted, "zero_optimization": {**fitted["zero_optimization"], "sub_group_size": sub_group + 7_528}}
    assert locked_swap_bytes(larger, model) > 8 << 20
    assert sub_group * 4 >= 1 << 20  # still above DeepSpeed's minimum swap size: it still swaps
    assert why is not None and "RLIMIT_MEMLOCK is 8.0 MiB" in why
    assert "4 buffers of 519,432 elements (sub-groups of 519,432)" in why
    # A limit where only sub-groups under DeepSpeed's minimum swap size fit: refused by name.
    with pytest.raises(MemlockError, match="minimum swap size"):
        fit_swap_buffers_to_memlock(config, model, 4 << 20)
    assert config["zero_optimization"]["sub_group_size"] == 1_000_000_000  # the input is left as it was
    assert config["zero_optimization"]["offload_optimizer"]["buffer_count"] == 8
    # A tensor larger than any sub-group size can cut: its buffers alone would not fit.
    with pytest.raises(MemlockError, match=r"lock 16\.0 MiB, as each holds a whole one \(the largest: 1,048,576"):
        fit_swap_buffers_to_memlock(config, Trainable((1_048_576, 7_528), ranks=1), 8 << 20)
    # Already small enough: unchanged.
    assert fit_swap_buffers_to_memlock(config, many(100, 1_000), 8 << 20) == (config, None)
    # Where the checkpoint may lock buffers of its own (at 64 MiB, 6 of 1.6 MiB), DeepSpeed gets the rest.
    fitted, _ = fit_swap_buffers_to_memlock(config, many(100, 40_000), 64 << 20)
    assert locked_swap_bytes(fitted, many(100, 40_000)) <= (64 << 20) - checkpoint_locked_bytes(64 << 20) < 55 << 20
    # Parameter buffers alone over the limit: a clear error before the model loads, not a SIGSEGV.
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "buffer_count": 5, "buffer_size": 100_000_000}
    with pytest.raises(MemlockError, match=r"RLIMIT_MEMLOCK.*LimitMEMLOCK=infinity"):
        fit_swap_buffers_to_memlock(config, None, 8 << 20)


def test_sub_groups_are_cut_finer_where_fast_init_reads_them_through_the_parameter_swappers_buffers():
    """With both on NVMe and `offload_optimizer.fast_init` (an override) DeepSpeed first reads
    each sub-group through the parameter swapper's buffers and asserts they hold the largest;
    without it, one parameter at a time, and nothing needs cutting."""
    config = {"bf16": {"enabled": True},
              "zero_optimization": {"sub_group_size": 1_000_000,
                                    "offload_optimizer": {"device": "nvme", "buffer_count": 12, "pipeline_read": True},
                                    "offload_param": {"device": "nvme", "buffer_count": 16, "buffer_size": 300_000}}}
    model = many(100, 7_500)
    assert fit_swap_buffers_to_memlock(config, model, None) == (config, None)
    config["zero_optimization"]["offload_optimizer"]["fast_init"] = True
    fitted, why = fit_swap_buffers_to_memlock(config, model, None)
    # 40 tensors (300,000 elements) fill a buffer; the swap buffers stay as they were: no limit
    assert fitted["zero_optimization"]["sub_group_size"] == 300_000
    assert fitted["zero_optimization"]["offload_optimizer"]["buffer_count"] == 12
    assert why is not None and "sub-groups of 300,000" in why and "hold no more" in why


def test_the_parameters_partitioned_swap_buffer_is_fitted_with_the_optimizer_in_ram():
    """The whole tensors of the largest sub-group leave through it: with the optimizer in CPU
    RAM the sub-groups are cut finer to fit it, with no minimum swap size to keep."""
    config = {"bf16": {"enabled": True},
              "zero_optimization": {"sub_group_size": 1_000_000_000, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "nvme", "buffer_count": 16, "buffer_size": 65_536}}}
    model = Trainable((65_536,) * 100, ranks=2)  # 6.5M elements: a 13 MB buffer as one sub-group
    fitted, why = fit_swap_buffers_to_memlock(config, model, 8 << 20)
    assert locked_swap_bytes(config, model) > 8 << 20 >= locked_swap_bytes(fitted, model)
    assert why is not None and "optimizer sub-groups of" in why and "partitioned swap buffer" in why
