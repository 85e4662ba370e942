"""Preference tuning checked against TRL, which we did not write, and trained for real.

TRL's DPOTrainer (the test extra pins it) and ours get the same tiny model, the same LoRA
adapters (moved off their zero start, so that the policy and the reference differ) and the same
records: the tokens, each pair's log-probabilities, rewards and loss agree to 1e-4. Then the
runtime trains DPO with LoRA under ZeRO-3 with the optimizer state and the parameters offloaded
to the CPU: the first step's loss is ln 2 (the policy is the reference) and it falls, and a run
SIGKILLed after a checkpoint and restarted reports the same losses, rewards and log-probabilities
to the bit, with LoRA and with full fine-tuning against a frozen copy on NVMe.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from spillway_runtime.core.spec_inputs import DatasetSource
from spillway_runtime.training.data import PackedDataset, read_pairs
from spillway_runtime.training.dpo import adapters_off, preference_loss, step_metrics
from spillway_runtime.training.runconfig import FaultInjection

from .conftest import run_job

pytestmark = pytest.mark.integration

SEQUENCE = 48
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def arithmetic_pairs(count: int, chat: bool = False, seed: int = 0) -> list[dict[str, Any]]:
    """The tiny model's arithmetic as preferences: the right sum chosen, a wrong one rejected."""
    import random

    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
        question = f"what is {WORDS[a]} plus {WORDS[b]}?"
        right_answer, wrong_answer = f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {wrong}."
        if chat:
            records.append({"prompt": [{"role": "user", "content": question}],
                            "chosen": [{"role": "assistant", "content": right_answer}],
                            "rejected": [{"role": "assistant", "content": wrong_answer}]})
        else:
            records.append({"prompt": f"Question: {question} Answer:", "chosen": f" {right_answer}",
                            "rejected": f" {wrong_answer}"})
    return records


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def trl_trainer(model_dir: Path, records: list[dict[str, Any]], beta: float, loss: str, chat: bool,
                out: Path) -> Any:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat:
        tokenizer.chat_template = TEMPLATE
    args = DPOConfig(output_dir=str(out), beta=beta, loss_type=[loss], max_length=SEQUENCE, report_to=[],
                     use_cpu=True, save_strategy="no", per_device_train_batch_size=len(records))
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                         train_dataset=Dataset.from_list(records), processing_class=tokenizer, peft_config=lora)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # adapters away from zero: the policy is no longer the reference
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return trainer


def trl_quantities(trainer: Any, examples: list[int]) -> dict[str, float]:
    """TRL's loss and logged means for the examples as one batch."""
    trainer._metrics["train"].clear()
    trainer.model.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in examples])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"loss": float(loss), **{k: logged[k] for k in ("rewards/chosen", "rewards/rejected", "rewards/margins",
                                                            "rewards/accuracies", "logps/chosen", "logps/rejected")}}


def our_quantities(model: Any, data: PackedDataset, examples: int, start: int, beta: float,
                   loss: str) -> dict[str, float]:
    batch = data.eval_batch(start, 0, 1, examples)
    with torch.no_grad():
        mean, stats = preference_loss(model, adapters_off(model, model.disable_adapter), batch, beta, loss)
    return {"loss": float(mean), **step_metrics(stats)}


@pytest.mark.parametrize("loss,chat", [("sigmoid", False), ("ipo", False), ("sigmoid", True)],
                         ids=["sigmoid", "ipo", "sigmoid-chat"])
def test_loss_rewards_and_log_probabilities_equal_trl_s(tmp_path: Path, tiny_model: dict[str, Path], loss: str,
                                                        chat: bool) -> None:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    beta, records = 0.1, arithmetic_pairs(3, chat=chat)
    trainer = trl_trainer(tiny_model["model"], records, beta, loss, chat, tmp_path / "trl")

    # the same tokens as TRL's
    tokenizer = AutoTokenizer.from_pretrained(tiny_model["model"])
    source = DatasetSource(uri="x", format="preference", chatTemplate=TEMPLATE if chat else None)
    pairs = list(read_pairs(source, write_jsonl(tmp_path / "pairs.jsonl", records), tokenizer, SEQUENCE))
    for (chosen, rejected), theirs in zip(pairs, trainer.train_dataset, strict=True):
        assert chosen[0] == theirs["prompt_ids"] + theirs["chosen_ids"]
        assert rejected[0] == theirs["prompt_ids"] + theirs["rejected_ids"]
        assert sum(chosen[1]) == len(theirs["chosen_ids"]) and sum(rejected[1]) == len(theirs["rejected_ids"])
    data = PackedDataset.build_pairs(pairs, tokenizer.pad_token_id, SEQUENCE)

    # the same model and adapters
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model["model"], dtype=torch.float32),
                          LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                     task_type="CAUSAL_LM"))
    set_peft_model_state_dict(ours, get_peft_model_state_dict(trainer.model))
    ours.train()

    differences: dict[str, float] = {}
    cases = [(list(range(len(records))), len(records), 0)] + [([i], 1, i) for i in range(len(records))]
    for examples, size, start in cases:  # the batch's means, and each pair alone
        theirs, mine = trl_quantities(trainer, examples), our_quantities(ours, data, size, start, beta, loss)
        for name, value in theirs.items():
            differences[name] = max(differences.get(name, 0.0), abs(mine[name] - value))
    print(f"max |ours - TRL| ({loss}{', chat' if chat else ''}):",
          ", ".join(f"{k} {v:.2e}" for k, v in differences.items()))
    assert max(differences.values()) < 1e-4, differences
    single = trl_quantities(trainer, [0])
    assert abs(single["rewards/margins"]) > 1e-3, "the adapters should move the policy off the reference"


