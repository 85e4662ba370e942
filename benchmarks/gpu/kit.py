"""The GPU validation kit: what a lent GPU machine can tell us in one call, best first.

Run by benchmarks/gpu/run.sh there (after the carried wheels are installed and DeepSpeed's
CPUAdam and async-I/O ops are built), or with --dry-run here (a CPU accelerator, tiny
models, every stage still run: tests/integration/test_gpu_kit.py). Stages:

  d. first: SIGKILL and resume through the runtime (`python -m spillway_runtime`, as `spillway run`
     launches it) with the optimizer on NVMe: the resumed losses equal the uninterrupted run's
     (saved after each of its three launches);
  a. the largest Llama-shaped model (random init, bf16) that trains GPU-resident (ZeRO-2,
     optimizer and parameters on the GPU) under a 24 GiB memory cap: a small search;
  b. a ~3x larger model under the same cap with ZeRO-3 and the optimizer on the CPU
     (DeepSpeedCPUAdam), then the optimizer on NVMe with the parameters on the CPU;
  c. beside every measurement, the planner's prediction for the same shape on this machine
     (plan_placement on the hardware `spillway run` measures: the disk's sweep, CPU Adam, the
     copies, the GPU's decoder layers, DeepSpeed's host work): bytes per tier and step time as
     ratios;
  e. stage a's smallest shape as plain ZeRO-Offload, with Twin-Flow keeping 30% of the
     optimizer on the GPU, and with ZenFlow: step time, peak GPU memory, losses (both ZeRO-3
     variants cut into ~16 sub-groups since 2026-12-05: not comparable with earlier runs);
  f. last: d again with Twin-Flow (offload.gpuResidentFraction 0.5): the GPU share's AdamW
     moments go through Spillway's checkpoint, so the resumed losses equal the uninterrupted run's.

A stage that needs a DeepSpeed op that did not build (run.sh's ops.json) is skipped with the
build's error. The NVMe model is sized from the planner's own swap bytes, and stage b's from the
host memory (--host-memory-gib: a Firecracker VM's MemTotal starts far below what it has).

Every measurement is its own process (`--measure`): an out-of-memory trial leaves nothing
behind, and the memory cap applies to it alone (less what the CUDA context and libraries hold
outside PyTorch's allocator, measured in the child). Results are rewritten to $OUT/gpu_kit.json
and $OUT/gpu_kit.md after every stage, so a call cut short keeps what it measured. The
DeepSpeed config is the runtime's own (dsconfig.build_deepspeed_config of the plan), except
that a GPU-resident optimizer is torch's fused AdamW rather than DeepSpeed's FusedAdam, whose
CUDA build would cost a minute of the call.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kit_report import Report  # beside this file: the script's folder is first on sys.path

GiB = 1 << 30
CAP_BYTES = 24 * GiB  # a consumer card's memory: what the kit asks the planner and DeepSpeed to fit under
VOCAB = 32000
RESULT_TAG = "KIT_RESULT "
# (ZeRO stage, optimizer tier, parameter tier[, the optimizer's share kept in CPU RAM])
Placement = tuple[int, str, str] | tuple[int, str, str, float]
STAGES = frozenset({"resume", "resident", "cpu", "nvme", "overlap", "twin"})  # d, a, b's CPU and NVMe optimizer, e, f
# Stage e: DeepSpeed's ways of taking the CPU optimizer step off the critical path, each as an edit
# of the runtime's ZeRO-Offload config: (name, placement, zero_optimization
# keys merged in). Twin-Flow ("ratio": the share of the optimizer state offloaded; the rest stays
# and is updated on the GPU, ZeRO-3 only). ZenFlow (ZeRO-2 here): the top 10% of gradient columns
# updated on the GPU each step, the rest on the CPU every 4 steps: in the step, as the runtime runs
# it (`offload.overlap: zenflow`, spec.ZENFLOW_DEFAULTS), and overlapped with the next steps
# (overlap_step, which the runtime does not use: its in-flight update is in no checkpoint).
# spec.ZENFLOW_DEFAULTS, written out: this module is imported before spillway is installed.
ZENFLOW_DEFAULTS = {"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 4, "update_interval": 4,
                    "full_warm_up_rounds": 0, "overlap_step": False}
STAGE_E_SUB_GROUPS = 16
OVERLAP_VARIANTS: list[tuple[str, Placement, dict[str, Any]]] = [
    ("zero_offload", (3, "cpu", "gpu"), {}),
    ("twin_flow_ratio_0.7", (3, "cpu", "gpu"), {"offload_optimizer": {"ratio": 0.7}}),
    ("zero_offload_z2", (2, "cpu", "gpu"), {}),
    ("zenflow_z2", (2, "cpu", "gpu"), {"zenflow": ZENFLOW_DEFAULTS}),
    ("zenflow_z2_overlapped", (2, "cpu", "gpu"), {"zenflow": {**ZENFLOW_DEFAULTS, "overlap_step": True}}),
]
# Llama widths and their MLP sizes (Llama-2 / TinyLlama ratios, ~8/3 h rounded to 256)
INTERMEDIATE = {64: 176, 128: 352, 1024: 2816, 1536: 4096, 2048: 5632, 2560: 6912, 3072: 8192, 4096: 11008}


def llama_config(hidden: int, layers: int, vocab: int = VOCAB, seq: int = 1024) -> dict[str, Any]:
    heads = max(1, hidden // 128) if hidden >= 128 else 2
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": INTERMEDIATE[hidden],
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "vocab_size": vocab, "max_position_embeddings": seq, "tie_word_embeddings": False}


def config_for_params(params: int, widths: list[int], vocab: int, seq: int, min_layers: int) -> dict[str, Any]:
    """A Llama shape of about `params` parameters: the widest width that still has `min_layers`
    (P ~ 12 L h^2 + 2 V h)."""
    for hidden in sorted(widths, reverse=True):
        layers = round((params - 2 * vocab * hidden) / (12 * hidden * hidden))
        if layers >= min_layers:
            return llama_config(hidden, layers, vocab, seq)
    return llama_config(min(widths), min_layers, vocab, seq)


@dataclass
class Settings:
    dry_run: bool
    out: Path
    work: Path
    budget_seconds: float
    cap_bytes: int | None
    micro_batch: int
    seq: int
    timed_steps: int
    search: list[tuple[int, int]]  # (hidden, layers), smallest first
    widths: list[int]
    min_layers: int  # stage b's shapes: no shallower than this
    vocab: int
    nvme_swap_bytes: int  # the NVMe variant's swap files are kept under this (disk and time)
    ops: dict[str, Any] = field(default_factory=dict)  # run.sh's ops.json: each op's build
    nvme_shares: tuple[float, ...] = ()  # stage b's NVMe model again with these shares kept in RAM
    only: frozenset[str] = STAGES  # --only: the measurements to make
    host_memory_bytes: int | None = None  # what the planner is told the host has, if more than probed
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_seconds - (time.monotonic() - self.started)

    @classmethod
    def make(cls, args: argparse.Namespace) -> Settings:
        out = Path(args.out or os.environ.get("OUT") or "gpu_kit_out")
        out.mkdir(parents=True, exist_ok=True)
        work = Path(args.work or tempfile.mkdtemp(prefix="gpu-kit-"))
        ops = json.loads(Path(args.ops).read_text()) if args.ops and Path(args.ops).is_file() else {}
        host = int(args.host_memory_gib * GiB) if args.host_memory_gib else None
        only = frozenset(args.only.split(",")) if args.only else STAGES
        shares = tuple(float(v) for v in args.nvme_shares.split(",")) if args.nvme_shares else ()
        if only - STAGES:
            raise SystemExit(f"--only: {', '.join(sorted(only - STAGES))} is not one of {', '.join(sorted(STAGES))}")
        if args.dry_run:
            return cls(True, out, work, args.budget_seconds, None, 2, 32, 1, [(64, 2), (128, 2)], [64, 128], 2, 512,
                       int(args.nvme_swap_gib * GiB), ops, shares, only, host)
        return cls(False, out, work, args.budget_seconds, CAP_BYTES, 4, 1024, 3,
                   [(1536, 24), (2048, 20), (2048, 28), (2560, 24)], [1024, 1536, 2048, 2560, 3072, 4096], 8, VOCAB,
                   int(args.nvme_swap_gib * GiB), ops, shares, only, host)

    def missing_op(self, optimizer: str) -> str | None:
        """Why a placement with the optimizer on `optimizer` cannot run: an op run.sh failed to build
        (none when ops.json is absent: the dry run, or the ops were built elsewhere)."""
        needs = {"cpu": ["cpu_adam"], "nvme": ["cpu_adam", "async_io"]}.get(optimizer, [])
        for name in needs:
            built = self.ops.get(name)
            if built is not None and not built.get("ok"):
                return f"DeepSpeed's {name} op did not build: {str(built.get('error', ''))[-400:]}"
        return None


# ----------------------------------------------------------------------------- planning (c)

def node_hardware(settings: Settings) -> tuple[Any, dict[str, Any]]:
    """This machine as `spillway run` plans on it (`probe_cache.hardware_for_run`, measured afresh
    into the work folder, about 25 s): the capacities, the disk's async-I/O sweep, the CPU Adam
    rate, on a GPU the host-device copy and its decoder-layer curve (`probe.measure_gpu_decoder`),
    and DeepSpeed's host work on this accelerator (`engine_probe`). Stage c's predictions carry
    them, and the report holds them and how they were measured. Until 2026-12-07 the kit planned
    with the planner's assumed disk, CPU Adam and copy rates: the first H200 run's 0.51 for the
    NVMe step was against those."""
    from spillway_runtime.engine_probe import measure_engine_host_work
    from spillway_runtime.probe import probe_basic
    from spillway_runtime.probe_cache import ProbeCacheSettings, hardware_for_run

    measured = ProbeCacheSettings(cache_dir=settings.work / "probe-cache", sweep=True, compute=True,
                                  compute_seconds=2.0 if settings.dry_run else 6.0)
    try:
        hw, probed = hardware_for_run(settings.work / "nvme", measure=True, settings=measured)
        record = probed.model_dump()
    except Exception as err:  # the one GPU call goes on with the capacities and the host work, as before
        hw = probe_basic(settings.work / "nvme")
        hw.host_work_scale = measure_engine_host_work(hw.cpu_cores)
        record = {"source": "unmeasured", "why": f"hardware_for_run failed: {type(err).__name__}: {err}"}
    if settings.cap_bytes and hw.gpu_count:
        hw = hw.model_copy(update={"gpu_memory_bytes": min(hw.gpu_memory_bytes, settings.cap_bytes)})
    if settings.host_memory_bytes and settings.host_memory_bytes > hw.cpu_memory_bytes:
        hw = hw.model_copy(update={"cpu_memory_bytes": settings.host_memory_bytes,
                                   "cpu_memory_available_bytes": settings.host_memory_bytes})
    return hw, record


def plan_for(settings: Settings, hw: Any, config: dict[str, Any], placement: Placement) -> tuple[Any, Any]:
    """The planner's plan of `config` forced to `placement`, and the job spec it was made for."""
    from spillway_runtime.core.planner import ModelShape, PlanInputs, plan_placement
    from spillway_runtime.core.spec import FineTuneJobSpec

    stage, optimizer, parameters, *share = placement
    offload: dict[str, Any] = {"optimizer": optimizer, "parameters": parameters,
                               "deepspeed": {"zero_optimization": {"stage": stage}}}
    if share:
        offload["cpuResidentFraction"] = share[0]
    spec = FineTuneJobSpec.model_validate({
        "model": {"uri": "random-init", "dtype": "bf16"}, "dataset": {"uri": "random-tokens"},
        "training": {"microBatchSize": settings.micro_batch, "sequenceLength": settings.seq, "maxSteps": 10},
        "offload": offload,
    })
    shape = ModelShape.from_hf_config(config, name=f"llama-h{config['hidden_size']}-l{config['num_hidden_layers']}")
    plan = plan_placement(PlanInputs.of_spec(spec, shape), hw)
    return plan, spec


