"""`spillway api --kubernetes` against the real control plane: TokenReview/SubjectAccessReview
with real service-account tokens and RBAC, FineTuneJob objects created and patched through
the API, and the watch that records their history across API restarts.

The API runs as a subprocess under a service account of its own with only the permissions
it needs (SPILLWAY_API_RULES), so a missing permission fails here. The operator does not
run: status is patched with kubectl, as the operator and the runtime would.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from spillway_operator.placement import choose_placement, plan_status
from spillway_operator.settings import OperatorSettings
from spillway_runtime.core.spec import parse_job
from tests import polling
from tests.browser import chromium, shot, sign_in
from tests.e2e.operator_fixtures import CRD, POOL, free_port, pool_nodes

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# What the API's own service account needs, cluster-wide: the objects it creates and
# watches, and the two reviews that decide who its callers are and what they may do.
SPILLWAY_API_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["spillway.dev"], "resources": ["finetunejobs"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
    {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]},  # POST /v1/plan against the cluster
]
ALL_VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]
PRICING = "spillway-pricing"


def job_body(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "spec": {"model": {"uri": "pvc://models/llama-7b", "parameterCount": "7B"},
                     "dataset": {"uri": "pvc://data/train.jsonl"}, "training": {"maxSteps": 100},
                     "resources": {"gpusPerNode": 1}}}


def ftj_manifest(name: str) -> dict[str, Any]:
    return {"apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", **job_body(name)}


@dataclass
class World:
    cluster: Any
    team_a: str
    team_b: str
    system: str  # the API's own namespace, where the pricing ConfigMap lives
    tokens: dict[str, str]  # alice: every verb in team-a; reader: get/list in team-a
    api_kubeconfig: Path
    tmp: Path


class ApiServer:
    """`python -m spillway_api.cli api --kubernetes` on a free port, with its own SQLite file."""

    def __init__(self, kubeconfig: Path, db: Path, log: Path, pricing_namespace: str | None = None):
        """`pricing_namespace`: where the operator's pricing ConfigMap is (as the chart tells the API)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db = db
        self.log = log
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig),
                    "SPILLWAY_DATABASE_URL": f"sqlite:///{db}", "SPILLWAY_DATA_DIR": str(db.parent / "data"),
                    "PYTHONUNBUFFERED": "1"}
        if pricing_namespace:
            self.env |= {"SPILLWAY_OPERATOR_NAMESPACE": pricing_namespace, "SPILLWAY_OPERATOR_PRICING_CONFIGMAP": PRICING}
        self.env.pop("KUBERNETES_SERVICE_HOST", None)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 40) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spillway_api.cli", "api", "--kubernetes", "--port", str(self.port)],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"the API exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        try:
            polling.wait_for(ready, timeout, what="the API's /readyz", interval=0.1)
        except AssertionError as err:
            if "timed out" not in str(err):
                raise
            raise AssertionError(f"the API did not start in {timeout}s:\n{self.log.read_text()[-4000:]}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> float:
        """Signal the process and wait for it; returns how long it took to exit."""
        assert self.proc is not None
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"the API ignored signal {sig} for {timeout}s") from None
        return time.monotonic() - started

    def call(self, method: str, path: str, token: str | None = None, body: Any = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return httpx.request(method, self.url + path, headers=headers, json=body, timeout=30)


def wait_for(predicate: Any, timeout: float = 20, what: str = "condition") -> Any:
    return polling.wait_for(predicate, timeout, what)


def patch_status(cluster: Any, ns: str, name: str, status: dict[str, Any]) -> None:
    cluster.kubectl("patch", "ftj", name, "-n", ns, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": status}))


def _service_account_kubeconfig(cluster: Any, namespace: str, account: str, path: Path) -> None:
    """A kubeconfig for the cluster's server and CA that authenticates as the service account."""
    admin = yaml.safe_load(cluster.kubectl("config", "view", "--raw", "--minify").stdout)
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=2h").stdout.strip()
    admin["users"] = [{"name": account, "user": {"token": token}}]
    admin["contexts"][0]["context"]["user"] = account
    path.write_text(yaml.safe_dump(admin))
    path.chmod(0o600)


@pytest.fixture(scope="module")
def world(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("api-cluster")
    suffix = secrets.token_hex(3)
    team_a, team_b, system = f"e2e-api-a-{suffix}", f"e2e-api-b-{suffix}", f"e2e-api-sys-{suffix}"
    cluster.kubectl("apply", "-f", str(CRD))
    try:
        for ns in (team_a, team_b, system):
            cluster.kubectl("create", "namespace", ns)
            cluster.kubectl("label", "namespace", ns, "spillway.dev/e2e=true",
                            "pod-security.kubernetes.io/enforce=restricted")
        manifests: list[dict[str, Any]] = [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "spillway-api", "namespace": system}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": f"spillway-api-{suffix}"}, "rules": SPILLWAY_API_RULES},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": f"spillway-api-{suffix}"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": f"spillway-api-{suffix}"},
             "subjects": [{"kind": "ServiceAccount", "name": "spillway-api", "namespace": system}]},
            # As the chart's api-role.yaml: the pricing ConfigMap, by name, in its own namespace.
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": "spillway-api", "namespace": system},
             "rules": [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [PRICING], "verbs": ["get"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "spillway-api", "namespace": system},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "spillway-api"},
             "subjects": [{"kind": "ServiceAccount", "name": "spillway-api", "namespace": system}]},
        ]
        for user, verbs in (("alice", ALL_VERBS), ("reader", ["get", "list", "watch"])):
            manifests += [
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": user, "namespace": team_a}},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                 "metadata": {"name": f"ftj-{user}", "namespace": team_a},
                 "rules": [{"apiGroups": ["spillway.dev"], "resources": ["finetunejobs"], "verbs": verbs}]},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                 "metadata": {"name": f"ftj-{user}", "namespace": team_a},
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"ftj-{user}"},
                 "subjects": [{"kind": "ServiceAccount", "name": user, "namespace": team_a}]},
            ]
        cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests}))
        cluster.kubectl("wait", "--for=condition=Established", "crd/finetunejobs.spillway.dev", "--timeout=30s")
        tokens = {user: cluster.kubectl("create", "token", user, "-n", team_a, "--duration=1h",
                                        f"--audience={AUDIENCE}").stdout.strip()
                  for user in ("alice", "reader")}
        api_kubeconfig = tmp / "api-kubeconfig"
        _service_account_kubeconfig(cluster, system, "spillway-api", api_kubeconfig)
        yield World(cluster, team_a, team_b, system, tokens, api_kubeconfig, tmp)
    finally:
        for ns in (team_a, team_b, system):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)
        for kind in ("clusterrolebinding", "clusterrole"):
            cluster.kubectl("delete", kind, f"spillway-api-{suffix}", "--ignore-not-found", check=False)


