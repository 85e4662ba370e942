"""The REST API over HTTP against SQLite and PostgreSQL: submission, validation, listing,
errors, auth and limits. Jobs here name a model that does not exist, so the local
launcher refuses them at planning time (exit 2) without training."""

from __future__ import annotations

import stat
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text

from spillway_api.settings import Settings
from tests.polling import wait_for

from .conftest import job_body

pytestmark = pytest.mark.integration


# What never reads or writes the database beyond the app's start (auth, the planner, metrics)
# runs once, on SQLite: PostgreSQL adds nothing there.
SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def wait_phase(client: Any, ns: str, name: str, phases: set[str], timeout: float = 60) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        job: dict[str, Any] = client.get(f"/v1/namespaces/{ns}/jobs/{name}").json()
        return job if job.get("phase") in phases else None

    return wait_for(reached, timeout, f"job {ns}/{name} in {sorted(phases)}", interval=0.1)


def test_submit_list_filter_paginate_get_delete(client: Any) -> None:
    for i in range(5):
        r = client.post("/v1/namespaces/team-a/jobs", json=job_body(f"job-{i}"))
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["training"]["maxSteps"] == 10
    client.post("/v1/namespaces/team-b/jobs", json=job_body("other"))
    failed = wait_phase(client, "team-a", "job-4", {"Failed"})
    assert failed["exitCode"] == 2 and "spec.model.uri" in failed["message"]
    for i in range(4):
        wait_phase(client, "team-a", f"job-{i}", {"Failed"})

    page = client.get("/v1/namespaces/team-a/jobs", params={"limit": 2, "offset": 2}).json()
    assert page["count"] == 5 and [j["name"] for j in page["data"]] == ["job-2", "job-3"]
    assert client.get("/v1/namespaces/team-a/jobs", params={"phase": "Failed"}).json()["count"] == 5
    assert client.get("/v1/namespaces/team-a/jobs", params={"phase": "Running"}).json()["count"] == 0
    assert client.get("/v1/namespaces/team-b/jobs").json()["count"] == 1

    history = client.get("/v1/namespaces/team-a/jobs/job-0/history").json()
    assert [t["toPhase"] for t in history["transitions"]] == ["Pending", "Planning", "Failed"]

    dup = client.post("/v1/namespaces/team-a/jobs", json=job_body("job-0"))
    assert dup.status_code == 409 and dup.json()["code"] == "job_exists"

    assert client.delete("/v1/namespaces/team-a/jobs/job-0").status_code == 204
    gone = client.get("/v1/namespaces/team-a/jobs/job-0")
    assert gone.status_code == 404 and gone.json() == {
        "status": 404, "code": "job_not_found", "detail": gone.json()["detail"]}
    assert client.delete("/v1/namespaces/team-a/jobs/job-0").status_code == 404
    assert client.get("/v1/namespaces/team-a/jobs").json()["count"] == 4


