"""`spillway probe --annotate-node`: write this node's measured hardware onto its Node object.

Where this sits: run by the node-probe DaemonSet on GPU nodes (NODE_NAME from the
downward API). The operator reads these `spillway.dev/*` annotations back with
`hardware.hardware_from_node`; the key names live in `hardware` so both ends agree.
Annotations the probe did not measure this time are left as they are. The
kubernetes client is imported lazily.
"""

from __future__ import annotations

import os
from typing import Any

from spillway_runtime.core.hardware import NodeHardware

FIELD_MANAGER = "spillway-node-probe"


class NodeProbeError(RuntimeError):
    pass


def node_patch(hw: NodeHardware) -> dict[str, Any]:
    return {"metadata": {"annotations": hw.to_annotations()}}


def annotate_node(hw: NodeHardware, node_name: str | None = None) -> dict[str, str]:
    """Merge-patch the annotations onto NODE_NAME (or `node_name`); returns what was written."""
    name = node_name or os.environ.get("NODE_NAME")
    if not name:
        raise NodeProbeError("--annotate-node needs NODE_NAME (set it from the downward API: fieldRef spec.nodeName)")
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    patch = node_patch(hw)
    client.CoreV1Api().patch_node(name, patch, field_manager=FIELD_MANAGER)
    annotations: dict[str, str] = patch["metadata"]["annotations"]
    return annotations
