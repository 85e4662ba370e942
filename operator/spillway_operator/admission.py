"""What `kubectl apply` of a FineTuneJob is refused for: the checks of the admission webhook.

Where this sits: under the webhook server (`webhook`), beside the reconciler; pure (a job,
and on update the job as it was, in; one line per problem out, each naming the field).
The same checks `spillway run` makes before it trains, as far as they can be made before
a plan exists and without reading the volumes: the spec model (with its policy rules), URI
schemes and claim names (in a cluster pvc:// and s3:// only: a local path or file:// would
read the pod's own filesystem), the DeepSpeed overrides that no plan could accept, and a
`resumeFrom` that names no checkpoint of the job. What needs the plan or the volumes is
found by the operator and ends the job Failed with its reason (never an endless retry).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from spillway_runtime.core.spec import FineTuneJobSpec, SpecError, parse_job
from spillway_runtime.training.dsconfig import DeepSpeedConfigError, check_overrides
from spillway_runtime.training.runconfig import S3_CACHE_MOUNT, input_uris, resolve_uri

# A PersistentVolumeClaim's name: a DNS-1123 subdomain.
_CLAIM = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


HOST_PATH_REFUSED = (
    "spec.offload.nvme.hostPath: a job may not choose a node directory (the pod would mount it read-write on "
    "the node); leave it out: the job gets a directory of its own under the node's NVMe root, which the "
    "cluster admin declares (the chart's nodeProbe.nvmeHostPath, a node pool's nvme.path or "
    "operator.nvme.hostRoot), or set spec.offload.nvme.storageClassName to a local-volume StorageClass"
)


def problems(job: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Every reason to refuse ``job`` (``old``: the stored job, on an update); [] admits it.
    A FineTuneJob object always runs in the cluster, so its URIs are checked as a cluster's."""
    try:
        spec = parse_job(job).spec
    except SpecError as err:
        return err.problems
    return spec_problems(spec, cluster=True) + _resume_problems(spec, old)


def new_job_problems(spec: FineTuneJobSpec, *, cluster: bool) -> list[str]:
    """`problems` of a job about to be created whose spec model is already parsed (the REST API).
    ``cluster``: its pods run in a cluster (False: `spillway run` on the user's machine)."""
    return spec_problems(spec, cluster=cluster) + _resume_problems(spec, None)


def spec_problems(spec: FineTuneJobSpec, *, cluster: bool) -> list[str]:
    """The checks past the spec model's own: URIs and the DeepSpeed overrides. ``cluster``:
    the job's pods run in a cluster, where only pvc:// and s3:// name inputs."""
    found = [line for field, uri in input_uris(spec) for line in _uri_problems(field, uri, cluster=cluster)]
    if spec.offload.nvme.host_path:
        found.append(HOST_PATH_REFUSED)
    found += _control_plane_problems(spec)
    try:
        check_overrides(spec, _world_size(spec))
    except DeepSpeedConfigError as err:
        found.append(f"spec.{err}")
    return found


# What a cluster job's URI is written as instead of a path on the pod's own filesystem
CLUSTER_URI_HINT = "in a cluster write pvc://CLAIM/PATH (a claim in the job's namespace) or s3://BUCKET/KEY"


def _uri_problems(field: str, uri: str, *, cluster: bool) -> list[str]:
    if cluster:
        found = _cluster_uri_problems(field, uri)
        if found:
            return found
    try:
        resolve_uri(uri, Path("/"), S3_CACHE_MOUNT)  # s3:// is fetched onto the node first (s3_inputs)
    except ValueError as err:
        return [f"{field}: {err}"]
    if uri.startswith(("pvc://", "s3://")) and ".." in uri.split("://", 1)[1].split("/"):
        return [f"{field}: {uri!r} has a '..' segment: name the path inside the claim or bucket itself "
                "(the pod mounts other volumes beside it)"]
    if uri.startswith("pvc://"):
        claim = uri[len("pvc://"):].split("/", 1)[0]
        if not _CLAIM.fullmatch(claim):
            return [f"{field}: {uri!r} names no valid PersistentVolumeClaim: write pvc://CLAIM/PATH, "
                    "CLAIM a claim in the job's namespace (lower-case letters, digits, '-' and '.')"]
    return []


def _cluster_uri_problems(field: str, uri: str) -> list[str]:
    """A cluster job names its inputs by volume: a file:// URI or an absolute path would read
    whatever the pod has at that path (the image's files, or under a hostPath the operator
    mounts, the node's S3 cache or NVMe root, other jobs' entries), and a relative path has no
    job file to be relative to."""
    if uri.startswith("file://") or ("://" not in uri and uri.startswith(("/", "~"))):
        return [f"{field}: {uri!r} reads the pod's own filesystem: {CLUSTER_URI_HINT}"]
    if "://" not in uri:
        return [f"{field}: {uri!r} is a relative path, which means nothing in a pod (there is no job file "
                f"to be relative to): {CLUSTER_URI_HINT}"]
    scheme = uri.split("://", 1)[0]
    if scheme not in ("pvc", "s3"):
        return [f"{field}: unsupported URI scheme {scheme!r} in {uri!r}: {CLUSTER_URI_HINT}"]
    return []


# The taints and labels that keep workloads off a cluster's control plane
CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


def _control_plane_problems(spec: FineTuneJobSpec) -> list[str]:
    """A job's pods stay off the control plane: no toleration of its taints (nor one that
    tolerates every taint), no nodeSelector for its nodes."""
    found = []
    for i, toleration in enumerate(spec.resources.tolerations):
        if toleration.key in CONTROL_PLANE_KEYS or (not toleration.key and toleration.operator == "Exists"):
            what = toleration.key or "every taint (an empty key with operator Exists)"
            found.append(f"spec.resources.tolerations[{i}]: a job may not tolerate {what}: training pods do not run "
                         "on the control plane; tolerate the taints of your GPU nodes by key")
    for key in spec.resources.node_selector:
        if key in CONTROL_PLANE_KEYS:
            found.append(f"spec.resources.nodeSelector: {key!r} selects the control plane, where training pods do "
                         "not run; select your GPU nodes' labels")
    return found


def _world_size(spec: FineTuneJobSpec) -> int | None:
    """Processes in all: known before a plan only when gpusPerNode is given."""
    resources = spec.resources
    if resources.gpus_per_node is None:
        return None
    per_node = resources.gpus_per_node or resources.cpu_processes
    return resources.nodes * per_node


def _resume_problems(spec: FineTuneJobSpec, old: dict[str, Any] | None) -> list[str]:
    target = spec.resume_from
    if not target:
        return []
    if old is None:
        return [f"spec.resumeFrom: {target!r}: a new job has no checkpoints to resume from; leave it out "
                "(a rollback sets it on a job that has checkpointed)"]
    if (old.get("spec") or {}).get("resumeFrom") == target:
        return []  # unchanged: it named a checkpoint when it was set, which may since be done and pruned
    kept = [c.get("name") for c in (old.get("status") or {}).get("checkpoints") or []]
    if target not in kept:
        listed = ", ".join(str(name) for name in kept) or "none yet"
        return [f"spec.resumeFrom: the job has no checkpoint named {target!r}; its checkpoints: {listed}"]
    return []
