"""What the data readers' unit tests share (test_sft, test_dpo): a tiny model's tokenizer and
a JSONL writer. A module may define its own `model_dir` (test_data does). And for the
operator's tests: its phase machine is strict (set before any test module builds its
OperatorSettings), so a phase change the table does not allow fails the test that made it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from spillway_runtime.tiny import build_tiny_model

os.environ["SPILLWAY_OPERATOR_STRICT_PHASES"] = "true"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", hidden_size=32, layers=2, heads=2)


@pytest.fixture()
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    """One line per record: a string as it is (a malformed line), anything else as JSON."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path