@pytest.fixture
def api(world: World, tmp_path: Path) -> Iterator[ApiServer]:
    server = ApiServer(world.api_kubeconfig, tmp_path / "spillway.db", tmp_path / "api.log", world.system)
    server.start()
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


AUDIENCE = "spillway"  # the API's default (chart: api.audience)


def _routes(ns: str, job: str) -> list[tuple[str, str, str, Any]]:
    """(method, OpenAPI path, concrete path, body) for every namespaced route."""
    base, one = "/v1/namespaces/{namespace}", "/v1/namespaces/{namespace}/jobs/{name}"
    concrete = f"/v1/namespaces/{ns}"
    return [
        ("GET", f"{base}/jobs", f"{concrete}/jobs", None),
        ("POST", f"{base}/jobs", f"{concrete}/jobs", job_body("matrix-new")),
        ("GET", one, f"{concrete}/jobs/{job}", None),
        ("GET", f"{one}/history", f"{concrete}/jobs/{job}/history", None),
        ("GET", f"{one}/checkpoints", f"{concrete}/jobs/{job}/checkpoints", None),
        ("GET", f"{one}/cost", f"{concrete}/jobs/{job}/cost", None),
        ("GET", f"{one}/attempts", f"{concrete}/jobs/{job}/attempts", None),
        ("POST", f"{one}/rollback", f"{concrete}/jobs/{job}/rollback", {"checkpoint": "nope", "reason": "matrix"}),
        ("POST", f"{one}/suspend", f"{concrete}/jobs/{job}/suspend", None),
        ("POST", f"{one}/resume", f"{concrete}/jobs/{job}/resume", None),
        ("GET", f"{base}/cost", f"{concrete}/cost", None),
        ("DELETE", one, f"{concrete}/jobs/{job}", None),
    ]


