"""Measure the hardware of the machine this runs on, as a `NodeHardware`.

Counts and capacities are read (GPUs, RAM, cores, NVMe space); speeds are
measured: NVMe read/write with DeepSpeed's async I/O over a short sweep of
block size, queue depth and parallelism (the best settings are kept for the
plan's `aio` block), the CPU optimizer step of DeepSpeedCPUAdam and torch's
fused AdamW, host-device copies when a GPU is present, and without one the
CPU's matmul rate per dtype and hidden size (the CPU accelerator's compute; with one, a GPU's
decoder layers), and DeepSpeed's
host work around the compute (`engine_probe`). Every measurement
is bounded in time; `quick=True` skips the speed measurements.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from spillway_runtime.core.hardware import AioSettings, MatmulRate, NodeHardware, memlock_limit
from spillway_runtime.core.memlock import PROBE_SHARE
from spillway_runtime.core.planner import MIN_AIO_BYTES
from spillway_runtime.engine_probe import measure_engine_host_work


class ProbeError(RuntimeError):
    """A measurement that cannot be made here, with what to change."""


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return psutil.cpu_count() or 1


def _cgroup_memory_limit() -> int | None:
    """A container's memory limit (cgroup v2 or v1), which bounds what we may use."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (1 << 60):
            return int(raw)
    return None


# What a GPU's driver leaves on a machine, loaded or installed: without any of them CUDA (or
# ROCm, or WSL's GPU) has nothing to find, and asking torch is 1.5 s of importing it for a 0.
# (The NVIDIA container toolkit and device plugin give a GPU pod /dev/nvidiactl.)
GPU_DRIVER_SIGNS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg",
                    "/dev/nvmap", "/dev/nvgpu")  # the last two: Jetson's integrated GPU


def _no_gpu_driver() -> bool:
    return not any(Path(sign).exists() for sign in GPU_DRIVER_SIGNS) and shutil.which("nvidia-smi") is None


def probe_gpus() -> tuple[int, str | None, int]:
    """(count, product, memory per GPU in bytes); (0, None, 0) without GPUs."""
    if _no_gpu_driver():
        return 0, None, 0
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            props = torch.cuda.get_device_properties(0)
            return torch.cuda.device_count(), props.name, int(props.total_memory)
        return 0, None, 0
    except ImportError:
        pass
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=False,
        ).stdout.strip().splitlines()
        if out:
            name, mib = out[0].rsplit(",", 1)
            return len(out), name.strip(), int(float(mib)) * 2**20
    return 0, None, 0


def probe_basic(nvme_path: str | Path | None = None, name: str = "local") -> NodeHardware:
    """Capacities only: fast, no benchmarks."""
    vm = psutil.virtual_memory()
    total, available = vm.total, vm.available
    limit = _cgroup_memory_limit()
    if limit is not None:
        total, available = min(total, limit), min(available, limit)
    gpus, product, gpu_mem = probe_gpus()
    hw = NodeHardware(
        name=name,
        gpu_count=gpus,
        gpu_product=product,
        gpu_memory_bytes=gpu_mem,
        cpu_cores=_cores(),
        cpu_memory_bytes=total,
        cpu_memory_available_bytes=available,
        memlock_bytes=memlock_limit(),
    )
    if nvme_path is not None:
        path = Path(nvme_path)
        path.mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(path)
        hw.nvme_path = str(path.resolve())
        hw.nvme_capacity_bytes = usage.total
        hw.nvme_free_bytes = usage.free
    return hw


