"""What a node has: the `NodeHardware` model shared by the probe, the planner and the operator.

The probe measures it on the machine it runs on; the operator rebuilds it from
GPU Feature Discovery labels, allocatable resources and the `spillway.dev/*`
annotations that the node probe writes. Both directions live here so the key
names exist once. Importable without torch.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from spillway_runtime.core.units import parse_size

# annotation key -> NodeHardware field (all integers as decimal strings)
ANNOTATIONS: dict[str, str] = {
    "spillway.dev/nvme-capacity-bytes": "nvme_capacity_bytes",
    "spillway.dev/nvme-free-bytes": "nvme_free_bytes",
    "spillway.dev/nvme-read-bytes-per-second": "nvme_read_bytes_per_s",
    "spillway.dev/nvme-write-bytes-per-second": "nvme_write_bytes_per_s",
    "spillway.dev/cpu-adam-params-per-second": "cpu_adam_params_per_s",
    "spillway.dev/host-device-bytes-per-second": "host_device_bytes_per_s",
}
# annotation key -> AioSettings field: the async I/O settings the probe's sweep found best
# on the node's NVMe, read back into `NodeHardware.aio` so a cluster plan's `aio` block is
# the node's, not DeepSpeed's defaults. All three or none: a mix would be a setting nobody measured.
AIO_ANNOTATIONS: dict[str, str] = {
    "spillway.dev/aio-block-size": "block_size",
    "spillway.dev/aio-queue-depth": "queue_depth",
    "spillway.dev/aio-intra-op-parallelism": "intra_op_parallelism",
}
NVME_PATH_ANNOTATION = "spillway.dev/nvme-path"
# RLIMIT_MEMLOCK of a training process on the node, as the probe found it (its container runs as
# a training pod's do: non-root, no capability): bytes, or "unlimited". DeepSpeed locks its NVMe
# swap buffers under it (`core.memlock`); absent (never probed), the planner assumes no limit.
MEMLOCK_ANNOTATION = "spillway.dev/memlock-bytes"
UNLIMITED = "unlimited"
# The probe's CPU matmul rates (`NodeHardware.cpu_matmul`), one entry per dtype and hidden size:
# "bf16@256=4100000000,bf16@1024=3900000000,fp32@256=...". One annotation, as the figures are one curve.
CPU_MATMUL_ANNOTATION = "spillway.dev/cpu-matmul-flops-per-second"
# The same curve measured on one of a GPU node's GPUs (`NodeHardware.gpu_decoder`), written by a
# node probe given the GPUs (`nodeProbe.measureGpu`).
GPU_DECODER_ANNOTATION = "spillway.dev/gpu-decoder-flops-per-second"
HOST_WORK_ANNOTATION = "spillway.dev/host-work-scale"  # NodeHardware.host_work_scale, a ratio
# NodeHardware.nvme_transfer_seconds in whole microseconds
NVME_TRANSFER_ANNOTATION = "spillway.dev/nvme-transfer-microseconds"
# What a cost per transfer may be: beyond a second it is not a disk's latency but a measurement
# that went wrong, refused by hand and ignored in an annotation.
MAX_TRANSFER_SECONDS = 1.0
# What `engine_probe` keeps of its ratio: outside it a measurement failed (a neighbour took the
# machine for half of it), and a figure set by hand or in an annotation is refused.
HOST_WORK_SCALE_RANGE = (0.2, 5.0)
GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_MEMORY_MIB = "nvidia.com/gpu.memory"
GFD_COUNT = "nvidia.com/gpu.count"
GPU_RESOURCE = "nvidia.com/gpu"

# Dense bf16 peak TFLOPS per GPU product, for step-time prediction only. Matched by
# substring of the GFD product label; unknown products fall back to DEFAULT_GPU_TFLOPS.
GPU_PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "A10": 125.0,
    "L4": 121.0,
    "4090": 165.0,
    "3090": 71.0,
    "A6000": 155.0,
    "V100": 125.0,
    "T4": 65.0,
}
DEFAULT_GPU_TFLOPS = 100.0
# Throughput assumed when a figure was not measured, chosen on the pessimistic side so
# that a plan made without probe data never looks better than one made with it.
DEFAULT_NVME_READ_BPS = 1.5e9
DEFAULT_NVME_WRITE_BPS = 1.0e9
DEFAULT_CPU_ADAM_PARAMS_PER_S = 1.0e9
DEFAULT_HOST_DEVICE_BPS = 12e9  # PCIe 4.0 x16 achieves ~12-25 GB/s pinned


class AioSettings(BaseModel):
    """Best DeepSpeed async-I/O settings found by the probe's sweep."""

    block_size: int = 1 << 20
    queue_depth: int = 32
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True


