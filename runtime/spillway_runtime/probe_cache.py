"""The async-I/O sweep of this machine's NVMe disk, measured once and kept between `spillway run`s.

Where this sits: `local.prepare_local_run` asks `hardware_for_run` for the machine it
plans on. Capacities that change run to run (free NVMe, free RAM) always come from a
fresh `probe.probe_basic`; what the sweep measures (the best `aio` settings, read and
write bandwidth) belongs to the disk, so it is measured once per disk, kept in
`<cache dir>/probe-<hash of host and device>.json` and merged over the fresh facts.
Keyed by device rather than by directory: every new job gets its own `runs/<name>/nvme`,
and a key per directory would sweep again for each. An entry is measured again when it
is older than `max_age_days`, when the machine's fingerprint changed (the disk's model
or size, cores, RAM, GPUs, the memlock limit that bounds the sweep), or on request
(`spillway run --reprobe`, SPILLWAY_PROBE_REFRESH=1). `spillway probe --nvme-path`
stores its longer sweep here too.

The rates a step time is made of (CPU decoder layers per dtype and hidden size, the CPU optimizer
step, host-device copies) belong to the machine, not the disk, and every plan needs them:
they are measured on the first run of any job (about 2 s, plus loading DeepSpeed's CPU Adam
op) and kept in `<cache dir>/compute-<hash of host>.json`, stale on the same terms or when
torch or DeepSpeed changed. Importable without torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, TypeVar

import psutil
from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from spillway_runtime.core.hardware import COMPUTE_PROBE_VERSION, AioSettings, NodeHardware

# What an entry contributes to a run's hardware: figures measured once, not capacities.
MEASURED_FIELDS = (
    "nvme_read_bytes_per_s", "nvme_write_bytes_per_s", "nvme_transfer_seconds", "aio",
    "cpu_adam_params_per_s", "torch_adamw_params_per_s", "host_device_bytes_per_s", "cpu_matmul",
    "gpu_decoder", "host_work_scale",
)
# What the compute entry holds: the machine's rates the step time is made of, whatever the disk.
COMPUTE_FIELDS = ("cpu_matmul", "gpu_decoder", "cpu_adam_params_per_s", "torch_adamw_params_per_s", "host_device_bytes_per_s",
                  "host_work_scale")
DAY_SECONDS = 86_400
# What the disk's sweep measures; an entry measured another way is measured again. 1: the best
# settings' read and write rates at one size. 2: and the disk's cost per transfer
# (`probe.fit_transfer_cost`), the rates its bandwidth.
AIO_PROBE_VERSION = 2
EntryT = TypeVar("EntryT", bound=BaseModel)
_IMPORTED_AT = time.time()


class ProbeCacheSettings(BaseSettings):
    """Environment variables are the field names upper-cased with the prefix ``SPILLWAY_PROBE_``."""

    model_config = SettingsConfigDict(env_prefix="SPILLWAY_PROBE_", extra="ignore")

    cache_dir: Path | None = Field(
        None, description="Where entries live; default $XDG_CACHE_HOME/spillway, else ~/.cache/spillway"
    )
    max_age_days: float = Field(
        7.0, ge=0,
        description="Days an entry is trusted: a week catches what the fingerprint cannot see (firmware, "
        "filesystem, a fuller disk) at the cost of one short sweep a week",
    )
    aio_seconds: float = Field(
        3.0, gt=0,
        description="Seconds the sweep may take on a miss (it finishes the setting it is on): on two cores "
        "with 64 MiB per setting that covers most of the grid, and a first run is not slowed much; "
        "`spillway probe` sweeps longer",
    )
    aio_io_mib: int = Field(
        64, ge=1, description="MiB each setting writes and reads; 64 MiB takes tens of ms at NVMe speed"
    )
    refresh: bool = Field(False, description="Measure again even when the entry is fresh")
    sweep: bool = Field(
        True, description="0: plan with DeepSpeed's default async-I/O settings and the planner's assumed rates, "
        "neither measuring nor reading an entry: the same plan on every run (the test suite; a sweep's winner "
        "varies run to run, and its block size decides which small optimizer sub-groups are swapped at all)",
    )
    compute: bool = Field(
        True, description="0: no compute entry (CPU matmul, CPU Adam, host-device copy): the planner's assumed "
        "rates. Measuring one takes ~2 s of decoder layers plus loading DeepSpeed's CPU Adam op, once per machine",
    )
    host_work_retry_hours: float = Field(
        1.0, ge=0, description="Hours after which a compute entry without DeepSpeed's host work (the reading was "
        "out of range on a busy machine, or its child failed) measures that again, alone, instead of planning "
        "with the fitted constants until the entry is a week old",
    )
    compute_seconds: float = Field(
        2.0, gt=0, description="Budget of the decoder-layer curve on a miss (the CPU's; on a GPU machine the GPU's): "
        "on two cores with AMX it reaches hidden size 2048 in bf16 and 1024 in fp32; `spillway probe` measures longer",
    )

    @property
    def directory(self) -> Path:
        if self.cache_dir is not None:
            return self.cache_dir
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spillway"


class MachineFingerprint(BaseModel):
    """What, when it changes, makes a measured entry stale."""

    host: str
    device: str = Field(description="st_dev of the NVMe directory, major:minor")
    disk_model: str | None = Field(None, description="/sys/dev/block/<device>/device/model, where /sys has it")
    disk_bytes: int | None = Field(None, description="Size of the block device (or partition)")
    cpu_count: int
    memory_bytes: int
    gpu_count: int
    gpu_product: str | None
    memlock_bytes: int | None = Field(None, description="RLIMIT_MEMLOCK: bounds the buffer the sweep may lock")

    def key(self) -> str:
        return hashlib.sha256(f"{self.host}\0{self.device}".encode()).hexdigest()[:16]

    def changes(self, other: MachineFingerprint) -> list[str]:
        return [name for name in type(self).model_fields if getattr(self, name) != getattr(other, name)]


class ComputeFingerprint(BaseModel):
    """What, when it changes, makes a compute entry stale: the machine and the libraries whose
    kernels were timed."""

    host: str
    cpu_count: int
    cores: int = Field(description="CPUs this process may run on: the threads a training process gets")
    memory_bytes: int
    gpu_count: int
    gpu_product: str | None
    torch: str | None
    deepspeed: str | None
    probe: int = Field(1, description="What the compute probe times (`probe.COMPUTE_PROBE_VERSION`): an entry "
                       "measured another way is measured again")

    def key(self) -> str:
        return hashlib.sha256(self.host.encode()).hexdigest()[:16]

    def changes(self, other: ComputeFingerprint) -> list[str]:
        return [name for name in type(self).model_fields if getattr(self, name) != getattr(other, name)]


class ComputeEntry(BaseModel):
    fingerprint: ComputeFingerprint
    measured_at: float = Field(description="Unix seconds")
    probe_seconds: float
    hardware: NodeHardware = Field(description="Only COMPUTE_FIELDS are reused")
    host_work_tried_at: float | None = Field(
        None, description="When DeepSpeed's host work was last measured, if not at measured_at (Unix seconds)")


class ProbeEntry(BaseModel):
    fingerprint: MachineFingerprint
    probe: int = Field(1, description="What the sweep measured (AIO_PROBE_VERSION)")
    measured_at: float = Field(description="Unix seconds")
    probe_seconds: float = Field(description="How long the measurement took")
    hardware: NodeHardware = Field(description="The probe as measured; only MEASURED_FIELDS are reused")


class ProbeRecord(BaseModel):
    """How the hardware a local run planned on was measured: kept in runtime.json, written as
    the run's `probe` event and printed by `spillway run`."""

    source: Literal["cached", "measured", "unmeasured"]
    why: str = Field(description="Why it was measured, or why it was not")
    cache_file: str
    aio: AioSettings | None = None
    nvme_read_bytes_per_s: float | None = None
    nvme_write_bytes_per_s: float | None = None
    nvme_transfer_seconds: float | None = None
    measured_at: float | None = None
    age_seconds: float | None = None
    probe_seconds: float | None = None

    def describe(self) -> str:
        if self.aio is None:
            return f"async I/O: DeepSpeed settings not tuned to this disk ({self.why})"
        tuned = (f"block {self.aio.block_size >> 10} KiB, queue depth {self.aio.queue_depth}, "
                 f"parallelism {self.aio.intra_op_parallelism}")
        speed = ""
        if self.nvme_read_bytes_per_s and self.nvme_write_bytes_per_s:
            speed = (f"; read {self.nvme_read_bytes_per_s / 1e9:.2f} GB/s, "
                     f"write {self.nvme_write_bytes_per_s / 1e9:.2f} GB/s")
            if self.nvme_transfer_seconds is not None:
                speed += f", {self.nvme_transfer_seconds * 1e3:.1f} ms a transfer"
        if self.source == "cached":
            when = f"measured {_age(self.age_seconds or 0)} ago, cached in {self.cache_file}"
        else:
            when = f"measured just now in {self.probe_seconds or 0:.1f} s: {self.why}; kept in {self.cache_file}"
        return f"async I/O: {tuned}{speed} ({when})"


