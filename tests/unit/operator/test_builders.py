"""Pure builders: placement across node shapes, child objects, pod outcome policy."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway_operator import builders as b
from spillway_operator import job_cost, pod_outcomes, pod_specs
from spillway_operator.placement import choose_placement, plan_status
from spillway_operator.settings import OperatorSettings
from spillway_runtime.core.hardware import NVME_PATH_ANNOTATION, AioSettings, hardware_from_node
from spillway_runtime.core.plan_summary import PlanSummary
from spillway_runtime.core.spec import FineTuneJobSpec, parse_job

NODES_DIR = Path(__file__).resolve().parents[3] / "hack" / "kwok" / "nodes"
SETTINGS = OperatorSettings(backoff_base_seconds=10, backoff_max_seconds=60)


def node(profile: str, name: str | None = None) -> dict[str, Any]:
    n: dict[str, Any] = yaml.safe_load((NODES_DIR / f"{profile}.yaml").read_text())
    n["metadata"]["name"] = name or profile
    n.setdefault("status", {})["conditions"] = [{"type": "Ready", "status": "True"}]
    return n


def spec(**over: Any) -> FineTuneJobSpec:
    doc: dict[str, Any] = {
        "metadata": {"name": "j"},
        "spec": {"model": {"uri": "pvc://models/llama", "parameterCount": "7B"}, "dataset": {"uri": "file:///d"}},
    }
    doc["spec"].update(over)
    return parse_job(doc).spec


JOB = {"apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "j", "namespace": "ns", "uid": "u-1"}}


def test_cheapest_and_fastest_choose_different_shapes() -> None:
    nodes = [node("gpu-24g"), node("gpu-80g"), node("gpu-48g-nvme")]
    pricing = {"NVIDIA-A100-SXM4-80GB": "4.0", "NVIDIA-L40S": "1.0", "NVIDIA-GeForce-RTX-4090": "0.4"}
    cheap = choose_placement(spec(), nodes, pricing, SETTINGS)
    fast = choose_placement(spec(resources={"placement": "fastest"}), nodes, pricing, SETTINGS)
    assert cheap.chosen is not None and fast.chosen is not None
    assert cheap.chosen.plan is not None and fast.chosen.plan is not None
    fits = [c for c in cheap.shapes if c.plan is not None and c.plan.feasible]
    assert len(fits) >= 2
    assert cheap.chosen.plan.predicted_cost_usd == min(c.plan.predicted_cost_usd or 0 for c in fits if c.plan)
    fits_fast = [c for c in fast.shapes if c.plan is not None and c.plan.feasible]
    fastest = min(c.plan.predicted_total_seconds for c in fits_fast if c.plan)
    assert fast.chosen.plan.predicted_total_seconds == fastest
    status = plan_status(cheap)
    assert status is not None and status["label"] == cheap.chosen.plan.label
    assert len(status["rejectedShapes"]) == 2
    assert all(r["why"] for r in status["rejectedShapes"])
    # One model: status.plan reads back as the runtime's PlanSummary, the shape a local job records.
    summary = PlanSummary.model_validate(status)
    assert summary.node_names == [cheap.chosen.nodes[0]] and summary.shape == cheap.chosen.shape
    assert summary.predicted_step_seconds == cheap.chosen.plan.predicted_step_seconds
    assert summary.bytes.nvme == cheap.chosen.plan.bytes.nvme
    assert status == cheap.chosen.plan.summary(
        price_per_hour=summary.price_per_hour_usd, shape=summary.shape, node_names=summary.node_names,
        gpu_product=summary.gpu_product, rejected_shapes=summary.rejected_shapes).dump()


def test_a_multi_node_job_costs_its_nodes_once() -> None:
    """Two nodes of one GPU at $2/GPU-hour: $4 an hour, and the predicted cost is the
    predicted hours times $4 (the node count was once multiplied in twice)."""
    nodes = [node("gpu-80g", "a"), node("gpu-80g", "b")]
    placement = choose_placement(spec(resources={"nodes": 2, "gpusPerNode": 1}), nodes, {"NVIDIA-A100-SXM4-80GB": "2.0"},
                                 SETTINGS)
    status = plan_status(placement)
    assert status is not None and status["nodeCount"] == 2 and status["gpusPerNode"] == 1
    assert status["pricePerHourUsd"] == 4.0
    hours = status["predictedTotalSeconds"] / 3600
    assert status["predictedCostUsd"] == pytest.approx(hours * 4.0, abs=1e-4)  # rounded to 0.01 cent


def test_no_fit_shows_the_closest_plan_and_nothing_planned_shows_none() -> None:
    big = spec(model={"uri": "file:///m", "parameterCount": "400B"})
    status = plan_status(choose_placement(big, [node("gpu-24g"), node("gpu-80g")], {}, SETTINGS))
    assert status is not None and status["feasible"] is False and status["shortfalls"]
    assert len(status["rejectedShapes"]) == 1
    gpus = spec(resources={"gpusPerNode": 8})
    assert plan_status(choose_placement(gpus, [node("gpu-24g")], {}, SETTINGS)) is None


def test_no_fit_names_short_tier_and_gib() -> None:
    placement = choose_placement(spec(model={"uri": "file:///m", "parameterCount": "400B"}), [node("gpu-24g")], {}, SETTINGS)
    assert placement.chosen is None
    assert "short by" in placement.failure and "GiB" in placement.failure


def test_node_selector_and_taints_exclude_nodes() -> None:
    tainted = node("gpu-80g", "tainted")
    tainted["spec"] = {"taints": [{"key": "gpu", "value": "a100", "effect": "NoSchedule"}]}
    placement = choose_placement(spec(), [tainted], {}, SETTINGS)
    assert placement.chosen is None and "not tolerated" in placement.failure
    tolerated = spec(resources={"tolerations": [{"key": "gpu", "operator": "Exists"}]})
    assert choose_placement(tolerated, [tainted], {}, SETTINGS).chosen is not None
    picky = spec(resources={"nodeSelector": {"pool": "x"}})
    assert choose_placement(picky, [node("gpu-80g")], {}, SETTINGS).chosen is None


def test_pod_has_gpu_limits_memory_affinity_and_volumes() -> None:
    s = spec(resources={"gpusPerNode": 1}, offload={"nvme": {"storageClassName": "local-nvme"}})
    placement = choose_placement(s, [node("gpu-24g", "n1"), node("gpu-24g", "n2")], {}, SETTINGS)
    choice = placement.chosen
    assert choice is not None and choice.plan is not None
    pod = pod_specs.build_pod(JOB, s, choice, attempt=2, rank=0, settings=SETTINGS)
    assert pod["metadata"]["name"] == "j-a2-0"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    memory_mib = int(container["resources"]["requests"]["memory"].removesuffix("Mi"))
    assert memory_mib * 2**20 >= choice.plan.bytes.cpu
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    # one term per node: the API server allows a single value per metadata.name field selector
    assert [t["matchFields"] for t in terms["nodeSelectorTerms"]] == [
        [{"key": "metadata.name", "operator": "In", "values": ["n1"]}],
        [{"key": "metadata.name", "operator": "In", "values": ["n2"]}],
    ]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["input-models"]["persistentVolumeClaim"]["claimName"] == "models"
    if choice.plan.bytes.nvme:
        claim = volumes["nvme"]["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert claim["storageClassName"] == "local-nvme"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 60
    # The runtime's last words become the job's condition message (classify_pod reads them).
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # A read-only root filesystem: HOME (library caches) is on a writable volume.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    home = next(e["value"] for e in container["env"] if e["name"] == "HOME")
    writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
    assert any(home == path or home.startswith(path + "/") for path in writable), (home, writable)
    # The runtime serves /metrics on the port the container names `metrics` (the chart's PodMonitor).
    port = int(next(e["value"] for e in container["env"] if e["name"] == "SPILLWAY_METRICS_PORT"))
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"]
    # Deterministic: the same inputs build the same pod (restart safety rests on it).
    assert pod_specs.build_pod(JOB, s, choice, attempt=2, rank=0, settings=SETTINGS) == pod


def test_each_job_mounts_only_its_own_directory_under_the_nodes_nvme_root_with_no_root_step() -> None:
    s = spec(resources={"gpusPerNode": 1}, offload={"policy": "nvme", "optimizer": "nvme"})
    hardware = node("gpu-48g-nvme", "n1")
    choice = choose_placement(s, [hardware], {}, SETTINGS).chosen
    assert choice is not None and choice.plan is not None and choice.plan.bytes.nvme > 0
    pod = pod_specs.build_pod(JOB, s, choice, attempt=0, rank=0, settings=SETTINGS)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    root = hardware_from_node(hardware).nvme_path
    assert root and volumes["nvme"]["hostPath"] == {"path": root, "type": "DirectoryOrCreate"}
    (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "nvme"]
    meta = JOB["metadata"]
    assert mount == {"name": "nvme", "mountPath": b.NVME_DIR, "subPath": f"jobs/{meta['namespace']}/{meta['name']}"}
    assert "initContainers" not in pod["spec"]  # the kubelet makes the subPath with the root's mode
    # Without a path of the node's own, the admin's default root, never one the job names.
    bare = node("gpu-48g-nvme", "n2")
    bare["metadata"]["annotations"].pop(NVME_PATH_ANNOTATION)
    choice = choose_placement(s, [bare], {}, SETTINGS).chosen
    assert choice is not None and choice.plan is not None and choice.plan.uses_nvme
    pod = pod_specs.build_pod(JOB, s, choice, attempt=0, rank=0, settings=SETTINGS)
    assert {v["name"]: v for v in pod["spec"]["volumes"]}["nvme"]["hostPath"]["path"] == SETTINGS.nvme_host_root


@pytest.mark.parametrize("where", ["job", "operator"])
def test_a_storage_class_nvme_volume_is_an_ephemeral_claim_with_no_host_path(where: str) -> None:
    """The job's class, or the admin's default (chart: operator.nvme.storageClassName): a
    generic ephemeral volume that fsGroup hands to the training uid, nothing of the node."""
    nvme = {"storageClassName": "local-nvme"} if where == "job" else {}
    settings = SETTINGS if where == "job" else SETTINGS.model_copy(update={"nvme_storage_class": "local-nvme"})
    s = spec(resources={"gpusPerNode": 1}, offload={"policy": "nvme", "optimizer": "nvme", "nvme": nvme})
    choice = choose_placement(s, [node("gpu-48g-nvme", "n1")], {}, settings).chosen
    assert choice is not None
    pod = pod_specs.build_pod(JOB, s, choice, attempt=0, rank=0, settings=settings)
    assert "initContainers" not in pod["spec"]
    assert not [v for v in pod["spec"]["volumes"] if "hostPath" in v]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "nvme"]
    assert volume["ephemeral"]["volumeClaimTemplate"]["spec"]["storageClassName"] == "local-nvme"
    assert pod["spec"]["securityContext"]["fsGroup"] == settings.run_as_user


def test_nvme_asked_for_gets_a_volume_even_when_everything_stays_in_ram() -> None:
    """A tiny model's LoRA adapters on a forced `optimizer: nvme`: every piece is under
    DeepSpeed's minimum swap size (the plan's NVMe bytes are 0), yet DeepSpeed's NVMe
    offload still needs its directory (the pod failed with InvalidSpec without one)."""
    s = spec(model={"uri": "pvc://models/tiny", "parameterCount": "1M"}, resources={"gpusPerNode": 0},
             offload={"optimizer": "nvme"}, method={"type": "lora", "rank": 4})
    choice = choose_placement(s, [node("gpu-48g-nvme", "n1")], {}, SETTINGS).chosen
    assert choice is not None and choice.plan is not None
    assert choice.plan.optimizer == "nvme" and choice.plan.bytes.nvme == 0
    pod = pod_specs.build_pod(JOB, s, choice, attempt=0, rank=0, settings=SETTINGS)
    assert "nvme" in {v["name"] for v in pod["spec"]["volumes"]}
    assert b.NVME_DIR in {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    ds = b.build_runtime_config(JOB, s, choice.plan, None).deepspeed
    assert ds["zero_optimization"]["offload_optimizer"]["nvme_path"] == b.NVME_DIR


def test_a_nodes_probed_aio_settings_reach_the_pods_deepspeed_config() -> None:
    """The node probe's sweep, written as annotations, is the `aio` block the training pod
    reads; a node the sweep never ran on gets the untuned defaults."""
    probed = node("gpu-48g-nvme", "n1")
    probed["metadata"]["annotations"].update({
        "spillway.dev/aio-block-size": str(8 << 20), "spillway.dev/aio-queue-depth": "128",
        "spillway.dev/aio-intra-op-parallelism": "4"})
    s = spec(offload={"optimizer": "nvme"})
    tuned = choose_placement(s, [probed], {}, SETTINGS).chosen
    untuned = choose_placement(s, [node("gpu-48g-nvme", "n2")], {}, SETTINGS).chosen
    assert tuned is not None and tuned.plan is not None and untuned is not None and untuned.plan is not None
    assert tuned.plan.optimizer == "nvme"
    configmap = b.build_configmap(JOB, b.build_runtime_config(JOB, s, tuned.plan, None), attempt=0)
    aio = json.loads(configmap["data"]["deepspeed.json"])["aio"]
    assert (aio["block_size"], aio["queue_depth"], aio["intra_op_parallelism"]) == (8 << 20, 128, 4)
    default = b.build_runtime_config(JOB, s, untuned.plan, None).deepspeed["aio"]
    assert {k: default[k] for k in ("block_size", "queue_depth", "intra_op_parallelism")} == AioSettings().model_dump(
        include={"block_size", "queue_depth", "intra_op_parallelism"})


def test_cpu_processes_run_under_the_supervisor_with_their_share_of_threads() -> None:
    s = spec(model={"uri": "pvc://models/tiny", "parameterCount": "1M"},
             resources={"gpusPerNode": 0, "cpuProcesses": 2})
    choice = choose_placement(s, [node("cpu-only", "c1")], {}, SETTINGS).chosen
    assert choice is not None and choice.plan is not None
    assert (choice.plan.accelerator, choice.plan.processes_per_node) == ("cpu", 2)
    pod = pod_specs.build_pod(JOB, s, choice, attempt=0, rank=0, settings=SETTINGS)
    container = pod["spec"]["containers"][0]
    assert container["command"][:4] == ["python", "-m", "spillway_runtime.training.supervisor", "--processes=2"]
    threads = int(next(e["value"] for e in container["env"] if e["name"] == "OMP_NUM_THREADS"))
    assert threads == max(1, int(container["resources"]["requests"]["cpu"]) // 2)
    # DeepSpeed asserts train_batch_size = micro batch x accumulation x world size at start.
    ds = b.build_runtime_config(JOB, s, choice.plan, None).deepspeed
    t = s.training
    assert ds["train_batch_size"] == t.micro_batch_size * t.gradient_accumulation * 2


def test_cpu_processes_with_gpus_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"resources\.cpuProcesses is 2 with gpusPerNode 1"):
        spec(resources={"gpusPerNode": 1, "cpuProcesses": 2})


def test_runtime_config_carries_resume_only_when_asked() -> None:
    s = spec(resumeFrom="step-00010")
    placement = choose_placement(s, [node("gpu-80g")], {}, SETTINGS)
    assert placement.chosen is not None and placement.chosen.plan is not None
    with_resume = b.build_runtime_config(JOB, s, placement.chosen.plan, "step-00010")
    without = b.build_runtime_config(JOB, s, placement.chosen.plan, None)
    assert with_resume.job.spec.resume_from == "step-00010"
    assert without.job.spec.resume_from is None
    assert with_resume.model_dir == "/mnt/pvc/models/llama"


def test_rbac_is_limited_to_own_job_status() -> None:
    _, role, binding = b.build_runtime_rbac(JOB)
    assert all(rule["resourceNames"] == ["j"] for rule in role["rules"])
    assert "patch" not in role["rules"][0]["verbs"]
    assert binding["subjects"][0]["name"] == "j-runtime"


def _pod(phase: str, code: int | None = None, reason: str = "") -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if code is not None:
        status["containerStatuses"] = [{"state": {"terminated": {"exitCode": code, "reason": reason}}}]
    return {"metadata": {"name": "p"}, "spec": {"nodeName": "n"}, "status": status}


@pytest.mark.parametrize(
    ("pod", "node_exists", "kind"),
    [
        (_pod("Succeeded", 0), True, pod_outcomes.OUTCOME_SUCCEEDED),
        (_pod("Failed", 1), True, pod_outcomes.OUTCOME_RETRYABLE),
        (_pod("Failed", 137, "OOMKilled"), True, pod_outcomes.OUTCOME_RETRYABLE),
        (_pod("Failed", 75), True, pod_outcomes.OUTCOME_PREEMPTED),
        (_pod("Failed", 2), True, pod_outcomes.OUTCOME_PERMANENT),
        (_pod("Failed", 4), True, pod_outcomes.OUTCOME_PERMANENT),
        (_pod("Running"), False, pod_outcomes.OUTCOME_PREEMPTED),
        (_pod("Running"), True, pod_outcomes.OUTCOME_RUNNING),
    ],
)
def test_exit_code_policy(pod: dict[str, Any], node_exists: bool, kind: str) -> None:
    assert pod_outcomes.classify_pod(pod, node_exists).kind == kind


def test_evicted_pod_is_preempted() -> None:
    pod = _pod("Failed")
    pod["status"]["reason"] = "Evicted"
    assert pod_outcomes.classify_pod(pod, True).kind == pod_outcomes.OUTCOME_PREEMPTED


def test_backoff_doubles_and_caps() -> None:
    assert [pod_outcomes.backoff_seconds(n, SETTINGS) for n in range(5)] == [0, 10, 20, 40, 60]


def test_condition_transition_time_moves_only_on_flip() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    c = b.set_condition([], "Running", True, "Running", "a", 1, t0)
    c = b.set_condition(c, "Running", True, "Running", "b", 2, t0 + timedelta(seconds=5))
    assert c[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z" and c[0]["message"] == "b"
    c = b.set_condition(copy.deepcopy(c), "Running", False, "Stopped", "c", 2, t0 + timedelta(seconds=9))
    assert c[0]["lastTransitionTime"] == "2026-01-01T00:00:09Z"


def test_cost_accrues_from_pod_time() -> None:
    now = datetime(2026, 1, 1, 1, tzinfo=UTC)
    pod = {"status": {"startTime": "2026-01-01T00:00:00Z"}}
    seconds = job_cost.pod_run_seconds(pod, now)
    assert seconds == 3600
    cost = job_cost.cost_status(now, 1.0, 0.5, seconds, 8.0, 4)
    assert cost["usd"] == 9.0 and cost["gpuHours"] == 4.5 and cost["display"] == "$9.00"
    assert cost["asOf"] == "2026-01-01T01:00:00Z"


@pytest.mark.parametrize(("checkpoint", "copies"), [({"keep": 3}, 4), ({"keep": 2, "keepBest": True}, 4)])
def test_checkpoint_volume_holds_kept_checkpoints_of_the_plans_real_size(checkpoint, copies) -> None:
    dataset = {"uri": "file:///d", "validation": {"fraction": 0.1}}
    s = spec(checkpoint=checkpoint, dataset=dataset)
    choice = choose_placement(s, [node("gpu-24g", "n1")], {}, SETTINGS).chosen
    assert choice is not None and choice.plan is not None
    plan = choice.plan
    per_param = {3: 12}.get(plan.zero_stage, 14)  # fp32 masters and both moments, + bf16 weights under ZeRO-2
    assert plan.checkpoint_bytes == plan.model.params * per_param
    assert b.checkpoint_size_bytes(s, plan) == copies * plan.checkpoint_bytes + 2**30


QWEN2_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
            "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False}


def test_a_config_plans_the_real_shape_and_says_so() -> None:
    """A 152k vocabulary: a larger embedding (the largest tensor, ZeRO-3's gathered layer) and
    larger logits than the 32k-vocabulary guess for the same parameter count, so more GPU bytes."""
    forced = {"optimizer": "cpu", "parameters": "cpu"}
    real = choose_placement(spec(model={"uri": "pvc://models/qwen2", "config": QWEN2_7B}, offload=forced),
                            [node("gpu-80g")], {}, SETTINGS)
    guess = choose_placement(spec(model={"uri": "pvc://models/qwen2", "parameterCount": "7615616512"}, offload=forced),
                             [node("gpu-80g")], {}, SETTINGS)
    assert real.chosen is not None and real.chosen.plan is not None
    assert guess.chosen is not None and guess.chosen.plan is not None
    assert real.chosen.plan.model.params == guess.chosen.plan.model.params == 7_615_616_512
    assert real.chosen.plan.model.largest_param_numel == 152064 * 3584
    assert real.chosen.plan.model.largest_param_numel > 4 * guess.chosen.plan.model.largest_param_numel
    assert real.chosen.plan.bytes.gpu > guess.chosen.plan.bytes.gpu
    real_status, guess_status = plan_status(real), plan_status(guess)
    assert real_status is not None and guess_status is not None
    assert real_status["reasons"][0] == (
        "model shape from spec.model.config (qwen2, 152,064-token vocabulary, 7.6B parameters)")
    assert guess_status["reasons"][0].startswith("model shape guessed from parameterCount as a Llama-shaped decoder")
    assert "give spec.model.config" in guess_status["reasons"][0]


def test_the_config_wins_over_a_parameter_count_it_contradicts() -> None:
    s = spec(model={"uri": "pvc://models/qwen2", "config": QWEN2_7B, "parameterCount": "13B"})
    status = plan_status(choose_placement(s, [node("gpu-80g")], {}, SETTINGS))
    assert status is not None
    assert status["reasons"][1] == (
        "spec.model.parameterCount (13.0B) differs from the config's 7.6B by 71%: planned with the config's")
    close = spec(model={"uri": "pvc://models/qwen2", "config": QWEN2_7B, "parameterCount": "7B"})
    status = plan_status(choose_placement(close, [node("gpu-80g")], {}, SETTINGS))
    assert status is not None and not any("differs" in r for r in status["reasons"])


def test_without_config_or_parameter_count_the_error_names_both() -> None:
    with pytest.raises(ValueError, match=r"spec\.model\.config .* or spec\.model\.parameterCount"):
        choose_placement(spec(model={"uri": "pvc://models/x"}), [node("gpu-80g")], {}, SETTINGS)