def test_every_route_needs_a_token_and_rbac_in_its_namespace(world: World, api: ApiServer) -> None:
    alice, reader = world.tokens["alice"], world.tokens["reader"]
    created = api.call("POST", f"/v1/namespaces/{world.team_a}/jobs", alice, job_body("matrix"))
    assert created.status_code == 201, created.text
    routes = _routes(world.team_a, "matrix")

    # The matrix covers every route the API serves that carries a namespace.
    schema = httpx.get(f"{api.url}/openapi.json").json()
    served = {(m.upper(), p) for p, ops in schema["paths"].items() for m in ops if "{namespace}" in p}
    assert served == {(m, p) for m, p, _, _ in routes}

    # alice's own ServiceAccount token, but for the API server's audience: a credential that
    # works against the cluster is never accepted (nor, so, ever sent here by a client that works)
    cluster_token = world.cluster.kubectl("create", "token", "alice", "-n", world.team_a,
                                          "--duration=10m").stdout.strip()
    plan = f"/v1/plan?namespace={world.team_a}"
    for method, _, path, body in [*routes, ("POST", "", plan, {"parameterCount": "7B"})]:
        for token in (None, "not-a-token", alice + "x", cluster_token):
            r = api.call(method, path, token, body)
            assert r.status_code == 401, (method, path, token and token[:8], r.text)
            assert r.json()["code"] == "unauthorized"
            if token == cluster_token:
                assert f"--audience {AUDIENCE}" in r.json()["detail"], r.text
    # A plan reads the cluster's nodes and prices: for whoever may create a job where it asks.
    assert api.call("POST", plan, alice, {"parameterCount": "7B"}).status_code == 200
    for who, path in ((alice, "/v1/plan"), (reader, plan), (alice, f"/v1/plan?namespace={world.team_b}")):
        r = api.call("POST", path, who, {"parameterCount": "7B"})
        assert r.status_code == 403 and r.json()["code"] == "forbidden", (path, r.text)
    assert "?namespace=" in api.call("POST", "/v1/plan", alice, {"parameterCount": "7B"}).json()["detail"]

    # Allowed in team-a, so forbidden in team-b, whether or not the job exists there.
    for method, _, path, body in _routes(world.team_b, "matrix"):
        r = api.call(method, path, alice, body)
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["code"] == "forbidden" and world.team_b in r.json()["detail"]

    # The reader's Role has get/list only: reads pass, writes are refused.
    for method, _, path, body in routes:
        r = api.call(method, path, reader, body)
        expected = {200} if method == "GET" else {403}
        assert r.status_code in expected, (method, path, r.text)
    assert world.cluster.get("finetunejob", "matrix", world.team_a)["spec"].get("suspend") in (None, False)

    # Alice may do everything in team-a (each answer comes from the handler, not from auth).
    expected_a = [200, 201, 200, 200, 200, 200, 200, 409, 200, 200, 200, 204]
    got = [api.call(method, path, alice, body).status_code for method, _, path, body in routes]
    assert got == expected_a
    assert world.cluster.get("finetunejob", "matrix", world.team_a) is None
    assert world.cluster.get("finetunejob", "matrix-new", world.team_a) is not None
    # Nothing the refused calls asked for reached the cluster.
    assert world.cluster.get("finetunejob", "matrix-new", world.team_b) is None