def _age(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * DAY_SECONDS:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / DAY_SECONDS:.1f} days"


def _disk(device: int) -> tuple[str | None, int | None]:
    """(model, bytes) of a block device from /sys; a partition's model is its disk's."""
    root = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    try:
        size = int((root / "size").read_text()) * 512
    except (OSError, ValueError):
        return None, None
    for model in (root / "device" / "model", root / ".." / "device" / "model"):
        with contextlib.suppress(OSError):
            return model.read_text().strip() or None, size
    return None, size


def fingerprint(nvme_dir: Path, basic: NodeHardware) -> MachineFingerprint:
    from spillway_runtime.core.hardware import memlock_limit

    device = os.stat(nvme_dir).st_dev
    model, size = _disk(device)
    return MachineFingerprint(
        host=socket.gethostname(), device=f"{os.major(device)}:{os.minor(device)}", disk_model=model,
        disk_bytes=size, cpu_count=os.cpu_count() or 1, memory_bytes=psutil.virtual_memory().total,
        gpu_count=basic.gpu_count, gpu_product=basic.gpu_product, memlock_bytes=memlock_limit(),
    )


def entry_path(settings: ProbeCacheSettings, fp: MachineFingerprint) -> Path:
    return settings.directory / f"probe-{fp.key()}.json"