def _time_best(fn: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _drop_page_cache(path: str) -> None:
    """So that reads come from the device, not from pages the write just left in RAM."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def aio_io_bytes(io_bytes: int) -> int:
    """What a measurement may lock: the buffer is mlock()ed, and past RLIMIT_MEMLOCK DeepSpeed
    dies of SIGSEGV (a container run as a non-root uid may lock 8 MiB). Measure with what
    training could lock too."""
    limit = memlock_limit()
    if limit is None:
        return io_bytes
    io_bytes = min(io_bytes, int(limit * PROBE_SHARE) // MIN_AIO_BYTES * MIN_AIO_BYTES)
    if io_bytes < MIN_AIO_BYTES:
        raise ProbeError(
            f"RLIMIT_MEMLOCK is {limit:,} bytes, under the {MIN_AIO_BYTES:,} the async I/O sweep locks: raise "
            "it (`ulimit -l`; LimitMEMLOCK=infinity in the container runtime's unit) or probe with --quick"
        )
    return io_bytes


def measure_aio_setting(aio: Any, path: str, settings: AioSettings, io_bytes: int) -> tuple[float, float]:
    """(read B/s, write B/s) of `io_bytes` through one `aio_handle` with `settings`, best of two
    each; `aio` is the loaded AsyncIOBuilder op."""
    import torch

    handle = aio.aio_handle(settings.block_size, settings.queue_depth, settings.single_submit,
                            settings.overlap_events, settings.intra_op_parallelism)
    buf = handle.new_cpu_locked_tensor(io_bytes, torch.empty(0, dtype=torch.uint8))
    # Random so that no drive compresses it; filled 8 bytes at a time, since byte-wise
    # random_ took 0.5 s per 64 MiB, longer than the transfers it prepares.
    buf.view(torch.int64).random_()

    def write() -> None:
        handle.pwrite(buf, path, False, True)
        handle.wait()

    def read() -> None:
        handle.pread(buf, path, False, True)
        handle.wait()

    try:
        write_s = _time_best(write, 2)
        _drop_page_cache(path)
        read_s = _time_best(read, 2)
    finally:
        handle.free_cpu_locked_tensor(buf)
    return io_bytes / read_s, io_bytes / write_s


class AioMeasurement(NamedTuple):
    """What the async-I/O sweep found: the disk's bandwidth and its cost per transfer with the
    best settings (`fit_transfer_cost`)."""

    read_bps: float
    write_bps: float
    settings: AioSettings
    transfer_seconds: float | None


def fit_transfer_cost(small_bytes: int, small: tuple[float, float], large_bytes: int,
                      large: tuple[float, float]) -> tuple[float, float, float]:
    """(read B/s, write B/s, seconds per transfer) of a line `seconds = cost + bytes / rate` through
    (read B/s, write B/s) measured at two transfer sizes, the cost the mean of the read's and the
    write's. A direction whose two points do not make a line of positive cost and rate (noise on
    a disk without such a cost) keeps its rate at `large_bytes` and adds no cost."""
    rates, costs = [], []
    for small_bps, large_bps in zip(small, large, strict=True):
        small_s, large_s = small_bytes / small_bps, large_bytes / large_bps
        per_byte = (large_s - small_s) / (large_bytes - small_bytes)
        cost = small_s - small_bytes * per_byte
        if per_byte <= 0 or cost <= 0:
            rates.append(large_bps)
            costs.append(0.0)
        else:
            rates.append(1 / per_byte)
            costs.append(cost)
    return rates[0], rates[1], sum(costs) / len(costs)


def measure_aio(
    directory: Path, budget_seconds: float = 30.0, io_bytes: int = 256 << 20, cores: int | None = None
) -> AioMeasurement:
    """Sweep DeepSpeed async I/O settings on `directory`: the best settings, and with them the
    disk's bandwidth and cost per transfer.

    The grid follows `ds_nvme_tune` (block 1M/8M x queue depth 8/32/128 x parallelism),
    in an order that tries the usually-best settings first, and stops when the budget
    is spent. The scored figure is the harmonic mean of read and write, since optimizer
    swapping does both every step. The best settings are then timed at a quarter of
    `io_bytes` and at `io_bytes` again: a disk may pay a fixed cost per transfer (one VM's disk
    took about 15 ms, a quarter of a 64 MiB transfer's time; another's none), which the
    swapper pays once per sub-group, whatever its size.
    """
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from spillway_runtime.deepspeed_fixes import quiet_ssd_endurance_warning

    io_bytes = aio_io_bytes(io_bytes)
    aio = AsyncIOBuilder().load()
    quiet_ssd_endurance_warning()  # its paragraph is on sustained offloading, not a probe's seconds
    cores = cores or _cores()
    parallelism = sorted({1, min(2, cores), min(4, cores), min(8, cores)})
    grid = [
        AioSettings(block_size=block, queue_depth=depth, intra_op_parallelism=par)
        for par in parallelism
        for block in (1 << 20, 8 << 20)
        for depth in (32, 128, 8)
        if block <= io_bytes
    ]
    deadline = time.monotonic() + budget_seconds
    directory.mkdir(parents=True, exist_ok=True)
    path = str(directory / f".spillway-aio-probe-{os.getpid()}")
    best: tuple[float, float, float, AioSettings] | None = None
    try:
        for settings in grid:
            if best is not None and time.monotonic() > deadline:
                break
            r_bps, w_bps = measure_aio_setting(aio, path, settings, io_bytes)
            score = 2 / (1 / r_bps + 1 / w_bps)
            if best is None or score > best[0]:
                best = (score, r_bps, w_bps, settings)
        assert best is not None
        small_bytes = max(MIN_AIO_BYTES, best[3].block_size, io_bytes // 4 // MIN_AIO_BYTES * MIN_AIO_BYTES)
        if small_bytes >= io_bytes:
            return AioMeasurement(best[1], best[2], best[3], None)
        # both sizes again, one after the other: the sweep's figure is its winner's luckiest
        small = measure_aio_setting(aio, path, best[3], small_bytes)
        large = measure_aio_setting(aio, path, best[3], io_bytes)
    finally:
        if os.path.exists(path):
            os.remove(path)
    read_bps, write_bps, cost = fit_transfer_cost(small_bytes, small, io_bytes, large)
    return AioMeasurement(read_bps, write_bps, best[3], cost)


# Hidden sizes the CPU compute curve is measured at, smallest first (the planner interpolates
# between them at the model's size); tokens per call as in a small micro-batch.
MATMUL_HIDDEN_SIZES = (128, 256, 512, 1024, 2048, 4096)
MATMUL_TOKENS = 256
MATMUL_DTYPES = ("fp32", "bf16")  # fp32 first: it is quick, and leaves bf16 the rest of the budget
# On a GPU: the widths of models that need offloading, a micro-batch of 4 x 1024 tokens (the GPU
# kit's), and the 16-bit dtypes GPUs train in (fp32: a share of the peak, as before measuring).
GPU_DECODER_HIDDEN_SIZES = (1024, 2048, 4096, 8192)
GPU_DECODER_BATCH, GPU_DECODER_SEQUENCE = 4, 1024
GPU_DECODER_DTYPES = ("bf16", "fp16")
_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _cpu_seconds_best(fn: Callable[[], None], repeats: int) -> float:
    """Best over `repeats` of min(wall time, CPU time): the seconds `fn` takes on cores that are
    the process's own. On a shared machine wall time measures the neighbours too, and a figure is
    kept for a week; CPU time alone counts a kernel that runs on one of the threads (bf16 matmuls
    without native bf16 instructions do) as if it ran on all. Where neighbours slow a kernel that
    uses every thread this still errs slow, by at most the thread count."""
    best = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        best = min(best, time.perf_counter() - wall, time.process_time() - cpu)
    return max(best, 1e-9)


def _decoder_layer(hidden: int, dtype: Any, device: str = "cpu", batch: int = 1,
                   seq: int = MATMUL_TOKENS) -> tuple[Callable[[], None], int]:
    """(forward and backward of one Llama decoder layer on `batch` sequences of `seq` tokens on
    `device`, its FLOPs as the planner counts them: 6 x tokens x parameters): heads of 64, a
    SwiGLU of 8/3 the width."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    heads = max(1, hidden // 64)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=-(-8 * hidden // 3 // 64) * 64,
                         num_attention_heads=heads, num_key_value_heads=heads, num_hidden_layers=1,
                         vocab_size=256, max_position_embeddings=seq)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):  # no random init: at hidden 4096 it took longer than the timing
        layer = LlamaDecoderLayer(config, layer_idx=0)
    layer = layer.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(0.02)  # any finite value: the time of a matmul does not depend on it
    x = torch.randn(batch, seq, hidden, dtype=dtype, device=device, requires_grad=True)
    positions = torch.arange(seq, device=device)[None]
    rotary = LlamaRotaryEmbedding(config).to(device)
    cos, sin = (t.to(dtype) for t in rotary(x, positions))
    grad = torch.randn(batch, seq, hidden, dtype=dtype, device=device)

    def forward_backward() -> None:
        out = layer(x, position_embeddings=(cos, sin), position_ids=positions)
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    return forward_backward, 6 * batch * seq * sum(p.numel() for p in layer.parameters())


