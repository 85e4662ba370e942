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

from tests.e2e.conftest import HACK_CLUSTER, Cluster

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