def _read(path: Path, model: type[EntryT]) -> EntryT | None:
    try:
        return model.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None  # absent, or written by another version: measure again


def read_entry(path: Path) -> ProbeEntry | None:
    return _read(path, ProbeEntry)


def staleness(entry: ProbeEntry | None, fp: MachineFingerprint, settings: ProbeCacheSettings) -> str | None:
    """Why `entry` cannot be used for this machine now, or None when it can."""
    if settings.refresh:
        return "a re-probe was asked for"
    if entry is None:
        return "no cached probe of this disk"
    if entry.hardware.aio is None:
        return "the cached probe did not measure async I/O"
    if entry.probe != AIO_PROBE_VERSION:
        return "the cached probe did not measure the disk's cost per transfer"
    changed = entry.fingerprint.changes(fp)
    if changed:
        return f"the machine changed since the cached probe ({', '.join(changed)})"
    age = time.time() - entry.measured_at
    if age > settings.max_age_days * DAY_SECONDS:
        return f"the cached probe is {age / DAY_SECONDS:.1f} days old (max {settings.max_age_days:g})"
    return None


def store_entry(path: Path, entry: ProbeEntry | ComputeEntry) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(entry.model_dump_json(indent=1))
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One sweep of a disk at a time: two runs starting together would measure each other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _record(source: Literal["cached", "measured", "unmeasured"], why: str, path: Path,
            entry: ProbeEntry | None) -> ProbeRecord:
    if entry is None:
        return ProbeRecord(source=source, why=why, cache_file=str(path))
    hw = entry.hardware
    return ProbeRecord(
        source=source, why=why, cache_file=str(path), aio=hw.aio, nvme_read_bytes_per_s=hw.nvme_read_bytes_per_s,
        nvme_write_bytes_per_s=hw.nvme_write_bytes_per_s, nvme_transfer_seconds=hw.nvme_transfer_seconds,
        measured_at=entry.measured_at,
        age_seconds=round(time.time() - entry.measured_at, 1), probe_seconds=entry.probe_seconds,
    )


