"""The Helm chart (charts/spillway) in a cluster: install, upgrade, uninstall (rendered
and validated offline: test_chart_render.py).

The chart is installed into the e2e control plane, where kwok plays the nodes: the
Deployments' and DaemonSet's pods are scheduled (images are never pulled), RBAC
is asked with `kubectl auth can-i` as each service account, and the operator
itself runs as a local process under the chart's operator service account to
reconcile examples/finetune.yaml.
"""

from __future__ import annotations

import copy
import json
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from spillway_operator.builders import runtime_account_name

from .operator_fixtures import OperatorProcess
from .test_chart_render import CHART, RELEASE, ROOT

if TYPE_CHECKING:
    from .cluster import Cluster

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "examples" / "finetune.yaml"
STORAGE_CLASS = "spillway-e2e-chart"
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"


# ------------------------------------------------------ against the cluster --


def add_volume(cluster: Cluster, label: str) -> str:
    """A PersistentVolume of STORAGE_CLASS (nothing here provisions disks); one per claim."""
    name = f"e2e-chart-{secrets.token_hex(4)}"
    cluster.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name, "labels": {"spillway.dev/e2e-chart": label}},
        "spec": {
            "capacity": {"storage": "1Pi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": STORAGE_CLASS,
            "hostPath": {"path": f"/tmp/{name}"},
        },
    }))
    return name


@pytest.fixture
def volumes(cluster: Cluster) -> Iterator[Callable[[], str]]:
    label = secrets.token_hex(4)
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": STORAGE_CLASS},
        "provisioner": "kubernetes.io/no-provisioner",
        "volumeBindingMode": "Immediate",
    }))
    try:
        yield lambda: add_volume(cluster, label)
    finally:
        cluster.kubectl("delete", "pv", "-l", f"spillway.dev/e2e-chart={label}", "--wait=false", check=False)


@pytest.fixture
def release(cluster: Cluster, namespace: str) -> Iterator[Callable[..., Any]]:
    """install(*helm_args): `helm install spillway` into the test namespace; always uninstalled
    afterwards (the chart's ClusterRoles are cluster-wide), with the kept PVC removed."""

    def install(*args: str) -> Any:
        return cluster.helm("install", RELEASE, str(CHART), "-n", namespace, *args)

    try:
        yield install
    finally:
        cluster.run("helm", "--kubeconfig", str(cluster.kubeconfig), "uninstall", RELEASE, "-n", namespace,
                    "--wait", check=False, timeout=120)
        cluster.kubectl("delete", "pvc", "--all", "-n", namespace, "--wait=false", check=False)


