"""Direct Preference Optimization (`method.objective: dpo`): preference records into token
pairs, and the loss of a micro-batch of pairs against the reference model.

Where this sits: beside `sft`, under `data` (which stores the pairs, [examples, 2, sequence],
and lays a micro-batch out as chosen rows then rejected rows) and `recipe` (which runs it).
It follows TRL's DPOTrainer (1.16), which the tests check it against, so that a TRL user's data
and numbers carry over:

- a record is `prompt`, `chosen`, `rejected`: three texts (an EOS is appended to each answer
  that lacks one, and `prompt + answer` is tokenized as one text), or a prompt of chat messages
  with the answers as an assistant message or a list of messages (rendered with the chat
  template: the prompt with its generation prompt, prompt + answer without);
- the answer starts where the tokenized prompt and the tokenized prompt + answer part;
- prompt + answer longer than `training.sequenceLength` keeps its start (TRL's `keep_start`):
  the answer's end is cut. A prompt that fills the sequence leaves nothing to compare and is a
  bad record (TRL drops it silently);
- the loss on the answers' tokens only; a sequence's log-probability is their sum;
- rewards are beta x (policy - reference) log-probabilities; `sigmoid` is the DPO paper's loss,
  `ipo` the IPO loss on per-token averages as TRL computes it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spillway_runtime.core.spec_inputs import DatasetSource
from spillway_runtime.training.dataset_files import RecordError, Records
from spillway_runtime.training.sft import checked_messages

FIELDS = ("prompt", "chosen", "rejected")  # TRL's columns; a job may name others (dataset.*Field)
# What a micro-batch's statistics hold, summed over its pairs (then over ranks and micro-batches):
# `pairs` counts them, the rest divided by it are TRL's logged means.
STATS = ("pairs", "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
         "logps/chosen", "logps/rejected")

Sequence = tuple[list[int], list[int]]  # token ids, 1 where the loss is learned (the answer)


Pair = tuple[Sequence, Sequence]  # (chosen, rejected)


class Pairs(Records[Pair]):
    """The preference records of `files` as (chosen, rejected) pairs, made as they are iterated
    (`Records`: a bad one refused by file:line, or skipped and counted)."""

    what = "preference records"

    def __init__(self, source: DatasetSource, files: list[Path], tokenizer: Any, sequence_length: int):
        if source.chat_template:
            tokenizer.chat_template = source.chat_template
        super().__init__(files, source.on_bad_record)
        self.tokenizer, self.sequence_length = tokenizer, sequence_length
        self.names = (source.prompt_field, source.chosen_field, source.rejected_field)

    def convert(self, record: Any) -> Pair:
        prompt, chosen, rejected = tokenize_pair(record, self.tokenizer, self.names)
        return fit_pair(prompt, chosen, rejected, self.sequence_length, self.names)


def tokenize_pair(record: Any, tokenizer: Any,
                  names: tuple[str, str, str] = FIELDS) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen answer ids, rejected answer ids), as TRL's DPOTrainer tokenizes them;
    `names`: the record's fields holding the prompt, the chosen and the rejected answer."""
    if not isinstance(record, dict) or any(name not in record for name in names):
        missing = [name for name in names if not isinstance(record, dict) or name not in record]
        raise RecordError(f"no field {missing[0]!r}: a preference record has {', '.join(map(repr, names))} "
                          "(dataset.promptField, chosenField and rejectedField name them)")
    prompt = record[names[0]]
    if isinstance(prompt, str):
        prompt_ids, chosen_full, rejected_full = _plain(record, tokenizer, names)
    elif isinstance(prompt, list):
        prompt_ids, chosen_full, rejected_full = _conversation(record, tokenizer, names)
    else:
        raise RecordError(f"field {names[0]!r} is {type(prompt).__name__}: give text or a list of messages")
    start = min(_common_prefix(prompt_ids, chosen_full), _common_prefix(prompt_ids, rejected_full))
    return prompt_ids[:start], chosen_full[start:], rejected_full[start:]