def _merged(basic: NodeHardware, entry: ProbeEntry) -> NodeHardware:
    """`basic` with the disk entry's figures. The compute rates it holds are a snapshot from its
    sweep: they only fill in where the compute entry gave none (before, a sweep's snapshot taken
    under load a day earlier overrode a fresh compute entry, and every plan's compute was 7x slow)."""
    measured = {name: value for name in MEASURED_FIELDS if (value := getattr(entry.hardware, name)) not in (None, [])
                and (name not in COMPUTE_FIELDS or getattr(basic, name) in (None, []))}
    return basic.model_copy(update=measured)


def _sweep(nvme_dir: Path, basic: NodeHardware, fp: MachineFingerprint, settings: ProbeCacheSettings) -> ProbeEntry:
    from spillway_runtime.probe import measure_aio

    started = time.monotonic()
    measured = measure_aio(nvme_dir, settings.aio_seconds, io_bytes=settings.aio_io_mib << 20, cores=basic.cpu_cores)
    hw = basic.model_copy(update={"nvme_read_bytes_per_s": measured.read_bps, "nvme_write_bytes_per_s": measured.write_bps,
                                  "nvme_transfer_seconds": measured.transfer_seconds, "aio": measured.settings})
    return ProbeEntry(fingerprint=fp, probe=AIO_PROBE_VERSION, measured_at=time.time(),
                      probe_seconds=round(time.monotonic() - started, 2), hardware=hw)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def compute_fingerprint(basic: NodeHardware) -> ComputeFingerprint:
    return ComputeFingerprint(
        host=socket.gethostname(), cpu_count=os.cpu_count() or 1, cores=basic.cpu_cores,
        memory_bytes=psutil.virtual_memory().total, gpu_count=basic.gpu_count, gpu_product=basic.gpu_product,
        torch=_version("torch"), deepspeed=_version("deepspeed"), probe=COMPUTE_PROBE_VERSION,
    )


def compute_entry_path(settings: ProbeCacheSettings, fp: ComputeFingerprint) -> Path:
    return settings.directory / f"compute-{fp.key()}.json"


def _compute_staleness(entry: ComputeEntry | None, fp: ComputeFingerprint, settings: ProbeCacheSettings) -> str | None:
    if settings.refresh and (entry is None or entry.measured_at < _IMPORTED_AT):
        # once per process: a run plans twice (again once it knows it uses NVMe)
        return "a re-probe was asked for"
    if entry is None:
        return "no cached compute rates of this machine"
    changed = entry.fingerprint.changes(fp)
    if changed:
        return f"the machine changed since they were measured ({', '.join(changed)})"
    if time.time() - entry.measured_at > settings.max_age_days * DAY_SECONDS:
        return "the cached compute rates are too old"
    return None


def _host_work_due(entry: ComputeEntry | None, settings: ProbeCacheSettings) -> bool:
    """A cached entry without DeepSpeed's host work whose last try is old enough to try again."""
    if entry is None or entry.hardware.host_work_scale is not None:
        return False
    tried = entry.host_work_tried_at or entry.measured_at
    return time.time() - tried > settings.host_work_retry_hours * 3600


def measure_compute(basic: NodeHardware, budget_seconds: float) -> NodeHardware:
    """`basic` with what the step time is made of measured: without GPUs the CPU matmul curve
    (the CPU accelerator's compute), the CPU optimizer step, with GPUs the host-device copy and
    the GPU's decoder-layer curve, and DeepSpeed's host work (`engine_probe`)."""
    from spillway_runtime.engine_probe import measure_engine_host_work
    from spillway_runtime.probe import measure_cpu_adam, measure_cpu_matmul, measure_gpu_decoder, measure_host_device

    update: dict[str, object] = {}
    if basic.gpu_count:
        update["host_device_bytes_per_s"] = measure_host_device(64 << 20)
        update["gpu_decoder"] = measure_gpu_decoder(budget_seconds)
    else:
        update["cpu_matmul"] = measure_cpu_matmul(basic.cpu_cores, budget_seconds)
    ds_rate, torch_rate = measure_cpu_adam(4_000_000, 2, torch_too=False)
    update["cpu_adam_params_per_s"] = ds_rate or torch_rate
    update["torch_adamw_params_per_s"] = torch_rate
    update["host_work_scale"] = measure_engine_host_work(basic.cpu_cores)
    return basic.model_copy(update=update)