# What the compute probe times (`probe.measure_cpu_matmul`); a cached entry measured another
# way is measured again. 1: a bare linear layer. 2: a Llama decoder layer. The linear layer's
# matmuls ran at 868 GFLOP/s (bf16, hidden 768, 2 cores) where a whole step of a model that
# wide reached 500: norms, rotary embeddings, attention, activations and residuals are a third
# of a layer's time at that width, less the wider the layer. 3: DeepSpeed's host work too
# (`engine_probe`: `NodeHardware.host_work_scale`). 4: on a GPU machine, decoder layers on the GPU
# (`NodeHardware.gpu_decoder`).
COMPUTE_PROBE_VERSION = 4


class MatmulRate(BaseModel):
    """FLOP/s of a Llama decoder layer's forward and backward pass (6 x tokens x its parameters)
    on the CPU, with the threads of one training process that has the node to itself (or on one
    GPU, `NodeHardware.gpu_decoder`): what the step spends its time on, its matmuls and
    everything between them, kernel launches included."""

    dtype: str = Field(description="bf16, fp16 or fp32: the training dtype it was measured in")
    hidden_size: int = Field(gt=0, description="The layer's hidden size")
    flops_per_s: float = Field(gt=0)


def matmul_rate_at(rates: list[MatmulRate], dtype: str, hidden_size: int) -> float | None:
    """The rate at `hidden_size` in `dtype`: interpolated between the measured sizes on a log
    scale, the nearest measured size's beyond them; None when `dtype` was not measured."""
    points = sorted((r.hidden_size, r.flops_per_s) for r in rates if r.dtype == dtype)
    if not points:
        return None
    if hidden_size <= points[0][0]:
        return points[0][1]
    for (h0, r0), (h1, r1) in itertools.pairwise(points):
        if hidden_size <= h1:
            share = math.log(hidden_size / h0) / math.log(h1 / h0)
            return float(math.exp(math.log(r0) + share * (math.log(r1) - math.log(r0))))
    return points[-1][1]


def matmul_annotation(rates: list[MatmulRate]) -> str:
    return ",".join(f"{r.dtype}@{r.hidden_size}={int(r.flops_per_s)}" for r in rates)


def matmul_from_annotation(value: str | None) -> list[MatmulRate]:
    """The rates a node probe wrote; an entry that does not parse is left out, not guessed."""
    rates: list[MatmulRate] = []
    for item in (value or "").split(","):
        key, _, rate = item.partition("=")
        dtype, _, hidden = key.partition("@")
        size, flops = _int(hidden), _int(rate)
        if dtype in ("bf16", "fp16", "fp32") and size and size > 0 and flops and flops > 0:
            rates.append(MatmulRate(dtype=dtype, hidden_size=size, flops_per_s=flops))
    return rates