def _plain(record: dict[str, Any], tokenizer: Any,
           names: tuple[str, str, str]) -> tuple[list[int], list[int], list[int]]:
    for name in names:
        if not isinstance(record[name], str):
            raise RecordError(f"field {name!r} is {type(record[name]).__name__}, not text (the prompt is text)")
    for name in names[1:]:
        if not record[name].strip():
            raise RecordError(f"field {name!r} is empty: nothing to compare")
    eos = tokenizer.eos_token or ""
    answers = [a if a.endswith(eos) else a + eos for a in (record[names[1]], record[names[2]])]
    prompt = record[names[0]]
    return (tokenizer(prompt)["input_ids"], tokenizer(prompt + answers[0])["input_ids"],
            tokenizer(prompt + answers[1])["input_ids"])


def _conversation(record: dict[str, Any], tokenizer: Any,
                  names: tuple[str, str, str]) -> tuple[list[int], list[int], list[int]]:
    if not getattr(tokenizer, "chat_template", None):
        raise RecordError("the prompt is chat messages but the tokenizer has no chat template; give one in "
                          "dataset.chatTemplate")
    prompt = _messages(record[names[0]], names[0])
    answers = []
    for name in names[1:]:
        value = record[name]
        answer = _messages([value] if isinstance(value, dict) else value, name)
        if not any(m["role"] == "assistant" for m in answer):
            raise RecordError(f"field {name!r} has no assistant message: nothing to compare")
        answers.append(answer)

    def render(messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        try:
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja2's errors: a template that cannot render this conversation
            raise RecordError(f"the chat template cannot render it ({type(err).__name__}: {err})") from None
        return list(out["input_ids"])

    return render(prompt, True), render(prompt + answers[0], False), render(prompt + answers[1], False)


def _messages(value: Any, name: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RecordError(f"field {name!r} is not a non-empty list of messages (nor text, with a text prompt)")
    return checked_messages(value, name)


def _common_prefix(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        length += 1
    return length


def fit_pair(prompt: list[int], chosen: list[int], rejected: list[int], sequence_length: int,
             names: tuple[str, str, str] = FIELDS) -> tuple[Sequence, Sequence]:
    """Prompt + each answer, cut to the sequence from the end (TRL's keep_start)."""
    if len(prompt) >= sequence_length:
        raise RecordError(f"the prompt alone is {len(prompt)} tokens, training.sequenceLength {sequence_length}: "
                          "no answer token is left to compare; shorten the prompt or raise sequenceLength")
    out = []
    for name, answer in ((names[1], chosen), (names[2], rejected)):
        if not answer:
            raise RecordError(f"field {name!r} adds no token after the prompt: nothing to compare")
        ids = (prompt + answer)[:sequence_length]
        out.append((ids, ([0] * len(prompt) + [1] * len(answer))[:sequence_length]))
    return out[0], out[1]


# --- the loss ----------------------------------------------------------------------------


def sequence_logps(logits: Any, labels: Any) -> Any:
    """Per row, the summed log-probability of its labelled tokens (labels -100 elsewhere), in fp32."""
    import torch.nn.functional as F

    shifted = labels[:, 1:]
    per_token = -F.cross_entropy(logits[:, :-1].float().flatten(0, 1), shifted.flatten(), ignore_index=-100,
                                 reduction="none").view(shifted.shape)
    return per_token.sum(dim=1)


def dpo_loss(policy: tuple[Any, Any], reference: tuple[Any, Any], beta: float, kind: str,
             answer_tokens: tuple[Any, Any]) -> tuple[Any, Any, Any]:
    """Per pair: (loss, chosen reward, rejected reward) from the (chosen, rejected) log-probs of
    the policy and the reference; `answer_tokens` (chosen, rejected) normalise IPO's log-ratios."""
    import torch.nn.functional as F

    chosen_ratio = policy[0] - reference[0]
    rejected_ratio = policy[1] - reference[1]
    if kind == "sigmoid":
        loss = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    elif kind == "ipo":  # TRL: log-ratios averaged per answer token, (delta - 1/(2 beta))^2
        delta = chosen_ratio / answer_tokens[0].clamp(min=1) - rejected_ratio / answer_tokens[1].clamp(min=1)
        loss = (delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"method.dpoLoss {kind!r}: use sigmoid or ipo")
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def adapters_off(model: Callable[..., Any],
                 disable_adapter: Callable[[], contextlib.AbstractContextManager[Any]]) -> Callable[..., Any]:
    """LoRA's reference: `model` itself with its adapters switched off (PEFT's `disable_adapter`),
    so that no second copy of the weights is held."""
    def forward(**inputs: Any) -> Any:
        with disable_adapter():
            return model(**inputs)
    return forward


def preference_loss(model: Callable[..., Any], reference: Callable[..., Any],
                    inputs: dict[str, Any], beta: float, kind: str) -> tuple[Any, Any]:
    """The DPO loss of one micro-batch of pairs (`data.pair_inputs`' layout: chosen rows, then
    rejected rows), averaged over its pairs, and its statistics summed (`STATS`). The reference
    forward runs first, without gradients: `reference` is the model with its adapters off
    (LoRA, `adapters_off`) or a frozen copy of the base (full fine-tuning); the policy's
    follows, so that backward comes straight after it. Pairs without a learned token (an
    evaluation's padding past the end) count for nothing."""
    import torch

    model_inputs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    with torch.no_grad():
        ref = sequence_logps(reference(**model_inputs).logits, inputs["labels"])
    policy = sequence_logps(model(**model_inputs).logits, inputs["labels"])
    tokens = (inputs["labels"] != -100).sum(dim=1)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    counted = ((chosen_tokens > 0) & (rejected_tokens > 0)).to(policy.dtype)
    loss, chosen_reward, rejected_reward = dpo_loss(policy.chunk(2), ref.chunk(2), beta, kind,
                                                    (chosen_tokens, rejected_tokens))
    pairs = counted.sum()
    mean = (loss * counted).sum() / pairs.clamp(min=1)
    policy_chosen, policy_rejected = policy.detach().chunk(2)
    stats = torch.stack([(value * counted).sum() for value in (
        torch.ones_like(counted), loss.detach(), chosen_reward, rejected_reward,
        (chosen_reward > rejected_reward).to(policy.dtype), chosen_reward - rejected_reward,
        policy_chosen, policy_rejected)]).double()
    return mean, stats


def step_metrics(stats: Any, prefix: str = "") -> dict[str, float]:
    """TRL's logged means from summed statistics (`STATS`); `prefix` eval_ for held-out data."""
    pairs = float(stats[0])
    return {f"{prefix}{name}": (float(value) / pairs if pairs else math.nan)
            for name, value in zip(STATS[2:], stats[2:].tolist(), strict=True)}


def frozen_reference(model_dir: str, torch_dtype: Any, config: dict[str, Any], policy_hf_config: Any) -> Any:
    """DPO with full fine-tuning: a frozen copy of the base as the reference, as TRL's
    `prepare_deepspeed` makes it, from `config` (`dsconfig.reference_config`): under ZeRO-3 an
    engine of its own without an optimizer, its weights partitioned and offloaded where the
    plan keeps the parameters (on NVMe in a folder of its own); under the other stages the
    whole base on the device. Never checkpointed: it is the base, read again on every start.
    `policy_hf_config` is the policy's HfDeepSpeedConfig (ZeRO-3), made current again after."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    stage3 = (config.get("zero_optimization") or {}).get("stage") == 3
    loading = None
    if stage3:  # zero.Init partitions the copy as it loads, with the reference's offload settings
        from transformers.integrations.deepspeed import HfDeepSpeedConfig, set_hf_deepspeed_config

        loading = HfDeepSpeedConfig(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    finally:
        if stage3:
            set_hf_deepspeed_config(policy_hf_config)
            del loading
    model.config.use_cache = False
    model.requires_grad_(False)
    reference, *_ = deepspeed.initialize(model=model, config=config)
    reference.eval()
    return reference
