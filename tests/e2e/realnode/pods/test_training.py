"""Training jobs in real containers: the CPU flavour of the training image on the test
cluster's real node, driven by the real operator, as a user drives it with kubectl.

- A tiny job with its Adam state on the node's NVMe (its own directory under the node's
  NVMe root, made by the kubelet as a subPath: no root init container) trains to
  Succeeded. status.progress and status.checkpoints are written by the pod under its own
  ServiceAccount; the exported model loads with transformers.
- A chat LoRA job and a DPO LoRA job from a Parquet file, as the examples set them.
- A bad dataset line: the job ends Failed with the runtime's own message (file and line)
  in its condition and in `kubectl describe`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.cluster import REPO_ROOT, Cluster
from tests.e2e.operator_fixtures import wait_status
from tests.e2e.realnode.real_jobs import BAD_LINE, EXAMPLE, KEEP, MAX_STEPS, POD_TIMEOUT_S, RealNode, condition, finished

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]


def test_a_tiny_job_trains_in_a_pod_with_adam_state_on_the_nodes_nvme(
    real: RealNode, uninterrupted: tuple[dict[str, Any], Path]
) -> None:
    job, checkpoints = uninterrupted
    status = job["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-3000:]
    # Written by the pod, under the job's own ServiceAccount (the operator writes neither).
    assert status["progress"]["step"] == MAX_STEPS and status["progress"]["loss"] > 0
    assert status["progress"]["bytes"].get("nvme", 0) > 0, status["progress"]  # the Adam state went to NVMe
    # ... into the job's own directory under the node's root, the only part of it the pod saw
    namespace = job["metadata"]["namespace"]
    assert [p.name for p in (real.root / "nvme" / "jobs" / namespace).iterdir()] == ["tiny"]
    own = real.root / "nvme" / "jobs" / namespace / "tiny"
    assert own.stat().st_mode & 0o777 == 0o777 and own.stat().st_uid == 0, oct(own.stat().st_mode)
    # The swap files were there while it trained (progress.bytes.nvme above is what the pod
    # measured in this directory) and went with the pod: nothing is left on the node's drive.
    assert [p for p in own.rglob("*") if p.is_file()] == []
    # Planned from the model's own config.json, read from the claim by a short pod that is gone.
    assert status["modelConfig"]["source"] == "pvc://tiny-inputs/model"
    assert status["modelConfig"]["config"]["model_type"] == "llama", status["modelConfig"]
    assert any(r.startswith("model shape from config.json on pvc://tiny-inputs/model (llama")
               for r in status["plan"]["reasons"]), status["plan"]["reasons"]
    assert condition(job, "ModelConfigRead")["status"] == "True"
    kept = sorted({*range(3, MAX_STEPS + 1, 3), MAX_STEPS})[-KEEP:]  # every 3 steps, and the last
    assert [c["step"] for c in status["checkpoints"]] == kept  # the pruned ones are gone from status too
    assert sorted(p.name for p in checkpoints.glob("step-*")) == [f"step-{s:08d}" for s in kept]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints / "export")
    assert model.num_parameters() == int(yaml.safe_load(EXAMPLE.read_text())["spec"]["model"]["parameterCount"])


def test_a_chat_lora_job_trains_in_a_pod_with_masked_loss_evaluation_and_exports_the_adapter(
    real: RealNode, cluster: Cluster, namespace: str
) -> None:
    """examples/chat-lora.yaml's settings through the operator: chat records with the loss on
    the answers, a held-out share evaluated, LoRA adapters on the frozen base, the adapter
    exported in PEFT's layout."""
    chat = yaml.safe_load((REPO_ROOT / "examples" / "chat-lora.yaml").read_text())["spec"]
    real.inputs(namespace)
    # No parameterCount: the operator plans from config.json as read from the claim.
    checkpoints = real.job(namespace, "chat-lora", dataset="arithmetic-chat.jsonl", spec_update={
        "model": {"parameterCount": None},
        "dataset": {key: chat["dataset"][key] for key in ("format", "chatTemplate", "validation")},
        "method": chat["method"], "export": chat["export"],
        "training": {"evalEverySteps": 3, "learningRate": chat["training"]["learningRate"],
                     "sequenceLength": chat["training"]["sequenceLength"]}})
    job = finished(real, namespace, "chat-lora")
    status = job["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-3000:]
    assert "parameterCount" not in job["spec"]["model"] and "config" in status["modelConfig"]
    assert not [p for p in real.cluster.kubectl_json("get", "pods", "-n", namespace)["items"]
                if p["metadata"]["name"].endswith("-model-config")]
    assert status["progress"]["evalLoss"] > 0 and status["progress"]["evalStep"] == status["progress"]["step"]
    export = checkpoints / "export"
    assert (export / "adapter_config.json").is_file() and (export / "adapter_model.safetensors").is_file()
    assert (export / "merged" / "model.safetensors").is_file() and not (export / "model.safetensors").exists()
    adapter = json.loads((export / "adapter_config.json").read_text())
    assert adapter["r"] == chat["method"]["rank"] and adapter["peft_type"] == "LORA"


def test_dpo_with_lora_trains_in_a_pod_from_a_parquet_file(real: RealNode, namespace: str) -> None:
    """examples/dpo-lora.yaml on the tiny model: preference pairs read from a Parquet file on
    the claim, DPO with LoRA (the reference the base with the adapters off), TRL's metrics of
    the last step and of the held-out pairs in status.progress.preference. The planner keeps the
    optimizer on the device, here the CPU: DeepSpeed's FusedAdam, compiled into the image (the
    image once lacked it, and such a pod exited 1 trying to compile it)."""
    dpo = yaml.safe_load((REPO_ROOT / "examples" / "dpo-lora.yaml").read_text())["spec"]
    real.inputs(namespace)
    real.job(namespace, "dpo-lora", dataset="arithmetic-preferences.parquet", spec_update={
        "dataset": {key: dpo["dataset"][key] for key in ("format", "validation")},
        "method": dpo["method"], "offload": {"optimizer": None, **dpo["offload"]},
        "training": {**dpo["training"], "maxSteps": 6, "evalEverySteps": 3, "evalBatches": 2},
        "checkpoint": {"everySteps": 3}})
    job = finished(real, namespace, "dpo-lora")
    status = job["status"]
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["plan"]["label"].startswith("Z2 opt:gpu"), status["plan"]
    progress = status["progress"]
    assert progress["step"] == 6 and progress["evalStep"] == 6, progress
    metrics = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")
    assert set(progress["preference"]) == {*metrics, *(f"eval_{m}" for m in metrics)}, progress["preference"]
    assert 0 <= progress["preference"]["rewards/accuracies"] <= 1 and progress["loss"] < 0.69  # below ln 2


def test_a_bad_dataset_line_fails_the_job_with_the_runtimes_own_message(
    real: RealNode, cluster: Cluster, namespace: str
) -> None:
    real.inputs(namespace)
    real.job(namespace, "bad", dataset="bad.jsonl")
    job = wait_status(cluster, namespace, "bad", lambda s: s.get("phase") == "Failed", POD_TIMEOUT_S, "Failed")
    message = condition(job, "Failed").get("message", "") or job["status"].get("message", "")
    assert f"bad.jsonl:{BAD_LINE}: not valid JSON" in message, json.dumps(job["status"], indent=1)
    described = cluster.kubectl("describe", "ftj", "bad", "-n", namespace).stdout
    assert f"bad.jsonl:{BAD_LINE}: not valid JSON" in described, described[-3000:]