class NodeHardware(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("local", description="Node name or 'local'")
    gpu_count: int = Field(0, ge=0)
    gpu_product: str | None = None
    gpu_memory_bytes: int = Field(0, ge=0, description="Memory of one GPU")
    gpu_peak_tflops: float | None = Field(None, description="Dense bf16 peak of one GPU")
    cpu_cores: int = Field(1, ge=1)
    cpu_memory_bytes: int = Field(ge=0, description="Total (or allocatable) CPU RAM")
    cpu_memory_available_bytes: int | None = Field(None, ge=0)
    nvme_path: str | None = None
    nvme_capacity_bytes: int = Field(0, ge=0)
    nvme_free_bytes: int = Field(0, ge=0)
    nvme_read_bytes_per_s: float | None = None
    nvme_write_bytes_per_s: float | None = None
    nvme_transfer_seconds: float | None = Field(
        None, ge=0, le=MAX_TRANSFER_SECONDS,
        description="The NVMe disk's fixed cost per async-I/O transfer (one submission and its wait, whatever its "
        "size), beside its read and write bandwidth: the probe's fit of two transfer sizes. None: not measured, "
        "counted as none")
    aio: AioSettings | None = None
    cpu_adam_params_per_s: float | None = None
    torch_adamw_params_per_s: float | None = None
    host_device_bytes_per_s: float | None = None
    host_work_scale: float | None = Field(
        None, ge=HOST_WORK_SCALE_RANGE[0], le=HOST_WORK_SCALE_RANGE[1],
        description="DeepSpeed's host work here (hooks, host copies) over the machine the step-time model's host "
        "constants were fitted on: ZeRO-3's time over ZeRO-2 on a micro model, measured over predicted "
        "(`engine_probe`); None: the constants as they are")
    cpu_matmul: list[MatmulRate] = Field(
        default_factory=list, description="Measured on nodes without GPUs, where training runs on the CPU"
    )
    gpu_decoder: list[MatmulRate] = Field(
        default_factory=list, description="Measured on one of a GPU node's GPUs (`probe.GPU_DECODER_BATCH` sequences of "
        "`probe.GPU_DECODER_SEQUENCE` tokens a call); empty: the planner assumes a share of the GPU's peak")
    memlock_bytes: int | None = Field(
        None, ge=0, description="RLIMIT_MEMLOCK of a training process (what DeepSpeed's swap buffers may lock): "
        "None where unlimited, or not probed")
    probe_seconds: float | None = None

    @property
    def usable_cpu_bytes(self) -> int:
        avail = self.cpu_memory_available_bytes
        return self.cpu_memory_bytes if avail is None else min(avail, self.cpu_memory_bytes)

    @property
    def peak_tflops(self) -> float:
        if self.gpu_peak_tflops:
            return self.gpu_peak_tflops
        product = (self.gpu_product or "").upper()
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in product:
                return tflops
        return DEFAULT_GPU_TFLOPS

    def shape_key(self) -> str:
        """Identifies nodes that plan identically (the operator plans once per shape)."""
        return (
            f"{self.gpu_count}x{self.gpu_product or 'cpu'}/{self.gpu_memory_bytes >> 30}Gi"
            f"/ram{self.cpu_memory_bytes >> 30}Gi/nvme{self.nvme_free_bytes >> 30}Gi"
            + ("" if self.memlock_bytes is None else f"/memlock{self.memlock_bytes >> 10}Ki")
        )

    @property
    def host_work(self) -> float:
        """What the step-time model's host constants are multiplied by here: `host_work_scale`, 1 unmeasured."""
        return self.host_work_scale or 1.0

    def to_annotations(self) -> dict[str, str]:
        out = {key: str(int(v)) for key, field in ANNOTATIONS.items() if (v := getattr(self, field)) is not None}
        if self.aio is not None:
            out.update({key: str(getattr(self.aio, field)) for key, field in AIO_ANNOTATIONS.items()})
        if self.nvme_path:
            out[NVME_PATH_ANNOTATION] = self.nvme_path
        if self.cpu_matmul:
            out[CPU_MATMUL_ANNOTATION] = matmul_annotation(self.cpu_matmul)
        if self.gpu_decoder:
            out[GPU_DECODER_ANNOTATION] = matmul_annotation(self.gpu_decoder)
        if self.host_work_scale:
            out[HOST_WORK_ANNOTATION] = f"{self.host_work_scale:.3f}"
        if self.nvme_transfer_seconds is not None:
            out[NVME_TRANSFER_ANNOTATION] = str(round(self.nvme_transfer_seconds * 1e6))
        out[MEMLOCK_ANNOTATION] = UNLIMITED if self.memlock_bytes is None else str(self.memlock_bytes)
        return out


def _int(value: Any) -> int | None:
    try:
        return int(float(str(value)))
    except (TypeError, ValueError, OverflowError):  # "infinity", "1e400": not a figure
        return None


def host_work_scale_from_annotation(value: str | None) -> float | None:
    """`HOST_WORK_ANNOTATION`'s ratio; None for absent and for what is not a figure in HOST_WORK_SCALE_RANGE."""
    try:
        scale = float(value) if value is not None else None
    except ValueError:
        return None
    low, high = HOST_WORK_SCALE_RANGE
    return scale if scale is not None and low <= scale <= high else None


def transfer_seconds_from_annotation(value: str | None) -> float | None:
    """`NVME_TRANSFER_ANNOTATION`'s microseconds as seconds; None for absent and for what is not
    a figure from 0 to MAX_TRANSFER_SECONDS."""
    micros = _int(value) if value is not None else None
    if micros is None or not 0 <= micros <= MAX_TRANSFER_SECONDS * 1e6:
        return None
    return micros / 1e6


def memlock_from_annotation(value: str | None) -> int | None:
    """RLIMIT_MEMLOCK from `MEMLOCK_ANNOTATION`: bytes, or a Kubernetes quantity (8Mi) set by
    hand; None for "unlimited" (systemd's "infinity" too), for absent, and for what does not parse."""
    if value is None or value.strip().lower() in (UNLIMITED, "infinity"):
        return None
    try:
        return parse_size(value.strip())
    except ValueError:
        return None


def aio_from_annotations(annotations: dict[str, str]) -> AioSettings | None:
    """The probed aio settings, or None when any of the three is missing or not a positive integer
    (the plan then uses the defaults rather than half a measurement)."""
    values = {field: _int(annotations.get(key)) for key, field in AIO_ANNOTATIONS.items()}
    if any(v is None or v <= 0 for v in values.values()):
        return None
    return AioSettings.model_validate(values)


def parse_quantity(value: str) -> int:
    """Kubernetes resource quantity ('64Gi', '16', '500m' cpu) to an integer (cpu rounded down)."""

    if value.endswith("m") and value[:-1].isdigit():
        return int(value[:-1]) // 1000
    return parse_size(value)


def hardware_from_node(node: dict[str, Any]) -> NodeHardware:
    """Rebuild NodeHardware from a Kubernetes Node object (as a dict)."""
    meta = node.get("metadata", {})
    labels: dict[str, str] = meta.get("labels") or {}
    annotations: dict[str, str] = meta.get("annotations") or {}
    status = node.get("status", {})
    allocatable: dict[str, str] = status.get("allocatable") or status.get("capacity") or {}
    gpu_count = _int(allocatable.get(GPU_RESOURCE)) or _int(labels.get(GFD_COUNT)) or 0
    mem_mib = _int(labels.get(GFD_MEMORY_MIB)) or 0
    values: dict[str, Any] = {
        field: _int(annotations.get(key)) for key, field in ANNOTATIONS.items() if key in annotations
    }
    return NodeHardware(
        name=meta.get("name", "node"),
        gpu_count=gpu_count,
        gpu_product=labels.get(GFD_PRODUCT) if gpu_count else None,
        gpu_memory_bytes=mem_mib * 2**20 if gpu_count else 0,
        cpu_cores=max(1, parse_quantity(allocatable.get("cpu", "1"))),
        cpu_memory_bytes=parse_quantity(allocatable.get("memory", "0")),
        nvme_path=annotations.get(NVME_PATH_ANNOTATION),
        aio=aio_from_annotations(annotations),
        cpu_matmul=matmul_from_annotation(annotations.get(CPU_MATMUL_ANNOTATION)),
        gpu_decoder=matmul_from_annotation(annotations.get(GPU_DECODER_ANNOTATION)) if gpu_count else [],
        host_work_scale=host_work_scale_from_annotation(annotations.get(HOST_WORK_ANNOTATION)),
        nvme_transfer_seconds=transfer_seconds_from_annotation(annotations.get(NVME_TRANSFER_ANNOTATION)),
        memlock_bytes=memlock_from_annotation(annotations.get(MEMLOCK_ANNOTATION)),
        **{k: v for k, v in values.items() if v is not None},
    )


CAP_IPC_LOCK = 14

def memlock_limit() -> int | None:
    """How much this process may mlock(): None when unlimited (no limit, or CAP_IPC_LOCK,
    which root has on most hosts). The soft limit is raised to the hard one first."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
            soft = hard
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as fh:
            effective = next((int(line.split()[1], 16) for line in fh if line.startswith("CapEff:")), 0)
    except OSError:
        effective = 0
    return None if effective & (1 << CAP_IPC_LOCK) else int(soft)
