"""Seconds per step: the sum `estimates.step_time` computes is the one the plan's reasons state."""

import pytest

from spillway_runtime.core.estimates import (
    GRADIENT_SECONDS_PER_PARAM_ON_CPU,
    GRADIENT_SECONDS_PER_TENSOR,
    MIN_AIO_BYTES,
    sub_group_cut,
)
from spillway_runtime.core.hardware import DEFAULT_HOST_DEVICE_BPS, MatmulRate, NodeHardware, hardware_from_node, matmul_rate_at
from spillway_runtime.core.planner import ModelShape, over_in_ram, plan_tiers
from spillway_runtime.core.spec import Offload, Training
from spillway_runtime.core.units import GiB

P13 = ModelShape.from_param_count(13_000_000_000)
TRAIN = Training(sequence_length=2048, micro_batch_size=1, gradient_accumulation=8, max_steps=1000)


def gpu_node(ram_gib: int) -> NodeHardware:
    return NodeHardware(
        name="rtx4090", gpu_count=1, gpu_product="NVIDIA GeForce RTX 4090", gpu_memory_bytes=24564 * 2**20,
        cpu_cores=16, cpu_memory_bytes=ram_gib * GiB, nvme_capacity_bytes=2 * 10**12, nvme_free_bytes=2 * 10**12,
        nvme_read_bytes_per_s=3.5e9, nvme_write_bytes_per_s=3.0e9,
    )


@pytest.mark.parametrize(("ram_gib", "offload", "pipelined"), [
    (256, Offload(optimizer="nvme", parameters="nvme"), True),  # RAM for the pipeline's double buffers
    (24, Offload(optimizer="nvme", parameters="nvme"), False),  # too little: one set of buffers
    (256, Offload(optimizer="cpu", parameters="cpu"), False),
])
def test_the_step_time_reason_states_the_sum_that_is_computed(ram_gib: int, offload: Offload,
                                                               pipelined: bool) -> None:
    plan = plan_tiers(P13, gpu_node(ram_gib), TRAIN, offload)
    s = plan.step
    assert plan.swap.pipeline is pipelined and s.pipelined is pipelined
    # ZeRO-3 on a GPU: the hooks of every tensor, every micro-step
    assert s.gather_release == pytest.approx(0.67e-3 * (9 * P13.num_layers + 3) * TRAIN.gradient_accumulation)
    assert s.gradients == pytest.approx(0.24e-3 * (9 * P13.num_layers + 3) * TRAIN.gradient_accumulation)
    forward_backward = max(s.compute + s.gradients + s.gather_release, s.host_device,
                           s.parameter_nvme + s.gradient_nvme)
    if pipelined:  # over n swapped sub-groups: the longer whole, the shorter where nothing hides it
        n, stepped = s.swapped_sub_groups, s.cpu_optimizer * (1 - s.resident_share)
        groups = sub_group_cut(P13, 1, plan.swap.sub_group_size, MIN_AIO_BYTES)  # finer than 1e9 elements: more to overlap
        assert len(groups.sizes) > 13 and n == len(groups.swapped(plan.swap.cpu_resident_fraction))
        assert s.resident_share == pytest.approx(groups.kept(plan.swap.cpu_resident_fraction) / groups.total)
        optimizer_phase = (s.cpu_optimizer - stepped + max(stepped, s.optimizer_nvme)
                           + min(stepped, s.optimizer_nvme) / n)
    else:
        optimizer_phase = s.cpu_optimizer + s.optimizer_nvme
    assert s.total == pytest.approx(forward_backward + optimizer_phase)
    assert s.nvme == pytest.approx(s.parameter_nvme + s.gradient_nvme + s.optimizer_nvme)
    [reason] = [r for r in plan.reasons if r.startswith("step ")]
    assert (f"step {s.total:.3g} s = max(compute {s.compute:.3g} + gradients {s.gradients:.3g} + ZeRO-3 "
            f"gather/release {s.gather_release:.3g}, host-device {s.host_device:.3g}, ") in reason
    if s.gradient_nvme:
        assert (f"parameter NVMe {s.parameter_nvme:.3g} + gradients' NVMe writes {s.gradient_nvme:.3g})"
                in reason)
    if pipelined:
        assert (f"+ optimizer phase {optimizer_phase:.3g} (pipelined swap over {n} sub-groups" in reason
                and f"max(step {stepped:.3g}, optimizer NVMe {s.optimizer_nvme:.3g}) + the shorter / {n})" in reason)
    else:
        assert f"+ optimizer step {s.cpu_optimizer:.3g} + optimizer NVMe {s.optimizer_nvme:.3g}" in reason


