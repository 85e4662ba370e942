"""Malformed FineTuneJobs, each with what its refusal must say: the admission checks' unit
tests and the cluster's (refused by the API server, or Failed with the reason) share them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def example() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / "tiny-cluster.yaml").read_text())


def with_(path: str, value: Any) -> dict[str, Any]:
    """The tiny example with spec.<path> set (a dotted camelCase path; None deletes)."""
    job = example()
    node = job["spec"]
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return job


# (what is wrong, the job, a part of the message that names what to change). The field's
# path starts every part, up to the first ':' or ' ' where the part has one.
CORPUS: list[tuple[str, dict[str, Any], str]] = [
    ("no spec", {k: v for k, v in example().items() if k != "spec"}, "spec"),
    ("no model", with_("model", None), "spec.model"),
    ("empty model uri", with_("model.uri", ""), "spec.model.uri"),
    ("gs model uri", with_("model.uri", "gs://bucket/llama"), "spec.model.uri: unsupported URI scheme 'gs'"),
    ("https dataset uri", with_("dataset.uri", "https://example.org/d.jsonl"), "spec.dataset.uri: unsupported URI scheme"),
    ("hf tokenizer uri", with_("model.tokenizerUri", "hf://meta/llama"), "spec.model.tokenizerUri"),
    ("pvc uri without claim", with_("dataset.uri", "pvc:///data.jsonl"), "spec.dataset.uri: 'pvc:///data.jsonl' names no valid"),
    ("pvc claim in capitals", with_("model.uri", "pvc://Models/llama"), "spec.model.uri"),
    ("unknown dtype", with_("model.dtype", "fp8"), "spec.model.dtype"),
    ("negative steps", with_("training.maxSteps", -1), "spec.training.maxSteps"),
    ("steps past int32", with_("training.maxSteps", 2**31), "spec.training.maxSteps"),
    ("zero micro batch", with_("training.microBatchSize", 0), "spec.training.microBatchSize"),
    ("learning rate as a word", with_("training.learningRate", "fast"), "spec.training.learningRate"),
    ("warmup past the end", with_("training.warmupSteps", 100), "warmupSteps"),
    ("unknown training field", with_("training.epochs", 3), "spec.training.epochs"),
    ("unknown offload tier", with_("offload.optimizer", "disk"), "spec.offload.optimizer"),
    ("policy contradicts tier", with_("offload.policy", "cpu"), "contradicts policy"),
    ("ZeRO stage as a word", with_("offload.deepspeed", {"zero_optimization": {"stage": "three"}}),
     "spec.offload.deepspeed.zero_optimization.stage is 'three'"),
    ("ZeRO stage 4", with_("offload.deepspeed", {"zero_optimization": {"stage": 4}}), "zero_optimization.stage is 4"),
    ("zero_optimization as a string", with_("offload.deepspeed", {"zero_optimization": "stage3"}),
     "spec.offload.deepspeed.zero_optimization is str"),
    ("batch contradicts training", with_("offload.deepspeed", {"train_batch_size": 64}),
     "spec.offload.deepspeed.train_batch_size is 64 but the training settings give 4"),
    ("accumulation contradicts training", with_("offload.deepspeed", {"gradient_accumulation_steps": 8}),
     "spec.offload.deepspeed.gradient_accumulation_steps"),
    ("SuperOffload", with_("offload.deepspeed", {"zero_optimization": {"offload_optimizer": {"super_offload": True}}}),
     "spec.offload: offload.deepspeed: zero_optimization.offload_optimizer.super_offload is not supported"),
    ("cpu processes with GPUs", with_("resources", {"gpusPerNode": 2, "cpuProcesses": 2}), "resources.cpuProcesses"),
    ("too many nodes", with_("resources.nodes", 5000), "spec.resources.nodes"),
    ("bad toleration effect", with_("resources.tolerations", [{"key": "a", "effect": "Sometimes"}]),
     "spec.resources.tolerations"),
    ("keep zero checkpoints", with_("checkpoint.keep", 0), "spec.checkpoint.keep"),
    ("checkpoint size as a word", with_("checkpoint.size", "big"), "spec.checkpoint.size"),
    ("resumeFrom on a new job", with_("resumeFrom", "step-3"), "spec.resumeFrom: 'step-3': a new job has no checkpoints"),
    ("evaluation without held-out data", with_("training.evalEverySteps", 5),
     "training.evalEverySteps needs dataset.validation"),
    ("chat template on text data", with_("dataset.chatTemplate", "{{ messages }}"), "chatTemplate applies"),
    ("validation with a file and a fraction", with_("dataset.validation", {"uri": "file:///v.jsonl", "fraction": 0.1}),
     "exactly one of validation.uri"),
    ("a gs validation file", with_("dataset.validation", {"uri": "gs://b/v.jsonl"}),
     "spec.dataset.validation.uri: unsupported URI scheme 'gs'"),
    # A hostile tenant's: a node directory mounted read-write (static pods, other pods' Secrets)
    ("NVMe on the node's static-pod folder", with_("offload.nvme.hostPath", "/etc/kubernetes/manifests"),
     "spec.offload.nvme.hostPath: a job may not choose a node directory"),
    ("NVMe on the kubelet's pods", with_("offload.nvme", {"hostPath": "/var/lib/kubelet/pods", "size": "1Gi"}),
     "spec.offload.nvme.hostPath: a job may not choose a node directory"),
    ("a claim path that climbs out of the claim", with_("model.uri", "pvc://models/../../s3-cache/ns/x/bucket/m"),
     "spec.model.uri: 'pvc://models/../../s3-cache/ns/x/bucket/m' has a '..' segment"),
    ("tolerating the control plane's taint",
     with_("resources.tolerations", [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]),
     "spec.resources.tolerations[0]: a job may not tolerate node-role.kubernetes.io/control-plane"),
    ("tolerating every taint", with_("resources.tolerations", [{"operator": "Exists"}]),
     "spec.resources.tolerations[0]: a job may not tolerate every taint"),
    ("selecting the control plane", with_("resources.nodeSelector", {"node-role.kubernetes.io/control-plane": ""}),
     "spec.resources.nodeSelector: 'node-role.kubernetes.io/control-plane' selects the control plane"),
    ("keepBest without held-out data", with_("checkpoint.keepBest", True), "checkpoint.keepBest needs dataset.validation"),
    # A hostile tenant's inputs on the pod's own filesystem: in a cluster only pvc:// and s3://
    ("a model among the node's Kubernetes credentials", with_("model.uri", "file:///etc/kubernetes/pki"),
     "spec.model.uri: 'file:///etc/kubernetes/pki' reads the pod's own filesystem: in a cluster write "
     "pvc://CLAIM/PATH"),
    ("a dataset at an absolute path", with_("dataset.uri", "/mnt/s3-cache/other-team/train.jsonl"),
     "spec.dataset.uri: '/mnt/s3-cache/other-team/train.jsonl' reads the pod's own filesystem"),
    ("held-out data at a relative path", with_("dataset.validation", {"uri": "../data/val.jsonl"}),
     "spec.dataset.validation.uri: '../data/val.jsonl' is a relative path, which means nothing in a pod"),
    ("another team's cached data mixed in", with_("dataset.mixture", [{"uri": "file:///mnt/s3-cache/other/t.jsonl"}]),
     "spec.dataset.mixture[0].uri: 'file:///mnt/s3-cache/other/t.jsonl' reads the pod's own filesystem"),
]
# Refused with the whole message by the operator too (the others: with the field named)
POD_FILESYSTEM = {"a model among the node's Kubernetes credentials", "a dataset at an absolute path",
                  "held-out data at a relative path", "another team's cached data mixed in"}

# Refused only with the stored job at hand (the webhook); the operator handles the field
# itself (spec.resumeFrom: a Rollback condition) when no webhook saw the job.
WEBHOOK_ONLY = {"resumeFrom on a new job"}
