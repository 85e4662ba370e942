"""Smoke tests for the e2e control plane itself (hack/cluster, hack/kwok).

Each test proves one thing the Spillway e2e suite relies on is real: the API
server validates and stores custom resources, the scheduler accounts for
nvidia.com/gpu, the garbage collector follows owner references, service
account tokens authenticate and RBAC authorizes, helm installs, and kwok
runs pods on simulated GPU nodes and ends them when told to.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .cluster import Cluster

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
NODE_PROFILES = sorted(p.stem for p in (REPO_ROOT / "hack" / "kwok" / "nodes").glob("*.yaml"))

# Never pulled: kwok simulates containers.
IMAGE = "registry.invalid/spillway/e2e:0"


def pod_manifest(
    name: str,
    *,
    gpus: int = 0,
    cpu: str = "100m",
    nodes: list[str] | None = None,
    scratch: str | None = None,
) -> dict[str, Any]:
    """A bare pod; ``nodes`` pins it to those node names with a hostname
    affinity (which says nothing about GPUs), so other tests' nodes or a
    shared cluster cannot change where it may go."""
    resources: dict[str, Any] = {"requests": {"cpu": cpu, "memory": "64Mi"}}
    if gpus:
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        # What Pod Security `restricted` (the namespace fixture's default) asks of a pod
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "main", "image": IMAGE, "resources": resources,
                        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
    }
    if scratch:
        # Node-local NVMe scratch the way the operator asks for it: a generic
        # ephemeral volume of the e2e cluster's local-NVMe class.
        spec["containers"][0]["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
        claim = {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "spillway-local-nvme",
            "resources": {"requests": {"storage": scratch}},
        }
        spec["volumes"] = [{"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": claim}}}]
    if nodes:
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
                            ]
                        }
                    ]
                }
            }
        }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def bound_node(cluster: Cluster, namespace: str, pod: str, timeout: float = 30) -> str:
    node: str = cluster.wait_for(
        lambda: (cluster.get("pod", pod, namespace) or {}).get("spec", {}).get("nodeName"),
        timeout,
        what=f"the scheduler to bind {namespace}/{pod}",
    )
    return node


def unschedulable_message(cluster: Cluster, namespace: str, pod: str, timeout: float = 30, containing: str = "") -> str:
    """The scheduler's reason for not placing the pod, once it says `containing` (its first
    word may be a passing state: an ephemeral volume's claim not made yet)."""
    def message() -> str | None:
        obj = cluster.get("pod", pod, namespace) or {}
        for cond in obj.get("status", {}).get("conditions", []):
            if cond["type"] == "PodScheduled" and cond.get("reason") == "Unschedulable":
                said = cond.get("message") or "(no message)"
                return said if containing in said else None
        return None

    return cluster.wait_for(message, timeout, what=f"{namespace}/{pod} to be reported Unschedulable ({containing!r})")


def test_control_plane_runs_the_pinned_kubernetes(cluster: Cluster, kube_api: Any) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
    assert int(version["serverVersion"]["minor"].rstrip("+")) >= 33
    # The components it needs are all healthy and RBAC is on.
    assert cluster.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
    assert cluster.get("clusterrole", "system:kube-scheduler") is not None

    # The Python client logs in with the same kubeconfig (token, CA data).
    from kubernetes import client

    assert client.VersionApi(kube_api).get_code().git_version == version["serverVersion"]["gitVersion"]
    namespaces = {ns.metadata.name for ns in client.CoreV1Api(kube_api).list_namespace().items if ns.metadata}
    assert {"default", "kube-system"} <= namespaces


