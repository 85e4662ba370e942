"""`spillway run` on bad input: a corpus of malformed jobs and input files across the spec,
the model directory, the tokenizer, the dataset and the raw DeepSpeed settings. Each one
ends with exit 2 and one message that names the field or the file (and line) to fix; none
with a traceback, and none with exit 1.

Most are found before training starts, and run in this process (typer's runner) for speed;
those only the training process can find (a tokenizer or weights that do not load, a
dataset line) run the real command, as a user would."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from spillway_api.cli import build_app

from .conftest import job_document

pytestmark = pytest.mark.integration


def _edit(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    node = doc["spec"]
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return doc


def _broken_copy(src: Path, dst: Path, name: str, content: bytes | None) -> Path:
    """A copy of the model directory with one file replaced (None: removed)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != name:
            (dst / f.name).write_bytes(f.read_bytes())
    if content is not None:
        (dst / name).write_bytes(content)
    return dst


# Each case: what is wrong, how to make it (tmp dir, tiny model dir, dataset -> job file),
# and a part of the message. Cases marked RUNTIME are found by the training process.
Case = tuple[str, Callable[[Path, Path, Path], Path], str]


def _job(tmp: Path, doc: dict[str, Any] | str) -> Path:
    path = tmp / "job.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def _spec_case(path: str, value: Any) -> Callable[[Path, Path, Path], Path]:
    return lambda tmp, model, data: _job(tmp, _edit(job_document("bad", model, data), path, value))


def _dataset_case(content: bytes, name: str = "bad.jsonl", **dataset: Any) -> Callable[[Path, Path, Path], Path]:
    def make(tmp: Path, model: Path, data: Path) -> Path:
        (tmp / name).write_bytes(content)
        doc = job_document("bad", model, tmp / name)
        doc["spec"]["dataset"].update(dataset)
        return _job(tmp, doc)
    return make


def _model_case(name: str, content: bytes | None) -> Callable[[Path, Path, Path], Path]:
    return lambda tmp, model, data: _job(tmp, job_document("bad", _broken_copy(model, tmp / "m", name, content), data))


def _tokenizer_case(files: dict[str, bytes]) -> Callable[[Path, Path, Path], Path]:
    def make(tmp: Path, model: Path, data: Path) -> Path:
        tok = tmp / "tok"
        tok.mkdir()
        for name, content in files.items():
            (tok / name).write_bytes(content)
        return _job(tmp, _edit(job_document("bad", model, data), "model.tokenizerUri", str(tok)))
    return make


def _ds(overrides: dict[str, Any]) -> Callable[[Path, Path, Path], Path]:
    return _spec_case("offload.deepspeed", overrides)


BEFORE_TRAINING: list[Case] = [
    ("not YAML", lambda tmp, m, d: _job(tmp, "spec: [unclosed\n"), "not valid YAML"),
    ("no FineTuneJob in the file", lambda tmp, m, d: _job(tmp, "kind: Deployment\n"), "FineTuneJob"),
    ("an empty file", lambda tmp, m, d: _job(tmp, ""), "FineTuneJob"),
    ("the job file is a directory", lambda tmp, m, d: tmp, "cannot read the file"),
    ("no model", lambda tmp, m, d: _job(tmp, {**job_document("bad", m, d), "spec": {
        k: v for k, v in job_document("bad", m, d)["spec"].items() if k != "model"}}), "spec.model"),
    ("maxSteps as a word", _spec_case("training.maxSteps", "ten"), "spec.training.maxSteps"),
    ("a misspelt field", _spec_case("trainig", {"maxSteps": 3}), "spec.trainig"),
    ("a negative learning rate", _spec_case("training.learningRate", -1), "spec.training.learningRate"),
    ("an https dataset", _spec_case("dataset.uri", "https://example.org/d.jsonl"), "unsupported URI scheme 'https'"),
    ("a model directory that does not exist", _spec_case("model.uri", "/nonexistent/model"), "spec.model.uri"),
    ("a dataset that does not exist", _spec_case("dataset.uri", "/nonexistent/d.jsonl"), "spec.dataset.uri"),
    ("a tokenizer directory that does not exist", _spec_case("model.tokenizerUri", "/nonexistent/tok"),
     "spec.model.tokenizerUri"),
    ("a model directory without config.json", _model_case("config.json", None), "config.json"),
    ("config.json that is not JSON", _model_case("config.json", b"{not json"), "config.json"),
    ("config.json of an unknown architecture", _model_case("config.json", b'{"model_type": "no-such-arch"}'), "config.json"),
    ("zero_optimization as a string", _ds({"zero_optimization": "stage3"}), "offload.deepspeed.zero_optimization is str"),
    ("the ZeRO stage as a word", _ds({"zero_optimization": {"stage": "three"}}), "zero_optimization"),
    ("train_batch_size against the batch settings", _ds({"train_batch_size": 999}), "offload.deepspeed.train_batch_size"),
    ("an unknown aio setting", _ds({"aio": {"turbo": True}}), "unknown aio keys"),
    ("NVMe with ZeRO stage 2", _ds({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}),
     "stage"),
    ("bf16 as a scalar", _ds({"bf16": True}), "offload.deepspeed.bf16 is bool"),
    ("an unknown dataset format", _spec_case("dataset.format", "parquet"), "spec.dataset.format"),
    ("a chat template for text data", _spec_case("dataset.chatTemplate", "{{ messages }}"), "chatTemplate applies"),
    ("bad records neither failed nor skipped", _spec_case("dataset.onBadRecord", "ignore"), "spec.dataset.onBadRecord"),
]