TINY_WIDE = ModelShape(name="wide", params=6_478_080, largest_layer_params=3_538_944, largest_param_numel=1_179_648,
                       hidden_size=768, num_layers=1, vocab_size=376, num_attention_heads=6)
CPU_TRAIN = Training(sequence_length=64, micro_batch_size=4, max_steps=12)


def cpu_node(*rates: MatmulRate) -> NodeHardware:
    return NodeHardware(name="cpu", cpu_cores=2, cpu_memory_bytes=24 * GiB, cpu_matmul=list(rates))


def test_the_cpu_accelerators_compute_time_follows_the_measured_matmul_rate() -> None:
    assumed = plan_tiers(TINY_WIDE, cpu_node(), CPU_TRAIN, Offload(policy="none"))
    bf16_only = cpu_node(MatmulRate(dtype="bf16", hidden_size=768, flops_per_s=4e9))
    slow = plan_tiers(TINY_WIDE, bf16_only, CPU_TRAIN, Offload(policy="none"))
    fast = plan_tiers(TINY_WIDE, cpu_node(MatmulRate(dtype="bf16", hidden_size=768, flops_per_s=8e9)), CPU_TRAIN,
                      Offload(policy="none"))
    assert slow.step.compute == pytest.approx(slow.step.flops / 4e9)
    assert fast.step.compute == pytest.approx(slow.step.compute / 2)
    assert slow.predicted_step_seconds > fast.predicted_step_seconds
    assert any("at 4 GFLOP/s (measured: bf16 decoder layers at hidden size 768" in r for r in slow.reasons)
    assert any("(assumed: 25 GFLOP/s per core x 2" in r for r in assumed.reasons)
    # an fp32 run does not borrow the bf16 figure
    fp32 = plan_tiers(TINY_WIDE, bf16_only, CPU_TRAIN, Offload(policy="none"), dtype="fp32")
    assert fp32.step.flops_per_s == 25e9 * bf16_only.cpu_cores


def test_two_processes_share_the_measured_rate() -> None:
    hw = cpu_node(MatmulRate(dtype="bf16", hidden_size=768, flops_per_s=4e9))
    one = plan_tiers(TINY_WIDE, hw, CPU_TRAIN, Offload(policy="none"), cpu_processes=1)
    two = plan_tiers(TINY_WIDE, hw, CPU_TRAIN, Offload(policy="none"), cpu_processes=2)
    # each process does the same micro-batch on half the cores
    assert two.step.compute == pytest.approx(2 * one.step.compute)


def test_the_rate_between_measured_sizes_is_interpolated_and_held_beyond_them() -> None:
    rates = [MatmulRate(dtype="bf16", hidden_size=256, flops_per_s=2e9),
             MatmulRate(dtype="bf16", hidden_size=1024, flops_per_s=8e9)]
    assert matmul_rate_at(rates, "bf16", 512) == pytest.approx(4e9)  # halfway on a log scale
    assert matmul_rate_at(rates, "bf16", 128) == 2e9
    assert matmul_rate_at(rates, "bf16", 8192) == 8e9
    assert matmul_rate_at(rates, "fp32", 512) is None
    hw = cpu_node(*rates)
    sources = {h: plan_tiers(shape, hw, CPU_TRAIN).step.flops_source
               for h, shape in ((512, TINY_WIDE.model_copy(update={"hidden_size": 512})),
                                (4096, TINY_WIDE.model_copy(update={"hidden_size": 4096})))}
    assert sources[512] == "measured: bf16 decoder layers at hidden size 512, interpolated on the CPU"
    assert sources[4096] == ("measured: bf16 decoder layers at hidden size 1024, the largest measured (the model's is 4096) "
                             "on the CPU")


