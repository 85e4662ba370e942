"""A job's NetworkPolicy: who may open a connection to its pods.

Where this sits: a pure builder beside `builders`, called by `children` before the
pods are created, so no pod of the job is ever reachable from outside it. The
chart's own NetworkPolicies (templates/networkpolicies.yaml) cover the operator,
the API and the node probe; this one names the job, so the operator makes it.
"""

from __future__ import annotations

from typing import Any

from spillway_operator.builders import LABEL_JOB, LABEL_MANAGED_BY, MANAGER, child_meta, child_name
from spillway_operator.settings import OperatorSettings

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace


def network_policy_name(job: str) -> str:
    return child_name(job, "ingress")


def build_network_policy(job: dict[str, Any], settings: OperatorSettings) -> dict[str, Any]:
    """The job's pods accept any port from the same job's pods (the rendezvous and the
    ports gloo and NCCL pick), the `metrics` port from the admin's metrics namespaces,
    nothing else. Egress is left alone (the API server, S3, the model's registry)."""
    name = job["metadata"]["name"]
    own = {LABEL_JOB: name, LABEL_MANAGED_BY: MANAGER}
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": own}}]}]
    if settings.metrics_namespaces:
        ingress.append({
            "ports": [{"port": "metrics", "protocol": "TCP"}],
            "from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ns}}}
                     for ns in settings.metrics_namespaces],
        })
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_meta(job, network_policy_name(name), "network-policy"),
        "spec": {"podSelector": {"matchLabels": own}, "policyTypes": ["Ingress"], "ingress": ingress},
    }