def with_compute_rates(basic: NodeHardware, settings: ProbeCacheSettings) -> NodeHardware:
    """`basic` with this machine's compute rates: cached per machine (not per disk: every plan
    needs them, NVMe or not), measured on a miss. A failed measurement plans with the assumed rates."""
    if not settings.compute:
        return basic
    fp = compute_fingerprint(basic)
    path = compute_entry_path(settings, fp)
    entry = _read(path, ComputeEntry)
    if _compute_staleness(entry, fp, settings) is not None or _host_work_due(entry, settings):
        with _locked(path):
            entry = _read(path, ComputeEntry)
            if _compute_staleness(entry, fp, settings) is not None:
                started = time.monotonic()
                try:
                    measured = measure_compute(basic, settings.compute_seconds)
                except (ImportError, RuntimeError, OSError) as err:
                    print(f"probe: compute rates not measured ({err}); planning with assumed rates")
                    return basic
                entry = ComputeEntry(fingerprint=fp, measured_at=time.time(),
                                     probe_seconds=round(time.monotonic() - started, 2), hardware=measured)
                with contextlib.suppress(OSError):
                    store_entry(path, entry)
            elif entry is not None and _host_work_due(entry, settings):
                from spillway_runtime.engine_probe import measure_engine_host_work

                scale = measure_engine_host_work(basic.cpu_cores)
                entry = entry.model_copy(update={
                    "host_work_tried_at": time.time(),
                    "hardware": entry.hardware.model_copy(update={"host_work_scale": scale})})
                with contextlib.suppress(OSError):
                    store_entry(path, entry)
    assert entry is not None
    return basic.model_copy(update={
        name: value for name in COMPUTE_FIELDS if (value := getattr(entry.hardware, name)) not in (None, [])
    })


def hardware_for_run(nvme_dir: Path, *, measure: bool,
                     settings: ProbeCacheSettings | None = None) -> tuple[NodeHardware, ProbeRecord]:
    """This machine now, with the disk's cached sweep merged in. Without a usable entry the sweep
    runs only when `measure` (the plan puts state on NVMe); otherwise the capacities alone."""
    from spillway_runtime.probe import ProbeError, probe_basic

    settings = settings or ProbeCacheSettings()
    basic = probe_basic(nvme_dir)
    fp = fingerprint(nvme_dir, basic)
    path = entry_path(settings, fp)
    if not settings.sweep:
        return basic, _record("unmeasured", "SPILLWAY_PROBE_SWEEP=0: DeepSpeed's default async I/O", path, None)
    basic = with_compute_rates(basic, settings)
    entry = read_entry(path)
    why = staleness(entry, fp, settings)
    if why is None and entry is not None:
        return _merged(basic, entry), _record("cached", "fresh", path, entry)
    if not measure:
        return basic, _record("unmeasured", f"{why}; the plan keeps nothing on NVMe", path, None)
    with _locked(path):
        entry = read_entry(path)
        if entry is not None and staleness(entry, fp, settings) is None:
            return _merged(basic, entry), _record("cached", "measured by a run that started alongside", path, entry)
        try:
            entry = _sweep(nvme_dir, basic, fp, settings)
        except (ProbeError, OSError) as err:
            return basic, _record("unmeasured", f"{why}; the sweep failed: {err}", path, None)
        try:
            store_entry(path, entry)
        except OSError as err:
            why = f"{why}; not cached: {err}"
    return _merged(basic, entry), _record("measured", why or "", path, entry)


def store_probe(nvme_dir: Path, hw: NodeHardware, settings: ProbeCacheSettings | None = None) -> Path | None:
    """Keep a full `spillway probe` of `nvme_dir` for later runs; None when it measured no async I/O."""
    if hw.aio is None:
        return None
    settings = settings or ProbeCacheSettings()
    fp = fingerprint(nvme_dir, hw)
    path = entry_path(settings, fp)
    with _locked(path):
        store_entry(path, ProbeEntry(fingerprint=fp, probe=AIO_PROBE_VERSION, measured_at=time.time(),
                                     probe_seconds=hw.probe_seconds or 0.0, hardware=hw))
    return path
