import pytest

from spillway_runtime.core.hardware import AioSettings, NodeHardware
from spillway_runtime.core.planner import ModelShape, plan_tiers
from spillway_runtime.core.spec import parse_job
from spillway_runtime.core.units import GiB
from spillway_runtime.training.dsconfig import DeepSpeedConfigError, apply_overrides, build_deepspeed_config

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
