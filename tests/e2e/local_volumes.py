"""A real local-volume provisioner for the real-node tests: rancher's local-path-provisioner
(`hack/cluster build` builds it from the Go module proxy) run against the test cluster as
a cluster admin would run it, behind a StorageClass of `local` volumes bound when the pod
is scheduled (WaitForFirstConsumer).

This is how a cluster admin offers jobs node-local NVMe without any job naming a host path
(the chart's `operator.nvme.storageClassName`, or a job's
`spec.offload.nvme.storageClassName`): each pod's generic ephemeral volume is a directory
the provisioner's helper pod makes under the node's root, root's and mode 0700, which the
kubelet hands to the pod's fsGroup when it mounts it (a `local` volume takes fsGroup, a
hostPath does not). So the training pod needs no root init container, no hostPath and no
more than Pod Security `restricted`, and it sees its own directory only. The provisioner
runs with the admin's kubeconfig (it is the admin's component, not the one under test);
its helper pods run in its own namespace, privileged by default, from the `base` image
loaded into the node."""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.e2e.cluster import HACK_CLUSTER, Cluster
from tests.integration.storage_fixtures import serving

NAMESPACE = "local-path-storage"
CONFIG_MAP = "local-path-config"
HELPER_SERVICE_ACCOUNT = "local-path-helper"
# The loaded 2-core machine: the manager's start and its informers' first list.
START_TIMEOUT_S = 60
# What the helper pod runs: the volume's directory, root's and 0700 (the kubelet gives its
# group to the pod's fsGroup at mount), and its removal when the claim goes.
SETUP = 'set -eu\nmkdir -m 0700 -p "$VOL_DIR"\n'
TEARDOWN = 'set -eu\nrm -rf "$VOL_DIR"\n'


@dataclass
class LocalStorage:
    storage_class: str
    root: Path  # on this machine, which is also the node: the provisioner's volumes live here
    log: Path

    def volumes(self) -> list[Path]:
        """The volumes' directories that exist now."""
        return sorted(self.root.iterdir())


def _helper_pod(image: str) -> dict[str, object]:
    """The helper pods' template: the provisioner adds the node, the volumes and the command."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "helper-pod"},
            "spec": {"automountServiceAccountToken": False,
                     "containers": [{"name": "helper-pod", "image": image, "imagePullPolicy": "Never"}]}}


@contextlib.contextmanager
def running_local_path(cluster: Cluster, work: Path) -> Iterator[LocalStorage]:
    """The provisioner, its namespace, scripts and StorageClass, until the block ends; then
    the class and the node's root go (a volume left behind is the test's to report)."""
    binary = subprocess.run([str(HACK_CLUSTER), "bin-path", "local-path-provisioner"], capture_output=True,
                            text=True, check=True).stdout.strip()
    image = cluster.load_images("base")["base"]
    tag = secrets.token_hex(3)
    storage_class, provisioner = f"spillway-e2e-local-{tag}", f"spillway.dev/e2e-local-{tag}"
    root = Path("/tmp") / f"spillway-e2e-local-{tag}"
    root.mkdir(mode=0o755)
    config, helper = work / "config.json", work / "helper-pod.yaml"
    config.write_text(json.dumps({"nodePathMap": [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": [str(root)]}]}))
    helper.write_text(yaml.safe_dump(_helper_pod(image)))
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": HELPER_SERVICE_ACCOUNT, "namespace": NAMESPACE},
         "automountServiceAccountToken": False},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONFIG_MAP, "namespace": NAMESPACE},
         "data": {"setup": SETUP, "teardown": TEARDOWN}},
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
         "metadata": {"name": storage_class, "annotations": {"defaultVolumeType": "local"}},
         "provisioner": provisioner, "volumeBindingMode": "WaitForFirstConsumer", "reclaimPolicy": "Delete"},
    ]}))
    log = work / "local-path-provisioner.log"
    command = [binary, "--debug", "start", f"--config={config}", f"--helper-pod-file={helper}",
               f"--provisioner-name={provisioner}", f"--namespace={NAMESPACE}", f"--helper-image={image}",
               f"--service-account-name={HELPER_SERVICE_ACCOUNT}", f"--configmap-name={CONFIG_MAP}",
               f"--kubeconfig={cluster.kubeconfig}"]
    try:
        with serving(command, log, lambda: "Started provisioner controller" in log.read_text(errors="replace"),
                     "local-path-provisioner", timeout=START_TIMEOUT_S, grace=5):
            yield LocalStorage(storage_class, root, log)
    finally:
        cluster.kubectl("delete", "storageclass", storage_class, "--ignore-not-found", check=False)
        shutil.rmtree(root, ignore_errors=True)