def _decoder_curve(sizes: tuple[int, ...], dtypes: tuple[str, ...], budget_seconds: float,
                   layer: Callable[[int, Any], tuple[Callable[[], None], int]],
                   seconds_best: Callable[[Callable[[], None], int], float]) -> list[MatmulRate]:
    """FLOP/s of `layer(hidden, dtype)` (a forward and backward, and its FLOPs) per dtype at
    `sizes` from the smallest, until each dtype's share of the budget is spent: a slow machine
    gets the small sizes, and the planner holds the largest measured rate for larger models."""
    import torch

    rates: list[MatmulRate] = []
    end = time.monotonic() + budget_seconds
    for done, name in enumerate(dtypes):
        # an equal share of what is left: time one dtype did not use goes to the next
        deadline = time.monotonic() + (end - time.monotonic()) / (len(dtypes) - done)
        dtype = getattr(torch, _TORCH_DTYPES[name])
        for hidden in sizes:
            try:
                forward_backward, flops = layer(hidden, dtype)
                forward_backward()  # first call: allocation and kernel selection, not timed
                seconds = seconds_best(forward_backward, 1)
                if 3 * seconds < deadline - time.monotonic():
                    seconds = min(seconds, seconds_best(forward_backward, 2))
                del forward_backward  # the layer's memory, before the next is built
            except torch.cuda.OutOfMemoryError:
                break  # a GPU that holds no layer this wide: the largest measured stands for it
            rates.append(MatmulRate(dtype=name, hidden_size=hidden, flops_per_s=flops / seconds))
            # twice the hidden size is four times the work, twice over (first call and timed)
            if time.monotonic() + 8 * seconds > deadline:
                break
    return rates