def prediction(plan: Any) -> dict[str, Any]:
    return {"label": plan.label, "feasible": plan.feasible, "params": plan.model.params,
            "bytes": plan.bytes.model_dump(), "step_seconds": plan.predicted_step_seconds,
            "compute": plan.step.compute_rate(),
            "activation_checkpointing": plan.activation_checkpointing,
            "shortfalls": [s.describe() for s in plan.shortfalls]}


def ratios(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, float | None]:
    """Measured over predicted: GPU peak, CPU peak RSS, NVMe swap bytes, step time."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    bytes_ = predicted["bytes"]
    return {"gpu": ratio(measured.get("peak_gpu_bytes"), bytes_["gpu"]),
            "cpu": ratio(measured.get("peak_rss_bytes"), bytes_["cpu"]),
            "nvme": ratio(measured.get("swap_bytes"), bytes_["nvme"]),
            "step": ratio(measured.get("step_seconds"), predicted["step_seconds"])}


# ----------------------------------------------------------------------------- one measurement

def measure(settings: Settings, hw: Any, config: dict[str, Any], placement: Placement,
            timeout: float, zero_update: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train `config` at `placement` in a child process; its numbers beside the plan's.
    `zero_update`: keys merged into the runtime's zero_optimization (stage e's variants)."""
    from spillway_runtime.training.dsconfig import build_deepspeed_config

    plan, spec = plan_for(settings, hw, config, placement)
    row: dict[str, Any] = {"placement": plan.label, "predicted": prediction(plan)}
    if hw.gpu_decoder:  # beside it, the step at a share of the GPU's peak, as planned before the GPU was measured
        assumed = plan_for(settings, hw.model_copy(update={"gpu_decoder": []}), config, placement)[0]
        row["predicted"]["step_seconds_at_peak_share"] = assumed.predicted_step_seconds
    missing = settings.missing_op(placement[1])
    if missing:
        return {**row, "skipped": missing}
    nvme = settings.work / f"swap-{time.monotonic_ns()}"
    ds_config = build_deepspeed_config(plan, spec, nvme_path=str(nvme) if plan.uses_nvme else None)
    if zero_update:
        ds_config["zero_optimization"] = overlap_config(ds_config["zero_optimization"], zero_update)
    job = {"config": config, "ds_config": ds_config, "cap_bytes": settings.cap_bytes, "seq": settings.seq,
           "micro_batch": settings.micro_batch, "timed_steps": settings.timed_steps, "nvme": str(nvme),
           "checkpointing": plan.activation_checkpointing}
    started = time.monotonic()
    try:
        rc, output = run_child([sys.executable, __file__, "--measure", json.dumps(job)], timeout,
                               log=settings.work / f"measure-{time.monotonic_ns()}.log")
        lines = [line for line in output.splitlines() if line.startswith(RESULT_TAG)]
        if lines:
            row["measured"] = json.loads(lines[-1][len(RESULT_TAG):])
        elif rc is None:
            row["error"] = f"timed out after {timeout:.0f} s"
        else:
            tail = output[-1500:]
            row["error"] = "out of memory" if "OutOfMemory" in tail or "out of memory" in tail else tail
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    row["wall_seconds"] = round(time.monotonic() - started, 1)
    if "measured" in row:
        row["ratio"] = ratios(row["measured"], row["predicted"])
    return row


