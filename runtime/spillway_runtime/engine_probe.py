"""This node's DeepSpeed host work, measured in miniature: `python -m spillway_runtime.engine_probe`.

The step-time model's host terms (`estimates.GATHER_SECONDS_PER_TENSOR` and the three beside it:
ZeRO-3's per-tensor gathers and releases, every stage's gradient hooks, and on the CPU
accelerator their host-memory copies) are constants fitted on one machine. On another they
took 1.7-1.9 times as long while its matmuls ran at 0.7-0.8 of the speed, and neither a
rate of small tensor operations from Python nor a host copy's rate moved with them (see
docs/one-machine.md). What does move with them is the thing itself: this runs DeepSpeed's own
engine, ZeRO-2 and then ZeRO-3, on the micro model the constants were fitted on (the 0.75M
parameter Llama of benchmarks/bench_offload_overhead.py --model tiny), with the zero
settings `dsconfig` writes for it, and prints ZeRO-3's time over ZeRO-2 a step beside what
the constants predict for it. Their ratio is `NodeHardware.host_work_scale`.

A process of its own (`measure_engine_host_work` starts it): it brings up a one-process
process group on a free loopback port, and ZeRO-3 changes torch's functions for the rest
of the process it ran in (ZeRO-2 is therefore timed first).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

# The micro model: bench_offload_overhead's tiny (hidden 128, 4 layers, 4 heads, a 512-token
# vocabulary): 39 tensors, 0.75M parameters, where ZeRO-3's gathers are most of its step.
HIDDEN, LAYERS, HEADS, VOCAB = 128, 4, 4, 512
MICRO_BATCH, SEQUENCE = 4, 64
WARMUP_STEPS, TIMED_STEPS = 3, 12
TIMEOUT_SECONDS = 180.0
RESULT = "ENGINE_PROBE "
# A ratio outside these is a failed measurement (a neighbour took the machine for the ZeRO-3
# half, say), not a node: planning goes on with the constants as they are.
SCALE_RANGE = (0.2, 5.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _zero_block(stage: int) -> dict[str, Any]:
    """What `dsconfig._zero_block` writes for this model with everything on the accelerator."""
    h = HIDDEN * HIDDEN
    zero: dict[str, Any] = {"stage": stage, "contiguous_gradients": True, "overlap_comm": False}
    if stage == 3:
        zero.update({"reduce_bucket_size": h, "stage3_prefetch_bucket_size": int(0.9 * h),
                     "stage3_param_persistence_threshold": 10 * HIDDEN})
    else:
        zero.update({"reduce_bucket_size": h, "allgather_bucket_size": h})
    return zero


def _step_seconds(stage: int, device: str) -> tuple[float, int, int]:
    """(median seconds of a training step, parameter tensors, parameters) under ZeRO `stage`."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model: torch.nn.Module = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=2 * SEQUENCE,
        tie_word_embeddings=False, use_cache=False))
    model = model.to(torch.bfloat16)
    tensors, params = len(list(model.parameters())), sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 10**9, "bf16": {"enabled": True},
              "zero_optimization": _zero_block(stage), "zero_allow_untested_optimizer": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # the same in both: it cancels out
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(WARMUP_STEPS + TIMED_STEPS):
        ids = torch.randint(VOCAB, (MICRO_BATCH, SEQUENCE), generator=generator).to(device)
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        get_accelerator().synchronize()
        times.append(time.perf_counter() - start)
    engine.destroy()
    return statistics.median(times[WARMUP_STEPS:]), tensors, params


def main() -> None:
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    import logging

    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    accelerator = get_accelerator()
    deepspeed.init_distributed(verbose=False)
    device = accelerator.device_name(0)
    zero2, tensors, params = _step_seconds(2, device)
    zero3, _, _ = _step_seconds(3, device)
    print(RESULT + json.dumps({"zero2_seconds": zero2, "zero3_seconds": zero3, "tensors": tensors,
                               "params": params, "on_gpu": accelerator.device_name() != "cpu"}), flush=True)


def predicted_gather_seconds(tensors: int, params: int, on_gpu: bool) -> float:
    """What the constants put on ZeRO-3's time over ZeRO-2 for one micro-step of one process
    (`estimates.gather_release`; the gradient terms are the same in both at one micro-step)."""
    from spillway_runtime.core.estimates import GATHER_SECONDS_PER_PARAM_ON_CPU, GATHER_SECONDS_PER_TENSOR

    return tensors * GATHER_SECONDS_PER_TENSOR + (0 if on_gpu else params * GATHER_SECONDS_PER_PARAM_ON_CPU)


def measure_engine_host_work() -> float | None:
    """`NodeHardware.host_work_scale`: this node's ZeRO-3 time over ZeRO-2 on the micro model
    over what the constants predict for it; None where it could not be measured (said why)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)))))
    try:
        proc = subprocess.run([sys.executable, "-m", "spillway_runtime.engine_probe"], capture_output=True,
                              text=True, env=env, timeout=TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        print(f"probe: DeepSpeed's host work not measured (over {TIMEOUT_SECONDS:.0f} s)")
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"probe: DeepSpeed's host work not measured (exit {proc.returncode}: {tail[0]})")
        return None
    result = json.loads(lines[-1][len(RESULT):])
    over = float(result["zero3_seconds"]) - float(result["zero2_seconds"])
    scale = over / predicted_gather_seconds(int(result["tensors"]), int(result["params"]), bool(result["on_gpu"]))
    if not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:
        print(f"probe: DeepSpeed's host work not measured (ZeRO-3 over ZeRO-2 {over * 1e3:.1f} ms: "
              f"{scale:.2f} of the constants, outside {SCALE_RANGE})")
        return None
    return scale


if __name__ == "__main__":
    main()
