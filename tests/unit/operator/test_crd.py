"""The committed CRD is exactly what the spec models generate, and it is structural."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from spillway_operator.crd import CRD_FILE, build_crd, render_crd_yaml
from spillway_operator.reference import render_reference_markdown

ROOT = Path(__file__).resolve().parents[3]


def test_committed_crd_matches_generated() -> None:
    committed = (ROOT / "crds" / CRD_FILE).read_text()
    assert committed == render_crd_yaml(), "crds/ is stale: regenerate with `python -m spillway_operator.cli crds -o crds`"


def test_committed_reference_matches_generated() -> None:
    """docs/finetunejob.md is every field of the CRD and the phase machine, as generated."""
    committed = (ROOT / "docs" / "finetunejob.md").read_text()
    assert committed == render_reference_markdown(), (
        "docs/finetunejob.md is stale: regenerate with `spillway crds -o crds --reference docs/finetunejob.md`")


def test_every_spec_field_is_described_in_the_reference() -> None:
    """A user reading the reference finds words for every field they can set (a list's or a
    map's scalar entries are described by the list or map)."""
    rows = [line.split(" | ") for line in render_reference_markdown().splitlines() if line.startswith("| `spec.")]
    assert len(rows) > 100
    bare = [row[0] for row in rows if not row[-1].strip(" |") and not row[0].endswith(("[]`", ".*`"))]
    assert bare == []


def _walk(node: Any, path: str = "") -> list[str]:
    problems = []
    if isinstance(node, dict):
        for bad in ("$ref", "anyOf", "$defs", "title", "const"):
            if bad in node:
                problems.append(f"{path}: {bad}")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{path}: properties with additionalProperties")
        for k, v in node.items():
            problems += _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            problems += _walk(v, f"{path}[{i}]")
    return problems


def test_schema_is_structural() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []
    spec = schema["properties"]["spec"]["properties"]
    assert spec["offload"]["properties"]["deepspeed"]["x-kubernetes-preserve-unknown-fields"] is True
    assert spec["model"]["properties"]["parameterCount"]["x-kubernetes-int-or-string"] is True
    assert spec["model"]["properties"]["tokenizerUri"]["nullable"] is True
    budget = spec["budget"]["properties"]["maxCostUSD"]
    assert budget["exclusiveMinimum"] is True and budget["minimum"] == 0
    rules = json.dumps(spec["training"]["x-kubernetes-validations"])
    assert "warmupSteps" in rules


def test_printer_columns_and_names() -> None:
    crd = yaml.safe_load(render_crd_yaml())
    version = crd["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase",
        "Model",
        "Plan",
        "Step",
        "Loss",
        "Cost",
        "Age",
    ]
    assert version["subresources"] == {"status": {}}
    assert crd["spec"]["names"]["shortNames"] == ["ftj"]