def test_the_matmul_rates_round_trip_through_a_node_annotation() -> None:
    hw = cpu_node(MatmulRate(dtype="bf16", hidden_size=256, flops_per_s=2.5e9),
                  MatmulRate(dtype="fp32", hidden_size=1024, flops_per_s=3.1e10))
    annotations = hw.to_annotations()
    assert annotations["spillway.dev/cpu-matmul-flops-per-second"] == "bf16@256=2500000000,fp32@1024=31000000000"
    node = {"metadata": {"name": "cpu-1", "annotations": annotations},
            "status": {"allocatable": {"cpu": "2", "memory": "24Gi"}}}
    assert hardware_from_node(node).cpu_matmul == hw.cpu_matmul
    # an entry that does not parse is left out, the others kept
    annotations["spillway.dev/cpu-matmul-flops-per-second"] = "bf16@256=2500000000,int8@64=9,bf16@x=1,fp32@512=-4"
    assert hardware_from_node(node).cpu_matmul == [MatmulRate(dtype="bf16", hidden_size=256, flops_per_s=2.5e9)]


def test_a_gpus_measured_decoder_layers_replace_the_share_of_its_peak() -> None:
    """On a GPU node the probe's decoder-layer curve, measured on the GPU, times the compute;
    without one (or in a dtype it did not measure) the plan keeps 35% of the product's peak."""
    shape = P13.model_copy(update={"hidden_size": 5120})
    assumed = plan_tiers(shape, gpu_node(256), TRAIN, Offload(optimizer="cpu", parameters="gpu"))
    curve = [MatmulRate(dtype="bf16", hidden_size=4096, flops_per_s=2.0e14),
             MatmulRate(dtype="bf16", hidden_size=8192, flops_per_s=3.2e14)]
    measured_node = gpu_node(256).model_copy(update={"gpu_decoder": curve})
    measured = plan_tiers(shape, measured_node, TRAIN, Offload(optimizer="cpu", parameters="gpu"))
    assert assumed.step.flops_per_s == pytest.approx(0.35 * gpu_node(256).peak_tflops * 1e12)
    assert measured.step.flops_per_s == pytest.approx(matmul_rate_at(curve, "bf16", 5120))
    assert 2.0e14 < measured.step.flops_per_s < 3.2e14
    assert measured.step.compute == pytest.approx(measured.step.flops / measured.step.flops_per_s)
    assert measured.step.flops_source == "measured: bf16 decoder layers at hidden size 5120, interpolated on the GPU"
    assert any("measured: bf16 decoder layers at hidden size 5120, interpolated on the GPU" in r for r in measured.reasons)
    fp16 = plan_tiers(shape, measured_node, TRAIN, Offload(optimizer="cpu", parameters="gpu"), dtype="fp16")
    assert fp16.step.flops_per_s == assumed.step.flops_per_s  # not measured in fp16: the peak's share
    # a CPU node's curve is not the GPU's, nor the other way round
    cpu_curve = gpu_node(256).model_copy(update={"cpu_matmul": curve})
    assert plan_tiers(shape, cpu_curve, TRAIN, Offload(optimizer="cpu")).step.flops_per_s == assumed.step.flops_per_s


def test_a_gpus_decoder_curve_round_trips_through_its_own_node_annotation() -> None:
    hw = gpu_node(64).model_copy(update={"gpu_decoder": [MatmulRate(dtype="bf16", hidden_size=1024, flops_per_s=9e13)]})
    annotations = hw.to_annotations()
    assert annotations["spillway.dev/gpu-decoder-flops-per-second"] == "bf16@1024=90000000000000"
    assert "spillway.dev/cpu-matmul-flops-per-second" not in annotations
    node = {"metadata": {"name": "gpu-1", "annotations": annotations},
            "status": {"allocatable": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "1"}}}
    assert hardware_from_node(node).gpu_decoder == hw.gpu_decoder
    node["status"]["allocatable"].pop("nvidia.com/gpu")  # a node without GPUs has no GPU curve to plan with
    assert hardware_from_node(node).gpu_decoder == []


