"""The GPU's decoder-layer probe (`probe.measure_gpu_decoder`), run here on the CPU: the code a GPU
node runs, on the device there is."""

import torch

from spillway_runtime.probe import GPU_DECODER_BATCH, GPU_DECODER_SEQUENCE, measure_gpu_decoder


def test_the_gpu_decoder_probe_times_each_width_of_the_curve() -> None:
    # fp32: this CPU's bf16 attention over 4 x 1024 tokens takes seconds a call
    rates = measure_gpu_decoder(budget_seconds=30.0, dtypes=("fp32",), device="cpu", sizes=(32, 64))
    assert [(r.dtype, r.hidden_size) for r in rates] == [("fp32", 32), ("fp32", 64)]
    assert GPU_DECODER_BATCH * GPU_DECODER_SEQUENCE == 4096  # the kit's micro-batch, the tokens a call
    # 6 x 4096 tokens x 49,408 parameters (hidden 64) is 1.2 GFLOP a call: 0.1 ms to 100 s here
    assert all(1e7 < r.flops_per_s < 1e13 for r in rates), rates


def test_without_cuda_the_gpu_decoder_probe_measures_nothing() -> None:
    if torch.cuda.is_available():
        return
    assert measure_gpu_decoder(device="cuda") == []
