"""What importing and loading DeepSpeed costs at every rank's start, and how the runtime
avoids it without changing what runs: each function here removes seconds that
`python -X importtime` or a profile of the start showed (benchmarks/bench_startup.py).

Where this sits: called by the runtime's entry point (`__main__`) and the recipe, before the
imports and calls they speed up.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any


def import_deepspeed() -> None:
    """DeepSpeed with mlflow hidden from it: its autotuner (which Spillway never runs) imports
    mlflow at import time when it is installed, as it is for `spec.tracking`, and that is 1-2 s
    of every rank's start on two cores (`python -X importtime`). A job that tracks to MLflow
    imports it later, as if this never happened."""
    hidden = "mlflow" not in sys.modules
    if hidden:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed  # noqa: F401
    finally:
        if hidden and sys.modules.get("mlflow", ...) is None:
            del sys.modules["mlflow"]


def ask_cpuinfo_once() -> None:
    """DeepSpeed asks py-cpuinfo for the CPU when it makes its CPU Adam (the vendor) and when
    it loads ops (the architecture and flags), and every answer is a Python subprocess that
    runs lscpu, dmesg and a CPUID probe: 1.2 s and 0.9 s of CPU on this machine, at every
    rank's start. The CPU does not change between runs: the answer is asked once per
    process, and kept beside the probe cache's entries (`probe_cache`), keyed by the host, the
    py-cpuinfo version and /proc/cpuinfo less its clock lines, so a machine asks it once. A
    cache that cannot be read or written only costs the question; `SPILLWAY_PROBE_REFRESH=1`
    asks again."""
    import cpuinfo

    if getattr(cpuinfo.get_cpu_info, "spillway_cached", False):
        return
    ask = cpuinfo.get_cpu_info
    path, refresh = _cpuinfo_entry(cpuinfo.CPUINFO_VERSION_STRING)
    info: dict[str, Any] | None = None
    if path is not None and not refresh:
        with contextlib.suppress(OSError, ValueError):
            info = json.loads(path.read_text())
    if not isinstance(info, dict) or not info:
        info = ask()
        if path is not None and info:
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_suffix(f".{os.getpid()}.tmp")
                partial.write_text(json.dumps(info))
                partial.replace(path)
    answer: dict[str, Any] = info

    def cached() -> dict[str, Any]:
        return dict(answer)

    cached.spillway_cached = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = cached


def _cpuinfo_entry(version: str) -> tuple[Path | None, bool]:
    """Where this machine's py-cpuinfo answer is kept (None: no /proc/cpuinfo), and whether
    to ask again (a refresh)."""
    from spillway_runtime.probe_cache import ProbeCacheSettings

    settings = ProbeCacheSettings()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None, settings.refresh
    stable = "\n".join(line for line in lines if not line.startswith(("cpu MHz", "bogomips")))
    key = hashlib.sha256(f"{socket.gethostname()}\0{version}\0{stable}".encode()).hexdigest()[:16]
    return settings.directory / f"cpuinfo-{key}.json", settings.refresh


def ask_numa_once() -> None:
    """DeepSpeed's CPU accelerator counts its devices by running `numactl --hardware` in a
    subprocess at every `device_count()`, and ZeRO-3 asks at every gradient reduction: one
    `make test` ran it 87,455 times (process accounting), each a fork and, where numactl is
    missing, a failed exec of every PATH entry. The NUMA nodes do not change during a run:
    ask once. (Not by setting `LOCAL_SIZE` as DeepSpeed's launcher does: that also turns on
    its shared-memory all-reduce, which leaves a 66 MiB file in /dev/shm per process.)"""
    from deepspeed.utils import numa

    if not hasattr(numa.get_numa_cores, "cache_info"):
        numa.get_numa_cores = functools.cache(numa.get_numa_cores)


def import_muon_without_compiling() -> None:
    """DeepSpeed's ZeRO set-up imports its Muon optimizer module only to ask whether the
    optimizer is one (Spillway configures Adam). That module applies torch.compile to three
    functions at import, and torch.compile loads the inductor compiler on the spot (about 4 s
    of every start). Import it with torch.compile deferred to each function's first call: the
    functions are compiled exactly as before if anything ever calls them."""
    import torch

    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return
    compile_now = torch.compile

    def compile_on_first_call(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile_on_first_call(fn, **options)
        compiled: list[Any] = []

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(compile_now(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    torch.compile = compile_on_first_call
    try:
        with contextlib.suppress(ImportError):  # a DeepSpeed without Muon: nothing to defer
            import deepspeed.runtime.zero.muon.original_muon  # noqa: F401
    finally:
        torch.compile = compile_now
