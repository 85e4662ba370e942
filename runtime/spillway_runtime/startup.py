"""What importing and loading DeepSpeed costs at every rank's start, and how the runtime
avoids it without changing what runs: each function here removes seconds that
`python -X importtime` or a profile of the start showed (benchmarks/bench_startup.py).

Where this sits: called by the runtime's entry point (`__main__`) and the recipe, before the
imports and calls they speed up.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
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
    """DeepSpeed asks py-cpuinfo three times while it loads the CPU Adam op, and every answer
    costs a subprocess (1.3 s each on this machine, 3.9 s of every start). The CPU does not
    change during a run: ask once."""
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def count_cpu_devices_by_ranks() -> None:
    """DeepSpeed's CPU accelerator answers `device_count()` with `LOCAL_SIZE` when it is set
    (its own launcher sets it to the node's ranks) and otherwise runs `numactl --hardware`
    in a subprocess, at every call: ZeRO-3 asks at every gradient reduction. One `make test`
    ran it 87,455 times (process accounting), each a fork and, where numactl is missing, a
    failed exec of every PATH entry (~0.2 ms). Spillway launches its ranks itself, so it sets
    what DeepSpeed's launcher would: the node's rank count (`LOCAL_WORLD_SIZE`), which only
    the quantized and hierarchical ZeRO groups read."""
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))


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
