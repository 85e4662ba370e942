"""The e2e tests' handle on a running control plane: `Cluster` (kubeconfig, env, kubectl and
helm runners, node and pod helpers, waits) and the paths and names it uses.

Where this sits: tests/e2e's conftest starts the control plane (hack/cluster) and hands a
`Cluster` to the tests through its `cluster` fixture; test modules and helper modules take
`Cluster` and these names from here.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml

from tests.polling import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
HACK_CLUSTER = REPO_ROOT / "hack" / "cluster"
HACK_IMAGES = REPO_ROOT / "hack" / "images"
NODE_PROFILES_DIR = REPO_ROOT / "hack" / "kwok" / "nodes"

# A cold image build installs torch and compiles DeepSpeed's ops (hack/images).
IMAGES_TIMEOUT_S = 60 * 60
# The annotation kwok's spillway-pod-exit-* stages act on (hack/kwok/stages.yaml).
EXIT_CODE_ANNOTATION = "spillway.dev/kwok-exit-code"
EXIT_REASON_ANNOTATION = "spillway.dev/kwok-exit-reason"
LOCAL_NVME_STORAGE_CLASS = REPO_ROOT / "hack" / "kwok" / "local-nvme.yaml"
# Label on the local PersistentVolumes a test made for a node, for cleanup.
KWOK_NODE_LABEL = "spillway.dev/e2e-node"
NODE_PROFILES = tuple(sorted(p.stem for p in NODE_PROFILES_DIR.glob("*.yaml")))

T = TypeVar("T")


GET_PATHS = {
    "pod": "/api/v1/namespaces/{namespace}/pods/{name}",
    "pvc": "/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}",
    "configmap": "/api/v1/namespaces/{namespace}/configmaps/{name}",
    "node": "/api/v1/nodes/{name}",
    "nodes": "/api/v1/nodes/{name}",
    **dict.fromkeys(("finetunejob", "ftj"), "/apis/spillway.dev/v1alpha1/namespaces/{namespace}/finetunejobs/{name}"),
}
GET_TIMEOUT_S = 60  # as a kubectl call's


class ClusterError(RuntimeError):
    """A kubectl/helm command failed; the message carries its output."""


@dataclass
class Cluster:
    """A running control plane and the means to drive it from tests."""

    kubeconfig: Path
    # KUBECONFIG and PATH (kubectl, helm, etcd, ...) for subprocesses.
    env: dict[str, str]
    # Where hack/cluster keeps certs, logs and pid files; None when the
    # cluster was not started by this session.
    state_dir: Path | None = None
    started_here: bool = False
    _api: Any = field(default=None, repr=False)  # the admin's ApiClient, made at the first `get`

    # -- commands ---------------------------------------------------------

    def run(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command with the cluster's environment; raise on failure."""
        proc = subprocess.run(
            list(args),
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise ClusterError(
                f"`{' '.join(args)}` exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}{self._log_hint()}"
            )
        return proc

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return self.run(
            "kubectl",
            "--kubeconfig",
            str(self.kubeconfig),
            *args,
            input=input,
            check=check,
            timeout=timeout,
        )

    def kubectl_json(self, *args: str, input: str | None = None) -> Any:
        """`kubectl ... -o json`, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", input=input).stdout)

    def apply(self, manifest: dict[str, Any] | str, namespace: str | None = None) -> Any:
        """`kubectl apply` a manifest (a dict, or YAML/JSON text); returns the object."""
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        ns = ["-n", namespace] if namespace else []
        return self.kubectl_json("apply", *ns, "-f", "-", input=text)

    def helm(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return self.run("helm", "--kubeconfig", str(self.kubeconfig), *args, timeout=timeout)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The object, or None when it does not exist. The kinds tests poll are read over the
        admin's HTTP connection (a kubectl process costs ~0.05 s of CPU, and a gate polls
        thousands of times); the others through kubectl."""
        path = GET_PATHS.get(kind)
        if path is None or (namespace is None) == ("{namespace}" in path):
            ns = ["-n", namespace] if namespace else []
            proc = self.kubectl("get", kind, name, *ns, "-o", "json", "--ignore-not-found")
            return json.loads(proc.stdout) if proc.stdout.strip() else None
        if self._api is None:
            from kubernetes import config as k8s_config

            self._api = k8s_config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]
        request = self._api.param_serialize("GET", path.format(namespace=namespace, name=name),
                                            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"])
        response = self._api.call_api(*request, _request_timeout=GET_TIMEOUT_S)
        response.read()
        if response.status == 404:
            return None
        if response.status != 200:
            raise ClusterError(f"GET {kind} {namespace}/{name}: {response.status}\n{response.data[:2000]!r}")
        return cast(dict[str, Any], json.loads(response.data))

    # -- the real node ----------------------------------------------------

    def settings(self) -> dict[str, str]:
        """What `hack/cluster up` recorded in <state>/cluster.env: ports, the real node's
        name, label and address, its containerd socket, the network namespace."""
        if self.state_dir is None:
            raise RuntimeError("the real node's settings need a cluster started by this session")
        lines = (self.state_dir / "cluster.env").read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    @property
    def real_node(self) -> str:
        return self.settings()["NODE_NAME"]

    def load_images(self, *names: str, node: int = 1) -> dict[str, str]:
        """Build (or reuse) images with hack/images and import them into the containerd of
        real node 1 (or 2); returns name -> reference (pull policy Never finds them)."""
        sock = self.settings()["CONTAINERD_SOCKET" if node == 1 else f"CONTAINERD{node}_SOCKET"]
        proc = subprocess.run(
            [str(HACK_IMAGES), "load", sock, *names], capture_output=True, text=True, timeout=IMAGES_TIMEOUT_S
        )
        if proc.returncode != 0:
            raise ClusterError(f"hack/images load {' '.join(names)} exited {proc.returncode}:\n{proc.stderr}")
        loaded = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.count(" ") == 1)
        missing = [name for name in names if name not in loaded]
        if missing:
            raise ClusterError(f"hack/images load did not report {missing}:\n{proc.stdout}\n{proc.stderr}")
        return {name: loaded[name] for name in names}

    def on_real_node(self, pod_spec: dict[str, Any]) -> dict[str, Any]:
        """``pod_spec`` with the real node's selector and a toleration of its taint."""
        label = self.settings()["NODE_LABEL"]
        spec = dict(pod_spec)
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), label: "true"}
        spec["tolerations"] = [*spec.get("tolerations", []), {"key": label, "operator": "Exists", "effect": "NoSchedule"}]
        return spec

    # -- waiting ----------------------------------------------------------

    @staticmethod
    def wait_for(
        condition: Callable[[], T | None],
        timeout: float = 30,
        interval: float = 0.25,
        what: str = "condition",
    ) -> T:
        """Poll ``condition`` until it returns something truthy; return it."""
        return cast(T, wait_for(condition, timeout, what, interval))

    def wait_for_pod_phase(
        self, namespace: str, pod: str, phases: str | tuple[str, ...], timeout: float = 30
    ) -> dict[str, Any]:
        wanted = (phases,) if isinstance(phases, str) else phases

        def reached() -> dict[str, Any] | None:
            obj = self.get("pod", pod, namespace)
            if obj is not None and obj.get("status", {}).get("phase") in wanted:
                return obj
            return None

        return self.wait_for(reached, timeout, what=f"pod {namespace}/{pod} to reach {'/'.join(wanted)}")

    # -- kwok nodes and pods ----------------------------------------------

    def node_manifest(self, profile: str, name: str) -> dict[str, Any]:
        """The Node object for a profile in hack/kwok/nodes/, renamed."""
        path = NODE_PROFILES_DIR / f"{profile}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown node profile {profile!r}; known: {', '.join(NODE_PROFILES)}")
        node: dict[str, Any] = yaml.safe_load(path.read_text())
        node["metadata"]["name"] = name
        node["metadata"]["labels"]["kubernetes.io/hostname"] = name
        # An address of its own, as real nodes have; kwok reports it as the
        # hostIP of the node's pods. Derived from the name: no state to keep.
        digest = hashlib.sha256(name.encode()).digest()
        node["status"]["addresses"] = [
            {"type": "InternalIP", "address": f"10.250.{digest[0]}.{digest[1] % 254 + 1}"},
            {"type": "Hostname", "address": name},
        ]
        return node

    def make_node(
        self, profile: str, name: str | None = None, nvme_volume: bool = False, timeout: float = 30
    ) -> str:
        """Create a kwok-managed node from a profile and wait until it is Ready and the node
        lifecycle controller has lifted its not-ready taint (it lags the condition: a job
        planned in between found no eligible node, "taint node.kubernetes.io/not-ready").

        ``nvme_volume=True`` also gives it a local NVMe PersistentVolume
        (see add_local_nvme_volume)."""
        name = name or f"{profile}-{secrets.token_hex(3)}"
        self.kubectl("create", "-f", "-", input=json.dumps(self.node_manifest(profile, name)))

        def ready() -> bool:
            node = self.get("node", name) or {}
            conditions = node.get("status", {}).get("conditions", [])
            lifecycle = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) and not any(
                t.get("key") in lifecycle for t in node.get("spec", {}).get("taints") or [])

        self.wait_for(ready, timeout, what=f"kwok to mark node {name} Ready")
        if nvme_volume:
            self.add_local_nvme_volume(name)
        return name

    def add_local_nvme_volume(self, node: str, size_bytes: int | None = None) -> str:
        """Create a local PersistentVolume on ``node``'s NVMe; returns its name.

        Class ``spillway-local-nvme`` (hack/kwok/local-nvme.yaml, applied here):
        no provisioner, WaitForFirstConsumer, so a claim of that class, e.g. a
        generic ephemeral volume, binds when its pod is scheduled and only
        where a volume fits. Path and default size come from the node's
        spillway.dev/nvme-path and spillway.dev/nvme-free-bytes annotations.
        Reclaim policy Retain: each volume serves one claim; add more for more.
        """
        annotations = self.kubectl_json("get", "node", node)["metadata"].get("annotations", {})
        if "spillway.dev/nvme-path" not in annotations:
            raise ValueError(f"node {node} has no spillway.dev/nvme-path annotation (no NVMe)")
        size = size_bytes or int(annotations["spillway.dev/nvme-free-bytes"])
        self.kubectl("apply", "-f", str(LOCAL_NVME_STORAGE_CLASS))
        pv_name = f"{node}-nvme-{secrets.token_hex(3)}"
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name, "labels": {KWOK_NODE_LABEL: node}},
            "spec": {
                "capacity": {"storage": str(size)},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "spillway-local-nvme",
                "local": {"path": annotations["spillway.dev/nvme-path"]},
                "nodeAffinity": {
                    "required": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
                                ]
                            }
                        ]
                    }
                },
            },
        }
        self.kubectl("create", "-f", "-", input=json.dumps(pv))
        return pv_name

    def delete_node(self, name: str, timeout: float = 30) -> None:
        """Delete a node, as when a machine is lost.

        Its pods stay bound to the vanished node until kube-controller-manager's
        pod garbage collector deletes them (it waits ~40 s to be sure the node
        is gone, then checks every 20 s), as in a real cluster.
        """
        self.kubectl("delete", "node", name, "--ignore-not-found", f"--timeout={int(timeout)}s")

    def set_pod_phase(
        self,
        namespace: str,
        pod: str,
        phase: str,
        exit_code: int | None = None,
        reason: str | None = None,
        timeout: float = 30,
    ) -> dict[str, Any]:
        """End a pod that runs on a kwok node: Succeeded (exit 0) or Failed.

        Waits for the pod to be Running, then annotates it with
        spillway.dev/kwok-exit-code; kwok writes the terminated container
        states and the phase, as a kubelet would. Returns the final pod.
        """
        if phase == "Succeeded":
            code = 0 if exit_code is None else exit_code
            if code != 0:
                raise ValueError("a Succeeded pod exits 0")
        elif phase == "Failed":
            code = 1 if exit_code is None else exit_code
            if code == 0:
                raise ValueError("a Failed pod exits non-zero")
        else:
            raise ValueError(f"phase must be Succeeded or Failed, not {phase!r}")
        self.wait_for_pod_phase(namespace, pod, "Running", timeout)
        annotations = [f"{EXIT_CODE_ANNOTATION}={code}"]
        if reason:
            annotations.append(f"{EXIT_REASON_ANNOTATION}={reason}")
        self.kubectl("annotate", "pod", pod, "-n", namespace, "--overwrite", *annotations)
        return self.wait_for_pod_phase(namespace, pod, phase, timeout)

    # -- diagnostics ------------------------------------------------------

    def _log_hint(self) -> str:
        if self.state_dir is None:
            return ""
        return f"\n(control-plane logs: {self.state_dir / 'logs'})"


# ---------------------------------------------------------------- startup --
