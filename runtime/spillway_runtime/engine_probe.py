"""This node's DeepSpeed host work, measured in miniature (`measure_engine_host_work`).

The step-time model's host terms (`estimates.GATHER_SECONDS_PER_TENSOR` and the three beside it:
ZeRO-3's per-tensor gathers and releases, every stage's gradient hooks, and on the CPU
accelerator their host-memory copies) are constants fitted on one machine. On another they
took about twice as long while its matmuls ran at 0.7-0.8 of the speed, and neither a rate
of small tensor operations from Python nor a host copy's rate moved with them (see
docs/one-machine.md). So this measures the thing itself: a child process
(`training.host_work`) sets DeepSpeed up as the runtime does and trains the micro model the
constants were fitted on (the 0.75M-parameter Llama of benchmarks/bench_offload_overhead.py
--model tiny) under ZeRO-2 and then ZeRO-3. ZeRO-3's time over ZeRO-2 a step, over what the
constants predict for it, is `NodeHardware.host_work_scale`. Two children, the median kept
(on a 2-core VM one read 2.0-2.4 within 20 minutes).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

from spillway_runtime.core.hardware import HOST_WORK_SCALE_RANGE

RESULT = "ENGINE_PROBE "  # the result line of the child, training.host_work
TIMEOUT_SECONDS = 180.0
MEASUREMENTS = 2


def predicted_gather_seconds(tensors: int, params: int, on_gpu: bool) -> float:
    """What the constants put on ZeRO-3's time over ZeRO-2 for one micro-step of one process
    (`estimates.gather_release`; the gradient terms are the same in both at one micro-step)."""
    from spillway_runtime.core.estimates import GATHER_SECONDS_PER_PARAM_ON_CPU, GATHER_SECONDS_PER_TENSOR

    return tensors * GATHER_SECONDS_PER_TENSOR + (0 if on_gpu else params * GATHER_SECONDS_PER_PARAM_ON_CPU)


def scale_from(result: dict[str, Any]) -> tuple[float | None, str]:
    """(`host_work_scale` from one child's result, or None with why): ZeRO-3's time over ZeRO-2,
    measured over predicted, where it falls in HOST_WORK_SCALE_RANGE (outside it the measurement
    failed, say a neighbour took the machine for half of it: not a node)."""
    over = float(result["zero3_seconds"]) - float(result["zero2_seconds"])
    scale = over / predicted_gather_seconds(int(result["tensors"]), int(result["params"]),
                                            result["accelerator"] != "cpu")
    low, high = HOST_WORK_SCALE_RANGE
    if not low <= scale <= high:
        return None, (f"ZeRO-3 over ZeRO-2 {over * 1e3:.1f} ms: {scale:.2f} of the constants, "
                      f"outside {low}-{high}")
    return scale, ""


def _measure_once(env: dict[str, str]) -> tuple[float | None, str]:
    try:
        proc = subprocess.run([sys.executable, "-m", "spillway_runtime.training.host_work"], capture_output=True,
                              text=True, env=env, timeout=TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        return None, f"over {TIMEOUT_SECONDS:.0f} s"
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"exit {proc.returncode}: {tail[0]}"
    return scale_from(json.loads(lines[-1][len(RESULT):]))


def measure_engine_host_work(cores: int) -> float | None:
    """`NodeHardware.host_work_scale`, the median of MEASUREMENTS children; None where none
    could measure (said why). Each child has the threads one training process on this node
    has (`cores`, as `spillway run` gives it): with one thread ZeRO-3's extra on the micro model
    was 26-32 ms on a 2-core VM, with two 54-56 ms, as the runtime's own steps had it. On a
    busy machine it reads high (under a load of 5 on 2 cores, 7-16x the constants): outside
    HOST_WORK_SCALE_RANGE it is no figure, and the plan keeps the fitted constants."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, cores)))}
    scales, why = [], ""
    for _ in range(MEASUREMENTS):
        scale, why = _measure_once(env)
        if scale is not None:
            scales.append(scale)
    if not scales:
        print(f"probe: DeepSpeed's host work not measured ({why}); planning with the fitted constants")
        return None
    return statistics.median(scales)
