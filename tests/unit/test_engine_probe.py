"""`engine_probe.scale_from`: a child's two step times to `NodeHardware.host_work_scale`."""

from __future__ import annotations

import pytest

from spillway_runtime.core.hardware import NodeHardware
from spillway_runtime.engine_probe import scale_from

MICRO = {"tensors": 39, "params": 787_584, "accelerator": "cpu"}  # the constants predict 27.0 ms


def test_zero3s_time_over_zero2_over_the_constants_prediction_is_the_scale() -> None:
    scale, why = scale_from({**MICRO, "zero2_seconds": 0.045, "zero3_seconds": 0.099})
    assert scale == pytest.approx(0.054 / (39 * 0.67e-3 + 787_584 * 1.16e-9)) and why == ""
    # on a GPU the per-parameter copies run at HBM speed: the hooks alone are predicted
    gpu, _ = scale_from({**MICRO, "accelerator": "cuda", "zero2_seconds": 0.010, "zero3_seconds": 0.036})
    assert gpu == pytest.approx(0.026 / (39 * 0.67e-3))


def test_a_measurement_outside_the_range_is_no_figure_and_says_so() -> None:
    for zero3, told in ((0.040, "-5.0 ms: -0.18 of the constants"), (0.300, "255.0 ms: 9.43 of the constants")):
        scale, why = scale_from({**MICRO, "zero2_seconds": 0.045, "zero3_seconds": zero3})
        assert scale is None and told in why and "outside 0.2-5.0" in why, why


def test_a_scale_set_by_hand_outside_the_range_is_refused() -> None:
    with pytest.raises(ValueError, match="host_work_scale"):
        NodeHardware(name="n", cpu_cores=2, cpu_memory_bytes=1 << 30, host_work_scale=-3)
    assert NodeHardware(name="n", cpu_cores=2, cpu_memory_bytes=1 << 30).host_work == 1.0