def test_zero3_gathers_and_releases_every_tensor_on_the_computes_path() -> None:
    """ZeRO-3's per-tensor hooks (and, on the CPU accelerator, its host-memory copies of the
    16-bit weights) add to the compute of every micro-step's forward and backward; ZeRO-2 has
    none. On this model, 12 tensors of 6.5M parameters: the 14 ms measured over ZeRO-2."""
    hw = cpu_node(MatmulRate(dtype="bf16", hidden_size=768, flops_per_s=500e9))
    z2 = plan_tiers(TINY_WIDE, hw, CPU_TRAIN, Offload(optimizer="gpu", parameters="gpu",
                                                      deepspeed={"zero_optimization": {"stage": 2}}))
    z3 = plan_tiers(TINY_WIDE, hw, CPU_TRAIN, Offload(optimizer="gpu", parameters="gpu",
                                                      deepspeed={"zero_optimization": {"stage": 3}}))
    assert z2.zero_stage == 2 and z2.step.gather_release == 0
    # both stages handle every gradient: 12 hooks, and 6.5M parameters copied in host memory
    assert z2.step.gradients == z3.step.gradients == pytest.approx(12 * 0.24e-3 + 6_478_080 * 2.03e-9)
    assert TINY_WIDE.parameter_tensors == 12
    assert z3.step.gather_release == pytest.approx(12 * 0.67e-3 + 6_478_080 * 1.16e-9)
    assert 0.012 < z3.step.gather_release < 0.016
    assert z3.predicted_step_seconds == pytest.approx(z2.predicted_step_seconds + z3.step.gather_release)
    twice = plan_tiers(TINY_WIDE, hw, CPU_TRAIN.model_copy(update={"gradient_accumulation": 2}),
                       Offload(optimizer="gpu", parameters="gpu", deepspeed={"zero_optimization": {"stage": 3}}))
    assert twice.step.gather_release == pytest.approx(2 * z3.step.gather_release)  # every micro-step


def test_a_node_whose_probe_measured_slower_host_work_gets_longer_hooks_and_copies_and_says_so() -> None:
    """`NodeHardware.host_work_scale` (`engine_probe`: ZeRO-3 over ZeRO-2 on a micro model,
    measured over predicted) multiplies the four host constants, gathers and gradients alike;
    the compute and the optimizer step keep their own measured rates."""
    rate = MatmulRate(dtype="bf16", hidden_size=768, flops_per_s=500e9)
    stage3 = Offload(optimizer="gpu", parameters="gpu", deepspeed={"zero_optimization": {"stage": 3}})
    fitted = plan_tiers(TINY_WIDE, cpu_node(rate), CPU_TRAIN, stage3)
    slower = plan_tiers(TINY_WIDE, cpu_node(rate).model_copy(update={"host_work_scale": 2.1}), CPU_TRAIN, stage3)
    assert fitted.step.host_work_scale == 1.0 and slower.step.host_work_scale == 2.1
    assert slower.step.gather_release == pytest.approx(2.1 * fitted.step.gather_release)
    assert slower.step.gradients == pytest.approx(2.1 * fitted.step.gradients)
    assert (slower.step.compute, slower.step.cpu_optimizer) == (fitted.step.compute, fitted.step.cpu_optimizer)
    assert slower.predicted_step_seconds == pytest.approx(
        fitted.predicted_step_seconds + 1.1 * (fitted.step.gather_release + fitted.step.gradients))
    assert "host work measured at 2.10x the fitted constants" in slower.step.formula()
    assert "host work" not in fitted.step.formula()


