"""The test cluster's real node: real containers, run by containerd and runc under
a real kubelet, inside the cluster's own network namespace (hack/cluster).

These tests hold the harness to what hack/CLUSTER.md promises: a pod on the
real node runs its image as the user it asks for, reaches the API server with
its own ServiceAccount through the `kubernetes` Service, and its logs come back
through the kubelet; `hack/cluster down` leaves no process, mount, network
namespace or cgroup behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spillway_operator.builders import RENDEZVOUS_PORT
from spillway_operator.netpol import build_network_policy
from spillway_operator.settings import OperatorSettings
from tests.e2e.cluster import HACK_CLUSTER, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

# Reads the pod's own object from the API server as its ServiceAccount, through the
# `kubernetes` Service (kube-proxy's rules), verifying the server with the mounted CA.
WHOAMI = textwrap.dedent(
    """
    import json, os, ssl, urllib.request
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    token = open(f"{sa}/token").read()
    ns = open(f"{sa}/namespace").read()
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    url = f"https://{host}:{port}/api/v1/namespaces/{ns}/pods/{os.environ['POD_NAME']}"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
    pod = json.load(urllib.request.urlopen(req, context=ctx, timeout=20))
    print(json.dumps({"uid": pod["metadata"]["uid"], "me": [os.getuid(), os.getgid()], "node": pod["spec"]["nodeName"]}))
    """
)


def _reader_account(cluster: Cluster, namespace: str) -> None:
    """A ServiceAccount allowed to get pods in ``namespace``, and nothing else."""
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    cluster.kubectl("create", "role", "pod-reader", "--verb=get", "--resource=pods", "-n", namespace)
    cluster.kubectl(
        "create", "rolebinding", "pod-reader", "--role=pod-reader", f"--serviceaccount={namespace}:reader",
        "-n", namespace,
    )


def test_a_pod_on_the_real_node_reads_itself_from_the_api_server(cluster: Cluster, namespace: str) -> None:
    image = cluster.load_images("python")["python"]
    _reader_account(cluster, namespace)
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "whoami"},
        "spec": cluster.on_real_node({
            "restartPolicy": "Never",
            "serviceAccountName": "reader",
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000},
            "containers": [{
                "name": "main",
                "image": image,
                "imagePullPolicy": "Never",
                "command": ["python3", "-c", WHOAMI],
                "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
            }],
        }),
    }
    created = cluster.apply(pod, namespace)
    done = cluster.wait_for_pod_phase(namespace, "whoami", ("Succeeded", "Failed"), timeout=120)
    logs = cluster.kubectl("logs", "whoami", "-n", namespace).stdout
    assert done["status"]["phase"] == "Succeeded", logs
    seen = json.loads(logs.strip().splitlines()[-1])
    # The object the API server gave the pod is this pod: same uid, on the real node,
    # and the process ran as the user the pod asked for.
    assert seen == {"uid": created["metadata"]["uid"], "me": [1000, 1000], "node": cluster.real_node}
    assert done["status"]["podIP"].startswith("10.245.")


def _cgroup_dirs(path: str) -> list[str]:
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
              if line.split()[2] in ("cgroup", "cgroup2")]
    return [m + path for m in mounts if os.path.isdir(m + path)]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory with a short path: containerd's sockets under it must stay within the
    104 characters of a Unix socket path (a pytest-xdist worker's tmp_path is too long)."""
    path = Path(tempfile.mkdtemp(prefix="sw-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_down_leaves_no_process_mount_namespace_or_cgroup(cluster: Cluster, short_tmp: Path) -> None:
    """A second cluster, beside the session's, with a running container; `down`
    must remove every trace of it and leave the session's cluster alone."""
    state = short_tmp / "second"
    env = dict(os.environ, SPILLWAY_CLUSTER_DIR=str(state))
    env.pop("SPILLWAY_CLUSTER_IMAGES_DIR", None)  # the session's cluster's roots are its own
    up = subprocess.run([str(HACK_CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stderr[-3000:]
    second = Cluster(kubeconfig=state / "kubeconfig", env=dict(cluster.env, KUBECONFIG=str(state / "kubeconfig")),
                     state_dir=state)
    try:
        settings = second.settings()
        assert settings["NETNS"] != cluster.settings()["NETNS"]
        image = second.load_images("pause")["pause"]
        second.wait_for(lambda: second.get("serviceaccount", "default", "default"), 60, what="default SA")
        second.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "idle"},
                      "spec": second.on_real_node({"containers": [
                          {"name": "idle", "image": image, "imagePullPolicy": "Never"}]})}, "default")
        second.wait_for_pod_phase("default", "idle", "Running", timeout=120)
        cgroup = settings["CGROUP"]
        assert _cgroup_dirs(cgroup), "the cluster's cgroup should exist while it runs"
        assert any(str(state) in line for line in Path("/proc/self/mountinfo").read_text().splitlines())
    finally:
        down = subprocess.run([str(HACK_CLUSTER), "down"], env=env, capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stderr[-3000:]

    assert not Path(f"/run/netns/{settings['NETNS']}").exists()
    assert _cgroup_dirs(cgroup) == []
    mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(state) in line]
    assert mounts == []
    # Every live process whose cgroup is (under) the cluster's: none may be left. (A
    # zombie is dead; reaping it is its parent's business, here this test runner's.)
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                state_field = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state_field != "Z" and cgroup in (proc / "cgroup").read_text():
                    left.append(proc.name)
            except (OSError, IndexError):
                continue
    assert left == []
    # The session's cluster did not notice.
    node = cluster.get("node", cluster.real_node)
    assert node is not None
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"


# A rank 0 as the others see it: something listening on the rendezvous port.
LISTEN = textwrap.dedent(
    f"""
    import socket
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", {RENDEZVOUS_PORT}))
    s.listen(16)
    while True:
        s.accept()[0].close()
    """
)
# A rank dialling rank 0 as torch's store client does: again until a deadline. The enforcer
# learns a new pod's address from the API server a moment after the pod starts, so the
# first tries of a pod the policy admits may be refused, as in a real job's start.
CONNECT = textwrap.dedent(
    f"""
    import socket, sys, time
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection((sys.argv[1], {RENDEZVOUS_PORT}), timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    """
)


def test_a_jobs_network_policy_lets_only_its_own_pods_reach_its_rendezvous(cluster: Cluster, namespace: str) -> None:
    """The NetworkPolicy the operator makes for a job (netpol.build_network_policy), under a
    real enforcer (kube-router's firewall, hack/cluster): a pod of the same job reaches rank
    0's rendezvous port from either real node, a pod of another job reaches it before the
    policy exists and not after, from either node."""
    settings = cluster.settings()
    assert settings.get("NETWORK_POLICY") == "1", "the cluster runs no NetworkPolicy enforcer"
    image = cluster.load_images("python")["python"]
    cluster.load_images("python", node=2)
    job = {"metadata": {"name": "a", "namespace": namespace, "uid": "0"}}
    policy = build_network_policy(job, OperatorSettings())
    del policy["metadata"]["ownerReferences"]  # no FineTuneJob "a" exists: the collector would remove it
    own = policy["spec"]["podSelector"]["matchLabels"]

    def pod(name: str, labels: dict[str, str], args: list[str], node: int = 1) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never", "command": ["python3", *args],
                            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
        }
        if node == 1:
            spec = cluster.on_real_node(spec)
        else:
            spec["nodeName"] = settings["NODE2_NAME"]
            spec["tolerations"] = [{"key": settings["NODE2_TAINT"], "operator": "Exists"}]
        return cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                              "spec": spec}, namespace)

    counter = iter(range(100))

    def reaches(labels: dict[str, str], node: int) -> bool:
        name = f"client-{next(counter)}"
        pod(name, labels, ["-c", CONNECT, rank0_ip], node)
        done = cluster.wait_for_pod_phase(namespace, name, ("Succeeded", "Failed"), timeout=120)
        return bool(done["status"]["phase"] == "Succeeded")

    pod("rank0", {**own, "spillway.dev/rank": "0"}, ["-c", LISTEN])
    rank0_ip = cluster.wait_for_pod_phase(namespace, "rank0", "Running", timeout=120)["status"]["podIP"]
    other = {**own, "spillway.dev/job": "b"}
    assert reaches(other, 1), "another job's pod could not connect with no policy at all: the test proves nothing"
    cluster.apply(policy, namespace)
    # The enforcer applies what it watches; a blocked connection is the sign it has.
    cluster.wait_for(lambda: not reaches(other, 1), 60, interval=1, what="the policy enforced")
    assert {node: (reaches(own, node), reaches(other, node)) for node in (1, 2)} == {1: (True, False), 2: (True, False)}
