"""Preference tuning (method.objective dpo): the spec's combinations, preference records read
as TRL reads them (what is learned, where a long one is cut, bad records named by file:line),
the pairs' batch layout, and the loss at the reference and off it. TRL itself is compared in
tests/integration/test_dpo.py (importing it takes seconds)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from spillway_runtime.core.spec import SpecError, parse_job
from spillway_runtime.core.spec_inputs import DatasetSource
from spillway_runtime.training.data import DatasetError, PackedDataset, read_pairs
from spillway_runtime.training.dpo import adapters_off, dpo_loss, preference_loss, sequence_logps, step_metrics

from .conftest import write_jsonl

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PLAIN = {"prompt": "Question: what is two plus three? Answer:", "chosen": " 5.", "rejected": " 6."}
CHAT = {"prompt": [{"role": "user", "content": "What is 2 plus 3?"}],
        "chosen": {"role": "assistant", "content": "5."},
        "rejected": [{"role": "assistant", "content": "6."}]}


def job(method: dict[str, Any], dataset: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "job"},
            "spec": {"model": {"uri": "/m"}, "dataset": {"uri": "/d.jsonl", **dataset}, "method": method}}


def test_dpo_is_an_objective_beside_the_method_type_with_trl_s_defaults() -> None:
    spec = parse_job(job({"type": "lora", "objective": "dpo"}, {"format": "preference"})).spec
    assert (spec.method.objective, spec.method.beta, spec.method.dpo_loss) == ("dpo", 0.1, "sigmoid")
    assert parse_job(job({}, {})).spec.method.objective == "sft"
    with_template = job({"type": "lora", "objective": "dpo", "dpoLoss": "ipo", "beta": 0.5},
                        {"format": "preference", "chatTemplate": TEMPLATE})
    assert parse_job(with_template).spec.dataset.chat_template == TEMPLATE
    full = parse_job(job({"type": "full", "objective": "dpo"}, {"format": "preference"})).spec.method
    assert (full.type, full.objective) == ("full", "dpo")  # its reference is a frozen copy of the base


@pytest.mark.parametrize("method,dataset,says", [
    ({"type": "lora", "objective": "dpo"}, {"format": "chat"}, "method.objective dpo with dataset.format chat"),
    ({"type": "lora"}, {"format": "preference"}, "method.objective sft with dataset.format preference"),
    ({"type": "lora", "objective": "dpo", "beta": 0}, {"format": "preference"}, "spec.method.beta"),
    ({"type": "lora", "objective": "dpo", "beta": 1000}, {"format": "preference"}, "spec.method.beta"),
    ({"type": "lora", "objective": "dpo", "dpoLoss": "hinge"}, {"format": "preference"}, "spec.method.dpoLoss"),
], ids=["dpo-on-chat", "sft-on-preference", "beta-0", "beta-1000", "hinge"])
def test_combinations_that_cannot_train_are_refused_by_field(method: dict[str, Any], dataset: dict[str, Any],
                                                             says: str) -> None:
    with pytest.raises(SpecError, match=says):
        parse_job(job(method, dataset))


def _source(**extra: Any) -> DatasetSource:
    return DatasetSource(uri="x", format="preference", chatTemplate=TEMPLATE, **extra)


def _learned(tokenizer: Any, ids: list[int], learn: list[int]) -> str:
    return str(tokenizer.decode([t for t, flag in zip(ids, learn, strict=True) if flag]))


def test_both_answers_follow_the_same_prompt_and_only_they_are_learned(tokenizer: Any, tmp_path: Path) -> None:
    [(chosen, rejected)] = list(read_pairs(_source(), write_jsonl(tmp_path / "d.jsonl", [PLAIN]), tokenizer, 64))
    prompt = tokenizer(PLAIN["prompt"])["input_ids"]
    for (ids, learn), answer in ((chosen, " 5."), (rejected, " 6.")):
        assert _learned(tokenizer, ids, learn) == answer + "</s>"  # an EOS learned, as TRL adds it
        assert ids[: len(prompt)] == prompt and not any(learn[: len(prompt)])

    [(chosen, rejected)] = list(read_pairs(_source(), write_jsonl(tmp_path / "c.jsonl", [CHAT]), tokenizer, 64))
    assert _learned(tokenizer, *chosen) == "5.<|end|>\n"
    assert _learned(tokenizer, *rejected) == "6.<|end|>\n"
    assert tokenizer.decode(chosen[0][: chosen[1].index(1)]) == "<|user|>\nWhat is 2 plus 3?<|end|>\n<|assistant|>\n"


def test_a_job_names_the_fields_of_its_preference_records(tokenizer: Any, tmp_path: Path) -> None:
    """dataset.promptField, chosenField and rejectedField: records with other column names (a
    StackExchange-style dump's) read as TRL's prompt/chosen/rejected do; a missing one, or an
    answer that is not text, is refused naming the job's field; the names need format preference."""
    renamed = [{"question": r["prompt"], "response_j": r["chosen"], "response_k": r["rejected"]} for r in (PLAIN, CHAT)]
    named = _source(promptField="question", chosenField="response_j", rejectedField="response_k")
    want = list(read_pairs(_source(), write_jsonl(tmp_path / "d.jsonl", [PLAIN, CHAT]), tokenizer, 64))
    assert list(read_pairs(named, write_jsonl(tmp_path / "r.jsonl", renamed), tokenizer, 64)) == want
    for bad, says in (({"question": "q", "response_j": "a"}, "no field 'response_k': a preference record has "
                       "'question', 'response_j', 'response_k' (dataset.promptField, chosenField and rejectedField"),
                      ({"question": "q", "response_j": 5, "response_k": "b"}, "field 'response_j' is int, not text")):
        path = write_jsonl(tmp_path / "bad.jsonl", [bad])
        with pytest.raises(DatasetError, match=f"^{path}:1: {re.escape(says)}"):
            list(read_pairs(named, path, tokenizer, 64))
    with pytest.raises(ValueError, match="chosenField and rejectedField apply to format preference only"):
        DatasetSource(uri="x", format="completion", chosenField="response_j")


def test_a_long_record_keeps_its_start_and_loses_the_answer_s_end(tokenizer: Any, tmp_path: Path) -> None:
    long = {**PLAIN, "chosen": " five, " * 40}
    [(chosen, rejected)] = list(read_pairs(_source(), write_jsonl(tmp_path / "d.jsonl", [long]), tokenizer, 32))
    assert len(chosen[0]) == 32 and chosen[1][-1] == 1  # cut inside the answer
    assert chosen[0] == tokenizer(long["prompt"] + long["chosen"])["input_ids"][:32]
    assert len(rejected[0]) < 32  # the short one is whole


@pytest.mark.parametrize("record,says", [
    ("{not json", "not valid JSON"),
    ({"prompt": "p", "chosen": "a"}, "no field 'rejected'"),
    ({"prompt": "p", "chosen": 5, "rejected": "b"}, "field 'chosen' is int, not text"),
    ({"prompt": "p", "chosen": "  ", "rejected": "b"}, "field 'chosen' is empty"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, "field 'prompt' is int"),
    ({**CHAT, "chosen": {"role": "robot", "content": "x"}}, "chosen\\[0\\].role is 'robot'"),
    ({**CHAT, "rejected": [{"role": "user", "content": "x"}]}, "field 'rejected' has no assistant message"),
    ({**CHAT, "chosen": "5."}, "field 'chosen' is not a non-empty list of messages"),
    ({**PLAIN, "prompt": "seven " * 40}, "the prompt alone is .* tokens, training.sequenceLength 32"),
], ids=["json", "missing", "not-text", "empty", "prompt-type", "role", "no-assistant", "mixed", "long-prompt"])
def test_a_malformed_record_is_named_by_file_and_line(tokenizer: Any, tmp_path: Path, record: Any, says: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [PLAIN, "", record])
    with pytest.raises(DatasetError, match=f"^{path}:3: {says}.*onBadRecord: skip"):
        list(read_pairs(_source(), path, tokenizer, 32))
    read = read_pairs(_source(onBadRecord="skip"), path, tokenizer, 32)
    assert (len(list(read)), read.skipped) == (1, 1) and read.first_skipped.startswith(f"{path}:3: ")


def test_chat_records_need_a_template(tokenizer: Any, tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"no chat template; give one in dataset\.chatTemplate"):
        list(read_pairs(DatasetSource(uri="x", format="preference"), write_jsonl(tmp_path / "d.jsonl", [CHAT]), tokenizer, 32))


def test_a_batch_is_the_chosen_sequences_then_the_rejected_ones(tokenizer: Any, tmp_path: Path) -> None:
    records = [PLAIN, {**PLAIN, "prompt": "Question: what is one plus one? Answer:", "chosen": " 2"},
               {**PLAIN, "rejected": " nine, surely."}]
    pairs = list(read_pairs(_source(), write_jsonl(tmp_path / "d.jsonl", records), tokenizer, 40))
    data = PackedDataset.build_pairs(pairs, tokenizer.pad_token_id, 40)
    data.save(tmp_path / "tokens-x.json")
    data = PackedDataset.load(tmp_path / "tokens-x.json")
    assert data.pairs and len(data) == 3
    batch = data.eval_batch(0, 0, 1, 2)
    width = max(len(ids) for pair in pairs[:2] for ids, _ in pair)
    assert batch["input_ids"].shape == (4, width)
    for row, (ids, learn) in enumerate([pairs[0][0], pairs[1][0], pairs[0][1], pairs[1][1]]):
        assert batch["input_ids"][row, : len(ids)].tolist() == ids
        assert batch["attention_mask"][row].tolist() == [1] * len(ids) + [0] * (width - len(ids))
        assert batch["labels"][row].tolist() == [t if f else -100 for t, f in zip(ids, learn, strict=True)] + \
            [-100] * (width - len(ids))
    past_the_end = data.eval_batch(1, 0, 1, 2)  # the third pair, then the first again, not counted
    assert (past_the_end["labels"][[1, 3]] == -100).all() and (past_the_end["labels"][[0, 2]] != -100).any()
    training, held_out = data.split(0.34, seed=1)
    assert (len(training), len(held_out)) == (2, 1) and training.pairs
    assert training.micro_batch(0, 0, 1, 2, seed=3)["input_ids"].shape[0] == 4


def test_the_loss_is_dpo_s_and_ipo_s_as_trl_writes_them() -> None:
    policy, reference = (torch.tensor([-3.0]), torch.tensor([-5.0])), (torch.tensor([-4.0]), torch.tensor([-4.5]))
    loss, chosen, rejected = dpo_loss(policy, reference, 0.1, "sigmoid", (torch.tensor([2]), torch.tensor([3])))
    assert chosen.item() == pytest.approx(0.1) and rejected.item() == pytest.approx(-0.05)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.1 * (1.0 + 0.5))))
    loss, *_ = dpo_loss(policy, reference, 0.1, "ipo", (torch.tensor([2]), torch.tensor([4])))
    assert loss.item() == pytest.approx((1.0 / 2 + 0.5 / 4 - 1 / 0.2) ** 2)
    same = (torch.tensor([-2.0]), torch.tensor([-7.0]))
    assert dpo_loss(same, same, 0.3, "sigmoid", (torch.tensor([1]), torch.tensor([1])))[0].item() == \
        pytest.approx(math.log(2))