@pytest.mark.parametrize("profile", NODE_PROFILES)
def test_node_profiles_register_as_ready_nodes(cluster: Cluster, make_node: Any, profile: str) -> None:
    manifest = cluster.node_manifest(profile, "unused")
    name = make_node(profile)
    node = cluster.get("node", name)
    assert node is not None
    labels, annotations = node["metadata"]["labels"], node["metadata"].get("annotations", {})
    # kwok keeps what the profile declared and adds the kubelet's view.
    assert node["status"]["allocatable"] == manifest["status"]["allocatable"]
    assert node["status"]["nodeInfo"]["kubeletVersion"].startswith("kwok-")
    assert labels["type"] == "kwok"
    if profile == "cpu-only":
        assert "nvidia.com/gpu" not in node["status"]["allocatable"]
        assert not any(k.startswith("nvidia.com/") for k in labels)
    else:
        count = int(labels["nvidia.com/gpu.count"])
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(count)
        assert int(labels["nvidia.com/gpu.memory"]) > 20_000
        assert " " not in labels["nvidia.com/gpu.product"]
        for key in (
            "spillway.dev/nvme-capacity-bytes",
            "spillway.dev/nvme-free-bytes",
            "spillway.dev/nvme-read-bytes-per-second",
            "spillway.dev/nvme-write-bytes-per-second",
            "spillway.dev/cpu-adam-params-per-second",
            "spillway.dev/host-device-bytes-per-second",
        ):
            assert annotations[key].isdigit(), key
        assert int(annotations["spillway.dev/nvme-free-bytes"]) <= int(
            annotations["spillway.dev/nvme-capacity-bytes"]
        )
        assert annotations["spillway.dev/nvme-path"].startswith("/")


def test_custom_resource_round_trips_and_is_validated(cluster: Cluster, namespace: str) -> None:
    crd = FIXTURES_DIR / "widget-crd.yaml"
    cluster.kubectl("apply", "-f", str(crd))
    try:
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd/widgets.smoke.spillway.dev", "--timeout=30s"
        )
        spec = {"size": 3, "product": "NVIDIA-L40S", "tags": ["a", "b"]}
        widget = {
            "apiVersion": "smoke.spillway.dev/v1alpha1",
            "kind": "Widget",
            "metadata": {"name": "w1"},
            "spec": spec,
        }
        cluster.apply(widget, namespace)
        stored = cluster.kubectl_json("get", "widgets.smoke.spillway.dev", "w1", "-n", namespace)
        assert stored["spec"] == spec
        assert stored["metadata"]["uid"]

        # The API server enforces the schema...
        invalid = dict(widget, metadata={"name": "w2"}, spec={"size": 0})
        rejected = cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=json.dumps(invalid), check=False
        )
        assert rejected.returncode != 0
        assert "spec.size" in rejected.stderr
        assert cluster.get("widgets.smoke.spillway.dev", "w2", namespace) is None

        # ...and serves status as a subresource: writes to the main resource
        # ignore it, writes to /status land.
        cluster.kubectl(
            "patch",
            "widget",
            "w1",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"status": {"phase": "Ignored"}}),
        )
        assert "status" not in cluster.kubectl_json("get", "widget", "w1", "-n", namespace)
        cluster.kubectl(
            "patch",
            "widget",
            "w1",
            "-n",
            namespace,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {"phase": "Ready"}}),
        )
        assert cluster.kubectl_json("get", "widget", "w1", "-n", namespace)["status"] == {"phase": "Ready"}
    finally:
        cluster.kubectl("delete", "-f", str(crd), "--ignore-not-found", "--timeout=60s", check=False)


