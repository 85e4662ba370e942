"""The operator under RBAC that forbids part of what it needs: the job says which permission
is missing, nothing is half-created, and it proceeds once an admin grants it.

Its own module: no other operator may run beside the restricted one, and the operators
of the other e2e modules are module-scoped fixtures, stopped before this module starts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e.operator_fixtures import (
    OPERATOR_NAMESPACE,
    OperatorProcess,
    active_pods,
    add_checkpoint_volume,
    events_of,
    install_crd,
    job_manifest,
    wait_status,
)

pytestmark = pytest.mark.e2e


def _condition(job: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in job.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def test_rbac_forbidding_pod_creation_is_reported_and_retried(
    cluster: Any, namespace: str, make_node: Callable[..., str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The operator runs as a service account with the chart's operator roles minus `create pods`:
    the job says which permission is missing, creates nothing, and proceeds once it is granted."""
    import yaml

    from tests.e2e.test_chart import CHART, service_account_kubeconfig

    install_crd(cluster)
    node = make_node("gpu-48g-nvme")
    add_checkpoint_volume(cluster)
    rendered = cluster.helm("template", "spillway-limited", str(CHART), "-n", OPERATOR_NAMESPACE,
                            "--set", "operator.leaderElection=false").stdout
    roles = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in ("ClusterRole", "Role")
             and d["metadata"]["name"].startswith("spillway-limited-operator")]
    assert roles, "the chart renders operator roles"
    account = "limited-operator"
    cluster.kubectl("create", "serviceaccount", account, "-n", OPERATOR_NAMESPACE, check=False)
    for role in roles:
        for rule in role["rules"]:
            if "pods" in rule.get("resources", []):
                rule["verbs"] = [v for v in rule["verbs"] if v != "create"]
        cluster.apply(role)
        binding_kind = "ClusterRoleBinding" if role["kind"] == "ClusterRole" else "RoleBinding"
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": binding_kind,
                   "metadata": {"name": role["metadata"]["name"], **({"namespace": OPERATOR_NAMESPACE}
                                                                     if binding_kind == "RoleBinding" else {})},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role["kind"],
                               "name": role["metadata"]["name"]},
                   "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": OPERATOR_NAMESPACE}]}
        cluster.apply(binding)
    work = tmp_path_factory.mktemp("limited-operator")
    env = dict(cluster.env)
    env["KUBECONFIG"] = str(service_account_kubeconfig(cluster, OPERATOR_NAMESPACE, account, work / "kubeconfig"))
    op = OperatorProcess(env, work / "operator.log")
    op.env["SPILLWAY_OPERATOR_PRICING_CONFIGMAP"] = "spillway-limited-pricing"
    op.start()
    try:
        cluster.apply(job_manifest("denied", node=node), namespace)
        job = wait_status(cluster, namespace, "denied",
                          lambda s: _condition({"status": s}, "Authorized").get("status") == "False", timeout=90)
        message = _condition(job, "Authorized")["message"]
        assert "forbidden" in message.lower() and "pods" in message
        assert any(e["reason"] == "Forbidden" for e in events_of(cluster, namespace, "denied"))
        assert active_pods(cluster, namespace, "denied") == []

        cluster.kubectl("create", "clusterrole", "limited-operator-pods", "--verb=create", "--resource=pods")
        cluster.kubectl("create", "clusterrolebinding", "limited-operator-pods", "--clusterrole=limited-operator-pods",
                        f"--serviceaccount={OPERATOR_NAMESPACE}:{account}")
        wait_status(cluster, namespace, "denied",
                    lambda s: _condition({"status": s}, "Authorized").get("status") == "True", timeout=120)
        assert len(active_pods(cluster, namespace, "denied")) == 1
    finally:
        op.stop()
        cluster.kubectl("delete", "clusterrolebinding", "limited-operator-pods", check=False)
        cluster.kubectl("delete", "clusterrole", "limited-operator-pods", check=False)
        for role in roles:
            cluster.kubectl("delete", role["kind"].lower(), role["metadata"]["name"],
                            *(["-n", OPERATOR_NAMESPACE] if role["kind"] == "Role" else []), check=False)