CHILDREN: set[int] = set()  # process groups of live children: ended by the SIGTERM handler


def run_child(command: list[str], timeout: float, log: Path, env: dict[str, str] | None = None,
              until: Any = None) -> tuple[int | None, str]:
    """A child in its own session (its process group ends with it), its output in `log`, bounded
    by `timeout`: its exit status (None when it was killed for time) and output. `until()`,
    polled, kills it early once it returns true; the status is then the kill's."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        child = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    CHILDREN.add(child.pid)
    deadline = time.monotonic() + max(1.0, timeout)
    timed_out = False
    try:
        while child.poll() is None:
            if time.monotonic() > deadline:
                timed_out = True
                break
            if until is not None and until():
                _kill(child.pid)
                until = None
            time.sleep(0.05)
    finally:
        if child.poll() is None:
            _kill(child.pid)
        rc = child.wait()
        CHILDREN.discard(child.pid)
    return (None if timed_out else rc), log.read_text(errors="replace")


def _kill(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _build_model(job: dict[str, Any], ds_config: dict[str, Any], device: str) -> Any:
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in job["config"].items() if k != "model_type"}, use_cache=False)
    zero = ds_config["zero_optimization"]
    if zero["stage"] == 3:
        remote = zero.get("offload_param", {}).get("device")
        context: Any = deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device=remote, dtype=torch.bfloat16)
    else:
        context = torch.device(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of a large model on the way
    try:
        with context:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    if job["checkpointing"]:
        model.gradient_checkpointing_enable()
    return model


def run_measurement(job: dict[str, Any]) -> dict[str, Any]:
    """In the child: build, train warm-up + timed steps, report times and peaks."""
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())})
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    cuda = get_accelerator().device_name() == "cuda"
    device = get_accelerator().device_name(0)
    outside = None
    ds_config = job["ds_config"]
    deepspeed.init_distributed(verbose=False)
    if cuda and job["cap_bytes"]:
        # the cap bounds PyTorch's allocator only: what the CUDA context, NCCL and the libraries
        # already hold outside it is taken off first (cuBLAS's workspace comes later: a few MiB)
        torch.ones(1, device=device) @ torch.ones(1, 1, device=device)
        free, total = torch.cuda.mem_get_info()
        outside = total - free - torch.cuda.memory_reserved()
        torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, (job["cap_bytes"] - outside) / total)))
    torch.manual_seed(0)  # the same weights in every measurement: stage e compares their losses
    model = _build_model(job, ds_config, device)
    optimizer = None
    if "offload_optimizer" not in ds_config["zero_optimization"]:
        # torch's fused AdamW: DeepSpeed's FusedAdam would be built with nvcc first
        params = ds_config.pop("optimizer")["params"]
        ds_config["zero_allow_untested_optimizer"] = True
        optimizer = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params["betas"]),
                                      eps=params["eps"], weight_decay=params["weight_decay"], fused=cuda or None)
    from spillway_runtime.deepspeed_fixes import (
        hold_one_steps_gradient_partitions_only,
        run_twin_flow_as_deepspeed_describes_it,
        view_zenflow_weights_in_column_order,
    )

    view_zenflow_weights_in_column_order()  # as the runtime runs ZenFlow (DeepSpeed 0.19.8 scrambles its weights)
    run_twin_flow_as_deepspeed_describes_it()  # and Twin-Flow (its AdamW's schedule; on a CPU dry run, its path)
    hold_one_steps_gradient_partitions_only()  # and one micro-batch a step offloaded: no 16-bit gradient buffer
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    generator = torch.Generator().manual_seed(0)
    tokens = job["micro_batch"] * job["seq"]
    times, losses = [], []
    for _ in range(1 + job["timed_steps"]):  # the first step warms up (allocations, swap files)
        ids = torch.randint(job["config"]["vocab_size"], (job["micro_batch"], job["seq"]), generator=generator).to(device)
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        get_accelerator().synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    step = sorted(times[1:])[len(times[1:]) // 2]
    nvme = Path(job["nvme"])
    swap = sum(p.stat().st_size for p in nvme.rglob("*") if p.is_file()) if nvme.exists() else 0
    return {"step_seconds": round(step, 4), "tokens_per_second": round(tokens / step, 1),
            "first_step_seconds": round(times[0], 3), "losses": losses,
            "peak_gpu_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "swap_bytes": swap,
            "outside_allocator_bytes": outside, "sub_groups_on_accelerator": _on_accelerator(engine)}


def _on_accelerator(engine: Any) -> list[int] | None:
    """Twin-Flow: [sub-groups kept on the accelerator, sub-groups] of this rank (None without it)."""
    placed = getattr(engine.optimizer, "subgroup_to_device", None)
    if not placed or getattr(engine.optimizer, "backup_optimizer", None) is None:
        return None
    return [sum(device != "cpu" for device in placed.values()), len(placed)]


# ----------------------------------------------------------------------------- stages

def stage_gpu_resident(settings: Settings, hw: Any, report: Report) -> dict[str, Any] | None:
    """(a) Up from the second-smallest size while trials fit, down while they do not."""
    placement = (2, "gpu", "gpu")
    tried: dict[int, dict[str, Any]] = {}
    index = min(1, len(settings.search) - 1)
    while 0 <= index < len(settings.search) and index not in tried and settings.left() > 30:
        hidden, layers = settings.search[index]
        config = llama_config(hidden, layers, settings.vocab, settings.seq)
        tried[index] = row = measure(settings, hw, config, placement, min(240.0, settings.left() - 20))
        row["config"] = config
        report.add("a_gpu_resident", {"trials": list(tried.values())})
        fits = "measured" in row
        if fits and (index + 1 in tried or index + 1 == len(settings.search)):
            break
        if not fits and index - 1 in tried:
            index -= 1
            break
        index += 1 if fits else -1
    fitting = [tried[i] for i in sorted(tried) if "measured" in tried[i]]
    best = fitting[-1] if fitting else None
    report.add("a_gpu_resident", {"trials": list(tried.values()), "largest": best,
                                  "cap_bytes": settings.cap_bytes or "skipped: the 24 GiB cap needs CUDA (dry run)",
                                  **({} if best else {"skipped": "no size fitted (or the budget ran out)"})})
    return best


HOST_SHARE = 0.6  # stage b's planned host state stays under this share of the host's memory


def sized(settings: Settings, hw: Any, params: int, placement: Placement) -> tuple[dict[str, Any], str]:
    """A shape of about `params` parameters whose plan keeps its swap files under the NVMe limit
    and its host state under HOST_SHARE of the host memory (the planner's own bytes, not a
    bytes-per-parameter guess): the shape and, when it was shrunk, why."""
    limits = {"nvme": settings.nvme_swap_bytes, "cpu": int(HOST_SHARE * hw.cpu_memory_bytes)}
    why = []
    for _ in range(4):
        config = config_for_params(params, settings.widths, settings.vocab, settings.seq, settings.min_layers)
        plan = plan_for(settings, hw, config, placement)[0]
        planned = plan.bytes.model_dump()
        over = max(planned[tier] / limit for tier, limit in limits.items())
        if over <= 1.0:
            break
        tier = max(limits, key=lambda t: planned[t] / limits[t])
        why.append(f"{plan.model.params:,} parameters planned {planned[tier] / GiB:.1f} GiB of {tier}, "
                   f"over {limits[tier] / GiB:.1f} GiB")
        params = int(params / over * 0.95)
    return config, "; ".join(why)


def stage_offloaded(settings: Settings, hw: Any, report: Report, resident: dict[str, Any] | None) -> None:
    """(b) ~3x the GPU-resident model: optimizer on the CPU; then optimizer on NVMe, parameters on
    the CPU, with the swap files kept under the NVMe limit (disk and time on the machine)."""
    hidden, layers = settings.search[0]  # nothing fitted: 3x the smallest size tried
    base = resident["predicted"]["params"] if resident else 12 * layers * hidden**2 + 2 * settings.vocab * hidden
    target = 3 * base
    rows: dict[str, Any] = {"target_params": target}
    for key, placement in (("optimizer_cpu", (3, "cpu", "gpu")), ("optimizer_nvme_parameters_cpu", (3, "nvme", "cpu"))):
        if placement[1] not in settings.only:
            continue
        left = settings.left()
        if left < 60:
            rows[key] = {"skipped": f"budget: {left:.0f} s left"}
            report.add("b_offloaded", rows)
            continue
        config, capped = sized(settings, hw, target, placement)
        row = measure(settings, hw, config, placement, min(200.0, left - 20))
        row["config"] = config
        if capped:
            row["capped"] = capped
        rows[key] = row
        report.add("b_offloaded", rows)
        if placement[1] == "nvme":
            stage_shares(settings, hw, report, rows, config)


def stage_shares(settings: Settings, hw: Any, report: Report, rows: dict[str, Any], config: dict[str, Any]) -> None:
    """(b) The NVMe model again with a share of its optimizer sub-groups kept in CPU RAM
    (offload.cpuResidentFraction): the same shape, so the rows compare."""
    for share in settings.nvme_shares:
        key = f"optimizer_nvme_share_{share:g}"
        left = settings.left()
        if left < 60:
            rows[key] = {"skipped": f"budget: {left:.0f} s left"}
        else:
            row = measure(settings, hw, config, (3, "nvme", "cpu", share), min(200.0, left - 20))
            rows[key] = {**row, "placement": f"{row['placement']} ram {share:g}", "config": config}
        report.add("b_offloaded", rows)


def overlap_config(zero: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`zero` (a zero_optimization section) with `update` merged in, one level deep."""
    merged = dict(zero)
    for key, value in update.items():
        merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    return merged


