"""The Kueue harness itself (tests/e2e/kueue_fixtures.py), before any Spillway code is
involved: a plain Workload within a ClusterQueue's quota is admitted on its flavour, one
beyond what is left waits with Kueue's reason, and is admitted once the first reports
Finished, as an operator that owns Workloads does."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from tests.e2e.kueue_fixtures import API_VERSION, GROUP, Kueue, kueue  # noqa: F401  (the fixture)

pytestmark = pytest.mark.e2e

ADMIT_TIMEOUT_S = 60


def workload(name: str, queue: str, cpu: str) -> dict[str, Any]:
    container = {"name": "main", "image": "registry.invalid/none", "resources": {"requests": {"cpu": cpu}}}
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {
            "queueName": queue,
            "podSets": [{"name": "main", "count": 1,
                         "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}],
        },
    }


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def wait_admitted(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    def admitted() -> dict[str, Any] | None:
        wl = cluster.get(f"workloads.{GROUP}", name, namespace)
        return wl if condition(wl, "Admitted").get("status") == "True" else None

    result: dict[str, Any] = cluster.wait_for(admitted, ADMIT_TIMEOUT_S, what=f"Kueue to admit Workload {name}")
    return result


def test_workload_admitted_within_quota_next_waits_until_first_finished(
    cluster: Any, namespace: str, kueue: Kueue  # noqa: F811
) -> None:
    suffix = namespace.rsplit("-", 1)[-1]
    flavor = kueue.flavor(f"e2e-harness-{suffix}")
    cq = kueue.cluster_queue(f"e2e-harness-{suffix}", {flavor: {"cpu": "2", "memory": "4Gi"}})
    kueue.local_queue(namespace, "team", cq)

    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(workload("first", "team", "1")))
    first = wait_admitted(cluster, namespace, "first")
    assert condition(first, "QuotaReserved")["status"] == "True"
    admission = first["status"]["admission"]
    assert admission["clusterQueue"] == cq
    assert [(a["name"], a["flavors"]["cpu"], a["count"]) for a in admission["podSetAssignments"]] == [
        ("main", flavor, 1)
    ]

    # 2 CPUs do not fit next to the first's 1 of 2: pending, with Kueue's reason.
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(workload("second", "team", "2")))

    def pending() -> dict[str, Any] | None:
        wl = cluster.get(f"workloads.{GROUP}", "second", namespace)
        reserved = condition(wl, "QuotaReserved")
        return wl if reserved.get("status") == "False" and reserved.get("message") else None

    second = cluster.wait_for(pending, ADMIT_TIMEOUT_S, what="Kueue to say why Workload second waits")
    reserved = condition(second, "QuotaReserved")
    assert reserved["reason"] == "Pending", reserved
    assert "insufficient unused quota for cpu" in reserved["message"], reserved
    assert condition(second, "Admitted").get("status") != "True"
    assert not (second.get("status") or {}).get("admission")

    # The owner reports the end of the first: its quota goes back, the second fits.
    finished = {"type": "Finished", "status": "True", "reason": "Succeeded", "message": "done",
                "lastTransitionTime": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    cluster.kubectl("patch", f"workloads.{GROUP}", "first", "-n", namespace, "--subresource=status",
                    "--type=json", "-p", json.dumps([{"op": "add", "path": "/status/conditions/-", "value": finished}]))
    second = wait_admitted(cluster, namespace, "second")
    assert second["status"]["admission"]["clusterQueue"] == cq
    assert [w["metadata"]["name"] for w in kueue.workloads(namespace)] == ["first", "second"]