def test_dpo_with_lora_trains_under_zero_3_offload(tmp_path: Path, tiny_model: dict[str, Path]) -> None:
    """The runtime end to end on examples/dpo-lora-local.yaml's data and method (plain and chat
    records, its template): pairs tokenized, the reference with the adapters off, ZeRO-3 with
    the optimizer state and the parameters in CPU RAM, TRL's metrics per step and on held-out
    pairs. Shorter than the example, on the test's tiny model."""
    import yaml

    example = EXAMPLES / "dpo-lora-local.yaml"
    doc = yaml.safe_load(example.read_text())
    spec = doc["spec"]
    spec["model"]["uri"] = str(tiny_model["model"])
    spec["dataset"]["uri"] = str((example.parent / spec["dataset"]["uri"]).resolve())
    spec["training"].update({"maxSteps": 10, "microBatchSize": 2, "gradientAccumulation": 2,
                             "learningRate": 3e-2, "evalEverySteps": 10, "evalBatches": 4})
    spec["offload"] = {"optimizer": "cpu", "parameters": "cpu", "deepspeed": {"zero_optimization": {"stage": 3}}}
    spec["checkpoint"] = {"everySteps": 5, "keep": 2}
    job = tmp_path / "dpo.yaml"
    job.write_text(yaml.safe_dump(doc))

    run = run_job(job, tmp_path / "run")
    assert run.returncode == 0, run.log[-3000:]
    assert run.config.plan.zero_stage == 3
    steps = {e["step"]: e for e in run.of("step")}
    assert sorted(steps) == list(range(1, 11))
    first, last = steps[1], steps[10]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-3)  # the policy starts as the reference
    assert first["rewards/margins"] == pytest.approx(0, abs=1e-3)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        assert math.isfinite(first[name]), name
    print("dpo steps:", [(s, round(e["loss"], 4), round(e["rewards/margins"], 4)) for s, e in sorted(steps.items())])
    assert last["loss"] < first["loss"] - 0.05 and last["rewards/margins"] > 0.1, last
    [evaluation] = run.of("eval")
    assert evaluation["pairs"] == 8 and evaluation["eval_rewards/margins"] > 0 and evaluation["eval_loss"] < math.log(2)
    assert any("240 preference pairs tokenized" in e.get("message", "") for e in run.of("log"))

    # SIGKILLed in the step after the step-5 checkpoint and restarted: every reported quantity of
    # steps 6-10 to the bit (the adapters, both optimizer moments, the data position in pairs)
    killed = run_job(job, tmp_path / "killed", faults=FaultInjection(step_sleep_seconds=0.4), signal_at_step=6)
    assert killed.returncode == -9, killed.log[-3000:]
    resumed = run_job(job, tmp_path / "killed")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert resumed.of("resumed")[-1]["step"] == 5
    quantities = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                  "logps/chosen", "logps/rejected")
    again = {e["step"]: e for e in resumed.of("step")}  # the events file holds the killed run's too: the last
    assert sorted(again) == list(range(1, 11))
    resumed_steps = range(6, 11)
    assert {s: [again[s][q] for q in quantities] for s in resumed_steps} == {
        s: [steps[s][q] for q in quantities] for s in resumed_steps}


