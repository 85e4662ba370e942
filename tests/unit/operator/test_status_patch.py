"""Every status field the operator writes is one of FineTuneJobStatus's, of its type
(status.StatusPatch): strict in the tests (every reconciler test writes through it), logged
and written in production."""

from __future__ import annotations

import logging

import pytest

from spillway_operator.status import StatusContractError, StatusPatch


def test_a_field_outside_the_contract_or_of_another_type_raises_naming_it() -> None:
    patch = StatusPatch(strict=True)
    patch.update(attempt=2, finishedAt=None, phase="Running",
                 cost={"usd": 1.5, "gpuHours": 0.5, "settledUSD": 1.0, "asOf": "2026-01-01T00:00:00Z"})
    patch.setdefault("retryAfter", "2026-01-01T00:01:00Z")
    assert dict(patch)["cost"]["settledUSD"] == 1.0 and patch["finishedAt"] is None
    with pytest.raises(StatusContractError, match=r"status\.finshedAt is not a field of FineTuneJobStatus"):
        patch["finshedAt"] = "2026-01-01T00:00:00Z"
    with pytest.raises(StatusContractError, match=r"status\.attempt = 'three' is not of its type"):
        patch["attempt"] = "three"
    with pytest.raises(StatusContractError, match=r"status\.phase = 'Exporting'"):
        patch.update({"phase": "Exporting"})
    assert "finshedAt" not in patch and patch["attempt"] == 2 and patch["phase"] == "Running"


def test_outside_the_tests_it_is_logged_and_written(caplog: pytest.LogCaptureFixture) -> None:
    patch = StatusPatch()
    with caplog.at_level(logging.ERROR, logger="spillway.operator"):
        patch["failures"] = "many"
    assert patch["failures"] == "many"
    assert "status.failures = 'many' is not of its type" in caplog.text and "operator bug" in caplog.text
