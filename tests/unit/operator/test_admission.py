"""The admission checks: every malformed job of the corpus is refused with a message that
names the field to change; the checked-in examples and a rollback to a kept checkpoint pass."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway_operator.admission import problems
from tests.bad_jobs import CORPUS, ROOT, example, with_

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
def test_the_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 20


@pytest.mark.parametrize(("job", "expected"), [(job, expected) for _, job, expected in CORPUS],
                         ids=[what for what, _, _ in CORPUS])
def test_a_malformed_job_is_refused_naming_the_field(job: dict[str, Any], expected: str) -> None:
    found = problems(job)
    assert found, "admitted"
    assert any(expected in line for line in found), found


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_examples_are_admitted(path: Path) -> None:
    [job] = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "FineTuneJob"]
    assert problems(job) == []


def _stored(checkpoints: list[str], resume_from: str | None = None) -> dict[str, Any]:
    job = example()
    if resume_from:
        job["spec"]["resumeFrom"] = resume_from
    job["status"] = {"checkpoints": [{"name": name, "step": i + 1} for i, name in enumerate(checkpoints)]}
    return job


def test_a_rollback_must_name_a_kept_checkpoint() -> None:
    update = with_("resumeFrom", "step-3")
    assert problems(update, _stored(["step-3", "step-6"])) == []
    [line] = problems(update, _stored(["step-6", "step-9"]))
    assert line == "spec.resumeFrom: the job has no checkpoint named 'step-3'; its checkpoints: step-6, step-9"


def test_an_unchanged_resume_from_stays_admitted_after_its_checkpoint_is_pruned() -> None:
    # Another edit (suspend) of a job rolled back long ago: the old target is gone, but it
    # was valid when set and is not what this update changes.
    update = with_("resumeFrom", "step-3")
    update["spec"]["suspend"] = True
    assert problems(update, _stored(["step-30"], resume_from="step-3")) == []


def test_train_batch_size_is_checked_only_when_the_process_count_is_known() -> None:
    job = with_("offload.deepspeed", {"train_batch_size": 8})  # 2 x 2 x 2 processes
    job["spec"]["resources"]["cpuProcesses"] = 2
    assert problems(job) == []
    unknown = copy.deepcopy(job)
    del unknown["spec"]["resources"]["gpusPerNode"]
    unknown["spec"]["resources"].pop("cpuProcesses")
    assert problems(unknown) == []  # every GPU of the node it lands on: not known yet
