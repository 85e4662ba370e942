"""The runtime's start: DeepSpeed is imported without pulling in mlflow (its autotuner's
optional import, 1-2 s of every rank's start), and mlflow still imports for a job that tracks."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = """
import sys
from spillway_runtime.startup import import_deepspeed
import_deepspeed()
import deepspeed.autotuning.autotuner as autotuner
assert "deepspeed" in sys.modules and "mlflow" not in sys.modules, sorted(m for m in sys.modules if "mlflow" in m)
assert autotuner.has_mlflow is False
import mlflow  # a job with spec.tracking.mlflow imports it later, as usual
assert mlflow.__version__
"""


def test_deepspeed_is_imported_without_mlflow_which_still_imports_later() -> None:
    child = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=False,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert child.returncode == 0, child.stderr[-2000:]
