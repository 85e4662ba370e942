import pytest

from spillway_runtime.checkpoints.tensor_io import checkpoint_locked_bytes
from spillway_runtime.core.hardware import AioSettings, NodeHardware
from spillway_runtime.core.planner import ModelShape, plan_tiers
from spillway_runtime.core.spec import parse_job
from spillway_runtime.core.units import GiB
from spillway_runtime.training.dsconfig import (
    DeepSpeedConfigError,
    Trainable,
    apply_overrides,
    build_deepspeed_config,
    fit_swap_buffers_to_memlock,
    locked_swap_bytes,
)

SHAPE = ModelShape.from_param_count(13_000_000_000)
HW = NodeHardware(name="n", gpu_count=1, gpu_product="RTX 4090", gpu_memory_bytes=24 * GiB, cpu_cores=16,
                  cpu_memory_bytes=64 * GiB, nvme_capacity_bytes=2 * 10**12, nvme_free_bytes=2 * 10**12,
                  aio=AioSettings(block_size=8 << 20, queue_depth=128, intra_op_parallelism=4))


def job(offload=None):
    spec = {"model": {"uri": "/m"}, "dataset": {"uri": "/d.jsonl"}, "offload": offload or {}}
    return parse_job({"apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "j"},
                      "spec": spec}).spec


def test_nvme_plan_becomes_stage3_config_with_top_level_aio():
    spec = job()
    plan = plan_tiers(SHAPE, HW, spec.training, spec.offload)
    cfg = build_deepspeed_config(plan, spec, nvme_path="/nvme")
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_optimizer"]["nvme_path"] == "/nvme"
    assert zero["sub_group_size"] == plan.swap.sub_group_size
    assert "aio" not in zero
    assert cfg["aio"] == {"block_size": 8 << 20, "queue_depth": 128, "intra_op_parallelism": 4,
                          "single_submit": False, "overlap_events": True}
    assert cfg["bf16"]["enabled"] is True


def test_nvme_without_a_path_is_refused():
    spec = job()
    plan = plan_tiers(SHAPE, HW, spec.training, spec.offload)
    with pytest.raises(DeepSpeedConfigError, match=r"offload\.nvme\.path"):
        build_deepspeed_config(plan, spec)


def test_overrides_merge_last_and_old_spellings_are_translated():
    spec = job({"deepspeed": {"zero_optimization": {"aio": {"queue_depth": 64}},
                              "aio": {"thread_count": 8}, "gradient_clipping": 0.5}})
    plan = plan_tiers(SHAPE, HW, spec.training, spec.offload)
    cfg = build_deepspeed_config(plan, spec, nvme_path="/nvme")
    assert cfg["gradient_clipping"] == 0.5
    assert "aio" not in cfg["zero_optimization"]
    assert cfg["aio"]["queue_depth"] == 64
    assert cfg["aio"]["intra_op_parallelism"] == 8
    assert "thread_count" not in cfg["aio"]


def test_param_buffer_smaller_than_largest_parameter_is_refused():
    spec = job({"optimizer": "nvme", "parameters": "nvme"})
    plan = plan_tiers(SHAPE, HW, spec.training, spec.offload)
    cfg = build_deepspeed_config(plan, spec, nvme_path="/nvme")
    assert cfg["zero_optimization"]["offload_param"]["buffer_size"] >= SHAPE.largest_param_numel
    with pytest.raises(DeepSpeedConfigError, match=f"set it to at least {SHAPE.largest_param_numel}"):
        apply_overrides(cfg, {"zero_optimization": {"offload_param": {"buffer_size": 1000}}}, plan)


def test_nvme_offload_with_stage_2_override_is_refused():
    spec = job()
    plan = plan_tiers(SHAPE, HW, spec.training, spec.offload)
    cfg = build_deepspeed_config(plan, spec, nvme_path="/nvme")
    with pytest.raises(DeepSpeedConfigError, match=r"NVMe offload needs zero_optimization\.stage 3"):
        apply_overrides(cfg, {"zero_optimization": {"stage": 2}}, plan)


@pytest.mark.parametrize(("override", "message"), [
    # DeepSpeed asserted this only once the engine had started: a traceback, exit 1
    ({"train_batch_size": 999}, r"offload\.deepspeed\.train_batch_size is 999 but the training settings give 1: "
                                r"set the batch with training\.microBatchSize x"),
    ({"gradient_accumulation_steps": 8}, r"is 8 but the training settings give 1: set the batch with "
                                         r"training\.gradientAccumulation"),
    # an AttributeError traceback before
    ({"zero_optimization": "three"}, r"offload\.deepspeed\.zero_optimization is str 'three'; it is a block"),
    ({"aio": 5}, r"offload\.deepspeed\.aio is int 5"),
])
def test_overrides_that_contradict_or_misshape_the_config_are_refused_by_name(override, message):
    spec = job({"deepspeed": override})
    plan = plan_tiers(SHAPE, HW, spec.training, spec.offload)
    with pytest.raises(DeepSpeedConfigError, match=message):
        build_deepspeed_config(plan, spec, nvme_path="/nvme")


def test_batch_overrides_that_agree_are_accepted():
    t = job().training
    batch = t.micro_batch_size * t.gradient_accumulation
    spec = job({"deepspeed": {"train_batch_size": batch, "gradient_accumulation_steps": t.gradient_accumulation}})
    plan = plan_tiers(SHAPE, HW, spec.training, spec.offload)
    assert build_deepspeed_config(plan, spec, nvme_path="/nvme")["train_batch_size"] == batch


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
    with pytest.raises(DeepSpeedConfigError, match="minimum swap size"):
        fit_swap_buffers_to_memlock(config, model, 4 << 20)
    assert config["zero_optimization"]["sub_group_size"] == 1_000_000_000  # the input is left as it was
    assert config["zero_optimization"]["offload_optimizer"]["buffer_count"] == 8
    # A tensor larger than any sub-group size can cut: its buffers alone would not fit.
    with pytest.raises(DeepSpeedConfigError, match=r"lock 16\.0 MiB, as each holds a whole one \(the largest: 1,048,576"):
        fit_swap_buffers_to_memlock(config, Trainable((1_048_576, 7_528), ranks=1), 8 << 20)
    # Already small enough: unchanged.
    assert fit_swap_buffers_to_memlock(config, many(100, 1_000), 8 << 20) == (config, None)
    # Where the checkpoint may lock buffers of its own (at 64 MiB, 6 of 1.6 MiB), DeepSpeed gets the rest.
    fitted, _ = fit_swap_buffers_to_memlock(config, many(100, 40_000), 64 << 20)
    assert locked_swap_bytes(fitted, many(100, 40_000)) <= (64 << 20) - checkpoint_locked_bytes(64 << 20) < 55 << 20
    # Parameter buffers alone over the limit: a clear error before the model loads, not a SIGSEGV.
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "buffer_count": 5, "buffer_size": 100_000_000}
    with pytest.raises(DeepSpeedConfigError, match=r"RLIMIT_MEMLOCK.*LimitMEMLOCK=infinity"):
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
