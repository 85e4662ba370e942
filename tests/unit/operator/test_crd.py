"""The committed CRD is exactly what the spec models generate, and it is structural."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from spillway_operator.crd import CRD_FILE, build_crd, render_crd_yaml

ROOT = Path(__file__).resolve().parents[3]


def test_committed_crd_matches_generated() -> None:
    committed = (ROOT / "crds" / CRD_FILE).read_text()
    assert committed == render_crd_yaml(), "crds/ is stale: regenerate with `python -m spillway_operator.cli crds -o crds`"


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
