"""The chart's node probe on the test cluster's real node: its DaemonSet measures the
node's NVMe and CPU Adam and annotates the node, and its token may patch only its own
Node's spillway.dev/* annotations."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess

import pytest

from spillway_runtime.core.hardware import (
    HOST_WORK_ANNOTATION,
    HOST_WORK_SCALE_RANGE,
    MEMLOCK_ANNOTATION,
    NVME_PATH_ANNOTATION,
    NVME_TRANSFER_ANNOTATION,
    transfer_seconds_from_annotation,
)
from tests.e2e.cluster import REPO_ROOT, Cluster
from tests.e2e.realnode.real_jobs import POD_TIMEOUT_S, RUNTIME_UID, RealNode

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]


def test_the_node_probe_daemonset_measures_and_annotates_the_real_node(
    real: RealNode, cluster: Cluster, namespace: str
) -> None:
    """`helm install` with the probe on and the training image: its DaemonSet pod runs on
    the real node (its GPU label is the real node's label here), measures the NVMe
    directory and CPU Adam, and annotates the node with the figures and the *host* path."""
    node = cluster.real_node
    repository, tag = real.image.rsplit(":", 1)
    nvme = real.root / "nvme"  # what this folder's jobs spill to: the figures stay true for them
    s3_cache = real.root / f"s3-cache-{secrets.token_hex(3)}"  # made by the kubelet, prepared by the probe
    before = cluster.kubectl_json("get", "node", node)["metadata"].get("annotations", {})
    release = f"p{secrets.token_hex(3)}"
    toleration = json.dumps([{"key": real.label, "operator": "Exists", "effect": "NoSchedule"}])
    cluster.helm(
        "install", release, str(REPO_ROOT / "charts" / "spillway"), "-n", namespace, "--skip-crds",
        "--set", "operator.enabled=false", "--set", "api.enabled=false",
        "--set", f"runtimeImage.repository={repository}", "--set-string", f"runtimeImage.tag={tag}",
        "--set", "runtimeImage.pullPolicy=Never",
        "--set", f"nodeProbe.gpuNodeLabel={real.label}", "--set", f"nodeProbe.nvmeHostPath={nvme}",
        "--set", f"operator.s3CacheHostPath={s3_cache}",
        "--set", "nodeProbe.aioSeconds=5", "--set-json", f"nodeProbe.tolerations={toleration}",
        timeout=300,
    )
    try:
        def measured() -> dict[str, str] | None:
            annotations = cluster.kubectl_json("get", "node", node)["metadata"].get("annotations", {})
            keys = ("spillway.dev/nvme-read-bytes-per-second", "spillway.dev/nvme-write-bytes-per-second",
                    "spillway.dev/cpu-adam-params-per-second")
            fresh = all(k in annotations and annotations.get(k) != before.get(k) for k in keys)
            return annotations if fresh else None

        annotations = cluster.wait_for(measured, POD_TIMEOUT_S, interval=2, what="the probe's annotations")
        pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=node-probe")
        assert [p["spec"]["nodeName"] for p in pods["items"]] == [node]
        assert annotations[NVME_PATH_ANNOTATION] == str(nvme)  # the host's path, not the container's /nvme
        for key in ("nvme-read-bytes-per-second", "nvme-write-bytes-per-second", "cpu-adam-params-per-second",
                    "nvme-capacity-bytes", "nvme-free-bytes"):
            assert float(annotations[f"spillway.dev/{key}"]) > 0, (key, annotations)
        # DeepSpeed's own engine ran ZeRO-2 and ZeRO-3 to the end in the probe's container (engine_probe):
        # its ratio, or on a machine too busy to time it (the gate's other workers) its refusal, said
        scale = annotations.get(HOST_WORK_ANNOTATION)
        if scale is None:
            log = cluster.kubectl("logs", "-n", namespace, pods["items"][0]["metadata"]["name"]).stdout
            assert "DeepSpeed's host work not measured (ZeRO-3 over ZeRO-2" in log, log[-3000:]
        else:
            assert HOST_WORK_SCALE_RANGE[0] <= float(scale) <= HOST_WORK_SCALE_RANGE[1], annotations
        assert int(annotations["spillway.dev/nvme-capacity-bytes"]) == shutil.disk_usage(nvme).total
        # the disk's cost per transfer, fitted to the sweep winner's two sizes (under 8 MiB of memlock
        # both fit): microseconds, 0 on a disk without one
        assert transfer_seconds_from_annotation(annotations.get(NVME_TRANSFER_ANNOTATION)) is not None, annotations
        # what a training pod may lock, as the probe's container (non-root, no capability) found it:
        # this machine's containers get 8 MiB (hack/CLUSTER.md); the operator plans the swap under it
        assert annotations[MEMLOCK_ANNOTATION] == str(8 << 20), annotations
        # jobs' and fetch pods' subPaths: the kubelet makes them with these modes, no root container needed
        for root in (nvme, s3_cache):
            assert (root.stat().st_mode & 0o7777, root.stat().st_uid) == (0o1777, RUNTIME_UID), root
        # Its ServiceAccount may patch nodes (RBAC cannot say which): the chart's policy lets a
        # token of its pod (with the pod's node claim) patch its own Node's spillway.dev/* only.
        [probe_pod] = pods["items"]
        token = cluster.kubectl("create", "token", probe_pod["spec"]["serviceAccountName"], "-n", namespace,
                                "--bound-object-kind=Pod", f"--bound-object-name={probe_pod['metadata']['name']}",
                                "--duration=10m").stdout.strip()

        config = json.loads(cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
        config["users"][0]["user"] = {"token": token}
        probe_config = real.root / f"probe-{release}.kubeconfig"
        probe_config.write_text(json.dumps(config))

        def as_probe(*args: str) -> subprocess.CompletedProcess[str]:
            return cluster.kubectl("--kubeconfig", str(probe_config), *args, check=False)

        allowed = as_probe("annotate", "node", node, "--overwrite", "spillway.dev/policy-check=1")
        assert allowed.returncode == 0, allowed.stderr
        other = cluster.settings()["NODE2_NAME"]
        for args, says in (
            (("annotate", "node", other, "--overwrite", "spillway.dev/policy-check=1"), "only the Node its own pod"),
            (("label", "node", node, "--overwrite", "team=probe"), "only spillway.dev/* annotations and labels"),
            (("taint", "node", node, "spillway.dev/evict=now:NoExecute"), "only spillway.dev/* annotations and labels"),
        ):
            refused = as_probe(*args)
            assert refused.returncode != 0 and says in refused.stderr, (args, refused.stderr)
        assert "team" not in cluster.kubectl_json("get", "node", node)["metadata"].get("labels", {})
    finally:
        cluster.helm("uninstall", release, "-n", namespace, "--wait", timeout=300)
        # Put the node's figures back as the folder's fixture wrote them (other tests plan on them).
        now = cluster.kubectl_json("get", "node", node)["metadata"].get("annotations", {})
        changes = [f"{k}={before[k]}" if k in before else f"{k}-"
                   for k in now if k.startswith("spillway.dev/") and now[k] != before.get(k)]
        if changes:
            cluster.kubectl("annotate", "node", node, "--overwrite", *changes)
