"""Bytes a run uses where: resident memory per tier, what this process read and wrote on block
devices, and the swap files a rank leaves on NVMe (removed at exit when the job says so).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from spillway_runtime.core.planner import OffloadPlan
from spillway_runtime.training.dsconfig import REFERENCE_DIR


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing):
    loading a model and building the engine free gigabytes of temporaries that the allocator
    would otherwise keep resident, and measured set-up memory would count them."""
    import ctypes

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: libc's, where glibc
    if trim is not None:
        trim(0)


def status_bytes(field: str) -> int | None:
    """A figure of this process's memory from Linux's /proc/self/status: `RssAnon`, its resident
    anonymous memory (its heap and tensors, without the pages of files it maps, which the kernel
    may drop and read again); `VmLck`, what it has locked (mlock). None where the platform does
    not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def tier_bytes(plan: OffloadPlan, nvme_dir: str | None, torch: Any) -> dict[str, int]:
    """In use now: this process's resident memory, the GPU's allocated memory, the swap files."""
    import psutil

    out = {"cpu": psutil.Process().memory_info().rss}
    if plan.accelerator == "cuda":
        out["gpu"] = int(torch.cuda.memory_allocated())
    if nvme_dir and plan.bytes.nvme:
        out["nvme"] = dir_bytes(Path(nvme_dir))
    return out


def process_io_bytes() -> dict[str, int]:
    """What this process read from and wrote to block devices (its swap I/O, checkpoints and
    data: DeepSpeed's async I/O runs in it); empty where the platform does not say."""
    import psutil

    try:
        io = psutil.Process().io_counters()
    except (AttributeError, psutil.AccessDenied):
        return {}
    return {"read": int(io.read_bytes), "written": int(io.write_bytes)}


def remove_swap_files(nvme_dir: Path, rank: int) -> int:
    """Delete what DeepSpeed's swappers wrote for `rank` (`zero_stage_3/optimizer/rankN`,
    `zero_stage_3/<dtype>params/rankN`, and DPO's frozen reference's under `reference/`) and the
    folders left empty; returns the bytes freed. Other ranks of the pod remove their own."""
    freed = 0
    for root in (nvme_dir, nvme_dir / REFERENCE_DIR):
        stage = root / "zero_stage_3"
        for folder in stage.glob(f"*/rank{rank}"):
            freed += dir_bytes(folder)
            shutil.rmtree(folder, ignore_errors=True)
            for parent in (folder.parent, stage, *([root] if root != nvme_dir else [])):
                try:
                    parent.rmdir()  # only once empty: another rank may still be removing its own
                except OSError:
                    break
    return freed


def dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total
