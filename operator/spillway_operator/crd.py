"""The FineTuneJob CustomResourceDefinition, generated from the runtime's pydantic spec and status models.

Where this sits: imported by the operator's `crds` command and by the test that
keeps `crds/finetunejobs.spillway.dev.yaml` equal to what this module makes.
The pydantic models stay the single source; this module only translates JSON
Schema (draft 2020-12, as pydantic writes it) into the structural OpenAPI v3
subset that the API server accepts, and adds what JSON Schema cannot say:
CEL cross-field rules, immutable fields, printer columns, the status subresource. The status
schema comes from `spillway_runtime.core.status.FineTuneJobStatus` the same way.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from spillway_runtime.core.spec import POLICY_TIERS, FineTuneJobSpec
from spillway_runtime.core.spec_types import API_GROUP, API_VERSION, KIND, MAX_LABEL_KEY
from spillway_runtime.core.status import FineTuneJobStatus

PLURAL = "finetunejobs"
SINGULAR = "finetunejob"
SHORT_NAMES = ["ftj"]
CRD_NAME = f"{PLURAL}.{API_GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"

# Fields that the spec models parse from strings too ("13B", "500Gi"): on the wire
# they are integers or strings, which a structural schema spells int-or-string.
INT_OR_STRING_PATHS = {
    ("model", "parameterCount"),
    ("offload", "nvme", "size"),
    ("checkpoint", "size"),
}
# Raw maps whose keys we do not know: kept as written instead of pruned.
PRESERVE_UNKNOWN_PATHS = {("offload", "deepspeed")}

# CEL rules, attached at a path inside spec. Messages name the field, as kubectl shows them.
VALIDATIONS: dict[tuple[str, ...], list[dict[str, str]]] = {
    # A map's keys have no structural bound (propertyNames is not structural): the model's
    # label-key length, in CEL.
    ("resources", "nodeSelector"): [
        {
            "rule": f"self.all(key, size(key) <= {MAX_LABEL_KEY})",
            "message": f"resources.nodeSelector keys are label keys: at most {MAX_LABEL_KEY} characters",
        }
    ],
    ("training",): [
        {
            "rule": "!has(self.warmupSteps) || !has(self.maxSteps) || self.warmupSteps <= self.maxSteps",
            "message": "training.warmupSteps must not exceed training.maxSteps",
            "fieldPath": ".warmupSteps",
        }
    ],
    # The policy's allowed tiers (spec.Offload), so that kubectl apply refuses a contradiction.
    ("offload",): [
        {
            "rule": f"!has(self.policy) || self.policy != '{policy}' || "
            f"((!has(self.optimizer) || self.optimizer in {list(tiers)}) && "
            f"(!has(self.parameters) || self.parameters in {list(tiers)}))",
            "message": f"offload.optimizer or offload.parameters contradicts policy {policy!r}: "
            f"with it they may be one of {list(tiers)}",
            "fieldPath": ".policy",
        }
        for policy, tiers in POLICY_TIERS.items() if tiers != POLICY_TIERS["auto"]
    ] + [
        {
            "rule": "!has(self.cpuResidentFraction) || ((!has(self.optimizer) || self.optimizer in ['auto', 'nvme']) "
            "&& (!has(self.policy) || self.policy in ['auto', 'nvme']))",
            "message": "offload.cpuResidentFraction is the share of an NVMe optimizer kept in RAM: it needs "
            "optimizer auto or nvme and policy auto or nvme",
            "fieldPath": ".cpuResidentFraction",
        }
    ],
    ("resources",): [
        {
            "rule": "!has(self.cpuProcesses) || self.cpuProcesses <= 1 || !has(self.gpusPerNode) || self.gpusPerNode == 0",
            "message": "resources.cpuProcesses above 1 runs CPU processes: set gpusPerNode to 0 or drop cpuProcesses",
            "fieldPath": ".cpuProcesses",
        }
    ],
    ("model",): [
        {
            "rule": "self.uri == oldSelf.uri",
            "message": "model.uri is immutable: create a new FineTuneJob to train another model",
            "fieldPath": ".uri",
        }
    ],
}

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri", "priority": 0},
    {"name": "Plan", "type": "string", "jsonPath": ".status.plan.label"},
    {"name": "Step", "type": "string", "jsonPath": ".status.progress.stepDisplay"},
    {"name": "Loss", "type": "string", "jsonPath": ".status.progress.lossDisplay"},
    {"name": "Cost", "type": "string", "jsonPath": ".status.cost.display"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROP_KEYS = {"title", "additionalProperties", "$defs", "examples"}


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    target: dict[str, Any] = copy.deepcopy(defs[ref.rsplit("/", 1)[-1]])
    extra = {k: v for k, v in schema.items() if k != "$ref"}
    target.update(extra)
    return target


def _structural(schema: dict[str, Any], defs: dict[str, Any], path: tuple[str, ...], status: bool = False) -> dict[str, Any]:
    """One pydantic JSON Schema node -> one structural OpenAPI v3 node. `status`: a node of the
    status schema, which the operator and the runtime write, never a user: no defaults (the API
    server would fill in fields nobody wrote), nothing required but what a keyed list's entries
    require, and the models' open records (extra="allow") kept as written."""
    schema = _resolve(schema, defs)
    if not status and path in PRESERVE_UNKNOWN_PATHS:
        out: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        if "description" in schema:
            out["description"] = schema["description"]
        return out
    nullable = False
    if not status and path in INT_OR_STRING_PATHS:
        # An integer or a string (13B, 500Gi): the structural form has no union of the two.
        out = {"description": schema["description"]} if "description" in schema else {}
        return {**out, "x-kubernetes-int-or-string": True, "nullable": True}
    if "anyOf" in schema:
        options = [o for o in schema["anyOf"] if o.get("type") != "null"]
        nullable = len(options) < len(schema["anyOf"])
        if len(options) != 1:
            raise ValueError(f"{'.'.join(path)}: unions other than X | None have no structural form")
        outer = {k: v for k, v in schema.items() if k != "anyOf"}
        # The field's own words (its description) over its model's docstring
        schema = {**outer, **_resolve(options[0], defs), **outer} if status else {**outer, **_resolve(options[0], defs)}

    out = {}
    if "description" in schema:
        out["description"] = schema["description"]
    out["type"] = schema["type"]
    if nullable:
        out["nullable"] = True
    for key in ("enum", "minimum", "maximum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
                "minProperties", "maxProperties", *(("format",) if status else ())):
        if key in schema:
            out[key] = schema[key]
    # JSON Schema 2020-12 writes exclusive bounds as numbers; OpenAPI v3.0 as flags.
    if "exclusiveMinimum" in schema:
        out["minimum"] = schema["exclusiveMinimum"]
        out["exclusiveMinimum"] = True
    if "exclusiveMaximum" in schema:
        out["maximum"] = schema["exclusiveMaximum"]
        out["exclusiveMaximum"] = True
    if not status and "default" in schema and schema["default"] is not None and schema["default"] != {}:
        out["default"] = schema["default"]

    kind = schema.get("type")
    if kind == "object":
        _object(schema, defs, path, status, out)
    elif kind == "array":
        out["items"] = _structural(schema["items"], defs, (*path, "[]"), status)
        if status and schema.get("x-kubernetes-list-type") == "map":
            out["items"]["required"] = list(_resolve(schema["items"], defs).get("required", []))
    # What a model says only to Kubernetes (a keyed list, an open record), as it says it.
    out.update({k: copy.deepcopy(v) for k, v in schema.items() if k.startswith("x-kubernetes-")})
    if not status and path in VALIDATIONS:
        out["x-kubernetes-validations"] = copy.deepcopy(VALIDATIONS[path])
    return out