def measure_cpu_matmul(threads: int, budget_seconds: float = 1.0,
                       dtypes: tuple[str, ...] = MATMUL_DTYPES) -> list[MatmulRate]:
    """FLOP/s of a Llama decoder layer's forward and backward (6 x tokens x its parameters,
    MATMUL_TOKENS tokens: what the planner counts, at the rate the layer really runs, its norms,
    attention and activations included) with `threads` threads, per dtype at
    MATMUL_HIDDEN_SIZES (`_decoder_curve`). Forward and backward, because a CPU without native
    16-bit instructions runs the backward's matmuls several times slower than the forward's."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  imported before the clock starts

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _decoder_curve(MATMUL_HIDDEN_SIZES, dtypes, budget_seconds, _decoder_layer, _cpu_seconds_best)
    finally:
        torch.set_num_threads(previous)


def measure_gpu_decoder(budget_seconds: float = 6.0, dtypes: tuple[str, ...] = GPU_DECODER_DTYPES,
                        device: str = "cuda", sizes: tuple[int, ...] = GPU_DECODER_HIDDEN_SIZES) -> list[MatmulRate]:
    """The same curve on one GPU (`NodeHardware.gpu_decoder`): GPU_DECODER_BATCH sequences of
    GPU_DECODER_SEQUENCE tokens a call, since a GPU's rate depends on the tokens it is given (few
    and the kernel launches bound it), timed to the GPU's completion. [] without CUDA. `device`:
    "cpu" runs the same code where there is no GPU (the suite)."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  imported before the clock starts

    if device == "cuda" and not torch.cuda.is_available():
        return []

    def layer(hidden: int, dtype: Any) -> tuple[Callable[[], None], int]:
        return _decoder_layer(hidden, dtype, device, GPU_DECODER_BATCH, GPU_DECODER_SEQUENCE)

    def synced(fn: Callable[[], None], repeats: int) -> float:
        def call() -> None:
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
        return _time_best(call, repeats)

    try:
        return _decoder_curve(sizes, dtypes, budget_seconds, layer, synced)
    except Exception as err:  # another transformers' layer, a driver error: the rest of the probe stands
        print(f"probe: the GPU's decoder layers not measured ({type(err).__name__}: {err}); the plan assumes "
              "a share of its peak")
        return []
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def measure_cpu_adam(params: int = 20_000_000, steps: int = 3,
                     torch_too: bool = True) -> tuple[float | None, float | None]:
    """Params/s of one optimizer step: (DeepSpeedCPUAdam, torch fused AdamW). `torch_too=False`:
    torch's only when DeepSpeed's op does not load."""
    import torch

    p = torch.nn.Parameter(torch.randn(params))
    p.grad = torch.randn(params)
    ds_rate: float | None = None
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        ds_opt = DeepSpeedCPUAdam([p], lr=1e-3)
        ds_opt.step()  # state allocation and JIT outside the timing
        ds_rate = params / _cpu_seconds_best(ds_opt.step, steps)
    except Exception as err:  # the op may fail to build; the torch figure still stands
        print(f"probe: DeepSpeedCPUAdam unavailable ({err})")
    if ds_rate is not None and not torch_too:
        return ds_rate, None
    q = torch.nn.Parameter(torch.randn(params))
    q.grad = torch.randn(params)
    torch_opt = torch.optim.AdamW([q], lr=1e-3, fused=True)
    torch_opt.step()
    torch_rate = params / _cpu_seconds_best(torch_opt.step, steps)
    return ds_rate, torch_rate


