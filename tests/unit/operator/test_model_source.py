"""The model's config.json read from its claim before planning: the reader pod the
reconciler starts, what it does with each outcome, and the reader itself
(`spillway_runtime.core.model_config`) on real files. The pod running on a real node is
tests/e2e/realnode/pods/test_training.py."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from spillway_operator import builders as b
from spillway_operator import model_source
from spillway_operator.reconciler import PermanentFailure, reconcile
from spillway_operator.settings import OperatorSettings
from spillway_runtime.core import model_config
from spillway_runtime.core.hardware import GPU_RESOURCE

from .fake_cluster import FakeCluster
from .test_reconciler import NS, reasons, status, world

SETTINGS = OperatorSettings(read_model_config=True, model_config_timeout_seconds=600, runtime_image="rt:1")
READER = model_source.pod_name("j")
# Qwen2-7B's config.json as published, with the nested and list fields planning never reads.
QWEN2_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
            "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 131072,
            "id2label": {str(i): f"LABEL_{i}" for i in range(200)}}


def step(cluster: FakeCluster, settings: OperatorSettings = SETTINGS) -> Any:
    return reconcile(NS, "j", settings, cluster)


def reader_exits(cluster: FakeCluster, code: int, message: str) -> None:
    cluster.run(NS, READER, "gpu-80g")
    cluster.exit(NS, READER, code, message)


def reasons_of_plan(cluster: FakeCluster) -> list[str]:
    return list(status(cluster)["plan"]["reasons"])


def test_the_reader_pod_mounts_the_claim_read_only_on_the_jobs_nodes_and_holds_no_gpu() -> None:
    cluster = world(model={"uri": "pvc://models/qwen/7b", "parameterCount": "7B"},
                    resources={"gpusPerNode": 1, "nodeSelector": {"pool": "gpu"},
                               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]})
    result = step(cluster)
    assert cluster.names("Pod") == [READER] and result.requeue_after
    pod = cluster.get("Pod", NS, READER)
    assert pod is not None
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["image"] == "rt:1"
    assert container["command"] == ["python", "-m", "spillway_runtime.core.model_config", "/mnt/pvc/models/qwen/7b"]
    assert container["volumeMounts"] == [{"name": "input-models", "mountPath": "/mnt/pvc/models", "readOnly": True}]
    assert spec["volumes"][0]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert GPU_RESOURCE not in json.dumps(container["resources"])
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["automountServiceAccountToken"] is False and spec["activeDeadlineSeconds"] == 600
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-j"
    conditions = {c["type"]: c for c in status(cluster)["conditions"]}
    assert conditions["ModelConfigRead"]["reason"] == "Reading" and reasons(cluster) == ["ReadingModelConfig"]
    # Reconciling while it runs starts nothing more.
    cluster.run(NS, READER, "gpu-80g")
    step(cluster)
    assert cluster.names("Pod") == [READER] and "plan" not in status(cluster)


def test_a_read_config_plans_the_real_shape_and_the_reader_goes() -> None:
    cluster = world(model={"uri": "pvc://models/qwen", "parameterCount": "13B"})
    step(cluster)
    reader_exits(cluster, 0, model_config.encode({k: v for k, v in QWEN2_7B.items() if k != "id2label"}).decode())
    step(cluster)
    st = status(cluster)
    assert st["modelConfig"]["source"] == "pvc://models/qwen" and st["modelConfig"]["config"]["vocab_size"] == 152064
    assert cluster.names("Pod") == ["j-a0-0"] and (READER, 0) in cluster.deleted
    notes = reasons_of_plan(cluster)
    assert notes[0].startswith("model shape from config.json on pvc://models/qwen (qwen2, 152,064-token vocabulary, 7.6B")
    assert "differs from the config's 7.6B" in notes[1]
    assert {c["type"]: c for c in st["conditions"]}["ModelConfigRead"]["status"] == "True"


def test_an_unreadable_config_falls_back_to_parameter_count_and_says_why() -> None:
    cluster = world()
    step(cluster)
    reader_exits(cluster, 1, "error: /mnt/pvc/models/llama/config.json does not exist (the directory holds ['a.bin'])")
    step(cluster)
    assert cluster.names("Pod") == ["j-a0-0"]
    assert reasons_of_plan(cluster)[0].startswith(
        "config.json could not be read from pvc://models/llama (/mnt/pvc/models/llama/config.json does not exist")
    assert "guessed from parameterCount" in reasons_of_plan(cluster)[0]
    assert "ModelConfigUnreadable" in reasons(cluster)


def test_without_parameter_count_an_unreadable_config_fails_the_job_naming_both_ways_out() -> None:
    cluster = world(model={"uri": "pvc://models/llama"})
    step(cluster)
    reader_exits(cluster, 0, '{"model_type": "t5", "d_model": 512}')  # read, but not a decoder we count
    with pytest.raises(PermanentFailure, match=r"give spec\.model\.config .* or spec\.model\.parameterCount"):
        step(cluster)
    st = status(cluster)
    assert st["phase"] == "Failed" and "t5" in st["message"] and "config.json could not be read" in st["message"]
    assert cluster.names("Pod") == []


def test_a_reader_that_never_runs_times_out_into_the_fallback() -> None:
    cluster = world()
    step(cluster)
    cluster.set_pod(NS, READER, {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "message": "0/3 nodes are available: untolerated taint"}]})
    cluster.objects[("Pod", NS, READER)]["metadata"]["creationTimestamp"] = b.rfc3339(
        datetime.now(UTC) - timedelta(seconds=601))
    step(cluster)
    assert cluster.names("Pod") == ["j-a0-0"]
    assert status(cluster)["modelConfig"]["error"] == (
        "not read within 600 s (not scheduled: 0/3 nodes are available: untolerated taint)")


def test_an_inline_config_or_one_already_read_starts_no_reader() -> None:
    inline = world(model={"uri": "pvc://models/qwen", "config": {k: v for k, v in QWEN2_7B.items()
                                                                  if k != "id2label"}})
    step(inline)
    assert inline.names("Pod") == ["j-a0-0"]
    assert reasons_of_plan(inline)[0].startswith("model shape from spec.model.config (qwen2")
    # A new attempt of a job whose config was read plans from status.modelConfig again.
    cluster = world()
    read = {"source": "pvc://models/llama", "config": {k: v for k, v in QWEN2_7B.items() if k != "id2label"}}
    cluster.patch_job_status(NS, "j", {"status": {"modelConfig": read}})
    step(cluster)
    assert cluster.names("Pod") == ["j-a0-0"] and reasons_of_plan(cluster)[0].startswith("model shape from config.json")
    # ... unless the model moved: then it is read again.
    cluster2 = world(model={"uri": "pvc://models/other", "parameterCount": "7B"})
    cluster2.patch_job_status(NS, "j", {"status": {"modelConfig": {"source": "pvc://models/llama", "error": "x"}}})
    step(cluster2)
    assert cluster2.names("Pod") == [READER]


def test_a_missing_model_claim_holds_the_job_before_any_reader() -> None:
    cluster = world()
    del cluster.objects[("PersistentVolumeClaim", NS, "models")]
    step(cluster)
    assert cluster.names("Pod") == [] and reasons(cluster) == ["InputsMissing"]


def test_a_leftover_reader_of_a_running_job_is_deleted() -> None:
    """Killed between storing the answer and deleting the pod: the pod goes once the job runs."""
    cluster = world()
    step(cluster)
    reader_exits(cluster, 0, model_config.encode({k: v for k, v in QWEN2_7B.items() if k != "id2label"}).decode())
    step(cluster)
    assert cluster.names("Pod") == ["j-a0-0"]
    leftover = {"apiVersion": "v1", "kind": "Pod", "spec": {}, "status": {"phase": "Succeeded"},
                "metadata": b.child_meta(cluster.get("FineTuneJob", NS, "j") or {}, READER, model_source.COMPONENT)}
    cluster.add(leftover)
    cluster.run(NS, "j-a0-0", "gpu-80g")
    step(cluster)  # Running now; the reader is not taken for an old attempt's pod
    assert status(cluster)["phase"] == "Running" and "j-a0-0" in cluster.names("Pod")
    step(cluster)
    assert cluster.names("Pod") == ["j-a0-0"] and (READER, 0) in cluster.deleted


# --- the reader -------------------------------------------------------------------------


def test_the_reader_keeps_what_planning_reads_and_fits_a_termination_message(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**QWEN2_7B, "mlp_only_layers": [0, 3],
                                                      "quantization_config": {"bits": 4}}))
    out = tmp_path / "message"
    assert model_config.main([str(tmp_path), "--out", str(out)]) == 0
    kept = json.loads(out.read_text())
    assert "id2label" not in kept and "quantization_config" not in kept and "architectures" not in kept
    assert kept["mlp_only_layers"] == [0, 3] and kept["rope_scaling"] is None
    assert {k: QWEN2_7B[k] for k in ("vocab_size", "num_key_value_heads", "tie_word_embeddings")}.items() <= kept.items()
    assert len(out.read_bytes()) <= model_config.MESSAGE_LIMIT


@pytest.mark.parametrize(("content", "expected"), [
    (None, "config.json does not exist (the directory holds ['weights.bin'])"),
    ("{not json", "cannot be read as JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    (json.dumps({f"key_{i:04d}": "x" * 150 for i in range(40)}), "give the config inline as spec.model.config"),
])
def test_the_reader_says_what_is_wrong_in_its_message(tmp_path: Path, content: str | None, expected: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"")
    if content is not None:
        (model / "config.json").write_text(content)
    out = tmp_path / "message"
    assert model_config.main([str(model), "--out", str(out)]) == 1
    message = out.read_text()
    assert message.startswith("error: ") and expected in message
