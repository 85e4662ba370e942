"""Evaluation on held-out data: its loss every `evalEverySteps` and at the end, from rows
never trained on, and without changing training: the losses of a run that evaluates every
3 steps are bit-equal to one that evaluates only at the end, and a run restarted from a
checkpoint reports the same training and held-out losses as the uninterrupted one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway_runtime.checkpoints.store import checkpoint_name

from .conftest import run_job
from .test_exact_resume import copy_checkpoint

pytestmark = pytest.mark.integration

STEPS = 12


def _job(make_job: Any, name: str, every: int) -> Path:
    path = make_job(name, training={"maxSteps": STEPS, "evalEverySteps": every, "microBatchSize": 2},
                    checkpoint={"everySteps": 3, "keep": 5}, offload={"policy": "cpu"})
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["dataset"]["validation"] = {"fraction": 0.1}
    path.write_text(yaml.safe_dump(doc))
    return path


def _evals(run: Any) -> dict[int, float]:
    return {e["step"]: e["eval_loss"] for e in run.of("eval")}


def test_evaluation_reports_held_out_loss_and_leaves_training_as_it_was(tmp_path: Path, make_job: Any) -> None:
    every = run_job(_job(make_job, "every", 3), tmp_path / "every")
    assert every.returncode == 0, every.log[-3000:]
    end_only = run_job(_job(make_job, "end", 0), tmp_path / "end")
    assert end_only.returncode == 0, end_only.log[-3000:]

    assert every.losses() == end_only.losses() and len(every.losses()) == STEPS
    evals = _evals(every)
    assert sorted(evals) == [3, 6, 9, 12] and _evals(end_only) == {12: evals[12]}
    assert evals[12] < 0.8 * evals[3], evals
    [first] = every.of("eval")[:1]
    assert first["tokens"] > 0 and first["perplexity"] == pytest.approx(2.718281828 ** first["eval_loss"], rel=1e-6)
    assert "sequences held out" in every.log
    # Checkpoints at evaluated steps carry their held-out loss (what checkpoint.keepBest ranks by).
    assert {c["step"]: c.get("evalLoss") for c in every.of("checkpoint")} == evals

    # restarted from the step-6 checkpoint (what a SIGKILL leaves behind is the same whatever the
    # run does: tests/integration/test_exact_resume.py kills runs)
    copy_checkpoint(every.run_dir, tmp_path / "restarted", checkpoint_name(6))
    resumed = run_job(_job(make_job, "restarted", 3), tmp_path / "restarted")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert resumed.of("resumed")[-1]["step"] == 6
    assert resumed.losses() == {s: loss for s, loss in every.losses().items() if s > 6}
    assert _evals(resumed) == {s: loss for s, loss in evals.items() if s > 6}


def test_a_validation_file_is_evaluated_and_its_bad_line_named(tmp_path: Path, make_job: Any,
                                                                tiny_model: dict[str, Path]) -> None:
    held_out = tmp_path / "held-out.jsonl"
    lines = tiny_model["data"].read_text().splitlines()
    held_out.write_text("\n".join(lines[:60]) + "\n")
    path = make_job("file", training={"maxSteps": 4, "evalEverySteps": 2}, offload={"policy": "cpu"})
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["dataset"]["validation"] = {"uri": str(held_out)}
    path.write_text(yaml.safe_dump(doc))
    run = run_job(path, tmp_path / "file")
    assert run.returncode == 0, run.log[-3000:]
    assert sorted(_evals(run)) == [2, 4] and f"sequences from {held_out}" in run.log
    held_out.write_text(lines[0] + "\n" + '{"body": "no text field"}\n')
    bad = run_job(path, tmp_path / "bad")
    assert bad.returncode == 2, bad.log[-3000:]
    assert f"{held_out}:2: no field 'text'" in bad.log


def test_early_stopping_ends_the_run_at_the_evaluation_that_ran_out_of_patience_and_resumes_to_the_same(
        tmp_path: Path, make_job: Any) -> None:
    # minDelta 5: no later evaluation improves on the step-3 one by that much, so patience 1
    # runs out at the step-6 evaluation (the held-out loss falls less than 5 in 3 steps).
    def stopping(name: str) -> Path:
        path = _job(make_job, name, 3)
        doc = yaml.safe_load(path.read_text())
        doc["spec"]["training"]["earlyStopping"] = {"patience": 1, "minDelta": 5.0}
        path.write_text(yaml.safe_dump(doc))
        return path

    run = run_job(stopping("stops"), tmp_path / "stops")
    assert run.returncode == 0, run.log[-3000:]
    assert sorted(run.losses()) == list(range(1, 7)) and sorted(_evals(run)) == [3, 6]
    [stopped] = run.of("early_stopped")
    assert (stopped["step"], stopped["best_step"], stopped["best_eval_loss"]) == (6, 3, _evals(run)[3])
    # The checkpoint named and kept as the best is the lowest held-out loss (a smaller gain than
    # minDelta is no reason to go on, but it is the better model).
    best = min(run.of("checkpoint"), key=lambda c: (c["evalLoss"], c["step"]))["name"]
    assert stopped["best_checkpoint"] == best and (run.run_dir / "checkpoints" / best / "manifest.json").is_file()
    [finished] = run.of("finished")
    assert finished["stopped_early"] and finished["step"] == 6
    assert f"stopped early at step 6 of {STEPS}" in finished["message"] and f"best checkpoint {best}" in finished["message"]

    # Restarted from step 3, it stops at step 6 again: the early-stopping state is in the checkpoint.
    copy_checkpoint(run.run_dir, tmp_path / "restarted", checkpoint_name(3))
    resumed = run_job(stopping("restarted"), tmp_path / "restarted")
    assert resumed.returncode == 0, resumed.log[-3000:]
    assert resumed.losses() == {s: loss for s, loss in run.losses().items() if s > 3}
    assert [e["step"] for e in resumed.of("early_stopped")] == [6] and _evals(resumed) == {6: _evals(run)[6]}
    # Restarted from the stop's own checkpoint (an export that failed after it): it trains no
    # further, and ends as the stopped run did.
    copy_checkpoint(run.run_dir, tmp_path / "after-stop", checkpoint_name(6))
    again = run_job(stopping("after-stop"), tmp_path / "after-stop")
    assert again.returncode == 0, again.log[-3000:]
    assert again.losses() == {} and [e["step"] for e in again.of("early_stopped")] == [6]
    assert again.of("finished")[0]["message"] == finished["message"]
