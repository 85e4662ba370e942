"""The GPU validation kit (benchmarks/gpu/) on the CPU: its dry run trains every stage's tiny
model and writes the results the GPU call would bring back, and the folder prepare.sh builds
for that call fits in what the device tool carries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "benchmarks" / "gpu"
CARRY_LIMIT = 64 << 20  # the device tool's limit on a carried working tree


def measured(row: dict) -> dict:
    assert "measured" in row, row.get("error")
    m = row["measured"]
    assert m["step_seconds"] > 0 and m["tokens_per_second"] > 0 and m["peak_rss_bytes"] > 0, m
    assert set(row["ratio"]) == {"gpu", "cpu", "nvme", "step"} and row["ratio"]["step"] > 0, row["ratio"]
    return m


@pytest.mark.integration
def test_dry_run_writes_every_stage(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OUT": str(tmp_path / "out")}
    child = subprocess.run([sys.executable, str(KIT / "kit.py"), "--dry-run", "--work", str(tmp_path / "work")],
                           env=env, capture_output=True, text=True, timeout=240, check=False)
    assert child.returncode == 0, (child.stdout + child.stderr)[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_kit.json").read_text())
    stages = report["stages"]
    assert report["dry_run"] is True and report["hardware"]["cpu_memory_bytes"] > 0

    resident = stages["a_gpu_resident"]
    measured(resident["largest"])
    assert "needs CUDA" in resident["cap_bytes"]  # the memory cap is recorded as skipped, with why

    offloaded = stages["b_offloaded"]
    cpu = measured(offloaded["optimizer_cpu"])
    nvme = measured(offloaded["optimizer_nvme_parameters_cpu"])
    assert offloaded["optimizer_cpu"]["predicted"]["params"] > resident["largest"]["predicted"]["params"]
    assert cpu["swap_bytes"] == 0 and nvme["swap_bytes"] > 0  # the optimizer state really went to disk

    planner = stages["c_planner"]["rows"]
    assert {r["placement"] for r in planner} == {"Z2 opt:gpu par:gpu", "Z3 opt:cpu par:gpu", "Z3 opt:nvme par:cpu"}

    resume = stages["d_resume"]
    assert resume["killed_by_sigkill"] and resume["returncodes"][0] == resume["returncodes"][2] == 0, resume
    assert resume["equal"] and resume["max_relative_difference"] <= 1e-4, resume

    table = (tmp_path / "out" / "gpu_kit.md").read_text()
    assert "| a | Z2 opt:gpu par:gpu |" in table and "SIGKILL and resume" in table


def test_carry_fits_the_device_tool():
    carry = KIT / "carry"
    if not (carry / "wheels").is_dir():
        pytest.skip("benchmarks/gpu/carry not built: run benchmarks/gpu/prepare.sh (it needs the package indexes)")
    size = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    assert size < CARRY_LIMIT, f"{size} bytes"
    wheels = {p.name.split("-")[0].lower() for p in (carry / "wheels").glob("*.whl")}
    assert {"deepspeed", "pydantic", "pydantic_core", "pydantic_settings", "spillway"} <= wheels
    assert (carry / "libaio" / "include" / "libaio.h").is_file() and list((carry / "libaio" / "lib").glob("libaio.so*"))
