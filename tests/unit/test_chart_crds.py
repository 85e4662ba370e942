"""The chart ships the CRDs from crds/, the one source, byte for byte.

crds/ is generated from the spec models (tests/unit/operator checks that drift);
Helm installs charts/spillway/crds/. A copy that falls behind would install an
old schema that silently prunes new spec fields.
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "crds"
CHART_COPY = ROOT / "charts" / "spillway" / "crds"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.yaml"))}


def test_chart_crds_are_identical_to_crds_folder() -> None:
    source, copy = _files(SOURCE), _files(CHART_COPY)
    assert source, "crds/ holds no CRD"
    assert sorted(copy) == sorted(source), (
        f"charts/spillway/crds/ has {sorted(copy)}, crds/ has {sorted(source)}: cp crds/*.yaml charts/spillway/crds/"
    )
    stale = [name for name in source if copy[name] != source[name]]
    assert not stale, f"charts/spillway/crds/{stale} differ from crds/: cp crds/*.yaml charts/spillway/crds/"


def test_chart_crd_is_the_finetunejob_crd() -> None:
    docs = [yaml.safe_load(text) for text in _files(CHART_COPY).values()]
    names = {d["metadata"]["name"] for d in docs if d and d.get("kind") == "CustomResourceDefinition"}
    assert "finetunejobs.spillway.dev" in names