def test_sequence_log_probabilities_ignore_everything_but_the_labels() -> None:
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[-100, 3, 4, -100, -100], [-100, -100, 7, 1, 2]])
    expected = [sum(float(torch.log_softmax(logits[r, t - 1], -1)[labels[r, t]]) for t in range(1, 5)
                    if labels[r, t] != -100) for r in range(2)]
    assert sequence_logps(logits, labels).tolist() == pytest.approx(expected, abs=1e-5)


def test_fresh_adapters_are_the_reference_and_only_they_learn(model_dir: Path, tokenizer: Any, tmp_path: Path) -> None:
    """With new LoRA adapters the policy is the base: loss ln 2, rewards 0; the gradient reaches
    the adapters alone, and one step on it prefers the chosen answers."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    records = [PLAIN, {"prompt": "Question: what is one times four? Answer:", "chosen": " 4.", "rejected": " 7."}]
    pairs = list(read_pairs(_source(), write_jsonl(tmp_path / "d.jsonl", records), tokenizer, 40))
    batch = PackedDataset.build_pairs(pairs, tokenizer.pad_token_id, 40).eval_batch(0, 0, 1, 2)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    loss, stats = preference_loss(model, adapters_off(model, model.disable_adapter), batch, 0.1, "sigmoid")
    metrics = step_metrics(stats)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert stats[0] == 2 and metrics["rewards/chosen"] == metrics["rewards/margins"] == 0
    loss.backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0} == \
        {n for n, p in model.named_parameters() if "lora_B" in n}
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 1.0 * p.grad
    after = step_metrics(preference_loss(model, adapters_off(model, model.disable_adapter), batch, 0.1, "sigmoid")[1])
    assert after["rewards/margins"] > 0 and after["rewards/accuracies"] == 1.0
