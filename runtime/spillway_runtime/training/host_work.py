"""The child process of `engine_probe.measure_engine_host_work`:
`python -m spillway_runtime.training.host_work` prints one RESULT line of JSON.

DeepSpeed's engine as the runtime sets it up (`recipe.Recipe._setup_distributed` and
`_setup_engine`: NUMA asked once, Muon imported without compiling, `deepspeed_fixes`, the
DeepSpeed config `dsconfig` builds from the planner's plan) trains the micro model
(`tiny.tiny_llama_config()`) under ZeRO-2 and then ZeRO-3, with the optimizer and the
parameters on the accelerator; each stage's median step (wall time) is reported. ZeRO-2
goes first: ZeRO-3 changes torch's functions for the rest of the process it ran in.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, NamedTuple

from spillway_runtime.engine_probe import RESULT
from spillway_runtime.training import startup
from spillway_runtime.training.processes import free_port

MICRO_BATCH, SEQUENCE = 4, 64
WARMUP_STEPS, TIMED_STEPS = 3, 12


class StageStep(NamedTuple):
    """One ZeRO stage's engine on the micro model: its median step and what it was built as."""

    seconds: float
    tensors: int
    params: int
    accelerator: str
    stage: int  # the ZeRO stage DeepSpeed built the engine with


def _engine(stage: int, hw: Any) -> tuple[Any, Any, int]:
    """(DeepSpeed engine, the plan it was configured from on `hw`, the model's vocabulary) at ZeRO `stage`."""
    import deepspeed
    import torch
    from transformers import LlamaForCausalLM

    from spillway_runtime import deepspeed_fixes
    from spillway_runtime.core.planner import ModelShape, PlanInputs, plan_placement
    from spillway_runtime.core.spec import FineTuneJobSpec
    from spillway_runtime.tiny import tiny_llama_config
    from spillway_runtime.training.dsconfig import build_deepspeed_config

    config = tiny_llama_config(use_cache=False)
    spec = FineTuneJobSpec.model_validate({
        "model": {"uri": "random-init", "dtype": "bf16"}, "dataset": {"uri": "random-tokens"},
        "training": {"microBatchSize": MICRO_BATCH, "sequenceLength": SEQUENCE, "maxSteps": 10},
        "offload": {"optimizer": "gpu", "parameters": "gpu", "deepspeed": {"zero_optimization": {"stage": stage}}},
    })
    plan = plan_placement(PlanInputs.of_spec(spec, ModelShape.from_hf_config(config.to_dict(), name="micro")),
                          hw)
    deepspeed_fixes.apply(plan)
    torch.manual_seed(0)
    model: torch.nn.Module = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    startup.import_muon_without_compiling()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=build_deepspeed_config(plan, spec))
    return engine, plan, int(config.vocab_size)


def _step(stage: int, hw: Any) -> StageStep:
    """The median seconds of a training step at ZeRO `stage`, and the engine's shape."""
    import torch
    from deepspeed.accelerator import get_accelerator

    engine, plan, vocab = _engine(stage, hw)
    accelerator = get_accelerator()
    device = accelerator.device_name(0)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(WARMUP_STEPS + TIMED_STEPS):
        ids = torch.randint(vocab, (MICRO_BATCH, SEQUENCE), generator=generator).to(device)
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        accelerator.synchronize()
        times.append(time.perf_counter() - start)
    built = int(engine.zero_optimization_stage())
    engine.destroy()
    return StageStep(statistics.median(times[WARMUP_STEPS:]), plan.model.parameter_tensors, plan.model.params,
                     plan.accelerator, built)


def main() -> None:
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    startup.ask_cpuinfo_once()
    startup.ask_numa_once()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from spillway_runtime.probe import probe_basic

    deepspeed.init_distributed(dist_backend="gloo" if get_accelerator().device_name() == "cpu" else "nccl")
    hw = probe_basic()  # both stages' plans: the capacities are read once
    zero2, zero3 = _step(2, hw), _step(3, hw)
    print(RESULT + json.dumps({"zero2_seconds": zero2.seconds, "zero3_seconds": zero3.seconds,
                               "tensors": zero2.tensors, "params": zero2.params, "accelerator": zero2.accelerator,
                               "stages": [zero2.stage, zero3.stage]}), flush=True)


if __name__ == "__main__":
    main()
