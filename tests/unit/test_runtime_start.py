"""The runtime's start: DeepSpeed is imported without pulling in mlflow (its autotuner's
optional import, 1-2 s of every rank's start), and mlflow still imports for a job that tracks;
DeepSpeed's CPU accelerator asks `numactl` for its devices once, not at every call; and
py-cpuinfo's answer (a Python subprocess, ~1 s) is asked once per machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHECK = """
import sys
from spillway_runtime.training.startup import import_deepspeed
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


COUNT = """
import os
from spillway_runtime.training.startup import ask_numa_once, import_deepspeed
import_deepspeed()
from deepspeed.accelerator import get_accelerator
accelerator = get_accelerator()
before = accelerator.device_count()
ask_numa_once()
ask_numa_once()
print(before, [accelerator.device_count() for _ in range(50)].count(before), "LOCAL_SIZE" in os.environ)
"""


def test_the_cpu_accelerator_asks_numactl_once_for_its_devices(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    numactl = tmp_path / "bin" / "numactl"  # answers as on a two-node machine, and counts its calls
    numactl.parent.mkdir()
    numactl.write_text(f"#!/bin/sh\necho call >> {calls}\necho 'available: 2 nodes (0-1)'\n"
                       "echo 'node 0 cpus: 0 1'\necho 'node 1 cpus: 2 3'\n")
    numactl.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_SIZE"}
    env.update(DS_ACCELERATOR="cpu", PATH=f"{numactl.parent}:{env['PATH']}")
    child = subprocess.run([sys.executable, "-c", COUNT], capture_output=True, text=True, timeout=120, check=False, env=env)
    assert child.returncode == 0, child.stderr[-2000:]
    # DeepSpeed's own answer (two NUMA nodes: two devices) fifty times more, from two calls
    # of numactl: the one before and the one cached. LOCAL_SIZE stays unset (it would turn
    # on DeepSpeed's shared-memory all-reduce and its files in /dev/shm).
    assert child.stdout.split()[-3:] == ["2", "50", "False"], child.stdout
    assert calls.read_text().splitlines() == ["call", "call"]


CPUINFO = """
import cpuinfo
from spillway_runtime.training.startup import ask_cpuinfo_once
ask_cpuinfo_once()
ask_cpuinfo_once()
print(cpuinfo.get_cpu_info()["vendor_id_raw"])
"""


def test_the_cpus_answer_is_asked_once_per_machine_and_kept_beside_the_probe_cache(tmp_path: Path) -> None:
    def vendor(**extra: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "SPILLWAY_PROBE_REFRESH"}
        env.update(SPILLWAY_PROBE_CACHE_DIR=str(tmp_path), **extra)
        child = subprocess.run([sys.executable, "-c", CPUINFO], capture_output=True, text=True, timeout=120,
                               check=False, env=env)
        assert child.returncode == 0, child.stderr[-2000:]
        return child.stdout.strip()

    asked = vendor()
    [entry] = tmp_path.glob("cpuinfo-*.json")
    assert json.loads(entry.read_text())["vendor_id_raw"] == asked != ""
    # The next process reads the entry instead of asking: shown by an entry that says otherwise
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "vendor_id_raw": "KeptVendor"}))
    assert vendor() == "KeptVendor"
    # A refresh asks again and keeps the new answer; a broken entry is asked again too
    assert vendor(SPILLWAY_PROBE_REFRESH="1") == asked
    assert json.loads(entry.read_text())["vendor_id_raw"] == asked
    entry.write_text("{not json")
    assert vendor() == asked and json.loads(entry.read_text())["vendor_id_raw"] == asked