def test_bad_input_is_refused_with_field_paths(client: Any) -> None:
    bad = job_body("bad", training={"maxSteps": 0, "warmupSteps": 1})
    r = client.post("/v1/namespaces/ns/jobs", json=bad)
    assert r.status_code == 422
    assert r.json()["code"] == "invalid_request"
    assert any(e.startswith("spec.training.maxSteps:") for e in r.json()["errors"]), r.json()

    r = client.post("/v1/namespaces/ns/jobs", json=job_body("bad", offload={"policy": "none", "optimizer": "nvme"}))
    assert r.status_code == 422 and any(e.startswith("spec.offload") for e in r.json()["errors"])
    r = client.post("/v1/namespaces/ns/jobs", json=job_body("bad", model={"uri": "gs://bucket/llama"}))
    assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
    assert any(e.startswith("spec.model.uri: unsupported URI scheme 'gs'") for e in r.json()["errors"]), r.json()
    stage = {"deepspeed": {"zero_optimization": {"stage": "three"}}}
    r = client.post("/v1/namespaces/ns/jobs", json=job_body("bad", offload=stage))
    assert r.status_code == 422 and any(e.startswith("spec.offload.deepspeed.zero_optimization.stage")
                                        for e in r.json()["errors"]), r.json()
    assert client.get("/v1/namespaces/ns/jobs/bad").status_code == 404  # nothing half-made
    r = client.post("/v1/namespaces/ns/jobs", json=job_body("bad", modell={}))
    assert r.status_code == 422 and any("spec.modell: unknown field" in e for e in r.json()["errors"])
    r = client.post("/v1/namespaces/ns/jobs", json={"metadata": {"name": "UPPER"}, "spec": job_body()["spec"]})
    assert r.status_code == 422 and r.json()["errors"][0].startswith("metadata.name")

    r = client.post("/v1/namespaces/ns/jobs", content=b'{"metadata": ', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "malformed_json"

    big = b'{"metadata": {"name": "x"}, "pad": "' + b"x" * (1 << 20) + b'"}'
    r = client.post("/v1/namespaces/ns/jobs", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["code"] == "body_too_large"

    def chunks() -> Any:
        for _ in range(20):
            yield b"x" * 100_000

    r = client.post("/v1/namespaces/ns/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413

    r = client.get("/v1/namespaces/ns/cost", params={"since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"})
    assert r.status_code == 422
    assert client.get("/v1/namespaces/ns/jobs", params={"limit": 0}).status_code == 422
    client.post("/v1/namespaces/ns/jobs", json=job_body("steps"))
    r = client.get("/v1/namespaces/ns/jobs/steps/history", params={"afterStep": 2**64})  # a 500 (integer overflow)
    assert r.status_code == 422 and any("afterStep" in e for e in r.json()["errors"]), r.text
    assert client.get("/v1/namespaces/ns/jobs/steps/history", params={"afterStep": 2**31 - 1}).status_code == 200
    r = client.get("/v1/namespaces/ns/jobs/steps/history", params={"afterStep": 2**31})  # PostgreSQL's int4
    assert r.status_code == 422, r.text
    client.delete("/v1/namespaces/ns/jobs/steps")
    # nothing of the refused requests was stored
    assert client.get("/v1/namespaces/ns/jobs").json()["count"] == 0


@SQLITE_ONLY
def test_auth_local_token(make_client: Any, settings: Settings) -> None:
    client = make_client(settings, authenticated=False)
    token_file = settings.resolved_token_file
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32
    routes = [("get", "/v1/namespaces/ns/jobs"), ("post", "/v1/namespaces/ns/jobs"),
              ("get", "/v1/namespaces/ns/jobs/x"), ("delete", "/v1/namespaces/ns/jobs/x"),
              ("get", "/v1/namespaces/ns/jobs/x/history"), ("get", "/v1/namespaces/ns/jobs/x/checkpoints"),
              ("post", "/v1/namespaces/ns/jobs/x/rollback"), ("post", "/v1/namespaces/ns/jobs/x/suspend"),
              ("post", "/v1/namespaces/ns/jobs/x/resume"), ("get", "/v1/namespaces/ns/jobs/x/cost"),
              ("get", "/v1/namespaces/ns/cost"), ("post", "/v1/plan")]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = client.request(method, path, headers=headers, json={})
            assert r.status_code == 401, (method, path, r.status_code)
            assert r.json()["code"] == "unauthorized"
    ok = client.get("/v1/namespaces/ns/jobs", headers={"Authorization": f"Bearer {token}"})
    assert ok.status_code == 200
    assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
    # a second start reuses the token
    make_client(settings, authenticated=False)
    assert token_file.read_text().strip() == token


@SQLITE_ONLY
def test_plan_dry_run(client: Any) -> None:
    hw = {"name": "box", "gpu_count": 1, "gpu_product": "RTX 4090", "gpu_memory_bytes": 24 << 30,
          "cpu_cores": 16, "cpu_memory_bytes": 64 << 30, "nvme_capacity_bytes": 2 * 10**12,
          "nvme_free_bytes": 2 * 10**12}
    r = client.post("/v1/plan", json={"parameterCount": "13B", "hardware": hw, "pricePerHour": 1.5})
    assert r.status_code == 200, r.text
    plan = r.json()["data"][0]
    assert plan["feasible"] and plan["plan"]["optimizer"] == "nvme" and plan["plan"]["predictedCostUsd"] > 0
    short = client.post("/v1/plan", json={"parameterCount": "13B", "hardware": {**hw, "nvme_free_bytes": 0,
                                                                                   "nvme_capacity_bytes": 0}})
    assert not short.json()["data"][0]["feasible"]
    assert any("CPU RAM is short by" in s for s in short.json()["data"][0]["shortfalls"])
    # a node whose pods may lock 8 MiB (its probe's spillway.dev/memlock-bytes): no NVMe swap fits
    locked = client.post("/v1/plan", json={"parameterCount": "13B", "hardware": {**hw, "memlock_bytes": 8 << 20}})
    assert not locked.json()["data"][0]["feasible"], locked.text
    assert any("RLIMIT_MEMLOCK" in s for s in locked.json()["data"][0]["shortfalls"]), locked.text
    # LoRA: only the adapters' optimizer state is sized, so the same node needs no NVMe
    lora = client.post("/v1/plan", json={"parameterCount": "13B", "hardware": {**hw, "nvme_free_bytes": 0,
                                                                                  "nvme_capacity_bytes": 0},
                                         "method": {"type": "lora", "rank": 16}})
    assert lora.status_code == 200, lora.text
    assert lora.json()["data"][0]["feasible"] and lora.json()["data"][0]["plan"]["optimizer"] != "nvme"
    assert client.post("/v1/plan", json={"parameterCount": "13B", "hardware": hw,
                                         "method": {"type": "lora", "rank": 0}}).status_code == 422
    node = {"metadata": {"name": "gpu-80g", "labels": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                                                       "nvidia.com/gpu.memory": "81920"}},
            "status": {"allocatable": {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": "8"}}}
    small = {"metadata": {"name": "cpu-only"}, "status": {"allocatable": {"cpu": "8", "memory": "16Gi"}}}
    r = client.post("/v1/plan", json={"parameterCount": "7B", "nodes": [node, small]}).json()
    assert r["count"] == 2 and r["best"] == "gpu-80g"
    # Local mode with no hardware given: this machine, as `spillway probe --quick` sees it.
    here = client.post("/v1/plan", json={"parameterCount": "125M"})
    assert here.status_code == 200, here.text
    [local] = here.json()["data"]
    assert local["node"] == "local" and local["plan"]["capacity"]["cpu"] > 0
    assert client.post("/v1/plan", json={"parameterCount": "lots", "hardware": hw}).status_code == 422


@SQLITE_ONLY
def test_plan_of_a_spec_with_the_models_config_plans_its_real_shape(client: Any) -> None:
    """spec.model.config wins over a parameter count, as in the operator: Qwen2-7B's 152k
    vocabulary, not a 32k-vocabulary Llama guess of the same size."""
    from spillway_runtime.core.planner import ModelShape

    config = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
              "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
              "tie_word_embeddings": False}
    hw = {"name": "box", "gpu_count": 1, "gpu_product": "NVIDIA-A100-SXM4-80GB", "gpu_memory_bytes": 80 << 30,
          "cpu_cores": 16, "cpu_memory_bytes": 256 << 30}
    spec = {"model": {"uri": "pvc://m/qwen", "config": config, "parameterCount": "7B"}, "dataset": {"uri": "pvc://d/x"}}
    r = client.post("/v1/plan", json={"spec": spec, "hardware": hw})
    assert r.status_code == 200, r.text
    [plan] = r.json()["data"]
    assert plan["plan"]["modelParameters"] == ModelShape.from_hf_config(config).params == 7_615_616_512
    guessed = client.post("/v1/plan", json={"parameterCount": "7B", "hardware": hw}).json()["data"][0]
    assert guessed["plan"]["modelParameters"] == 7 * 10**9
    bad = client.post("/v1/plan", json={"spec": {**spec, "model": {"uri": "pvc://m/qwen", "config": {
        **config, "hidden_size": "big"}}}, "hardware": hw})
    assert bad.status_code == 422 and "spec.model.config.hidden_size" in bad.text


@SQLITE_ONLY
def test_plan_without_a_size_answers_the_largest_model_per_placement(client: Any) -> None:
    from spillway_runtime.core.hardware import NodeHardware
    from spillway_runtime.core.largest import largest_model
    from spillway_runtime.core.spec import Training

    hw = {"name": "box", "gpu_count": 1, "gpu_product": "RTX 4090", "gpu_memory_bytes": 24 << 30,
          "cpu_cores": 16, "cpu_memory_bytes": 64 << 30, "nvme_capacity_bytes": 2 * 10**12,
          "nvme_free_bytes": 2 * 10**12}
    training = {"sequenceLength": 1024, "microBatchSize": 1}
    # more GPUs per node than the shape has: that shape answers nothing, and says why (schemathesis
    # found this a 500)
    [none] = client.post("/v1/plan", json={"hardware": hw, "gpusPerNode": 5}).json()["largest"]
    assert none["placements"] == [] and "gpusPerNode is 5" in none["whyNot"]
    r = client.post("/v1/plan", json={"hardware": hw, "training": training})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["data"] == [] and body["best"] == "box"
    [box] = body["largest"]
    expected = largest_model(NodeHardware.model_validate(hw), Training.model_validate(training))
    assert [(p["placement"], p["parameters"], p["predictedStepSeconds"], p["whyNot"], p["boundBy"])
            for p in box["placements"]] \
        == [(f.placement, f.parameters, f.predicted_step_seconds, f.why_not, f.bound_by) for f in expected]
    assert all(p["boundBy"] for p in box["placements"])
    by = {p["placement"]: p["parameters"] for p in box["placements"]}
    # The seeds' first case: more fits as state moves off the GPU (docs/one-machine.md's figures).
    assert by["Z3 opt:nvme par:nvme"] > by["Z3 opt:nvme par:cpu"] > by["Z3 opt:cpu par:cpu"] > 10**9
    # Nodes of one shape answer once; a policy rules placements out by name.
    node = {"metadata": {"name": "n1", "labels": {"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.memory": "24576"}},
            "status": {"allocatable": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "1"}}}
    twin = {**node, "metadata": {**node["metadata"], "name": "n2"}}
    r = client.post("/v1/plan", json={"nodes": [node, twin], "offload": {"policy": "cpu"}}).json()
    [shape] = r["largest"]
    assert shape["node"] == "n1"
    assert all(p["whyNot"] for p in shape["placements"] if "nvme" in p["placement"])


@SQLITE_ONLY
def test_metrics_count_requests(client: Any) -> None:
    client.get("/v1/namespaces/ns/jobs")
    body = client.get("/metrics").text
    assert 'spillway_api_requests_total{method="GET",route="/v1/namespaces/{namespace}/jobs",status="200"}' in body


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_database_unreachable_is_503_and_nothing_half_written(client: Any, database_url: str) -> None:
    assert client.post("/v1/namespaces/ns/jobs", json=job_body("before")).status_code == 201
    server, name = database_url.rsplit("/", 1)
    admin = create_engine(server + "/spillway", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        # the server refuses new connections to the job database and drops the open ones
        conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
        conn.execute(text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"))
    try:
        r = client.post("/v1/namespaces/ns/jobs", json=job_body("during"))
        assert r.status_code == 503 and r.json()["code"] == "database_unavailable", r.text
        assert client.get("/v1/namespaces/ns/jobs").status_code == 503
        assert client.get("/readyz").status_code == 503
        assert client.get("/healthz").status_code == 200
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        admin.dispose()
    assert client.get("/readyz").status_code == 200
    names = [j["name"] for j in client.get("/v1/namespaces/ns/jobs").json()["data"]]
    assert names == ["before"]


def test_two_deletes_of_one_job_that_race_answer_204_and_404(client: Any) -> None:
    """Two DELETE requests that both read the job before either removed it (two sessions,
    interleaved as two API workers would run them): one deletes, the other answers 404,
    and the job's history goes with the row. Before, the second raised StaleDataError: a
    409 that DELETE does not document."""
    from spillway_api.errors import ApiError
    from spillway_api.models import Job, Transition
    from spillway_api.service import JobService

    assert client.post("/v1/namespaces/ns/jobs", json=job_body("twice")).status_code == 201
    app = client.app
    first, second = app.state.sessions(), app.state.sessions()
    try:
        a = JobService(first, app.state.launchers, "local")
        b = JobService(second, app.state.launchers, "local")
        job_a, job_b = a.get("ns", "twice"), b.get("ns", "twice")
        a.delete(job_a)
        first.commit()
        with pytest.raises(ApiError) as refused:
            b.delete(job_b)
        assert refused.value.status == 404 and refused.value.code == "job_not_found"
        second.rollback()
        assert first.scalar(select(func.count()).select_from(Job).where(Job.name == "twice")) == 0
        assert first.scalar(select(func.count()).select_from(Transition).where(Transition.job_id == job_a.id)) == 0
    finally:
        first.close()
        second.close()
    assert client.get("/v1/namespaces/ns/jobs/twice").status_code == 404
