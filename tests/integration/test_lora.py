"""LoRA (PEFT) on a frozen base: only the adapters train, checkpoints hold only them, the
planner counts them exactly, a run killed and resumed matches the uninterrupted one to the
bit, and the export loads with PEFT (adapter) and with transformers (merged)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from spillway_runtime.checkpoints.store import MANIFEST, checkpoint_name
from spillway_runtime.training.lora import MERGED_DIR
from spillway_runtime.training.runconfig import FaultInjection

from .conftest import Run, run_job

pytestmark = pytest.mark.integration

STEPS = 12
EVERY = 5
LORA = {"type": "lora", "rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj", "down_proj"]}


def lora_job(make_job: Any, name: str, nvme: Path, optimizer: str, parameters: str, stage: int = 3,
             **extra: Any) -> Path:
    model = "wide" if parameters == "nvme" else "model"  # above DeepSpeed's 1 MiB minimum swap size
    offload = {"optimizer": optimizer, "parameters": parameters, "nvme": {"path": str(nvme)},
               "deepspeed": {"zero_optimization": {"stage": stage}}}
    return make_job(name, model=model, training={"maxSteps": STEPS, "learningRate": 1e-2}, offload=offload,
                    checkpoint={"everySteps": EVERY, "keep": 10}, method=LORA, **extra)


def peft_count(model_dir: Path) -> tuple[int, int]:
    """(trainable, total) parameters of the model with PEFT's adapters, built here."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    peft = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"],
                                            target_modules=LORA["targetModules"], task_type="CAUSAL_LM"))
    return (sum(p.numel() for p in peft.parameters() if p.requires_grad), sum(p.numel() for p in peft.parameters()))


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("stage,parameters", [(3, "cpu"), (2, "gpu")], ids=["z3-opt_cpu-par_cpu", "z2-opt_cpu"])
def test_lora_trains_the_adapters_only_and_exports_adapter_and_merged_model(
        tmp_path: Path, make_job: Any, tiny_model: dict[str, Path], stage: int, parameters: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = run_job(lora_job(make_job, "lora", tmp_path / "nvme", "cpu", parameters, stage, export={"merge": True}),
                  tmp_path / "run")
    assert run.config.plan.zero_stage == stage
    assert run.returncode == 0, run.log[-3000:]
    losses = run.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < 0.93 * losses[1], losses  # the frozen base alone would stay where it started

    # the adapters and nothing else train, as PEFT counts them, and as the planner predicted
    [lora] = run.of("lora")
    assert (lora["trainable"], lora["total"]) == peft_count(tiny_model["model"])
    assert run.config.plan.model.trainable_params == lora["trainable"]
    assert run.config.plan.model.params == lora["total"] - lora["trainable"]

    # a checkpoint holds the adapters' fp32 masters and moments, not the frozen base
    last = run.run_dir / "checkpoints" / checkpoint_name(STEPS)
    size = json.loads((last / MANIFEST).read_text())["sizeBytes"]
    assert run.config.plan.checkpoint_bytes == (12 if stage == 3 else 14) * lora["trainable"]
    assert run.config.plan.checkpoint_bytes <= size <= run.config.plan.checkpoint_bytes + (1 << 20), size

    # the export: PEFT's adapter on the base, and the merged model, agree; both differ from the base
    final = Path(run.config.export_dir)
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 2, 11]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model["model"], dtype=torch.float32)
    before = logits(base, ids)
    adapted = logits(PeftModel.from_pretrained(base, final), ids)
    merged = logits(AutoModelForCausalLM.from_pretrained(final / MERGED_DIR, dtype=torch.float32), ids)
    assert not torch.allclose(adapted, before, atol=1e-2)
    assert torch.allclose(merged, adapted, atol=5e-2, rtol=0), (merged - adapted).abs().max()
    if stage == 3:
        exported_checkpoints_are_the_runs_export(run.run_dir, final, tmp_path)
        # and the run is the uninterrupted reference of this placement's resume
        resumed_after_sigkill_is_bit_identical(make_job, tmp_path, run, ("cpu", parameters))


def exported_checkpoints_are_the_runs_export(run_dir: Path, final: Path, tmp_path: Path) -> None:
    """`spillway export` of a LoRA run's last checkpoint writes the adapter and the merged model
    the run itself exported, to the bit; an earlier checkpoint's adapter differs."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    def export(what: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
        done = subprocess.run([sys.executable, "-m", "spillway_api.cli", "export", str(what), "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return {name: load_file(out / name) for name in ("adapter_model.safetensors", f"{MERGED_DIR}/model.safetensors")}

    def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

    last = export(run_dir, tmp_path / "exported-last")
    for name, tensors in last.items():
        want = load_file(final / name)
        assert set(tensors) == set(want) and all(same_bits(tensors[k], want[k]) for k in want), name
    earlier = export(run_dir / "checkpoints" / checkpoint_name(EVERY), tmp_path / "exported-earlier")
    adapter, want = earlier["adapter_model.safetensors"], last["adapter_model.safetensors"]
    assert set(adapter) == set(want) and any(not torch.equal(adapter[k], want[k]) for k in want)


def test_lora_resume_after_sigkill_is_bit_identical_with_the_base_on_nvme(tmp_path: Path, make_job: Any) -> None:
    """(With the base in CPU RAM, the first test's run is the reference of the same check.)"""
    placement = ("cpu", "nvme")
    reference = run_job(lora_job(make_job, "reference", tmp_path / "nvme", *placement), tmp_path / "reference")
    assert reference.returncode == 0, reference.log[-3000:]
    resumed_after_sigkill_is_bit_identical(make_job, tmp_path, reference, placement)


def resumed_after_sigkill_is_bit_identical(make_job: Any, tmp_path: Path, reference: Run,
                                           placement: tuple[str, str]) -> None:
    """The job of REFERENCE's placement, SIGKILLed after its first checkpoint and run again:
    from that checkpoint on, REFERENCE's losses to the bit."""
    job = lora_job(make_job, "job", tmp_path / "nvme", *placement)
    killed = run_job(job, tmp_path / "resumed", faults=FaultInjection(step_sleep_seconds=0.4),
                     signal_at_step=EVERY + 2)
    assert killed.returncode == -9, killed.log[-3000:]
    resumed = run_job(job, tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert resumed.of("resumed")[-1]["step"] == EVERY
    expected, got = reference.losses(), resumed.losses()
    assert {s: got[s] for s in range(EVERY + 1, STEPS + 1)} == {s: expected[s] for s in range(EVERY + 1, STEPS + 1)}