def test_zero3_copies_its_gradient_partition_once_per_step_zero2_every_micro_step() -> None:
    """ZeRO-3 converts and copies the gradient partition into the fp32 one at the accumulation
    boundary only (between boundaries it adds into it); ZeRO-2's offload copies every micro-step.
    The hooks run in every micro-step of both."""
    hw = cpu_node(MatmulRate(dtype="bf16", hidden_size=768, flops_per_s=500e9))
    hooks = TINY_WIDE.parameter_tensors * GRADIENT_SECONDS_PER_TENSOR
    copies = TINY_WIDE.params * GRADIENT_SECONDS_PER_PARAM_ON_CPU
    for stage, copied in ((3, 1), (2, 4)):
        offload = Offload(optimizer="cpu", parameters="gpu", deepspeed={"zero_optimization": {"stage": stage}})
        four = plan_tiers(TINY_WIDE, hw, CPU_TRAIN.model_copy(update={"gradient_accumulation": 4}), offload)
        assert four.zero_stage == stage
        assert four.step.gradients == pytest.approx(4 * hooks + copied * copies)


@pytest.mark.parametrize("parameters", ["gpu", "cpu"])
def test_zero3_with_the_optimizer_offloaded_moves_its_gradients_as_deepspeed_does(parameters: str) -> None:
    """Per optimizer step, per rank, between GPU and host (DeepSpeed 0.19.8's stage3): with more
    than one micro-step a step, every micro-step the 16-bit gradient partition down into its CPU
    accumulation buffer and back up (2 B/param each way); with one, no such buffer and no round
    trip (deepspeed_fixes.hold_one_steps_gradient_partitions_only); at the boundary the fp32
    gradients down (4 B/param), and the updated 16-bit parameters up where they live on the GPU
    (2 B/param). With the parameters in CPU RAM their own term fetches them for the forward and
    backward and counts the gradients' way down."""
    model = ModelShape.from_param_count(3_000_000_000)
    offload = Offload(optimizer="cpu", parameters=parameters, deepspeed={"zero_optimization": {"stage": 3}})
    p = t = model.params
    for micro_steps in (1, 4):
        plan = plan_tiers(model, gpu_node(256), TRAIN.model_copy(update={"gradient_accumulation": micro_steps}), offload)
        assert (plan.zero_stage, plan.parameters) == (3, parameters)
        round_trip = 2 * t if micro_steps > 1 else 0
        if parameters == "gpu":
            moved = 2 * round_trip * micro_steps + 4 * t + 2 * t
        else:
            moved = (2 * 2 * p + round_trip + round_trip) * micro_steps + 4 * t
        assert plan.step.host_device == pytest.approx(moved / DEFAULT_HOST_DEVICE_BPS)


def test_the_gradient_partition_is_held_where_micro_batches_accumulate_fp16_scales_or_zenflow_runs() -> None:
    """DeepSpeed's whole-model gradient partition in RAM with ZeRO-3 and the optimizer offloaded:
    held with more than one micro-batch a step, with fp16 (its overflow check reads it), under
    ZenFlow; else not (deepspeed_fixes.hold_one_steps_gradient_partitions_only). Its bytes are
    the training dtype's."""
    from spillway_runtime.core.estimates import gradient_partition_held

    assert not gradient_partition_held(1, "bf16", False) and not gradient_partition_held(1, "fp32", False)
    assert gradient_partition_held(2, "bf16", False) and gradient_partition_held(1, "fp16", False)
    assert gradient_partition_held(1, "bf16", True)
    model = ModelShape.from_param_count(3_000_000_000)
    zero3 = Offload(optimizer="cpu", parameters="gpu", deepspeed={"zero_optimization": {"stage": 3}})
    one = TRAIN.model_copy(update={"gradient_accumulation": 1})
    two = TRAIN.model_copy(update={"gradient_accumulation": 2})
    bf16 = [plan_tiers(model, gpu_node(256), t, zero3).bytes.cpu for t in (one, two)]
    fp32 = [plan_tiers(model, gpu_node(256), t, zero3, dtype="fp32").bytes.cpu for t in (one, two)]
    assert (bf16[1] - bf16[0], fp32[1] - fp32[0]) == (2 * model.params, 4 * model.params)