def test_scheduler_puts_gpu_pods_on_gpu_nodes_only(cluster: Cluster, namespace: str, make_node: Any) -> None:
    cpu_node = make_node("cpu-only")
    gpu_node = make_node("gpu-24g")  # one GPU
    nodes = [cpu_node, gpu_node]

    # The cpu-only node does take pods: what keeps GPU pods off it is the
    # resource, not a broken node.
    cluster.apply(pod_manifest("cpu-pod", nodes=[cpu_node]), namespace)
    assert bound_node(cluster, namespace, "cpu-pod") == cpu_node

    cluster.apply(pod_manifest("gpu-pod-1", gpus=1, nodes=nodes), namespace)
    assert bound_node(cluster, namespace, "gpu-pod-1") == gpu_node

    # The only GPU is taken and the cpu-only node has none: the second GPU
    # pod must wait, and the scheduler says why.
    cluster.apply(pod_manifest("gpu-pod-2", gpus=1, nodes=nodes), namespace)
    message = unschedulable_message(cluster, namespace, "gpu-pod-2")
    assert "Insufficient nvidia.com/gpu" in message
    assert "nodeName" not in cluster.kubectl_json("get", "pod", "gpu-pod-2", "-n", namespace)["spec"]

    # Freeing the GPU lets it in, on the GPU node.
    cluster.kubectl("delete", "pod", "gpu-pod-1", "-n", namespace, "--timeout=30s")
    assert bound_node(cluster, namespace, "gpu-pod-2", timeout=60) == gpu_node


def test_generic_ephemeral_volumes_bind_local_nvme_volumes(
    cluster: Cluster, namespace: str, make_node: Any
) -> None:
    nvme_node = make_node("gpu-48g-nvme", nvme_volume=True)
    bare_node = make_node("gpu-24g")  # GPUs and NVMe annotations, but no volume
    nodes = [nvme_node, bare_node]

    cluster.apply(pod_manifest("scratch-1", gpus=1, nodes=nodes, scratch="1Ti"), namespace)
    assert bound_node(cluster, namespace, "scratch-1") == nvme_node

    def bound_claim() -> dict[str, Any] | None:
        # The ephemeral volume controller names the claim <pod>-<volume>.
        claim = cluster.get("pvc", "scratch-1-scratch", namespace)
        return claim if claim and claim["status"].get("phase") == "Bound" else None

    claim = cluster.wait_for(bound_claim, what="the ephemeral volume's claim to bind")
    volume = cluster.kubectl_json("get", "pv", claim["spec"]["volumeName"])
    assert volume["spec"]["local"]["path"] == "/mnt/nvme-raid0"
    affinity = volume["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]
    assert affinity["values"] == [nvme_node]

    # The only volume is taken: the next claimant waits, although GPUs are free.
    cluster.apply(pod_manifest("scratch-2", gpus=1, nodes=nodes, scratch="1Ti"), namespace)
    said = unschedulable_message(cluster, namespace, "scratch-2", containing="persistent volumes to bind")
    assert "persistent volumes to bind" in said


def test_deleting_an_owner_garbage_collects_its_dependents(cluster: Cluster, namespace: str) -> None:
    owner = cluster.apply(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}, "data": {"k": "v"}},
        namespace,
    )
    owner_ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "dependent", "ownerReferences": [owner_ref]},
        },
        namespace,
    )
    cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bystander"}}, namespace)

    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    cluster.wait_for(
        lambda: cluster.get("configmap", "dependent", namespace) is None,
        timeout=60,
        what="the garbage collector to delete the dependent ConfigMap",
    )
    assert cluster.get("configmap", "bystander", namespace) is not None