def _object(schema: dict[str, Any], defs: dict[str, Any], path: tuple[str, ...], status: bool,
            out: dict[str, Any]) -> None:
    """An object node's properties (or its map's values) into `out`."""
    props = schema.get("properties")
    extra = schema.get("additionalProperties")
    if not props:
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = _structural(extra, defs, (*path, "*"), status)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
        return
    out["properties"] = {name: _structural(sub, defs, (*path, name), status) for name, sub in props.items()}
    if status:
        if extra is True:  # an open record (extra="allow"): what another version wrote is kept
            out["x-kubernetes-preserve-unknown-fields"] = True
        return
    # Optional sub-objects (pydantic's default_factory) default to {} so that the
    # API server fills in their own defaults and `kubectl get -o yaml` shows them.
    for name, sub in out["properties"].items():
        optional = name not in schema.get("required", [])
        structured = sub.get("type") == "object" and "properties" in sub
        if optional and structured and not sub.get("nullable"):
            sub.setdefault("default", {})
    if schema.get("required"):
        out["required"] = list(schema["required"])


def status_schema() -> dict[str, Any]:
    """The status subresource's schema, from `FineTuneJobStatus`. The operator and the runtime
    own different parts of it (server-side apply keeps them apart); the chart's status policy
    (templates/status-policy.yaml) reads status.phase, status.plan and status.cost, which CEL
    sees only as far as the schema declares them."""
    raw = FineTuneJobStatus.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}), (), status=True)


def spec_schema() -> dict[str, Any]:
    raw = FineTuneJobSpec.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    return _structural(raw, defs, ())


def build_crd() -> dict[str, Any]:
    schema = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "spillway"}},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["spillway"],
            },
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    header = "# Generated by `spillway crds` from spillway_runtime.core.spec; do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=110)
