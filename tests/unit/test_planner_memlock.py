"""The planner under a node's RLIMIT_MEMLOCK (`NodeHardware.memlock_bytes`, which the node
probe writes as an annotation): DeepSpeed's NVMe swap buffers are fitted as the runtime will fit
them (`core.memlock`), and a placement whose buffers cannot fit is short of lockable memory, so
that admission says so instead of a pod that exits 2. Real pods under 8 MiB:
tests/integration/test_memlock_fit.py."""

import pytest

from spillway_runtime.core.estimates import lora_tensors
from spillway_runtime.core.hardware import MEMLOCK_ANNOTATION, NodeHardware, hardware_from_node
from spillway_runtime.core.largest import largest_model
from spillway_runtime.core.memlock import (
    MemlockError,
    Trainable,
    fit_swap_buffers_to_memlock,
    locked_swap_bytes,
    swap_budget,
)
from spillway_runtime.core.planner import ModelShape, plan_tiers
from spillway_runtime.core.spec import Method, Offload, Training, parse_job
from spillway_runtime.core.units import GiB
from spillway_runtime.training.dsconfig import build_deepspeed_config

from .test_planner import P13, TRAIN, rtx4090

POD_LIMIT = 8 << 20  # systemd's default LimitMEMLOCK, which a container run as a non-root uid gets
# the model of tests/integration/test_memlock_fit.py (`tiny.build_tiny_model`: 0.75M parameters)
SMALL = ModelShape.from_hf_config({"model_type": "llama", "vocab_size": 512, "hidden_size": 128,
                                   "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                                   "num_key_value_heads": 4, "tie_word_embeddings": False})
SHORT = Training(sequence_length=64, micro_batch_size=1, gradient_accumulation=1, max_steps=6)


def limited(hw: NodeHardware, memlock: int | None) -> NodeHardware:
    return hw.model_copy(update={"memlock_bytes": memlock})


def cpu_node(memlock: int | None) -> NodeHardware:
    return NodeHardware(name="cpu", cpu_cores=2, cpu_memory_bytes=24 * GiB, nvme_capacity_bytes=10**11,
                        nvme_free_bytes=10**11, memlock_bytes=memlock)


def spec_with(offload: dict) -> object:
    return parse_job({"apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "m"},
                      "spec": {"model": {"uri": "file:///m"}, "dataset": {"uri": "file:///d"},
                               "training": {"sequenceLength": 64, "maxSteps": 6}, "offload": offload}}).spec


@pytest.mark.parametrize(("optimizer", "parameters"), [("nvme", "cpu"), ("cpu", "nvme"), ("nvme", "nvme")])
def test_the_plan_fits_the_swap_under_the_nodes_limit_as_the_runtime_would(optimizer: str, parameters: str) -> None:
    offload = Offload(policy="nvme", optimizer=optimizer, parameters=parameters)
    spec = spec_with({"policy": "nvme", "optimizer": optimizer, "parameters": parameters})
    trainable = Trainable(SMALL.tensor_numels(), ranks=1)
    free = plan_tiers(SMALL, cpu_node(None), SHORT, offload)
    plan = plan_tiers(SMALL, cpu_node(POD_LIMIT), SHORT, offload)
    assert plan.feasible and plan.label == free.label == f"Z3 opt:{optimizer} par:{parameters}"
    unfitted = build_deepspeed_config(free, spec, nvme_path="/nvme")
    if locked_swap_bytes(unfitted, trainable) > (swap_budget(POD_LIMIT) or 0):  # the optimizer's 4+ MB buffers
        assert any("RLIMIT_MEMLOCK of 8.0 MiB" in r for r in plan.reasons), plan.reasons
        assert plan.swap.sub_group_size < free.swap.sub_group_size
        assert (plan.swap.optimizer_buffer_count, plan.swap.pipeline) == (4, False)
    else:  # the parameters' 16 buffers of 131,072 bf16 elements and the model's 1.5 MB: as planned
        assert optimizer == "cpu" and plan.swap == free.swap
    # The DeepSpeed config built from the plan fits: the runtime, counting the same tensors,
    # finds nothing to change, and what it would lock is under the limit.
    config = build_deepspeed_config(plan, spec, nvme_path="/nvme")
    assert fit_swap_buffers_to_memlock(config, trainable, POD_LIMIT) == (config, None)
    assert 0 < locked_swap_bytes(config, trainable) <= (swap_budget(POD_LIMIT) or 0)


def test_a_placement_whose_buffers_cannot_fit_is_short_of_lockable_memory_and_another_is_chosen() -> None:
    # 13B on 24 GB and 64 GiB: the optimizer on NVMe, pipelined, unlimited
    assert plan_tiers(P13, limited(rtx4090(64), None), TRAIN).label == "Z3 opt:nvme par:cpu"
    # Under a pod's 8 MiB the embedding's 164M elements alone need buffers of 2.4 GiB: no NVMe
    # placement can run, and nothing else fits 64 GiB
    plan = plan_tiers(P13, limited(rtx4090(64), POD_LIMIT), TRAIN)
    assert not plan.feasible and plan.label == "Z3 opt:nvme par:cpu"  # the least short, whose shortfall is said
    assert [s.describe()[:80] for s in plan.shortfalls] == [
        "Memory a process may lock (RLIMIT_MEMLOCK) is short by 2.4 GiB: DeepSpeed's NVMe"]
    why = {r.placement: r.why for r in plan.rejected}
    assert "LimitMEMLOCK" in why["Z3 opt:nvme par:nvme"]
    assert "RLIMIT_MEMLOCK" not in why["Z3 opt:cpu par:cpu"]  # short of RAM, not of locked memory
    # Where RAM holds the optimizer, the CPU placement locks nothing and plans as without a limit
    roomy = plan_tiers(P13, limited(rtx4090(288), POD_LIMIT), TRAIN)
    assert roomy.feasible and roomy.label == plan_tiers(P13, rtx4090(288), TRAIN).label == "Z3 opt:cpu par:cpu"
    # A limit the buffers fit under changes nothing
    assert plan_tiers(P13, limited(rtx4090(64), 64 * GiB), TRAIN).swap == plan_tiers(P13, rtx4090(64), TRAIN).swap


def test_the_largest_model_under_a_limit_names_the_locked_memory_as_what_binds() -> None:
    nvme = Offload(policy="nvme", optimizer="nvme")
    free = {f.placement: f for f in largest_model(rtx4090(64), TRAIN, nvme)}["Z3 opt:nvme par:cpu"]
    fit = {f.placement: f for f in largest_model(limited(rtx4090(64), POD_LIMIT), TRAIN, nvme)}["Z3 opt:nvme par:cpu"]
    assert fit.parameters < free.parameters
    assert fit.bound_by is not None and fit.bound_by.startswith("Memory a process may lock (RLIMIT_MEMLOCK)")
    assert "swap buffers" in fit.bound_by


def test_the_limit_travels_as_a_node_annotation() -> None:
    def back(annotations: dict[str, str]) -> NodeHardware:
        return hardware_from_node({"metadata": {"name": "n", "annotations": annotations},
                                   "status": {"allocatable": {"cpu": "2", "memory": "24Gi"}}})

    assert cpu_node(POD_LIMIT).to_annotations()[MEMLOCK_ANNOTATION] == str(POD_LIMIT)
    assert back(cpu_node(POD_LIMIT).to_annotations()).memlock_bytes == POD_LIMIT
    # no limit (or CAP_IPC_LOCK): "unlimited", which a re-probe writes over an old figure
    assert cpu_node(None).to_annotations()[MEMLOCK_ANNOTATION] == "unlimited"
    assert back(cpu_node(None).to_annotations()).memlock_bytes is None
    assert back({}).memlock_bytes is None  # never probed: planned as unlimited, as before
    # nodes under different limits plan apart
    assert cpu_node(POD_LIMIT).shape_key() != cpu_node(None).shape_key()

    # set by hand: a quantity is read as bytes, systemd's spelling as no limit, nonsense as not probed
    assert back({MEMLOCK_ANNOTATION: "8Mi"}).memlock_bytes == POD_LIMIT
    assert back({MEMLOCK_ANNOTATION: "infinity"}).memlock_bytes is None
    assert back({MEMLOCK_ANNOTATION: "lots"}).memlock_bytes is None


# A Llama 7B's shape: LoRA under 8 MiB is the case that matters (a full fine-tune's embedding
# alone needs more), and its adapters are not pieces of equal size.
LLAMA_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "tie_word_embeddings": False}


def test_loras_adapters_are_counted_as_peft_makes_them() -> None:
    """The tensors the planner fits LoRA's swap to are PEFT's, in DeepSpeed's order: here against
    the model transformers and PEFT build (on the meta device, from a smaller config of the
    same family, with the runtime's own `with_lora`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from spillway_runtime.training.lora import with_lora

    config = {**LLAMA_7B, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
    for targets in (["all-linear"], ["q_proj", "v_proj", "down_proj"]):
        method = Method(type="lora", rank=8, target_modules=targets)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        model, trainable, _ = with_lora(model, method)
        built = tuple(p.numel() for p in model.parameters() if p.requires_grad)
        shape = ModelShape.from_hf_config(config)
        assert lora_tensors(shape, 8, method.peft_targets) == built
        assert sum(built) == trainable


def test_a_lora_plan_under_the_limit_is_one_the_runtime_leaves_as_it_is() -> None:
    shape = ModelShape.from_hf_config(LLAMA_7B)
    method = Method(type="lora", rank=16, target_modules=["all-linear"])
    adapters = Trainable(lora_tensors(shape, 16, method.peft_targets), ranks=1)
    offload = {"policy": "nvme", "optimizer": "nvme", "parameters": "cpu"}
    spec = spec_with({**offload, "nvme": {"path": "/nvme"}})
    spec = spec.model_copy(update={"method": method})
    for limit in (POD_LIMIT, 6 << 20, 5 << 20):
        plan = plan_tiers(shape, limited(rtx4090(64), limit), SHORT, Offload(**offload), method=method)
        config = build_deepspeed_config(plan, spec, nvme_path="/nvme")
        if plan.feasible:  # the runtime, counting PEFT's tensors, finds nothing to change
            assert fit_swap_buffers_to_memlock(config, adapters, limit) == (config, None), limit
        else:  # and where the plan says no, the runtime would refuse too
            assert [s.tier for s in plan.shortfalls] == ["memlock"]
            with pytest.raises(MemlockError):
                fit_swap_buffers_to_memlock(config, adapters, limit)


def test_the_jobs_deepspeed_overrides_are_counted_as_the_runtime_counts_them() -> None:
    """offload.deepspeed decides what is locked too: 16 parameter buffers of a 1M-element
    size lock 32 MiB, which no plan under 8 MiB may take; the same job without it fits."""
    offload = {"policy": "nvme", "optimizer": "cpu", "parameters": "nvme"}
    plain = plan_tiers(SMALL, cpu_node(POD_LIMIT), SHORT, Offload(**offload))
    assert plain.feasible
    wide = {"zero_optimization": {"offload_param": {"buffer_size": 1_048_576}}}
    plan = plan_tiers(SMALL, cpu_node(POD_LIMIT), SHORT, Offload(**offload, deepspeed=wide))
    assert not plan.feasible and [s.tier for s in plan.shortfalls] == ["memlock"]