def test_full_fine_tuning_against_a_frozen_copy_equals_trl_s(tmp_path: Path, tiny_model: dict[str, Path]) -> None:
    """DPO without LoRA: the reference is a second, frozen model (TRL's ref_model). Our loss,
    rewards and log-probabilities of a batch and of each pair equal TRL's DPOTrainer's."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    beta, records = 0.1, arithmetic_pairs(3, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model["model"])
    policy = AutoModelForCausalLM.from_pretrained(tiny_model["model"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # trained a little: the policy is no longer the reference
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model["model"], dtype=torch.float32)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type=["sigmoid"], max_length=SEQUENCE,
                     report_to=[], use_cpu=True, save_strategy="no", per_device_train_batch_size=len(records))
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(records),
                         processing_class=tokenizer)
    source = DatasetSource(uri="x", format="preference")
    pairs = list(read_pairs(source, write_jsonl(tmp_path / "pairs.jsonl", records), tokenizer, SEQUENCE))
    data = PackedDataset.build_pairs(pairs, tokenizer.pad_token_id, SEQUENCE)
    differences: dict[str, float] = {}
    for examples, size, start in [([0, 1, 2], 3, 0), ([0], 1, 0), ([1], 1, 1), ([2], 1, 2)]:
        theirs = trl_quantities(trainer, examples)
        with torch.no_grad():
            mean, stats = preference_loss(trainer.model, trainer.ref_model, data.eval_batch(start, 0, 1, size),
                                          beta, "sigmoid")
        mine = {"loss": float(mean), **step_metrics(stats)}
        for name, value in theirs.items():
            differences[name] = max(differences.get(name, 0.0), abs(mine[name] - value))
    print("max |ours - TRL| (full fine-tuning):", ", ".join(f"{k} {v:.2e}" for k, v in differences.items()))
    assert max(differences.values()) < 1e-4, differences
    assert abs(theirs["rewards/margins"]) > 1e-3, "the policy should differ from the reference"


def test_dpo_with_full_fine_tuning_trains_against_a_frozen_copy_on_nvme(tmp_path: Path,
                                                                       tiny_model: dict[str, Path]) -> None:
    """Full fine-tuning DPO under ZeRO-3 with the parameters on NVMe: the reference is a frozen
    copy of the base, partitioned and swapped like the policy's parameters in a folder of its
    own; the plan counts its 2 B/param; the policy starts as the reference (loss ln 2) and
    learns; checkpoints hold the policy only; SIGKILLed after a checkpoint and restarted (the
    reference made again from the base), the run reports the same losses, rewards and
    log-probabilities to the bit."""
    import yaml

    example = EXAMPLES / "dpo-lora-local.yaml"
    doc = yaml.safe_load(example.read_text())
    spec = doc["spec"]
    spec["model"]["uri"] = str(tiny_model["wide"])  # every matrix above DeepSpeed's minimum swap size
    spec["dataset"]["uri"] = str((example.parent / spec["dataset"]["uri"]).resolve())
    spec["method"] = {"type": "full", "objective": "dpo", "beta": 0.1}
    spec["training"].update({"maxSteps": 6, "microBatchSize": 2, "gradientAccumulation": 1, "learningRate": 1e-3,
                             "evalEverySteps": 0, "warmupSteps": 0})
    spec["dataset"].pop("validation")
    spec["offload"] = {"optimizer": "cpu", "parameters": "nvme", "deepspeed": {"zero_optimization": {"stage": 3}}}
    spec["checkpoint"] = {"everySteps": 3, "keep": 1}
    job = tmp_path / "dpo-full.yaml"
    job.write_text(yaml.safe_dump(doc))

    run = run_job(job, tmp_path / "run")
    assert run.returncode == 0, run.log[-3000:]
    plan = run.config.plan
    assert (plan.zero_stage, plan.optimizer, plan.parameters) == (3, "cpu", "nvme")
    assert any("frozen copy of the base" in r for r in plan.reasons), plan.reasons
    assert any("DPO reference: a frozen copy of the base (ZeRO-3, parameters on nvme)" in e.get("message", "")
               for e in run.of("log"))
    # the two engines' parameter swap files, each in its own folder
    nvme = Path(run.config.nvme_dir)
    for root in (nvme, nvme / "reference"):
        assert list((root / "zero_stage_3").glob("*params/rank0/*")), sorted(map(str, nvme.rglob("*")))
    steps = {e["step"]: e for e in run.of("step")}
    assert sorted(steps) == list(range(1, 7))
    assert steps[1]["loss"] == pytest.approx(math.log(2), abs=2e-3) and steps[1]["rewards/margins"] == pytest.approx(
        0, abs=2e-2)
    assert steps[6]["loss"] < steps[1]["loss"], [(s, e["loss"]) for s, e in sorted(steps.items())]
    # the policy's checkpoints: the trainable model's 12-14 B/param, nothing of the reference
    for checkpoint in run.of("checkpoint"):
        assert checkpoint["sizeBytes"] < 16 * plan.model.params, checkpoint

    killed = run_job(job, tmp_path / "killed", faults=FaultInjection(step_sleep_seconds=0.4), signal_at_step=4)
    assert killed.returncode == -9, killed.log[-3000:]
    resumed = run_job(job, tmp_path / "killed")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert resumed.of("resumed")[-1]["step"] == 3
    quantities = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
    again = {e["step"]: e for e in resumed.of("step")}  # the killed run's events, then the resumed run's
    assert {s: [again[s][q] for q in quantities] for s in (4, 5, 6)} == {
        s: [steps[s][q] for q in quantities] for s in (4, 5, 6)}

