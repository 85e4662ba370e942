"""The spec's building blocks: the base of every spec model, the names of tiers and dtypes,
the bounds of every free-form field, and sizes and counts as the wire carries them.

Where this sits: under `spec` and `spec_inputs`, which build the FineTuneJob from these.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, WithJsonSchema
from pydantic.alias_generators import to_camel

from spillway_runtime.core.units import COUNT_PATTERN, MAX_COUNT, MAX_SIZE, SIZE_PATTERN, parse_size

API_GROUP = "spillway.dev"
API_VERSION = "v1alpha1"
KIND = "FineTuneJob"

Tier = Literal["gpu", "cpu", "nvme"]
TierChoice = Literal["auto", "gpu", "cpu", "nvme"]
OffloadPolicy = Literal["auto", "none", "cpu", "nvme"]
DType = Literal["bf16", "fp16", "fp32"]
ActivationCheckpointing = Literal["auto", "on", "off"]


class SpecModel(BaseModel):
    """Base for every spec model: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
    )


# Bounds of every free-form string, list and map of the spec (the CRD and the API's OpenAPI
# are generated from these models): an unbounded one lets a single apply carry megabytes into
# the API server, the operator and the database, and makes the CEL cost estimator assume the
# worst of every rule that reads it.
MAX_URI = 2048  # a URI or a filesystem path
MAX_DNS_NAME = 253  # a DNS-1123 subdomain: StorageClass, claim, checkpoint names
MAX_FIELD = 256  # a JSON field name, a module name, a region, an experiment
MAX_LABEL_KEY = 317  # a Kubernetes label key: a 253-character prefix, '/', a 63-character name
MAX_LABEL_VALUE = 63
MAX_ITEMS = 64  # list items and map entries (tolerations, nodeSelector, targetModules)
# Seconds as Kubernetes types them (int32: Job.ttlSecondsAfterFinished); also what keeps a
# finish time plus a TTL inside Python's datetime (a TTL of 3e11 s overflowed it).
MAX_SECONDS = 2**31 - 1


# What the wire carries for a size or a count: an integer, or a string such as 500Gi or 13B
# (the models store the integer). The CRD spells these int-or-string.
SIZE_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "integer", "minimum": 0, "maximum": MAX_SIZE},
    {"type": "string", "pattern": SIZE_PATTERN + "|^auto$", "maxLength": 32},
    {"type": "null"},
]}
COUNT_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "integer", "minimum": 1, "maximum": MAX_COUNT},
    {"type": "string", "pattern": COUNT_PATTERN, "maxLength": 32},
    {"type": "null"},
]}
Size = Annotated[int | None, WithJsonSchema(SIZE_SCHEMA)]
Count = Annotated[int | None, WithJsonSchema(COUNT_SCHEMA)]


def size_or_none(value: Any) -> Any:
    if value is None or value == "auto":
        return None
    return parse_size(value)