def _history(api: ApiServer, token: str, ns: str, name: str) -> dict[str, Any]:
    r = api.call("GET", f"/v1/namespaces/{ns}/jobs/{name}/history", token)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_submit_watch_restart_rollback_suspend_delete(world: World, api: ApiServer) -> None:
    cluster, ns, token = world.cluster, world.team_a, world.tokens["alice"]
    base = f"/v1/namespaces/{ns}/jobs"

    created = api.call("POST", base, token, job_body("flow"))
    assert created.status_code == 201, created.text
    obj = cluster.kubectl_json("get", "ftj", "flow", "-n", ns)
    assert obj["spec"]["model"]["uri"] == "pvc://models/llama-7b" and obj["spec"]["training"]["maxSteps"] == 100
    assert created.json()["uid"] == obj["metadata"]["uid"]
    assert api.call("POST", base, token, job_body("flow")).status_code == 409

    # The operator and the runtime report; the watch records it.
    patch_status(cluster, ns, "flow", {
        "phase": "Running", "progress": {"step": 5, "totalSteps": 100, "loss": 2.5, "etaSeconds": 950.0,
                                         "updatedAt": "2026-01-01T00:00:05Z"},
        "checkpoints": [{"name": "step-5", "step": 5, "loss": 2.5}], "cost": {"gpuHours": 0.5, "usd": 1.0}})
    wait_for(lambda: _history(api, token, ns, "flow")["progress"], what="the first progress point")
    history = _history(api, token, ns, "flow")
    assert [t["toPhase"] for t in history["transitions"]] == ["Pending", "Running"]
    assert [(p["step"], p["loss"], p["etaSeconds"]) for p in history["progress"]] == [(5, 2.5, 950.0)]
    assert api.call("GET", f"{base}/flow/cost", token).json()["usd"] == pytest.approx(1.0)

    # SIGKILL the API; while it is down the job moves on and is preempted and restarted.
    api.stop(signal.SIGKILL)
    patch_status(cluster, ns, "flow", {
        "progress": {"step": 10, "totalSteps": 100, "loss": 2.0, "updatedAt": "2026-01-01T00:00:10Z"},
        "checkpoints": [{"name": "step-5", "step": 5, "loss": 2.5}, {"name": "step-10", "step": 10, "loss": 2.0}],
        "cost": {"gpuHours": 1.0, "usd": 2.0}})
    patch_status(cluster, ns, "flow", {"phase": "Preempted", "preemptions": 1})
    patch_status(cluster, ns, "flow", {"phase": "Running", "attempt": 1})
    cluster.apply(ftj_manifest("outside"), ns)  # made with kubectl, never through the API
    api.start()
    wait_for(lambda: api.call("GET", f"{base}/outside", token).status_code == 200, what="the kubectl-made job")
    history = wait_for(lambda: (h := _history(api, token, ns, "flow"))["transitions"][-1]["toPhase"] == "Running"
                       and len(h["transitions"]) == 4 and h, what="the changes made while the API was down")
    # Every change while it was down, each once: replayed from the stored resourceVersion,
    # not just the latest state that a fresh list would give.
    assert [t["toPhase"] for t in history["transitions"]] == ["Pending", "Running", "Preempted", "Running"]
    assert [p["step"] for p in history["progress"]] == [5, 10]
    checkpoints = api.call("GET", f"{base}/flow/checkpoints", token).json()
    assert [c["name"] for c in checkpoints["data"]] == ["step-5", "step-10"]
    cost = api.call("GET", f"{base}/flow/cost", token).json()
    assert cost["usd"] == pytest.approx(2.0) and cost["gpuHours"] == pytest.approx(1.0) and cost["entries"] == 2
    # The operator's attempts: the first ended preempted with its own steps and cost.
    attempts = api.call("GET", f"{base}/flow/attempts", token).json()["data"]
    assert [(a["number"], a["origin"], a["phase"], a["firstStep"], a["lastStep"]) for a in attempts] == [
        (1, "cluster", "Preempted", 5, 10), (2, "cluster", "Running", None, None)]
    assert attempts[0]["usd"] == pytest.approx(2.0) and attempts[1]["usd"] == 0
    outside = _history(api, token, ns, "outside")
    assert [(t["toPhase"], t["reason"]) for t in outside["transitions"]] == [("Pending", "created in the cluster")]

    # A clean restart (SIGTERM) is prompt and adds nothing.
    took = api.stop(signal.SIGTERM)
    print(f"SIGTERM shutdown took {took:.2f}s")
    assert took < 8
    api.start()
    time.sleep(1.5)
    assert _history(api, token, ns, "flow") == history

    # Rollback: unknown checkpoint -> 409 with the valid ones; a known one sets spec.resumeFrom.
    rollback = f"{base}/flow/rollback"
    r = api.call("POST", rollback, token, {"checkpoint": "step-7", "reason": "typo"})
    assert r.status_code == 409 and r.json()["validCheckpoints"] == ["step-5", "step-10"]
    assert cluster.kubectl_json("get", "ftj", "flow", "-n", ns)["spec"].get("resumeFrom") is None
    r = api.call("POST", rollback, token, {"checkpoint": "step-5", "reason": "loss spike after step 7"})
    assert r.status_code == 202, r.text
    assert r.json()["requestedBy"] == f"system:serviceaccount:{ns}:alice" and r.json()["toStep"] == 5
    assert cluster.kubectl_json("get", "ftj", "flow", "-n", ns)["spec"]["resumeFrom"] == "step-5"
    time.sleep(1)  # the watch sees our own patch; the rollback stays pending until the operator applies it
    r = api.call("POST", rollback, token, {"checkpoint": "step-10", "reason": "second thoughts"})
    assert r.status_code == 409 and r.json()["code"] == "rollback_in_progress", r.text
    patch_status(cluster, ns, "flow", {"appliedResumeFrom": "step-5", "phase": "Pending"})
    done = wait_for(lambda: (rb := _history(api, token, ns, "flow")["rollbacks"]) and rb[0]["completedAt"] and rb,
                    what="the rollback to complete")
    assert [(x["checkpoint"], x["origin"]) for x in done] == [("step-5", "api")]

    # Suspend and resume patch spec.suspend.
    assert api.call("POST", f"{base}/flow/suspend", token).status_code == 200
    assert cluster.kubectl_json("get", "ftj", "flow", "-n", ns)["spec"]["suspend"] is True
    assert api.call("POST", f"{base}/flow/resume", token).status_code == 200
    assert cluster.kubectl_json("get", "ftj", "flow", "-n", ns)["spec"]["suspend"] is False

    # Delete removes the object and the row; the watch's DELETED event does not bring it back.
    assert api.call("DELETE", f"{base}/flow", token).status_code == 204
    assert cluster.get("finetunejob", "flow", ns) is None
    cluster.apply(ftj_manifest("marker"), ns)  # events arrive in order: once this is in, so is the delete
    wait_for(lambda: api.call("GET", f"{base}/marker", token).status_code == 200, what="the marker job")
    assert api.call("GET", f"{base}/flow", token).status_code == 404