def existing(cluster: Cluster, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    obj = cluster.get(kind, name, namespace)
    assert obj is not None, f"{kind} {namespace or ''}/{name} does not exist"
    return obj


def can_i(cluster: Cluster, who: str, *args: str) -> bool:
    proc = cluster.kubectl("auth", "can-i", *args, f"--as={who}", check=False)
    return proc.stdout.strip() == "yes"


def sa(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def pods_of(cluster: Cluster, namespace: str, component: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl_json(
        "get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/component={component},{INSTANCE}"
    )["items"]
    return items


def running_on(cluster: Cluster, namespace: str, component: str) -> list[str] | None:
    pods = pods_of(cluster, namespace, component)
    if pods and all(p["status"].get("phase") == "Running" for p in pods):
        return sorted(p["spec"]["nodeName"] for p in pods)
    return None


CLUSTER_KINDS = ("clusterroles,clusterrolebindings,validatingwebhookconfigurations,validatingadmissionpolicies,"
                 "validatingadmissionpolicybindings")
NAMESPACED_KINDS = "deployments,daemonsets,services,serviceaccounts,configmaps,roles,rolebindings,persistentvolumeclaims"


def owned_objects(cluster: Cluster, namespace: str) -> set[str]:
    names = cluster.kubectl("get", CLUSTER_KINDS, "-l", INSTANCE, "-o", "name").stdout.split()
    names += cluster.kubectl("get", NAMESPACED_KINDS, "-n", namespace, "-l", INSTANCE, "-o", "name").stdout.split()
    return set(names)


# The chart's node probe mounts the node's NVMe root (a hostPath) to measure it.
@pytest.mark.pod_security("privileged")
def test_install_rbac_upgrade_and_uninstall(
    cluster: Cluster, namespace: str, make_node: Callable[..., str], volumes: Callable[[], str],
    release: Callable[..., Any],
) -> None:
    gpu = make_node("gpu-24g")
    cpu = make_node("cpu-only")
    volumes()
    release("--set", f"database.sqlite.storageClassName={STORAGE_CLASS}", "--set", "operator.resyncSeconds=5")

    # Pods: the Deployments land on kwok nodes (the API once its SQLite claim binds), the probe
    # on the GPU node only.
    cluster.wait_for(lambda: running_on(cluster, namespace, "operator"), 60, what="operator pod Running")
    cluster.wait_for(lambda: running_on(cluster, namespace, "api"), 60, what="API pod Running with its PVC")
    probe_nodes = cluster.wait_for(lambda: running_on(cluster, namespace, "node-probe"), 60, what="probe pod")
    assert gpu in probe_nodes and cpu not in probe_nodes
    assert existing(cluster, "pvc", "spillway-db", namespace)["status"]["phase"] == "Bound"
    pricing = existing(cluster, "configmap", "spillway-pricing", namespace)["data"]
    assert pricing["NVIDIA-GeForce-RTX-4090"] == "0.4"
    assert cluster.get("crd", "finetunejobs.spillway.dev") is not None

    # RBAC, as each service account. Elsewhere = a namespace the chart knows nothing about.
    elsewhere = "default"
    operator, api, probe = sa(namespace, "spillway-operator"), sa(namespace, "spillway-api"), sa(
        namespace, "spillway-node-probe")
    allowed = [
        (operator, "list", "nodes"),
        (operator, "watch", "finetunejobs.spillway.dev", "-A"),
        (operator, "patch", "finetunejobs.spillway.dev", "--subresource=status", "-n", elsewhere),
        (operator, "create", "pods", "-n", elsewhere),
        (operator, "create", "roles.rbac.authorization.k8s.io", "-n", elsewhere),
        (operator, "get", "configmap/spillway-pricing", "-n", namespace),
        (operator, "get", "storageclasses.storage.k8s.io"),
        (operator, "update", "secret/spillway-webhook-tls", "-n", namespace),
        (operator, "patch", f"validatingwebhookconfigurations/spillway-{namespace}-finetunejobs"),
        (api, "create", "tokenreviews.authentication.k8s.io"),
        (api, "create", "subjectaccessreviews.authorization.k8s.io"),
        (api, "create", "finetunejobs.spillway.dev", "-n", elsewhere),
        (api, "list", "nodes"),
        (probe, "patch", "nodes"),
    ]
    denied = [
        (operator, "get", "secrets", "-n", namespace),
        (operator, "patch", "nodes"),
        (operator, "get", "secret/spillway-pricing-token", "-n", namespace),
        (operator, "patch", "validatingwebhookconfigurations/other-webhooks"),
        (operator, "create", "deployments.apps", "-n", elsewhere),
        (operator, "escalate", "roles.rbac.authorization.k8s.io", "-n", elsewhere),
        (operator, "create", "clusterrolebindings.rbac.authorization.k8s.io"),
        (api, "create", "pods", "-n", elsewhere),
        (api, "get", "secrets", "-n", namespace),
        (api, "patch", "finetunejobs.spillway.dev", "--subresource=status", "-n", elsewhere),
        (probe, "list", "pods", "-A"),
        (probe, "delete", "nodes"),
        (probe, "get", "secrets", "-n", namespace),
    ]
    assert [a for a in allowed if not can_i(cluster, *a)] == []
    assert [d for d in denied if can_i(cluster, *d)] == []

    # Users: the aggregated roles fold into the built-in edit and view ClusterRoles.
    cluster.kubectl("create", "serviceaccount", "alice", "-n", namespace)
    cluster.kubectl("create", "serviceaccount", "bob", "-n", namespace)
    cluster.kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit", f"--serviceaccount={namespace}:alice",
                    "-n", namespace)
    cluster.kubectl("create", "rolebinding", "bob-view", "--clusterrole=view", f"--serviceaccount={namespace}:bob",
                    "-n", namespace)
    alice, bob = sa(namespace, "alice"), sa(namespace, "bob")
    cluster.wait_for(lambda: can_i(cluster, alice, "create", "finetunejobs.spillway.dev", "-n", namespace), 30,
                     what="spillway-editor aggregated into edit")
    cluster.wait_for(lambda: can_i(cluster, bob, "list", "ftj", "-n", namespace), 30,
                     what="spillway-viewer aggregated into view")
    assert not can_i(cluster, alice, "patch", "finetunejobs.spillway.dev", "--subresource=status", "-n", namespace)
    assert not can_i(cluster, bob, "create", "finetunejobs.spillway.dev", "-n", namespace)
    assert not can_i(cluster, alice, "create", "finetunejobs.spillway.dev", "-n", elsewhere)

    # Upgrade with changed values: new env and prices, a restarted operator, no probe.
    before = existing(cluster, "deployment", "spillway-operator", namespace)
    cluster.helm("upgrade", RELEASE, str(CHART), "-n", namespace, "--reuse-values",
                 "--set", "operator.resyncSeconds=7", "--set", "nodeProbe.enabled=false",
                 "--set-json", 'pricing.gpuHourUSD={"NVIDIA-GeForce-RTX-4090": 0.55}')
    after = existing(cluster, "deployment", "spillway-operator", namespace)
    env = {e["name"]: e.get("value") for e in after["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SPILLWAY_OPERATOR_RESYNC_SECONDS"] == "7"
    old_sum = before["spec"]["template"]["metadata"]["annotations"]["checksum/pricing"]
    assert after["spec"]["template"]["metadata"]["annotations"]["checksum/pricing"] != old_sum
    assert existing(cluster, "configmap", "spillway-pricing", namespace)["data"]["NVIDIA-GeForce-RTX-4090"] == "0.55"
    assert cluster.get("daemonset", "spillway-node-probe", namespace) is None
    assert cluster.get("clusterrole", "spillway-node-probe") is None
    cluster.wait_for(lambda: not pods_of(cluster, namespace, "node-probe"), 30, what="probe pods gone")
    cluster.wait_for(lambda: running_on(cluster, namespace, "operator"), 60, what="upgraded operator Running")

    # Uninstall: only what the chart's README says is kept survives: the CRD and the SQLite PVC.
    assert len(owned_objects(cluster, namespace)) > 15
    cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait")
    assert owned_objects(cluster, namespace) == {"persistentvolumeclaim/spillway-db"}
    assert cluster.get("crd", "finetunejobs.spillway.dev") is not None
    cluster.wait_for(lambda: not pods_of(cluster, namespace, "operator") and not pods_of(cluster, namespace, "api"),
                     30, what="operator and API pods gone")


def service_account_kubeconfig(cluster: Cluster, namespace: str, account: str, path: Path) -> Path:
    """The admin kubeconfig with the user swapped for a token of `account`: a process using it
    has exactly the RBAC the chart gives that service account."""
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=1h").stdout.strip()
    config = json.loads(cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
    config["users"][0]["user"] = {"token": token}
    path.write_text(json.dumps(config))
    return path


def _the_runtime_account_reports_progress_but_cannot_touch_what_is_billed(cluster: Cluster, namespace: str,
                                                                          job: str) -> None:
    """The job's runtime ServiceAccount may patch its status (a namespace editor can run a
    pod as it), but the chart's status policy keeps cost, the plan that prices it and the
    phase the operator's: the API server refuses a forged one, and the operator goes on
    writing them."""
    runtime = f"--as=system:serviceaccount:{namespace}:{runtime_account_name(job)}"

    def patch(status: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl("patch", "ftj", job, "-n", namespace, "--subresource=status", "--type=merge",
                               "-p", json.dumps({"status": status}), runtime, check=False)

    reported = patch({"progress": {"step": 1, "totalSteps": 1000}})
    assert reported.returncode == 0, reported.stderr
    before = (cluster.get("ftj", job, namespace) or {})["status"]
    for forged in ({"cost": {"usd": 0, "settledUSD": 0}}, {"plan": {"pricePerHourUsd": 0}}, {"phase": "Succeeded"}):
        refused = patch(forged)
        field = next(iter(forged))
        assert refused.returncode != 0 and f"status.{field} is written by the spillway operator only" in refused.stderr, (
            forged, refused.stderr)
    after = (cluster.get("ftj", job, namespace) or {})["status"]
    assert after["plan"]["pricePerHourUsd"] == before["plan"]["pricePerHourUsd"] > 0
    assert after["phase"] != "Succeeded"
    # The operator still accrues cost (its own writes pass the policy).
    cluster.wait_for(lambda: ((cluster.get("ftj", job, namespace) or {}).get("status", {}).get("cost") or {}).get(
        "asOf") not in (None, (before.get("cost") or {}).get("asOf")), 60, what="the operator's next status.cost")


def _the_operators_token_reaches_only_the_children_of_jobs(cluster: Cluster, namespace: str, kubeconfig: Path,
                                                           child: dict[str, Any]) -> None:
    """RBAC lets the operator create pods, patch ConfigMaps and bind Roles in any namespace;
    the chart's policy, enforced by the API server, confines its ServiceAccount's token to
    the children of FineTuneJobs. Each try is made with that token and refused."""
    def as_operator(*args: str, body: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl("--kubeconfig", str(kubeconfig), *args, check=False,
                               input=json.dumps(body) if body is not None else None)

    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "escape"},
           "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {"privileged": True}}],
                    "volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}
    refused = as_operator("create", "-n", "kube-system", "-f", "-", body=pod)
    assert refused.returncode != 0 and "only the children of a FineTuneJob" in refused.stderr, refused.stderr
    # Dressed as a child of a real job (its labels and owner), it is still unprivileged and
    # mounts no node directory but the admin's roots.
    dressed = copy.deepcopy(pod)
    dressed["metadata"].update(namespace=namespace, labels=child["metadata"]["labels"],
                               ownerReferences=child["metadata"]["ownerReferences"])
    refused = as_operator("create", "-n", namespace, "-f", "-", body=dressed)
    assert refused.returncode != 0 and "a pod of the spillway operator is unprivileged" in refused.stderr, refused.stderr
    dressed["spec"].pop("volumes")
    # Not privileged, but root: with CHOWN (what the S3 fetch pod's init container once had),
    # or in a pod that does not ask the kubelet to refuse root.
    for root in ({"runAsUser": 0, "runAsNonRoot": False}, {"capabilities": {"add": ["CHOWN"]}}, {}):
        dressed["spec"]["containers"][0]["securityContext"] = root
        dressed["spec"]["securityContext"] = {"runAsNonRoot": bool(root)}
        refused = as_operator("create", "-n", namespace, "-f", "-", body=dressed)
        assert refused.returncode != 0 and "no container as root" in refused.stderr, (root, refused.stderr)
    dressed["spec"]["containers"][0].pop("securityContext")
    dressed["spec"]["securityContext"] = {"runAsNonRoot": True}
    dressed["spec"]["serviceAccountName"] = "default"  # an API token of another account
    refused = as_operator("create", "-n", namespace, "-f", "-", body=dressed)
    assert refused.returncode != 0 and "runtime ServiceAccount, or with no API token" in refused.stderr, refused.stderr
    # CoreDNS's ConfigMap (made here: the test cluster runs CoreDNS outside the cluster)
    cluster.kubectl("create", "configmap", "coredns", "-n", "kube-system", "--from-literal=Corefile=.:53 {}",
                    check=False)
    refused = as_operator("patch", "configmap", "coredns", "-n", "kube-system", "--type=merge",
                          "-p", '{"data":{"Corefile":". { forward . 203.0.113.1 }"}}')
    assert refused.returncode != 0 and "only the children of a FineTuneJob" in refused.stderr, refused.stderr
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "escalate", "namespace": namespace, "labels": child["metadata"]["labels"],
                            "ownerReferences": child["metadata"]["ownerReferences"]},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
               "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}]}
    refused = as_operator("create", "-f", "-", body=binding)
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr
    assert cluster.get("rolebinding", "escalate", namespace) is None
    # A NetworkPolicy is additive: one that selected every pod of the namespace and let
    # anything in would open what the namespace's own policies keep shut.
    opener = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "metadata": {"name": "open-all", "namespace": namespace, "labels": child["metadata"]["labels"],
                           "ownerReferences": child["metadata"]["ownerReferences"]},
              "spec": {"podSelector": {}, "ingress": [{}], "policyTypes": ["Ingress"]}}
    refused = as_operator("create", "-f", "-", body=opener)
    assert refused.returncode != 0 and "selects its own job's pods only" in refused.stderr, refused.stderr
    assert cluster.get("pod", "escape", "kube-system") is None and cluster.get("pod", "escape", namespace) is None


# The example's s3:// model: its fetch pod writes into the node's S3 cache (a hostPath). And the
# chart's own policy, not Pod Security, must be what refuses the operator's token a privileged pod.
@pytest.mark.pod_security("privileged")
def test_operator_under_the_charts_service_account_runs_the_13b_example(
    cluster: Cluster, namespace: str, make_node: Callable[..., str], volumes: Callable[[], str],
    release: Callable[..., Any], tmp_path: Path,
) -> None:
    """The user flow: helm install, kubectl apply -f examples/finetune.yaml, kubectl get ftj.
    The in-cluster operator pod is fake under kwok, so the real operator runs here, as the
    chart's operator ServiceAccount: if the chart's RBAC lacks anything it needs, this fails."""
    # The example's checkpoint class, and the models/data claims its pvc:// URIs name.
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": "spillway-checkpoints"},
        "provisioner": "kubernetes.io/no-provisioner",
        "volumeBindingMode": "Immediate",
    }))
    example = yaml.safe_load(EXAMPLE.read_text())
    assert example["spec"]["checkpoint"]["storageClassName"] == "spillway-checkpoints"
    assert example["spec"]["model"]["uri"].startswith("s3://")
    for claim in ("data",):
        volumes()
        cluster.apply({
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": STORAGE_CLASS,
                     "resources": {"requests": {"storage": "1Ti"}}},
        }, namespace)
    checkpoint_pv = f"e2e-chart-ckpt-{secrets.token_hex(4)}"
    cluster.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": checkpoint_pv},
        "spec": {"capacity": {"storage": "1Pi"}, "accessModes": ["ReadWriteOnce"],
                 "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "spillway-checkpoints",
                 "hostPath": {"path": f"/tmp/{checkpoint_pv}"}},
    }))
    gpu = make_node("gpu-24g", nvme_volume=True)
    release("--set", "operator.replicas=0", "--set", "api.enabled=false", "--set", "nodeProbe.enabled=false")

    kubeconfig = service_account_kubeconfig(cluster, namespace, "spillway-operator", tmp_path / "operator.kubeconfig")
    env = dict(cluster.env, KUBECONFIG=str(kubeconfig))
    operator = OperatorProcess(env, tmp_path / "operator.log")
    operator.env["SPILLWAY_OPERATOR_NAMESPACE"] = namespace  # where the chart put the pricing ConfigMap
    operator.env["SPILLWAY_OPERATOR_PRICING_CONFIGMAP"] = "spillway-pricing"
    operator.env["SPILLWAY_OPERATOR_COST_UPDATE_SECONDS"] = "3"  # the status policy lets its writes through
    operator.start()
    try:
        cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))

        def planned() -> dict[str, Any] | None:
            job = cluster.get("ftj", "llama-13b-sft", namespace) or {}
            plan = (job.get("status") or {}).get("plan") or {}
            return plan if plan.get("optimizer") else None

        try:
            plan = cluster.wait_for(planned, 60, what="status.plan")
        except AssertionError:
            raise AssertionError(f"no plan; operator log:\n{(tmp_path / 'operator.log').read_text()[-4000:]}") from None
        # 13B needs ~210 GB of state: a 24 GB GPU and 64 GiB of RAM force the optimizer to NVMe.
        assert plan["optimizer"] == "nvme" and plan["zeroStage"] == 3, plan
        assert plan["nodeNames"] == [gpu]
        assert plan["bytes"]["nvme"] > 100 * 10**9
        assert plan["pricePerHourUsd"] == pytest.approx(0.4), "the chart's pricing ConfigMap was not read"

        def pods(component: str) -> list[dict[str, Any]]:
            return cluster.kubectl_json("get", "pods", "-n", namespace, "-l",
                                        f"spillway.dev/job=llama-13b-sft,app.kubernetes.io/component={component}")["items"]

        # The model is in S3: a short pod on the chosen node downloads it first, holding no GPU,
        # with the keys of the example's Secret; kwok runs it, and it is ended here as a done download.
        fetcher = cluster.wait_for(lambda: (found := pods("s3-fetch")) and found[0], 60, what="the S3 fetch pod")
        assert not pods("trainer"), "a training pod before the model was downloaded"
        terms = fetcher["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [gpu]
        container = fetcher["spec"]["containers"][0]
        assert "nvidia.com/gpu" not in json.dumps(container["resources"])
        keys = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e}
        assert keys["AWS_ACCESS_KEY_ID"] == keys["AWS_SECRET_ACCESS_KEY"] == "s3-credentials"
        cluster.set_pod_phase(namespace, fetcher["metadata"]["name"], "Succeeded")

        def pod() -> dict[str, Any] | None:
            running = [p for p in pods("trainer") if p["status"].get("phase") == "Running"]
            return running[0] if running else None

        try:
            training_pod = cluster.wait_for(pod, 60, what="training pod Running")
        except AssertionError:
            events = cluster.kubectl("get", "events", "-n", namespace).stdout
            raise AssertionError(f"pod not Running; events:\n{events}\noperator log:\n"
                                 f"{(tmp_path / 'operator.log').read_text()[-3000:]}") from None
        assert training_pod["spec"]["nodeName"] == gpu
        # Made by the operator's own token before the pods: the job's pods take connections
        # from the same job's pods only (no metrics namespace is set in this release).
        policy = cluster.get("networkpolicy", "llama-13b-sft-ingress", namespace) or {}
        assert policy["spec"]["podSelector"]["matchLabels"]["spillway.dev/job"] == "llama-13b-sft"
        assert policy["spec"]["ingress"] == [{"from": [{"podSelector": policy["spec"]["podSelector"]}]}]
        ephemeral = [v["ephemeral"]["volumeClaimTemplate"]["spec"] for v in training_pod["spec"]["volumes"]
                     if "ephemeral" in v]
        assert [e["storageClassName"] for e in ephemeral] == ["spillway-local-nvme"]
        requests = training_pod["spec"]["containers"][0]["resources"]["requests"]
        assert requests["nvidia.com/gpu"] == "1"
        _the_runtime_account_reports_progress_but_cannot_touch_what_is_billed(cluster, namespace, "llama-13b-sft")
        _the_operators_token_reaches_only_the_children_of_jobs(cluster, namespace, kubeconfig, training_pod)
        assert parse_bytes(requests["memory"]) >= plan["bytes"]["cpu"]

        table = cluster.kubectl("get", "ftj", "-n", namespace).stdout
        header = table.splitlines()[0].split()
        assert header == ["NAME", "PHASE", "MODEL", "PLAN", "STEP", "LOSS", "COST", "AGE"], table
        assert "llama-13b-sft" in table and "s3://models/llama-13b" in table

        # Cost counts whole seconds from the pod's startTime to its container's finishedAt;
        # let at least two pass so the job has run for a measurable time.
        time.sleep(2)
        cluster.set_pod_phase(namespace, training_pod["metadata"]["name"], "Succeeded")
        done = cluster.wait_for(
            lambda: (j := cluster.get("ftj", "llama-13b-sft", namespace)) and j["status"].get("phase") == "Succeeded"
            and j, 30, what="job Succeeded")
        assert done["status"]["cost"]["pricePerHourUSD"] == pytest.approx(0.4), done["status"]
        assert done["status"]["cost"]["usd"] > 0, done["status"]
        log = (tmp_path / "operator.log").read_text()
        assert "Forbidden" not in log and "403" not in log, f"the chart's RBAC refused the operator:\n{log[-3000:]}"
    finally:
        operator.stop()
        cluster.kubectl("delete", "ftj", "--all", "-n", namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "pv", checkpoint_pv, "--wait=false", check=False)


def parse_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    for suffix, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * factor)
    return int(quantity)