def measure_host_device(num_bytes: int = 256 << 20) -> float | None:
    """Pinned host -> GPU copy, B/s; None without a GPU (on the CPU accelerator there is no copy)."""
    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(num_bytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")

    def copy() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    copy()
    return num_bytes / _time_best(copy, 5)


def probe(nvme_path: str | Path | None = None, *, quick: bool = False, aio_budget_seconds: float = 30.0,
          name: str = "local") -> NodeHardware:
    started = time.monotonic()
    hw = probe_basic(nvme_path, name)
    if quick:
        return hw
    if hw.nvme_path:
        measured = measure_aio(Path(hw.nvme_path), aio_budget_seconds, cores=hw.cpu_cores)
        hw.nvme_read_bytes_per_s, hw.nvme_write_bytes_per_s = measured.read_bps, measured.write_bps
        hw.aio, hw.nvme_transfer_seconds = measured.settings, measured.transfer_seconds
    hw.cpu_adam_params_per_s, hw.torch_adamw_params_per_s = measure_cpu_adam()
    hw.host_device_bytes_per_s = measure_host_device()
    hw.host_work_scale = measure_engine_host_work(hw.cpu_cores)
    if not hw.gpu_count:
        # training here runs on the CPU accelerator: its step time is these layers
        hw.cpu_matmul = measure_cpu_matmul(hw.cpu_cores, budget_seconds=4.0)
    else:
        hw.gpu_decoder = measure_gpu_decoder()
    hw.probe_seconds = round(time.monotonic() - started, 2)
    return hw