def test_the_python_client_and_spillway_jobs_against_the_cluster(world: World, api: ApiServer) -> None:
    """`spillway_api.client` and `spillway jobs` with real service-account tokens: what they
    submit is a FineTuneJob in the cluster, what the operator reports reads back typed, and
    what RBAC refuses is the API's Problem, raised or printed with its exit code."""
    from spillway_api.client import Client, SpillwayError
    from spillway_api.schemas import JobPublic

    cluster, ns = world.cluster, world.team_a
    with Client(api.url, world.tokens["alice"]) as client:
        submitted = client.submit(ns, job_body("via-client"))
        assert isinstance(submitted, JobPublic) and submitted.name == "via-client"
        assert cluster.get("finetunejob", "via-client", ns)["metadata"]["uid"] == submitted.uid
        patch_status(cluster, ns, "via-client", {
            "phase": "Running", "progress": {"step": 3, "totalSteps": 100, "loss": 2.25,
                                             "updatedAt": "2026-01-01T00:00:03Z"},
            "checkpoints": [{"name": "step-3", "step": 3, "loss": 2.25}]})
        wait_for(lambda: client.get(ns, "via-client").phase == "Running", what="Running through the client")
        assert [c.name for c in client.checkpoints(ns, "via-client").data] == ["step-3"]
        assert [(p.step, p.loss) for p in client.history(ns, "via-client").progress] == [(3, 2.25)]
        with pytest.raises(SpillwayError) as unknown:
            client.rollback(ns, "via-client", "step-7", "typo")
        assert unknown.value.status == 409
        assert client.rollback(ns, "via-client", "step-3", "loss spike").to_step == 3
        assert cluster.get("finetunejob", "via-client", ns)["spec"]["resumeFrom"] == "step-3"
        client.suspend(ns, "via-client")
        assert cluster.get("finetunejob", "via-client", ns)["spec"]["suspend"] is True
        with pytest.raises(SpillwayError) as elsewhere:
            client.submit(world.team_b, job_body("not-mine"))
        assert elsewhere.value.status == 403 and cluster.get("finetunejob", "not-mine", world.team_b) is None

    env = {**os.environ, "SPILLWAY_API_URL": api.url, "COLUMNS": "200"}
    listed = subprocess.run([sys.executable, "-m", "spillway_api.cli", "jobs", "list", "-n", ns, "-o", "json"],
                            capture_output=True, text=True, env={**env, "SPILLWAY_TOKEN": world.tokens["reader"]},
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    # the namespace's other jobs are other tests' (the world is the module's)
    assert ("via-client", "Running") in [(j["name"], j["phase"]) for j in json.loads(listed.stdout)]
    refused = subprocess.run([sys.executable, "-m", "spillway_api.cli", "jobs", "suspend", "via-client", "-n", ns],
                             capture_output=True, text=True, env={**env, "SPILLWAY_TOKEN": world.tokens["reader"]},
                             timeout=120)
    assert refused.returncode == 2 and "403" in refused.stderr, refused.stderr


def test_expired_bookmark_lists_again_and_records_deletions(world: World, api: ApiServer) -> None:
    cluster, ns, token = world.cluster, world.team_a, world.tokens["alice"]
    base = f"/v1/namespaces/{ns}/jobs"
    for name in ("kept", "gone"):
        cluster.apply(ftj_manifest(name), ns)
    wait_for(lambda: all(api.call("GET", f"{base}/{n}", token).status_code == 200 for n in ("kept", "gone")),
             what="both jobs")
    api.stop(signal.SIGTERM)
    cluster.kubectl("delete", "ftj", "gone", "-n", ns)
    patch_status(cluster, ns, "kept", {"phase": "Running", "progress": {"step": 3, "loss": 4.0}})
    # A resourceVersion the API server no longer has in its window: the watch gets 410 Gone.
    with sqlite3.connect(api.db) as db:
        assert db.execute("UPDATE watch_bookmarks SET resource_version = '1'").rowcount == 1
    api.start()
    wait_for(lambda: api.call("GET", f"{base}/gone", token).json().get("phase") == "Deleted",
             what="the job deleted while the API was down")
    kept = _history(api, token, ns, "kept")
    assert [t["toPhase"] for t in kept["transitions"]] == ["Pending", "Running"]
    assert [p["step"] for p in kept["progress"]] == [3]
    assert "listing again" in api.log.read_text()
    with sqlite3.connect(api.db) as db:
        (rv,) = db.execute("SELECT resource_version FROM watch_bookmarks").fetchone()
    assert int(rv) > 1
    # Created again under the same name: the row follows the new object.
    cluster.apply(ftj_manifest("gone"), ns)
    wait_for(lambda: api.call("GET", f"{base}/gone", token).json().get("phase") == "Pending",
             what="the re-created job")
    assert [t["toPhase"] for t in _history(api, token, ns, "gone")["transitions"]] == ["Pending", "Deleted", "Pending"]


def test_concurrent_submissions_race_the_watch_without_duplicates(world: World, api: ApiServer) -> None:
    """Each POST writes its row, creates the object and commits, while the watch already
    records that object: every job ends up with one row, its uid and one Pending transition."""
    from concurrent.futures import ThreadPoolExecutor

    ns, token = world.team_a, world.tokens["alice"]
    names = [f"burst-{i}" for i in range(8)]
    with ThreadPoolExecutor(len(names)) as pool:
        codes = list(pool.map(lambda n: api.call("POST", f"/v1/namespaces/{ns}/jobs", token, job_body(n)).status_code,
                              names))
    assert codes == [201] * len(names)
    for name in names:
        patch_status(world.cluster, ns, name, {"phase": "Running"})
    uids = {o["metadata"]["name"]: o["metadata"]["uid"]
            for o in world.cluster.kubectl_json("get", "ftj", "-n", ns)["items"]}

    def recorded() -> bool:
        jobs: list[dict[str, Any]] = api.call("GET", f"/v1/namespaces/{ns}/jobs", token, None).json()["data"]
        return bool(sum(j["phase"] == "Running" for j in jobs if j["name"] in names) == len(names))

    wait_for(recorded, what="every burst job Running")
    for name in names:
        job = api.call("GET", f"/v1/namespaces/{ns}/jobs/{name}", token).json()
        assert job["uid"] == uids[name]
        assert [t["toPhase"] for t in _history(api, token, ns, name)["transitions"]] == ["Pending", "Running"]


def test_revoked_access_stops_working_within_the_cache_time(world: World, api: ApiServer) -> None:
    """One reader loses its RoleBinding (-> 403), another its service account (-> 401)."""
    from spillway_api.auth import CACHE_SECONDS

    cluster, ns = world.cluster, world.team_a
    path = f"/v1/namespaces/{ns}/jobs"
    tokens = {}
    for account in ("unbound", "deleted"):
        cluster.kubectl("create", "serviceaccount", account, "-n", ns)
        cluster.kubectl("create", "rolebinding", f"ftj-{account}", "-n", ns, "--role=ftj-reader",
                        f"--serviceaccount={ns}:{account}")
        tokens[account] = cluster.kubectl("create", "token", account, "-n", ns, "--duration=10m",
                                          f"--audience={AUDIENCE}").stdout.strip()
        assert api.call("GET", path, tokens[account]).status_code == 200
        assert api.call("POST", path, tokens[account], job_body(f"{account}-job")).status_code == 403
    cluster.kubectl("delete", "rolebinding", "ftj-unbound", "-n", ns)
    cluster.kubectl("delete", "serviceaccount", "deleted", "-n", ns)
    # The API server's own view first: its RBAC and service-account caches lag on a loaded
    # machine, and that lag is not the API's cache time.
    def can_list(account: str) -> str:
        return cluster.kubectl("auth", "can-i", "list", "finetunejobs.spillway.dev", "-n", ns,
                               f"--as=system:serviceaccount:{ns}:{account}", check=False).stdout.strip()

    wait_for(lambda: can_list("unbound") == "no", timeout=120, what="the API server to see the binding gone")
    revoked = time.monotonic()
    wait_for(lambda: [api.call("GET", path, tokens[a]).status_code for a in ("unbound", "deleted")] == [403, 401],
             timeout=CACHE_SECONDS + 60, what="revoked access to be refused")
    assert time.monotonic() - revoked <= CACHE_SECONDS + 15  # the cache time, and a loaded machine's slack


def _pool_spec(pool: str) -> dict[str, Any]:
    return {**job_body("p")["spec"], "resources": {"gpusPerNode": 1, "nodeSelector": {POOL: pool}}}


def test_the_cluster_plan_is_the_operators_placement(world: World, api: ApiServer,
                                                     make_node: Callable[..., str]) -> None:
    """POST /v1/plan without hardware, in cluster mode, answers what the operator would do
    with the job: its node exclusions (a cordoned node, the nodeSelector), one plan per node
    shape, its pricing ConfigMap, its choice (`best`), and for the winner exactly the
    status.plan the operator would write."""
    cluster = world.cluster
    pool, nodes = pool_nodes(cluster, make_node, "gpu-80g", "gpu-48g-nvme", "gpu-24g")
    cluster.kubectl("cordon", nodes[2])
    prices = {"NVIDIA-A100-SXM4-80GB": "4.0", "NVIDIA-L40S": "0.5"}
    cluster.kubectl("create", "configmap", PRICING, "-n", world.system,
                    *[f"--from-literal={k}={v}" for k, v in prices.items()])
    spec = _pool_spec(pool)
    try:
        answer = api.call("POST", f"/v1/plan?namespace={world.team_a}", world.tokens["alice"], {"spec": spec})
        assert answer.status_code == 200, answer.text
        listed = cluster.kubectl_json("get", "nodes")["items"]
    finally:
        cluster.kubectl("delete", "configmap", PRICING, "-n", world.system, "--ignore-not-found", check=False)
    body = answer.json()
    placement = choose_placement(parse_job({"metadata": {"name": "p"}, "spec": spec}).spec, listed, prices,
                                 OperatorSettings())
    assert placement.chosen is not None
    assert body["best"] == sorted(placement.chosen.nodes)[0] and body["best"] in nodes[:2]
    assert sorted(d["node"] for d in body["data"]) == sorted(nodes[:2]), body["data"]
    assert body["excluded"][nodes[2]] == "not Ready or cordoned"
    assert all(why.startswith("nodeSelector") for n, why in body["excluded"].items() if n not in nodes)
    [best] = [d for d in body["data"] if d["node"] == body["best"]]
    assert best["plan"] == plan_status(placement), "not the status.plan the operator would write"
    price = prices[best["plan"]["gpuProduct"]]
    assert best["plan"]["pricePerHourUsd"] == float(price), "the pricing ConfigMap was not read"
    [other] = [d for d in body["data"] if d["node"] != body["best"]]
    assert other["plan"]["pricePerHourUsd"] == float(prices[other["plan"]["gpuProduct"]])
    assert [r["shape"] for r in best["plan"]["rejectedShapes"]] == [other["plan"]["shape"]]


def test_the_dashboard_shows_a_cluster_jobs_plan_and_cost(world: World, api: ApiServer,
                                                          make_node: Callable[..., str]) -> None:
    """A cluster job in the dashboard (headless Chromium, the API in cluster mode): the plan
    the operator writes to status.plan shows as it does for a local job: tier bars against
    the node's capacity, the predicted step time, the rejected placements and node shapes,
    and the cost in status.cost. Before there was one plan summary, a cluster job showed
    "no capacity", no prediction and no alternatives."""
    cluster, alice, ns = world.cluster, world.tokens["alice"], world.team_a
    pool, _ = pool_nodes(cluster, make_node, "gpu-80g", "gpu-48g-nvme")
    spec = _pool_spec(pool)
    created = api.call("POST", f"/v1/namespaces/{ns}/jobs", alice, {"metadata": {"name": "shown"}, "spec": spec})
    assert created.status_code == 201, created.text
    placement = choose_placement(parse_job({"metadata": {"name": "shown"}, "spec": spec}).spec,
                                 cluster.kubectl_json("get", "nodes")["items"], {}, OperatorSettings())
    plan = plan_status(placement)
    assert plan is not None and plan["feasible"] and plan["rejectedShapes"]
    # What the operator and the runtime would write (the operator does not run here).
    patch_status(cluster, ns, "shown", {"phase": "Running", "plan": plan, "progress": {"step": 10, "totalSteps": 100},
                                        "cost": {"usd": 1.25, "gpuHours": 0.5}})
    job = wait_for(lambda: (j := api.call("GET", f"/v1/namespaces/{ns}/jobs/shown", alice).json())["plan"] and j,
                   what="the watch to record the plan")
    assert job["plan"] == plan

    with chromium() as browser:
        page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
        page.set_default_timeout(30_000)
        problems: list[str] = []
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        sign_in(page, api.url, alice)
        page.goto(f"{api.url}/#/jobs?namespace={ns}")  # alice may list in her namespace only
        row = page.locator(f'tr[data-job="{ns}/shown"]')
        try:
            row.wait_for()
        except Exception:
            raise AssertionError(f"{page.url}: {page.locator('#main').inner_text()} {problems}") from None
        assert row.locator("td").nth(2).inner_text() == plan["label"]
        row.get_by_role("link", name="shown").click()
        page.locator(".tier").first.wait_for()
        for tier in ("gpu", "cpu", "nvme"):
            bar = page.locator(f'.tier[data-tier="{tier}"]')
            assert int(bar.get_attribute("data-bytes")) == plan["bytes"][tier]
            assert int(bar.get_attribute("data-capacity")) == plan["capacity"][tier]
            assert "no capacity" not in bar.inner_text()
        assert int(page.locator('.tier[data-tier="gpu"]').get_attribute("data-capacity")) > 0
        step = plan["predictedStepSeconds"]
        predicted = f"predicted {step:.2f} s/step" if step < 10 else f"predicted {step:.1f} s/step"
        assert predicted in page.locator("#main").inner_text()
        assert page.locator("#plan-reasons li").count() == len(plan["reasons"])
        assert page.locator("#plan-rejected li").count() == len(plan["rejected"])
        shapes = page.locator("#plan-rejected-shapes li")
        assert shapes.count() == len(plan["rejectedShapes"])
        assert plan["rejectedShapes"][0]["shape"] in shapes.first.inner_text()
        assert page.locator("#cost-accrued").inner_text() == "$1.25"
        assert ", ".join(plan["nodeNames"]) in page.locator("#main").inner_text()
        shot(page, "6-cluster-job")
        assert problems == []