IN_TRAINING: list[Case] = [
    # One dataset case of each reader (text, and chat records) takes the path from the
    # training process's data reader to exit 2 and the failed event; the readers' other
    # refusals (not UTF-8, no text field, an empty file, a completion, a chat template) are
    # tests/unit/test_data.py's and tests/unit/test_sft.py's, with the same messages.
    ("a dataset line that is not JSON", _dataset_case(b'{"text": "ok"}\n{"text": \n'), "bad.jsonl:2: not valid JSON"),
    ("a chat line with an unknown role", _dataset_case(
        b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
        b'{"messages": [{"role": "wizard", "content": "hi"}]}\n',
        format="chat", chatTemplate="{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"),
     "bad.jsonl:2: messages[0].role is 'wizard'"),
    ("truncated weights", _model_case("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}"), "model.uri"),
    ("a tokenizer directory without a tokenizer", _tokenizer_case({"README": b"nothing here"}), "tokenizer"),
    ("a tokenizer.json that is not JSON", _tokenizer_case({"tokenizer.json": b"{broken",
                                                          "tokenizer_config.json": b"{}"}), "tokenizer"),
]
# Found by the readers, tested there with these messages (tests/unit): counted in the corpus.
IN_THE_READERS = ["a dataset that is not UTF-8", "a dataset line without the text field", "an empty dataset",
                  "a completion line without its completion",
                  "chat data for a tokenizer without a chat template"]


def test_the_corpus_is_large_enough() -> None:
    assert len(BEFORE_TRAINING) + len(IN_TRAINING) + len(IN_THE_READERS) >= 30


@pytest.fixture(autouse=True)
def _own_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPILLWAY_DATABASE_URL", f"sqlite:///{tmp_path / 'spillway.db'}")


@pytest.mark.parametrize(("make", "expected"), [c[1:] for c in BEFORE_TRAINING], ids=[c[0] for c in BEFORE_TRAINING])
def test_bad_input_found_before_training_exits_2_naming_it(
    make: Callable[[Path, Path, Path], Path], expected: str, tmp_path: Path, tiny_model: dict[str, Path]
) -> None:
    job = make(tmp_path, tiny_model["model"], tiny_model["data"])
    result = CliRunner().invoke(build_app(), ["run", str(job), "--run-dir", str(tmp_path / "run")])
    output = result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, output
    assert "Traceback" not in output, output
    assert expected in output, output
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(("make", "expected"), [c[1:] for c in IN_TRAINING], ids=[c[0] for c in IN_TRAINING])
def test_bad_input_found_in_training_exits_2_naming_it(
    make: Callable[[Path, Path, Path], Path], expected: str, tmp_path: Path, tiny_model: dict[str, Path]
) -> None:
    job = make(tmp_path, tiny_model["model"], tiny_model["data"])
    result = subprocess.run([sys.executable, "-m", "spillway_api.cli", "run", str(job), "--run-dir", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "300"})
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert expected in output, output[-4000:]
    failed = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()
              if '"failed"' in line]
    assert failed and expected in failed[-1]["reason"]


def test_a_refused_rerun_leaves_the_earlier_run_as_it_was(tmp_path: Path, tiny_model: dict[str, Path]) -> None:
    """`spillway run` again with the same job name and a mistake: refused with exit 2, and
    the earlier run's record (Succeeded, its spec, its progress and history) is untouched;
    the refusal used to turn it into Failed."""
    good = _job(tmp_path, job_document("same", tiny_model["model"], tiny_model["data"], training={"maxSteps": 2}))
    done = subprocess.run([sys.executable, "-m", "spillway_api.cli", "run", str(good), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    database = tmp_path / "spillway.db"

    def record() -> tuple[Any, ...]:
        with sqlite3.connect(database) as db:
            job = db.execute("SELECT phase, message, spec, progress, exit_code, run_dir FROM jobs "
                             "WHERE name = 'same'").fetchone()
            transitions = db.execute("SELECT count(*) FROM transitions").fetchone()
        return job, transitions

    before = record()
    assert before[0][0] == "Succeeded"
    bad_dir = tmp_path / "again"
    bad_dir.mkdir()
    bad = _job(bad_dir, job_document("same", tiny_model["model"], bad_dir / "missing.jsonl"))
    refused = CliRunner().invoke(build_app(), ["run", str(bad), "--run-dir", str(tmp_path / "run")])
    assert refused.exit_code == 2 and "spec.dataset.uri" in refused.output, refused.output
    assert record() == before