def stage_overlap(settings: Settings, hw: Any, report: Report) -> None:
    """(e) The smallest shape of stage a's search (778M on a GPU: a minute a variant) trained as
    plain ZeRO-Offload, with Twin-Flow's GPU share and with ZenFlow (OVERLAP_VARIANTS): step
    time, peak GPU memory and the losses of the same steps, side by side. ZenFlow's steps are
    micro-steps (it sets DeepSpeed's gradient accumulation to its update interval) and it updates
    most gradients late, so its losses are not plain ZeRO-Offload's. `--only overlap` runs it
    alone."""
    hidden, layers = settings.search[0]
    config = llama_config(hidden, layers, settings.vocab, settings.seq)
    rows: dict[str, Any] = {"config": config}
    params = 12 * layers * hidden**2 + 2 * settings.vocab * hidden
    for name, placement, update in OVERLAP_VARIANTS:
        if placement[0] == 3:
            # DeepSpeed keeps int(0.3 x sub-groups) on the GPU, and the runtime's plan cuts a 778M
            # model into one: none. Both ZeRO-3 variants are cut into ~16 (4 on the GPU).
            update = {**update, "sub_group_size": params // STAGE_E_SUB_GROUPS}
        left = settings.left()
        if left < 60:
            rows[name] = {"skipped": f"budget: {left:.0f} s left"}
        else:
            row = measure(settings, hw, config, placement, min(200.0, left - 20), zero_update=update)
            rows[name] = {**row, "placement": f"{row['placement']} {name}", "zero_update": update}
        report.add("e_overlap", rows)


def stage_planner(report: Report) -> None:
    """(c) The predictions beside the measurements, one row each (they were made with them)."""
    rows = []
    for stage in ("a_gpu_resident", "b_offloaded"):
        block = report.stages.get(stage, {})
        candidates = block.get("trials", []) + [v for v in block.values() if isinstance(v, dict)]
        rows += [{"stage": stage, "placement": r["placement"], "params": r["predicted"]["params"],
                  "feasible": r["predicted"]["feasible"], "ratio": r["ratio"]}
                 for r in candidates if "ratio" in r]
    report.add("c_planner", {"rows": rows} if rows else {"skipped": "no measurement to compare"})


LAUNCH_SECONDS = 150.0  # one launch of stage d at most (a tiny model: ~20-40 s expected)


def stage_resume(settings: Settings, hw: Any, report: Report, twin_flow: bool = False) -> None:
    """(d) The runtime, SIGKILLed after its second checkpoint, resumes to the same losses. Run
    first; its report is rewritten after each launch; a failed reference ends it. (f) with
    `twin_flow`: the same with the optimizer in CPU RAM and half its sub-groups on the GPU
    (offload.gpuResidentFraction), whose AdamW moments Spillway writes into the checkpoint."""
    key = "f_twin_flow_resume" if twin_flow else "d_resume"
    optimizer = "cpu" if twin_flow else next((o for o in ("nvme", "cpu") if not settings.missing_op(o)), None)
    if optimizer is None or settings.missing_op(optimizer):
        report.add(key, {"skipped": settings.missing_op("cpu")})
        return
    if twin_flow and settings.left() < 3 * 40:  # three launches of a tiny model, ~20-40 s each
        report.add(key, {"skipped": f"{settings.left():.0f} s of the budget left"})
        return
    from spillway_runtime.tiny import build_tiny_model, write_dataset
    from spillway_runtime.training.reporting import read_events

    root = settings.work / ("twin-flow" if twin_flow else "resume")
    # the tiny model (0.75M parameters) in 7 sub-groups, 3 of them on the GPU
    shares = {"gpuResidentFraction": 0.5} if twin_flow else {}
    zero = {"stage": 3, **({"sub_group_size": 100_000} if twin_flow else {})}
    model = build_tiny_model(root / "model")
    data = write_dataset(root / "train.jsonl", count=400)
    job = root / "job.json"
    job.write_text(json.dumps({
        "apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "kit-resume"},
        "spec": {"model": {"uri": str(model), "dtype": "bf16"}, "dataset": {"uri": str(data)},
                 "training": {"maxSteps": 10, "microBatchSize": 2, "gradientAccumulation": 2, "sequenceLength": 32,
                              "learningRate": 3e-3, "warmupSteps": 2},
                 "offload": {"optimizer": optimizer, "parameters": "gpu", "nvme": {"path": str(root / "nvme")},
                             **shares, "deepspeed": {"zero_optimization": zero}},
                 "checkpoint": {"everySteps": 5, "keep": 5}}}))
    started = time.monotonic()
    result: dict[str, Any] = {"placement": f"Z3 opt:{optimizer} par:gpu" + (" gpuResidentFraction 0.5" if twin_flow else ""),
                              "returncodes": []}
    if optimizer != "nvme" and not twin_flow:
        result["fallback"] = settings.missing_op("nvme")
    for name, kill_at in (("reference", None), ("killed", 6), ("resumed", None)):
        run = root / ("reference" if name == "reference" else "resumed")
        rc, log = launch(job, run, hw, kill_at, timeout=min(LAUNCH_SECONDS, settings.left() - 20))
        result["returncodes"].append(rc)
        result["seconds"] = round(time.monotonic() - started, 1)
        if rc != (-signal.SIGKILL if kill_at else 0):
            result[f"{name}_log_tail"] = log[-2000:]
        report.add(key, result)
        if name == "reference" and rc != 0:
            result["skipped"] = "the uninterrupted run failed: no resume to compare"
            report.add(key, result)
            return
    losses = {name: {e["step"]: e["loss"] for e in read_events(run / "events.jsonl") if e["event"] == "step"}
              for name, run in (("reference", root / "reference"), ("resumed", root / "resumed"))
              if (run / "events.jsonl").exists()}
    resumed = losses.get("resumed", {})
    compared = sorted(s for s in resumed if s > 5)
    worst = max((abs(resumed[s] - losses["reference"][s]) / max(abs(losses["reference"][s]), 1e-12)
                 for s in compared if s in losses.get("reference", {})), default=None)
    report.add(key, {
        **result, "killed_by_sigkill": result["returncodes"][1] == -signal.SIGKILL, "compared_steps": compared,
        "max_relative_difference": worst, "equal": worst is not None and worst <= 1e-4 and len(compared) >= 5})


def launch(job: Path, run_dir: Path, hw: Any, kill_at: int | None, timeout: float) -> tuple[int | None, str]:
    """One runtime process, as `spillway run` starts it, with cuBLAS's deterministic workspace;
    SIGKILLed once the events show `kill_at`. Its exit status (None when out of time) and log."""
    from spillway_runtime.local import prepare_local_run, runtime_command, runtime_env
    from spillway_runtime.training.runconfig import FaultInjection

    faults = FaultInjection(step_sleep_seconds=0.4) if kill_at else None  # room for the kill to land
    config = prepare_local_run(job, run_dir=run_dir, hardware=hw, faults=faults)
    events = run_dir / "events.jsonl"
    offset = events.stat().st_size if events.exists() else 0

    def reached() -> bool:
        if kill_at is None or not events.exists():
            return False
        with events.open("rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
        steps = [json.loads(line)["step"] for line in text.splitlines() if '"event": "step"' in line and line.endswith("}")]
        return max(steps, default=0) >= kill_at

    env = {**runtime_env(config), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    return run_child(runtime_command(run_dir / "runtime.json", 1), timeout,
                     log=run_dir / f"runtime-{time.monotonic_ns()}.log", env=env, until=reached)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny models, no memory cap, CPU accelerator")
    parser.add_argument("--budget-seconds", type=float, default=420.0, help="stages that no longer fit are skipped")
    parser.add_argument("--out", help="results folder (default: $OUT)")
    parser.add_argument("--work", help="scratch folder for swap files and runs (default: a new temporary one)")
    parser.add_argument("--nvme-swap-gib", type=float, default=4, help="stage b's NVMe variant's planned swap stays under this")
    parser.add_argument("--ops", help="run.sh's ops.json: stages needing an op that did not build are skipped")
    parser.add_argument("--host-memory-gib", type=float, help="the host's memory, when more than MemTotal says now")
    parser.add_argument("--nvme-shares", help="stage b's NVMe model again with these shares of its optimizer "
                        "kept in CPU RAM (offload.cpuResidentFraction), e.g. 0.5")
    parser.add_argument("--only", help=f"a comma list of {', '.join(sorted(STAGES))} (default: all); stage b "
                        "without the resident search takes 3x its smallest size")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(RESULT_TAG + json.dumps(run_measurement(json.loads(args.measure))), flush=True)
        os._exit(0)  # no teardown of NCCL groups and pinned buffers: the process is done
    if args.dry_run:
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("SPILLWAY_PROBE_SWEEP", "0")
    settings = Settings.make(args)
    hw, probed = node_hardware(settings)
    report = Report(settings, {**hw.model_dump(), "probe": probed})

    def terminated(signum: int, _frame: Any) -> None:  # timeout's SIGTERM: end the children, keep the report
        for pgid in list(CHILDREN):
            _kill(pgid)
        report.stages["terminated"] = {"signal": signum, "elapsed_seconds": round(time.monotonic() - settings.started, 1)}
        report.write()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    report.write()
    if "resume" in settings.only:
        stage_resume(settings, hw, report)
    resident = stage_gpu_resident(settings, hw, report) if "resident" in settings.only else None
    stage_offloaded(settings, hw, report, resident)
    if "overlap" in settings.only:
        stage_overlap(settings, hw, report)
    if "twin" in settings.only:
        stage_resume(settings, hw, report, twin_flow=True)
    stage_planner(report)
    report.write()
    print(report.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