def test_service_account_tokens_authenticate_and_rbac_authorizes(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("create", "serviceaccount", "robot", "-n", namespace)
    token = cluster.kubectl("create", "token", "robot", "-n", namespace, "--duration=10m").stdout.strip()

    def review(tok: str) -> Any:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": tok}}
        return cluster.kubectl_json("create", "-f", "-", input=json.dumps(body))["status"]

    status = review(token)
    assert status["authenticated"] is True
    assert status["user"]["username"] == f"system:serviceaccount:{namespace}:robot"
    assert f"system:serviceaccounts:{namespace}" in status["user"]["groups"]
    forged = token[:-6] + ("AAAAAA" if not token.endswith("AAAAAA") else "BBBBBB")
    assert not review(forged).get("authenticated")

    # The token itself, against RBAC: forbidden until a RoleBinding allows it.
    as_robot = ("--token", token, "-n", namespace)
    denied = cluster.kubectl("get", "configmaps", *as_robot, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()
    cluster.kubectl(
        "create", "role", "cm-reader", "--verb=get,list", "--resource=configmaps", "-n", namespace
    )
    cluster.kubectl(
        "create",
        "rolebinding",
        "robot-cm-reader",
        "--role=cm-reader",
        f"--serviceaccount={namespace}:robot",
        "-n",
        namespace,
    )
    cluster.wait_for(
        lambda: cluster.kubectl("get", "configmaps", *as_robot, check=False).returncode == 0,
        timeout=30,
        what="the RoleBinding to take effect",
    )
    # A SubjectAccessReview agrees, and the grant stops at its verbs.
    sar = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": f"system:serviceaccount:{namespace}:robot",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
            "resourceAttributes": {"namespace": namespace, "verb": "delete", "resource": "configmaps"},
        },
    }
    assert cluster.kubectl_json("create", "-f", "-", input=json.dumps(sar))["status"]["allowed"] is False


# The fixture chart's Deployment sets no securityContext: `baseline` admits its pod, `restricted` would not.
@pytest.mark.pod_security("baseline")
def test_helm_templates_and_installs_a_chart(cluster: Cluster, namespace: str, make_node: Any) -> None:
    make_node("cpu-only")
    chart = str(FIXTURES_DIR / "charts" / "smoke")

    rendered = cluster.helm("template", "rel", chart, "--set", "message=templated").stdout
    assert "kind: ConfigMap" in rendered and 'message: "templated"' in rendered

    cluster.helm(
        "install",
        "rel",
        chart,
        "-n",
        namespace,
        "--set",
        "message=installed",
        "--wait",
        "--timeout",
        "120s",
    )
    config = cluster.get("configmap", "rel-smoke", namespace)
    assert config is not None and config["data"]["message"] == "installed"
    # helm asked the API server for its version during install.
    server = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    assert config["data"]["kubeVersion"] == server
    deployment = cluster.kubectl_json("get", "deployment", "rel-smoke", "-n", namespace)
    assert deployment["status"].get("readyReplicas") == 1
    releases = json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("rel", "deployed")]

    cluster.helm("uninstall", "rel", "-n", namespace, "--wait")
    assert cluster.get("configmap", "rel-smoke", namespace) is None


def test_kwok_runs_pods_and_tests_decide_how_they_end(
    cluster: Cluster, namespace: str, make_node: Any, set_pod_phase: Any
) -> None:
    node = make_node("gpu-80g")  # eight GPUs
    for name in ("trainer-ok", "trainer-oom"):
        cluster.apply(pod_manifest(name, gpus=4, nodes=[node]), namespace)

    running = cluster.wait_for_pod_phase(namespace, "trainer-ok", "Running")
    assert running["spec"]["nodeName"] == node
    assert running["status"]["podIP"]
    addresses = cluster.kubectl_json("get", "node", node)["status"]["addresses"]
    assert running["status"]["hostIP"] == next(a["address"] for a in addresses if a["type"] == "InternalIP")
    assert running["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
    # Without a word from the test, a simulated pod keeps running.
    time.sleep(2)
    assert cluster.kubectl_json("get", "pod", "trainer-ok", "-n", namespace)["status"]["phase"] == "Running"

    done = set_pod_phase(namespace, "trainer-ok", "Succeeded")
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0
    assert (
        terminated["startedAt"] == running["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
    )

    failed = set_pod_phase(namespace, "trainer-oom", "Failed", exit_code=137, reason="OOMKilled")
    terminated = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (137, "OOMKilled")

    # Finished pods hold no GPUs: all eight fit again.
    cluster.apply(pod_manifest("trainer-big", gpus=8, nodes=[node]), namespace)
    assert cluster.wait_for_pod_phase(namespace, "trainer-big", "Running")["spec"]["nodeName"] == node
