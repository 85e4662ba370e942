"""Every string, number, list and map a user sends is bounded: in the CRD's schema (what the
API server enforces on `kubectl apply`) and in the REST API's OpenAPI request schemas (what
the API enforces on POST), both generated from the spec models. An unbounded field lets one
request carry megabytes into the API server, the operator and the database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway_api.main import create_app
from spillway_api.settings import Settings
from spillway_operator.crd import build_crd
from spillway_runtime.core.spec import parse_job

# Free maps by design, their size bounded by the request's (the API's body limit, the API
# server's): raw DeepSpeed overrides (merged last, then checked against the plan) and the
# model's config.json inline (its own nested JSON, checked by param_counts.config_problems).
FREE_MAPS = (".offload.deepspeed", ".model.config")
# POST /v1/plan's measured inputs: a machine as `spillway probe` prints it and Kubernetes Node
# objects, which the planner reads as measurements; bounded by the API's 1 MiB body limit
# (413, tests/integration/api/test_jobs_api.py), not field by field.
MEASURED = ("POST /v1/plan body.hardware", "POST /v1/plan body.nodes")


def unbounded(schema: dict[str, Any], path: str, resolve: Any, seen: set[str] | None = None) -> list[str]:
    """The paths under ``schema`` whose values have no upper bound."""
    seen = set() if seen is None else seen
    if "$ref" in schema:
        if schema["$ref"] in seen:
            return []
        seen = seen | {schema["$ref"]}
        schema = resolve(schema["$ref"])
    if path.endswith(FREE_MAPS) or path.startswith(MEASURED):
        return []
    found: list[str] = []
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key, []):
            found += unbounded(option, path, resolve, seen)
    kind = schema.get("type")
    # An enum, a constant or a date-time (parsed whole, or refused) has no length to bound.
    bounded_value = "enum" in schema or "const" in schema or schema.get("format") == "date-time"
    if kind == "string" and not bounded_value and "maxLength" not in schema:
        found.append(f"{path}: string without maxLength")
    if kind in ("integer", "number") and not bounded_value and "maximum" not in schema and "exclusiveMaximum" not in schema:
        found.append(f"{path}: {kind} without maximum")
    if kind == "array":
        if "maxItems" not in schema:
            found.append(f"{path}: array without maxItems")
        found += unbounded(schema.get("items", {}), f"{path}[]", resolve, seen)
    for name, sub in (schema.get("properties") or {}).items():
        found += unbounded(sub, f"{path}.{name}", resolve, seen)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict) and extra:
        if "maxProperties" not in schema:
            found.append(f"{path}: map without maxProperties")
        found += unbounded(extra, f"{path}.*", resolve, seen)
    elif extra is True or schema.get("x-kubernetes-preserve-unknown-fields"):
        found.append(f"{path}: free map")
    return found


def test_the_walk_finds_what_is_unbounded_at_any_depth() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "array", "maxItems": 2, "items": {"$ref": "#/s"}},
        "m": {"type": "object", "additionalProperties": {"type": "integer", "maximum": 3}},
    }}
    resolve = {"#/s": {"type": "object", "properties": {"name": {"type": "string"}}}}.__getitem__
    assert unbounded(schema, "spec", resolve) == ["spec.a[].name: string without maxLength",
                                                  "spec.m: map without maxProperties"]


def test_every_field_of_the_crd_spec_is_bounded() -> None:
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert unbounded(spec, "spec", resolve=None) == []


def test_every_field_the_rest_api_accepts_is_bounded(tmp_path: Path) -> None:
    openapi = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'db'}", data_dir=tmp_path)).openapi()
    components = openapi["components"]["schemas"]

    def resolve(ref: str) -> dict[str, Any]:
        return dict(components[ref.rsplit("/", 1)[1]])

    found: list[str] = []
    for route, methods in openapi["paths"].items():
        for method, operation in methods.items():
            for parameter in operation.get("parameters", []):
                found += unbounded(parameter["schema"], f"{method.upper()} {route} ?{parameter['name']}", resolve)
            for media in operation.get("requestBody", {}).get("content", {}).values():
                found += unbounded(media["schema"], f"{method.upper()} {route} body", resolve)
    assert found == []


@pytest.mark.parametrize("field, value, named", [
    ("ttlSecondsAfterFinished", 300_000_000_000, "ttlSecondsAfterFinished"),
    ("training", {"seed": 2**32}, "training.seed"),
    ("model", {"uri": "/m" * 2000}, "model.uri"),
    ("resources", {"nodeSelector": {f"k{i}": "v" for i in range(65)}}, "resources.nodeSelector"),
])
def test_an_out_of_bounds_value_is_refused_naming_the_field(field: str, value: Any, named: str) -> None:
    job = yaml.safe_load("""
        apiVersion: spillway.dev/v1alpha1
        kind: FineTuneJob
        metadata: {name: bounds}
        spec: {model: {uri: /m}, dataset: {uri: /d.jsonl}}
    """)
    job["spec"][field] = value if not isinstance(value, dict) else {**job["spec"].get(field, {}), **value}
    with pytest.raises(Exception) as refused:
        parse_job(job)
    assert f"spec.{named}" in str(refused.value)

