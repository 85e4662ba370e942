"""The admission webhook's answers: every malformed job of the corpus is denied with the
field named (as `kubectl apply` shows it), good jobs and metadata-only updates pass."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway_operator.webhook import review
from tests.bad_jobs import CORPUS, ROOT, example, with_


def _review(job: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
    request = {"uid": "0a1b", "operation": "UPDATE" if old else "CREATE", "object": job}
    if old:
        request["oldObject"] = old
    answer = review({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == "0a1b"
    return dict(answer["response"])


@pytest.mark.parametrize(("job", "expected"), [(job, expected) for _, job, expected in CORPUS],
                         ids=[what for what, _, _ in CORPUS])
def test_a_malformed_job_is_denied_naming_the_field(job: dict[str, Any], expected: str) -> None:
    job = {**copy.deepcopy(job), "metadata": {"name": "bad"}}
    response = _review(job)
    assert response["allowed"] is False
    assert response["status"]["code"] == 422 and response["status"]["reason"] == "Invalid"
    message = response["status"]["message"]
    assert message.startswith("FineTuneJob 'bad' is invalid:\n- ")
    assert expected in message, message


def _example(path: Path) -> dict[str, Any]:
    [job] = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "FineTuneJob"]
    return job


def _runs_in_a_cluster(path: Path) -> bool:
    """An example for `kubectl apply` (its inputs on claims or in S3), not for `spillway run`."""
    return _example(path)["spec"]["model"]["uri"].startswith(("pvc://", "s3://"))


EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", [p for p in EXAMPLES if _runs_in_a_cluster(p)], ids=lambda p: Path(p).name)
def test_the_cluster_examples_are_allowed(path: Path) -> None:
    assert _review(_example(path)) == {"uid": "0a1b", "allowed": True}


@pytest.mark.parametrize("path", [p for p in EXAMPLES if not _runs_in_a_cluster(p)], ids=lambda p: Path(p).name)
def test_a_local_example_is_refused_naming_its_paths(path: Path) -> None:
    response = _review(_example(path))
    assert response["allowed"] is False
    assert "spec.model.uri" in response["status"]["message"] and "pvc://CLAIM/PATH" in response["status"]["message"]


def test_an_update_that_leaves_the_spec_alone_is_allowed_even_for_a_job_admitted_before_the_webhook() -> None:
    # A job stored while the webhook was down (failurePolicy Ignore): the operator must still
    # be able to add its finalizer and annotations, and to remove them when it is deleted.
    stored = with_("model.uri", "gs://bucket/llama")
    stored["metadata"]["finalizers"] = ["spillway.dev/cleanup"]
    updated = copy.deepcopy(stored)
    updated["metadata"]["annotations"] = {"kopf.zalando.org/last-handled-configuration": "{}"}
    assert _review(updated, stored)["allowed"] is True
    changed = copy.deepcopy(stored)
    changed["spec"]["suspend"] = True
    assert "spec.model.uri" in _review(changed, stored)["status"]["message"]


def test_a_rollback_is_allowed_only_to_a_kept_checkpoint() -> None:
    stored = example()
    stored["status"] = {"checkpoints": [{"name": "step-6", "step": 6}, {"name": "step-9", "step": 9}]}
    rollback = copy.deepcopy(stored)
    rollback["spec"]["resumeFrom"] = "step-6"
    assert _review(rollback, stored)["allowed"] is True
    rollback["spec"]["resumeFrom"] = "step-3"
    response = _review(rollback, stored)
    assert response["allowed"] is False
    assert "spec.resumeFrom: the job has no checkpoint named 'step-3'; its checkpoints: step-6, step-9" in (
        response["status"]["message"])


def test_every_problem_is_listed_on_its_own_line() -> None:
    job = with_("model.uri", "gs://bucket/llama")
    job["spec"]["dataset"]["uri"] = "https://example.org/d.jsonl"
    lines = _review(job)["status"]["message"].splitlines()
    assert len(lines) == 3 and lines[1].startswith("- spec.model.uri") and lines[2].startswith("- spec.dataset.uri")


def test_a_body_over_the_limit_is_a_413_whether_declared_or_streamed() -> None:
    from fastapi.testclient import TestClient

    from spillway_operator.webhook import MAX_BODY_BYTES, PATH, create_app

    client = TestClient(create_app())
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "u", "operation": "CREATE", "object": with_("model.uri", "gs://bucket/llama")}}
    padded = json.dumps({**review, "padding": "x" * MAX_BODY_BYTES}).encode()
    declared = client.post(PATH, content=padded, headers={"Content-Type": "application/json"})
    assert declared.status_code == 413 and str(MAX_BODY_BYTES) in declared.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked, cut off as it grows
        for start in range(0, len(padded), 1 << 20):
            yield padded[start:start + (1 << 20)]

    streamed = client.post(PATH, content=chunks(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413
    # At the limit's side of it, the same review is judged as usual.
    judged = client.post(PATH, json=review)
    assert judged.status_code == 200 and judged.json()["response"]["allowed"] is False
