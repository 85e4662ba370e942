"""The admission checks: every malformed job of the corpus is refused with a message that
names the field to change; the checked-in examples and a rollback to a kept checkpoint pass.
In a cluster (the webhook, the operator, the API's kubernetes launcher) inputs are pvc:// or
s3:// only; `spillway run` on the user's machine (cluster=False) reads local paths too."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway_operator.admission import new_job_problems, problems, spec_problems
from spillway_runtime.core.spec import parse_job
from tests.bad_jobs import CORPUS, ROOT, example, with_

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# The examples `spillway run` runs on the user's machine: their inputs are local paths.
LOCAL_EXAMPLES = {"chat-local.yaml", "chat-lora.yaml", "dpo-lora-local.yaml", "tiny-local.yaml"}


def _job(path: Path) -> dict[str, Any]:
    [job] = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "FineTuneJob"]
    return dict(job)


def test_the_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 20


@pytest.mark.parametrize(("job", "expected"), [(job, expected) for _, job, expected in CORPUS],
                         ids=[what for what, _, _ in CORPUS])
def test_a_malformed_job_is_refused_naming_the_field(job: dict[str, Any], expected: str) -> None:
    found = problems(job)
    assert found, "admitted"
    assert any(expected in line for line in found), found


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_examples_are_admitted_where_they_run(path: Path) -> None:
    job = _job(path)
    spec = parse_job(job).spec
    assert new_job_problems(spec, cluster=False) == []
    if path.name in LOCAL_EXAMPLES:
        # In a cluster their local paths are refused, each naming its field.
        found = problems(job)
        assert found and all("reads the pod's own filesystem" in line or "is a relative path" in line
                             for line in found), found
        assert {line.split(":", 1)[0] for line in found} >= {"spec.model.uri", "spec.dataset.uri"}
    else:
        assert problems(job) == [] == new_job_problems(spec, cluster=True)


HINT = "in a cluster write pvc://CLAIM/PATH (a claim in the job's namespace) or s3://BUCKET/KEY"
# (field, its dotted path for with_, a URI of the pod's own filesystem, the whole refusal)
POD_FILESYSTEM = [
    ("spec.model.uri", "model.uri", "file:///models/llama",
     f"spec.model.uri: 'file:///models/llama' reads the pod's own filesystem: {HINT}"),
    ("spec.model.uri", "model.uri", "file:///etc/kubernetes/admin.conf",
     f"spec.model.uri: 'file:///etc/kubernetes/admin.conf' reads the pod's own filesystem: {HINT}"),
    ("spec.model.tokenizerUri", "model.tokenizerUri", "/mnt/s3-cache/other-team/tok",
     f"spec.model.tokenizerUri: '/mnt/s3-cache/other-team/tok' reads the pod's own filesystem: {HINT}"),
    ("spec.dataset.uri", "dataset.uri", "/data/train.jsonl",
     f"spec.dataset.uri: '/data/train.jsonl' reads the pod's own filesystem: {HINT}"),
    ("spec.dataset.uri", "dataset.uri", "~/train.jsonl",
     f"spec.dataset.uri: '~/train.jsonl' reads the pod's own filesystem: {HINT}"),
    ("spec.dataset.uri", "dataset.uri", "data/train.jsonl",
     f"spec.dataset.uri: 'data/train.jsonl' is a relative path, which means nothing in a pod (there is no job "
     f"file to be relative to): {HINT}"),
    ("spec.dataset.validation.uri", "dataset.validation", "../val.jsonl",
     f"spec.dataset.validation.uri: '../val.jsonl' is a relative path, which means nothing in a pod (there is no "
     f"job file to be relative to): {HINT}"),
    ("spec.dataset.mixture[0].uri", "dataset.mixture", "/mnt/s3-cache/other-team/train.jsonl",
     f"spec.dataset.mixture[0].uri: '/mnt/s3-cache/other-team/train.jsonl' reads the pod's own filesystem: {HINT}"),
]


def _with_uri(path: str, uri: str) -> dict[str, Any]:
    if path == "dataset.mixture":
        return with_(path, [{"uri": uri, "weight": 0.5}])
    return with_(path, {"uri": uri} if path == "dataset.validation" else uri)


@pytest.mark.parametrize(("field", "path", "uri", "refusal"), POD_FILESYSTEM,
                         ids=[f"{field}={uri}" for field, _, uri, _ in POD_FILESYSTEM])
def test_a_cluster_refuses_a_path_of_the_pods_own_filesystem_naming_the_field(
        field: str, path: str, uri: str, refusal: str) -> None:
    job = _with_uri(path, uri)
    spec = parse_job(job).spec
    assert problems(job) == [refusal]  # the webhook's: a FineTuneJob object runs in the cluster
    assert spec_problems(spec, cluster=True) == [refusal]  # the operator's, before the first pod
    assert new_job_problems(spec, cluster=True) == [refusal]  # the API's, for the kubernetes launcher
    # `spillway run` on the user's machine reads local files: the same job is fine there.
    assert new_job_problems(spec, cluster=False) == [] == spec_problems(spec, cluster=False)


def test_a_cluster_names_claims_and_buckets_instead_of_other_schemes() -> None:
    job = with_("model.uri", "gs://bucket/llama")
    assert problems(job) == [f"spec.model.uri: unsupported URI scheme 'gs' in 'gs://bucket/llama': {HINT}"]
    # Locally the runtime's own refusal, which offers local paths
    [line] = new_job_problems(parse_job(job).spec, cluster=False)
    assert line.startswith("spec.model.uri: unsupported URI scheme 'gs'") and "file://" in line


def test_every_refused_field_is_reported_at_once() -> None:
    job = with_("model.uri", "file:///m")
    job["spec"]["dataset"]["uri"] = "train.jsonl"
    assert [line.split(":", 1)[0] for line in problems(job)] == ["spec.model.uri", "spec.dataset.uri"]


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
