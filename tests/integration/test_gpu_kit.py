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

from spillway_runtime.core.spec import ZENFLOW_DEFAULTS

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
    """run.sh as the device call runs it, less the install (this interpreter has the packages):
    the preflight, each op's build in ops.json, then every stage of kit.py on the CPU."""
    out = tmp_path / "out"
    # The budget is the kit's, which skips a stage with too little of it left: 300 s was 0.8 of
    # the dry run's time under the gate's load on a slow day (223 s, the last stage skipped)
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "KIT_INSTALL": "0", "RUN_SECONDS": "600",
           "KIT_WORK": str(tmp_path / "work")}
    child = subprocess.run(["bash", str(KIT / "run.sh"), "--dry-run", "--nvme-shares", "0.5"], env=env,
                           capture_output=True, text=True, timeout=630, check=False)
    assert child.returncode == 0, (child.stdout + child.stderr)[-3000:]
    preflight = (out / "preflight.txt").read_text()
    assert f"work: {tmp_path / 'work'}" in preflight and "o_direct yes" in preflight, preflight
    ops = json.loads((out / "ops.json").read_text())
    assert ops["cpu_adam"]["ok"] and ops["async_io"]["ok"], ops
    assert [json.loads(line)["stage"] for line in (out / "stages.jsonl").read_text().splitlines()] == [
        "imports", "build_ops", "kit"]
    report = json.loads((out / "gpu_kit.json").read_text())
    stages = report["stages"]
    assert report["dry_run"] is True and report["hardware"]["cpu_memory_bytes"] >= 120 << 30  # --host-memory-gib

    resident = stages["a_gpu_resident"]
    measured(resident["largest"])
    assert "needs CUDA" in resident["cap_bytes"]  # the memory cap is recorded as skipped, with why

    offloaded = stages["b_offloaded"]
    cpu = measured(offloaded["optimizer_cpu"])
    nvme = measured(offloaded["optimizer_nvme_parameters_cpu"])
    assert offloaded["optimizer_cpu"]["predicted"]["params"] > resident["largest"]["predicted"]["params"]
    assert cpu["swap_bytes"] == 0 and nvme["swap_bytes"] > 0  # the optimizer state really went to disk
    shared = offloaded["optimizer_nvme_share_0.5"]
    measured(shared)
    assert shared["placement"] == "Z3 opt:nvme par:cpu ram 0.5"
    assert shared["config"] == offloaded["optimizer_nvme_parameters_cpu"]["config"]  # the same shape, to compare

    # stage e: one model as plain ZeRO-Offload, with Twin-Flow's GPU share and with ZenFlow, each
    # trained by DeepSpeed from the runtime's config with the variant merged in
    overlap = stages["e_overlap"]
    assert (overlap["config"]["hidden_size"], overlap["config"]["num_hidden_layers"]) == (64, 2)
    assert {name: measured(overlap[name]) and overlap[name]["placement"] for name in
            ("zero_offload", "twin_flow_ratio_0.7", "zero_offload_z2", "zenflow_z2", "zenflow_z2_overlapped")} == {
        "zero_offload": "Z3 opt:cpu par:gpu zero_offload", "twin_flow_ratio_0.7": "Z3 opt:cpu par:gpu twin_flow_ratio_0.7",
        "zero_offload_z2": "Z2 opt:cpu par:gpu zero_offload_z2", "zenflow_z2": "Z2 opt:cpu par:gpu zenflow_z2",
        "zenflow_z2_overlapped": "Z2 opt:cpu par:gpu zenflow_z2_overlapped"}
    twin_flow = overlap["twin_flow_ratio_0.7"]
    assert twin_flow["zero_update"]["offload_optimizer"] == {"ratio": 0.7}
    # cut fine enough that int(0.3 x sub-groups) of them are on the "GPU", as on a real one
    on_gpu, sub_groups = twin_flow["measured"]["sub_groups_on_accelerator"]
    assert on_gpu == int(0.3 * sub_groups) >= 1, twin_flow["measured"]
    assert overlap["zero_offload"]["zero_update"]["sub_group_size"] == twin_flow["zero_update"]["sub_group_size"]
    assert overlap["zenflow_z2"]["zero_update"]["zenflow"] == ZENFLOW_DEFAULTS  # as the runtime runs it
    assert overlap["zenflow_z2_overlapped"]["zero_update"]["zenflow"]["overlap_step"] is True
    assert all(len(overlap[name]["measured"]["losses"]) == 2 for name in ("zero_offload", "zenflow_z2"))
    # with deepspeed_fixes' mend, ZenFlow trains the model as built: its first loss is ZeRO-Offload's
    assert overlap["zenflow_z2"]["measured"]["losses"][0] == overlap["zero_offload_z2"]["measured"]["losses"][0]

    planner = stages["c_planner"]["rows"]
    assert {r["placement"] for r in planner} == {"Z2 opt:gpu par:gpu", "Z3 opt:cpu par:gpu", "Z3 opt:nvme par:cpu",
                                                 "Z3 opt:nvme par:cpu ram 0.5"}

    resume = stages["d_resume"]
    assert resume["killed_by_sigkill"] and resume["returncodes"][0] == resume["returncodes"][2] == 0, resume
    assert resume["equal"] and resume["max_relative_difference"] <= 1e-4, resume

    # Twin-Flow's share through Spillway's checkpoint: on the CPU, bit for bit
    twin = stages["f_twin_flow_resume"]
    assert twin["placement"] == "Z3 opt:cpu par:gpu gpuResidentFraction 0.5" and twin["killed_by_sigkill"], twin
    assert twin["equal"] and twin["max_relative_difference"] == 0.0, twin

    table = (out / "gpu_kit.md").read_text()
    assert "| a | Z2 opt:gpu par:gpu |" in table and "SIGKILL and resume" in table
    assert "Twin-Flow, SIGKILL and resume" in table
    assert "| e | Z2 opt:cpu par:gpu zenflow_z2 |" in table


