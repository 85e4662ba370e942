"""Supervised fine-tuning records: chat conversations and prompt/completion pairs, turned
into token ids with a loss mask (learn the assistant's turns, or the completion, only).

Where this sits: under `data` (which packs what this returns), beside `spec`. Each record
becomes one document: (token ids, 1 where the loss is learned, else 0), never longer than
a sequence. A malformed record is a `DatasetError` naming file:line, or, with
`dataset.onBadRecord: skip`, counted and left out.

Chat rendering needs only the tokenizer's `apply_chat_template`: the conversation is
rendered prefix by prefix, so each assistant turn is the text its prefix's generation
prompt leads to (what the model learns to write), and everything else (system and user
turns, the template's role headers) is context. A template that does not render a
conversation as a growth of its prefixes is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spillway_runtime.core.spec_inputs import DatasetSource
from spillway_runtime.training.dataset_files import DatasetError, RecordError, Records

ROLES = ("system", "user", "assistant", "tool")


Document = tuple[list[int], list[int]]  # token ids, 1 where the loss is learned


class Documents(Records[Document]):
    """The chat or completion records of `files` as documents, made as they are iterated
    (`Records`: a bad one refused by file:line, or skipped and counted)."""

    def __init__(self, source: DatasetSource, files: list[Path], tokenizer: Any, sequence_length: int):
        if source.format == "chat" and source.chat_template:
            tokenizer.chat_template = source.chat_template
        if source.format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise DatasetError("dataset.format chat: the tokenizer has no chat template; give one in dataset.chatTemplate")
        super().__init__(files, source.on_bad_record)
        self.source, self.tokenizer, self.sequence_length = source, tokenizer, sequence_length
        self.what = f"{source.format} records"

    def convert(self, record: Any) -> Document:
        ids, learn = (_chat(self.source, record, self.tokenizer) if self.source.format == "chat"
                      else _completion(self.source, record, self.tokenizer))
        return _fit(ids, learn, self.sequence_length)


def _fit(ids: list[int], learn: list[int], sequence_length: int) -> tuple[list[int], list[int]]:
    ids, learn = ids[:sequence_length], learn[:sequence_length]
    if not any(learn[1:]):  # the first token of a document is never predicted
        raise RecordError(f"nothing to learn within training.sequenceLength ({sequence_length} tokens): the "
                          "answer starts after the cut; shorten the record or raise sequenceLength")
    return ids, learn


def _text(record: Any, name: str, what: str) -> str:
    if not isinstance(record, dict) or name not in record:
        raise RecordError(f"no field {name!r} ({what})")
    value = record[name]
    if not isinstance(value, str):
        raise RecordError(f"field {name!r} is {type(value).__name__}, not text")
    return value


def _encode(tokenizer: Any, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    learn: list[int] = []
    for text, flag in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids.extend(piece)
        learn.extend([flag] * len(piece))
    return ids, learn


def _completion(source: DatasetSource, record: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
    prompt = _text(record, source.prompt_field, "set dataset.promptField to the field holding the prompt")
    answer = _text(record, source.completion_field,
                   "set dataset.completionField to the field holding the completion")
    if not answer.strip():
        raise RecordError(f"field {source.completion_field!r} is empty: nothing to learn")
    ids, learn = _encode(tokenizer, [(prompt, 0), (answer, 1)])
    if tokenizer.eos_token_id is not None:  # learn to stop
        ids.append(tokenizer.eos_token_id)
        learn.append(1)
    return ids, learn


def _messages(source: DatasetSource, record: Any) -> list[dict[str, str]]:
    if not isinstance(record, dict) or source.messages_field not in record:
        raise RecordError(f"no field {source.messages_field!r}; set dataset.messagesField to the field holding "
                          "the conversation")
    messages = record[source.messages_field]
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"field {source.messages_field!r} is not a non-empty list of messages")
    checked = checked_messages(messages, source.messages_field)
    if not any(m["role"] == "assistant" for m in checked):
        raise RecordError(f"{source.messages_field} has no assistant message: nothing to learn")
    return checked


def checked_messages(messages: list[Any], name: str) -> list[dict[str, str]]:
    """Each message a known role and text content (RecordError naming `name[i]` otherwise),
    as plain role/content dicts."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else None
            raise RecordError(f"{name}[{i}].role is {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise RecordError(f"{name}[{i}].content is {type(message.get('content')).__name__}, not text")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _chat(source: DatasetSource, record: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
    messages = _messages(source, record)

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            text = tokenizer.apply_chat_template(messages[:upto], tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja2's errors: a template that cannot render this conversation
            raise RecordError(f"the chat template cannot render it ({type(err).__name__}: {err})") from None
        return str(text)

    pieces: list[tuple[str, int]] = []
    done = ""
    for k, message in enumerate(messages, 1):
        full = render(k, False)
        if message["role"] == "assistant":
            lead = render(k - 1, True)
            if not (lead.startswith(done) and full.startswith(lead)):
                raise _not_incremental(k)
            pieces += [(lead[len(done):], 0), (full[len(lead):], 1)]
        else:
            if not full.startswith(done):
                raise _not_incremental(k)
            pieces.append((full[len(done):], 0))
        done = full
    return _encode(tokenizer, pieces)


def _not_incremental(k: int) -> RecordError:
    return RecordError(f"the chat template renders the first {k} messages as something other than the first "
                       f"{k - 1} plus more (it rewrites earlier turns), so the assistant's turns cannot be found; "
                       "give dataset.chatTemplate one that renders each turn in place")