def test_the_optimizers_swap_pays_the_disks_cost_per_transfer_and_writes_its_gradients_in_the_backward() -> None:
    """With the optimizer on NVMe each swapped sub-group's fp32 gradients (4 B/param) go out in
    the backward, beside the compute, and its state and gradient come in (16 B/param) and its
    state goes out (12 B/param) in the optimizer phase: bytes at the disk's bandwidth, and per
    sub-group three transfers at the disk's cost per transfer (the probe's fit)."""
    from spillway_runtime.core.estimates import GRADIENT_SWAP_BYTES_PER_PARAM, OPTIMIZER_SWAP_BYTES_PER_PARAM

    model = ModelShape.from_param_count(3_000_000_000)
    one = TRAIN.model_copy(update={"gradient_accumulation": 1})
    costs = gpu_node(256).model_copy(update={"nvme_transfer_seconds": 0.015})
    # the planner's own cut: fewer, larger sub-groups where each transfer costs
    chosen = [plan_tiers(model, hw, one, Offload(optimizer="nvme", parameters="cpu", cpu_resident_fraction=0.5))
              for hw in (gpu_node(256), costs)]
    assert chosen[1].swap.sub_group_size > chosen[0].swap.sub_group_size
    offload = Offload(optimizer="nvme", parameters="cpu", cpu_resident_fraction=0.5,
                      deepspeed={"zero_optimization": {"sub_group_size": 100_000_000}})
    free, costly = (plan_tiers(model, hw, one, offload) for hw in (gpu_node(256), costs))
    assert costly.swap == free.swap  # the same cut, for the comparison
    n = costly.step.swapped_sub_groups
    assert n > 0 and 0 < costly.step.resident_share < 1
    swapped = model.params * (1 - costly.step.resident_share)
    state = OPTIMIZER_SWAP_BYTES_PER_PARAM * swapped
    gradients = GRADIENT_SWAP_BYTES_PER_PARAM * swapped
    assert free.step.gradient_nvme == pytest.approx(gradients / 3.0e9, rel=1e-3)
    assert free.step.optimizer_nvme == pytest.approx(state / 3.5e9 + (state - gradients) / 3.0e9, rel=1e-3)
    assert costly.step.gradient_nvme == pytest.approx(free.step.gradient_nvme + n * 0.015)
    assert costly.step.optimizer_nvme == pytest.approx(free.step.optimizer_nvme + 2 * n * 0.015)
    assert costly.step.nvme_bytes == free.step.nvme_bytes == pytest.approx(2 * state, rel=1e-3)
    for plan in (free, costly):  # at one micro-batch a step the writes outlast this GPU's backward
        s = plan.step
        assert s.parameter_nvme + s.gradient_nvme > s.compute + s.gradients + s.gather_release
        assert s.total == pytest.approx(max(s.host_device, s.parameter_nvme + s.gradient_nvme) + s.optimizer_phase)
        # the same step with the optimizer in RAM (the amortizing-accumulation hint's) has no writes
        in_ram = max(s.compute + s.gradients + s.gather_release, s.host_device, s.parameter_nvme)
        assert in_ram < s.parameter_nvme + s.gradient_nvme
        assert over_in_ram(s) == pytest.approx(s.total / (in_ram + s.cpu_optimizer))
    # at eight they hide behind it, and only the optimizer phase pays the cost per transfer
    free, costly = (plan_tiers(model, hw, TRAIN, offload) for hw in (gpu_node(256), costs))
    assert costly.step.compute > costly.step.parameter_nvme + costly.step.gradient_nvme
    assert costly.predicted_step_seconds - free.predicted_step_seconds == pytest.approx(
        costly.step.optimizer_phase - free.step.optimizer_phase)
    assert costly.step.optimizer_phase > free.step.optimizer_phase