def test_a_stage_that_needs_an_op_that_did_not_build_says_so(tmp_path):
    """ops.json's failures reach the stages: no NVMe row without async_io, none on the CPU
    without CPUAdam, and the resume stage falls back to the optimizer on the CPU."""
    sys.path.insert(0, str(KIT))
    try:
        import kit
    finally:
        sys.path.remove(str(KIT))
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps({"cpu_adam": {"ok": True}, "async_io": {"ok": False, "error": "ValueError: '0a'"}}))
    args = kit.argparse.Namespace(out=str(tmp_path / "out"), work=str(tmp_path / "work"), ops=str(ops),
                                  host_memory_gib=None, only=None, nvme_shares=None, dry_run=True, budget_seconds=60,
                                  nvme_swap_gib=4)
    settings = kit.Settings.make(args)
    assert settings.missing_op("gpu") is None and settings.missing_op("cpu") is None
    assert settings.missing_op("nvme") == "DeepSpeed's async_io op did not build: ValueError: '0a'"
    ops.write_text(json.dumps({"cpu_adam": {"ok": False, "error": "no compiler"}}))
    assert "cpu_adam op did not build: no compiler" in kit.Settings.make(args).missing_op("nvme")


def test_carry_fits_the_device_tool():
    carry = KIT / "carry"
    if not (carry / "wheels").is_dir():
        pytest.skip("benchmarks/gpu/carry not built: run benchmarks/gpu/prepare.sh (it needs the package indexes)")
    size = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    assert size < CARRY_LIMIT, f"{size} bytes"
    wheels = {p.name.split("-")[0].lower() for p in (carry / "wheels").glob("*.whl")}
    assert {"deepspeed", "pydantic", "pydantic_core", "pydantic_settings", "spillway"} <= wheels
    assert (carry / "libaio" / "include" / "libaio.h").is_file() and list((carry / "libaio" / "lib").glob("libaio.so*"))


def test_stage_e_merges_each_variant_into_the_runtimes_zero_section():
    """The variants edit the runtime's own zero_optimization (Twin-Flow's ratio inside its
    offload_optimizer, beside the device and pinning the runtime chose), and DeepSpeed's config
    model accepts the result."""
    sys.path.insert(0, str(KIT))
    try:
        import kit
    finally:
        sys.path.remove(str(KIT))
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "sub_group_size": 10_000_000}
    variants = {name: update for name, _, update in kit.OVERLAP_VARIANTS}
    twin = kit.overlap_config(zero, variants["twin_flow_ratio_0.7"])
    assert twin["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.7}
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}  # the runtime's is left as it was
    assert DeepSpeedZeroConfig(**twin).offload_optimizer.ratio == 0.7
    for name, overlapped in (("zenflow_z2", False), ("zenflow_z2_overlapped", True)):
        parsed = DeepSpeedZeroConfig(**kit.overlap_config({**zero, "stage": 2}, variants[name]))
        assert parsed.zenflow is not None and parsed.zenflow.update_interval == 4
        assert parsed.zenflow.overlap_step is overlapped
