"""What a FineTuneJob reads: its model (`spec.model`) and its data (`spec.dataset`, with its
held-out part and mixture), as the spec's models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from spillway_runtime.core.param_counts import FAMILIES, config_problems
from spillway_runtime.core.spec_types import MAX_FIELD, MAX_URI, Count, DType, SpecModel
from spillway_runtime.core.units import parse_count


class ModelSource(SpecModel):
    """The model to fine-tune: a Hugging Face model directory."""

    uri: str = Field(
        description="Hugging Face model directory: s3://BUCKET/PREFIX; in a cluster pvc://CLAIM/PATH; with "
        "`spillway run` also a local path or file://PATH",
        min_length=1, max_length=MAX_URI,
    )
    dtype: DType = Field("bf16", description="Training precision of the weights and activations")
    tokenizer_uri: str | None = Field(None, max_length=MAX_URI,
                                      description="Tokenizer directory when it differs from the model's")
    parameter_count: Count = Field(
        None,
        description="Parameters, e.g. 13B: lets the operator plan before the model's config.json is readable",
    )

    config: dict[str, Any] | None = Field(
        None,
        description="The model's Hugging Face config.json, inline: the operator plans from its real shape "
        "(vocabulary, grouped-query attention, tied embeddings, every MoE expert) instead of guessing a "
        f"Llama shape from parameterCount. model_type one of: {', '.join(sorted(FAMILIES))}",
    )

    @field_validator("parameter_count", mode="before")
    @classmethod
    def _parse_count(cls, value: Any) -> Any:
        return None if value is None else parse_count(value)

    @field_validator("config")
    @classmethod
    def _config_gives_a_shape(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        problems = config_problems(value) if value is not None else []
        if value is None or not problems:
            return value
        # Raised as a ValidationError so that each error's path ends in the config key at fault
        # (spec.model.config.vocab_size), which pydantic joins onto the field's own path.
        raise ValidationError.from_exception_data("config", [
            InitErrorDetails(type=PydanticCustomError("missing" if p.field not in value else "model_config", p.message),
                             loc=(p.field,), input=value.get(p.field))
            for p in problems
        ])


DatasetFormat = Literal["auto", "jsonl", "text", "chat", "completion", "preference"]


class Validation(SpecModel):
    uri: str | None = Field(
        None, min_length=1, max_length=MAX_URI,
        description="A held-out file or directory in the dataset's format (s3://, pvc:// in a cluster; a local "
        "path or file:// with `spillway run`)",
    )
    fraction: float | None = Field(
        None, gt=0, le=0.5,
        description="Or: sequences of the training data held out (chosen with training.seed; never trained on)",
    )

    @model_validator(mode="after")
    def _one_source(self) -> Validation:
        if (self.uri is None) == (self.fraction is None):
            raise ValueError("give exactly one of validation.uri (a held-out file) and validation.fraction "
                             "(a share of the training data)")
        return self


MAX_MIXTURE = 16  # dataset.mixture entries
MAX_WEIGHT = 100.0  # a source's rows per epoch, in multiples of its rows


class MixtureSource(SpecModel):
    """One more dataset of a mixture."""

    uri: str = Field(min_length=1, max_length=MAX_URI,
                     description="Another dataset in the same format and fields as dataset.uri (s3://, pvc:// in a "
                     "cluster; a local path or file:// with `spillway run`)")
    weight: float = Field(1.0, gt=0, le=MAX_WEIGHT,
                          description="Its rows per epoch: weight x its rows (0.5: a half of them chosen with "
                          "training.seed; 2: each twice; 1.5: each once and a seeded half again)")


class DatasetSource(SpecModel):
    """The training data: where it is, its format, and how it is packed into sequences."""

    uri: str = Field(
        description="A .jsonl, .parquet, .arrow or .txt file (.jsonl.gz, .txt.gz gzip'ed), a folder of them, or a "
        "folder that Hugging Face "
        "datasets saved (save_to_disk; a DatasetDict's train split)", min_length=1, max_length=MAX_URI)
    format: DatasetFormat = Field(
        "auto",
        description="auto: text for .txt files, jsonl for the others; chat: JSON lines with OpenAI-style `messages`, "
        "the loss on assistant turns only; completion: JSON lines with a prompt and a completion, the loss on "
        "the completion only; preference: JSON lines with `prompt`, `chosen` and `rejected` (text, or chat messages "
        "rendered with the chat template; promptField, chosenField and rejectedField name other fields), for "
        "method.objective dpo",
    )
    text_field: str = Field("text", description="Field of each record (JSON line, Parquet or Arrow row) holding the text",
                            min_length=1,
                            max_length=MAX_FIELD)
    messages_field: str = Field("messages", min_length=1, max_length=MAX_FIELD,
                                description="chat: field holding the conversation")
    prompt_field: str = Field("prompt", min_length=1, max_length=MAX_FIELD,
                              description="completion and preference: field holding the prompt")
    completion_field: str = Field("completion", min_length=1, max_length=MAX_FIELD,
                                  description="completion: field holding the answer")
    chosen_field: str = Field("chosen", min_length=1, max_length=MAX_FIELD,
                              description="preference: field holding the preferred answer")
    rejected_field: str = Field("rejected", min_length=1, max_length=MAX_FIELD,
                                description="preference: field holding the rejected answer")
    chat_template: str | None = Field(
        None, min_length=1, max_length=65536,
        description="chat: a Jinja chat template, for a tokenizer without one (it replaces the tokenizer's)",
    )
    packing: bool = Field(
        True,
        description="chat and completion: pack whole conversations into each sequence, kept apart (positions "
        "restart, no token attends across); false: one per sequence, padded. text and jsonl always pack",
    )
    text_packing: Literal["joined", "apart"] = Field(
        "joined",
        description="text and jsonl: joined packs every text and its EOS back to back into sequences (attention "
        "and positions run across texts); apart packs whole texts kept apart as chat records are (positions "
        "restart, no token attends to another text; a text longer than a sequence is cut into pieces), at the "
        "cost of the padding at the end of each sequence",
    )
    on_bad_record: Literal["fail", "skip"] = Field(
        "fail",
        description="chat and completion: a malformed record ends the run naming file:line (fail), or is "
        "skipped and counted in the log (skip)",
    )
    validation: Validation | None = Field(
        None, description="Held-out data: its loss is evaluated every training.evalEverySteps and at the end"
    )
    weight: float = Field(1.0, gt=0, le=MAX_WEIGHT,
                          description="With a mixture: dataset.uri's rows per epoch, weight x its rows (as a "
                          "mixture entry's weight)")
    mixture: list[MixtureSource] = Field(
        default_factory=list, max_length=MAX_MIXTURE,
        description="More datasets trained on with dataset.uri, in its format and fields: each tokenized and packed "
        "on its own (no sequence mixes two), their rows taken per weight and shuffled together every epoch",
    )

    @model_validator(mode="after")
    def _fields_of_its_format(self) -> DatasetSource:
        if self.text_packing != "joined" and self.format not in ("auto", "text", "jsonl"):
            raise ValueError(f"textPacking applies to formats text, jsonl and auto, not {self.format!r}: "
                             f"{self.format} records are always kept apart; remove textPacking")
        if self.chat_template is not None and self.format not in ("chat", "preference"):
            raise ValueError(f"chatTemplate applies to formats chat and preference only, not {self.format!r}; "
                             "remove it or set format: chat")
        if (self.chosen_field, self.rejected_field) != ("chosen", "rejected") and self.format != "preference":
            raise ValueError(f"chosenField and rejectedField apply to format preference only, not {self.format!r}; "
                             "remove them or set format: preference")
        return self


# Steps are stored as 32-bit integers (the API's PostgreSQL columns): no run comes near it.
