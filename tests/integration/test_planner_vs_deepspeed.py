"""The planner's model-state bytes agree with DeepSpeed's own estimators (buffer factor 1.0),
and its prediction for a real run matches what lands on disk and in RAM."""

import pytest

from spillway_runtime.core.estimates import model_state_bytes


@pytest.mark.integration
@pytest.mark.parametrize("gpus", [1, 4, 8])
@pytest.mark.parametrize("params", [350_000_000, 13_000_000_000])
def test_model_state_bytes_match_deepspeed_estimators(gpus, params):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    largest = params // 40
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, gpus, 1, cpu_offload=offload,
                                                         additional_buffer_factor=1.0)
        ours_gpu, ours_cpu = model_state_bytes(2, "cpu" if offload else "gpu", "gpu", params, largest, gpus, 1)
        assert (ours_gpu, ours_cpu) == (gpu, cpu)
    for opt, par in (("gpu", "gpu"), ("cpu", "gpu"), ("cpu", "cpu")):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            params, largest, gpus, 1, cpu_offload=opt == "cpu", cpu_offload_params=par == "cpu", zero_init=True,
            additional_buffer_factor=1.0)
        ours_gpu, ours_cpu = model_state_bytes(3, opt, par, params, largest, gpus, 1)
        assert ours_gpu == pytest.approx(gpu, abs=2)
        assert ours_cpu == pytest.approx(cpu, abs=2)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["Meta-Llama-3-8B", "Qwen2-7B", "gemma-7b", "Mixtral-8x7B-v0.1", "Qwen1.5-MoE-A2.7B"])
def test_full_size_config_shapes_give_deepspeeds_estimates(name):
    """A full-size model's planner bytes, from its config.json by arithmetic, against DeepSpeed's
    estimators fed by DeepSpeed's own count of the model transformers builds (on the meta device,
    no weights). Exact: for these models the largest module is one module (the 128k-256k
    embedding, or a layer's experts tensors), so the planner's L (a whole attention or MLP block
    when that is larger) and DeepSpeed's (one module's own parameters) agree."""
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from transformers import AutoConfig, AutoModelForCausalLM

    from spillway_runtime.core.planner import ModelShape
    from tests.unit.test_param_counts import FULL

    config = FULL[name][0]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    # model_to_params dedupes tied weights by data_ptr, which is 0 for every meta tensor;
    # parameters() dedupes them by identity.
    total = sum(p.numel() for p in model.parameters())
    _, largest = model_to_params(model)
    shape = ModelShape.from_hf_config(config)
    assert (shape.params, shape.largest_layer_params) == (total, largest)
    gpus = 8
    for offload in (False, True):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total, gpus, 1, cpu_offload=offload,
                                                         additional_buffer_factor=1.0)
        ours = model_state_bytes(2, "cpu" if offload else "gpu", "gpu", shape.params, shape.largest_layer_params,
                                 gpus, 1)
        assert ours == (gpu, cpu)
    for opt, par in (("gpu", "gpu"), ("cpu", "gpu"), ("cpu", "cpu")):
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            total, largest, gpus, 1, cpu_offload=opt == "cpu", cpu_offload_params=par == "cpu", zero_init=True,
            additional_buffer_factor=1.0)
        ours_gpu, ours_cpu = model_state_bytes(3, opt, par, shape.params, shape.largest_layer_params, gpus, 1)
        assert ours_gpu == pytest.approx(gpu, abs=2)
        assert ours_cpu == pytest.approx(cpu, abs=2)
