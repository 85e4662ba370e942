import copy
from pathlib import Path

import pytest

from spillway_runtime.core.spec import SpecError, load_job, parse_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def minimal(**spec_overrides):
    spec = {"model": {"uri": "/models/x"}, "dataset": {"uri": "/data/train.jsonl"}}
    spec.update(spec_overrides)
    return {"apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "job"}, "spec": spec}


def test_minimal_job_gets_defaults_and_camel_case_round_trip():
    job = parse_job(minimal())
    assert job.spec.training.max_steps == 100
    assert job.spec.offload.policy == "auto"
    dumped = job.model_dump(mode="json")
    assert dumped["spec"]["training"]["maxSteps"] == 100
    assert dumped["spec"]["checkpoint"]["everySteps"] == 50
    assert parse_job(dumped) == job


def test_error_names_the_field_path_and_the_value():
    with pytest.raises(SpecError) as err:
        parse_job(minimal(training={"maxSteps": 0, "sequenceLength": 4}))
    text = str(err.value)
    assert "spec.training.maxSteps: Input should be greater than or equal to 1 (got 0)" in text
    assert "spec.training.sequenceLength" in text


def test_unknown_field_is_rejected_by_name():
    with pytest.raises(SpecError, match=r"spec\.training\.maxStep: unknown field"):
        parse_job(minimal(training={"maxStep": 10}))


def test_enum_error_lists_valid_choices():
    with pytest.raises(SpecError, match=r"spec\.offload\.optimizer: .*'auto', 'gpu', 'cpu' or 'nvme'"):
        parse_job(minimal(offload={"optimizer": "disk"}))


def test_offload_choices_must_agree_with_policy():
    with pytest.raises(SpecError, match="optimizer: 'nvme' contradicts policy 'cpu'"):
        parse_job(minimal(offload={"policy": "cpu", "optimizer": "nvme"}))


def test_parameters_offloaded_with_optimizer_on_gpu_is_refused():
    with pytest.raises(SpecError, match="set optimizer to cpu or nvme"):
        parse_job(minimal(offload={"optimizer": "gpu", "parameters": "cpu"}))


def test_sizes_accept_units_and_auto():
    job = parse_job(minimal(offload={"nvme": {"storageClassName": "local", "size": "500Gi"}},
                            checkpoint={"size": "auto"}))
    assert job.spec.offload.nvme.size == 500 * 2**30
    assert job.spec.checkpoint.size is None


def test_warmup_longer_than_run_is_refused():
    with pytest.raises(SpecError, match="warmupSteps"):
        parse_job(minimal(training={"maxSteps": 5, "warmupSteps": 10}))


def test_early_stopping_needs_evaluations_that_have_checkpoints():
    validation = {"uri": "/data/train.jsonl", "validation": {"fraction": 0.1}}
    stopping = {"earlyStopping": {"patience": 3, "minDelta": 0.01}}
    job = parse_job(minimal(dataset=validation, training={"evalEverySteps": 100, **stopping},
                            checkpoint={"everySteps": 50}))
    assert (job.spec.training.early_stopping.patience, job.spec.training.early_stopping.min_delta) == (3, 0.01)
    with pytest.raises(SpecError, match=r"training.earlyStopping needs training.evalEverySteps \(0\) set to a "
                                        r"multiple of checkpoint.everySteps \(50\)"):
        parse_job(minimal(dataset=validation, training=stopping))
    with pytest.raises(SpecError, match=r"evalEverySteps \(30\) set to a multiple of checkpoint.everySteps \(20\)"):
        parse_job(minimal(dataset=validation, training={"evalEverySteps": 30, **stopping}, checkpoint={"everySteps": 20}))
    with pytest.raises(SpecError, match=r"spec.training.earlyStopping.patience: Input should be greater than or equal to 1"):
        parse_job(minimal(dataset=validation, training={"evalEverySteps": 50, "earlyStopping": {"patience": 0}}))


def test_early_stopping_counts_evaluations_without_an_improvement_beyond_min_delta():
    from spillway_runtime.training.schedule import EarlyStopping

    stopping = EarlyStopping(patience=2, min_delta=0.1)
    assert [stopping.record(step, loss) for step, loss in [(10, 2.0), (20, 1.95), (30, 1.5), (40, float("nan")),
                                                           (50, 1.45)]] == [False, False, False, False, True]
    assert (stopping.best, stopping.best_step, stopping.waited, stopping.exhausted) == (1.5, 30, 2, True)
    resumed = EarlyStopping(patience=2, min_delta=0.1)
    resumed.restore(EarlyStopping(2, 0.1, best=1.5, best_step=30, waited=1).state())
    assert resumed.record(50, 1.45) is True
    fresh = EarlyStopping(patience=1)
    fresh.restore(None)  # a checkpoint written without early stopping
    assert fresh.record(10, 3.0) is False and fresh.best_step == 10


def test_load_job_reports_yaml_errors_and_missing_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_job(bad)
    with pytest.raises(SpecError, match="cannot read the file"):
        load_job(tmp_path / "missing.yaml")


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_examples_are_valid(name):
    job = load_job(EXAMPLES / name)
    assert job.metadata.name


def test_lora_method_defaults_and_refusals():
    job = parse_job(minimal(method={"type": "lora"}))
    assert (job.spec.method.rank, job.spec.method.alpha, job.spec.method.target_modules) == (16, 32, ["all-linear"])
    assert job.spec.method.peft_targets == "all-linear"
    assert parse_job(minimal(method={"type": "lora", "targetModules": ["q_proj"]})).spec.method.peft_targets == ["q_proj"]
    with pytest.raises(SpecError, match=r"spec.method.targetModules"):  # a list, as the CRD and the API say
        parse_job(minimal(method={"type": "lora", "targetModules": "q_proj"}))
    assert parse_job(minimal()).spec.method.lora is False
    with pytest.raises(SpecError, match=r"spec.method.targetModules: .*all-linear stands alone"):
        parse_job(minimal(method={"type": "lora", "targetModules": ["all-linear", "q_proj"]}))
    with pytest.raises(SpecError, match=r"spec.method.targetModules: .*at least one module"):
        parse_job(minimal(method={"type": "lora", "targetModules": []}))
    with pytest.raises(SpecError, match=r"export.merge applies to method.type lora"):
        parse_job(minimal(export={"merge": True}))
    with pytest.raises(SpecError, match=r"spec.method.rank"):
        parse_job(minimal(method={"type": "lora", "rank": 0}))


QWEN2_CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064,
                "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0}


def test_model_config_is_kept_whole_and_round_trips():
    job = parse_job(minimal(model={"uri": "/models/qwen", "config": QWEN2_CONFIG}))
    assert job.spec.model.config == QWEN2_CONFIG  # snake_case keys and unknown keys kept as written
    dumped = job.model_dump(mode="json")
    assert dumped["spec"]["model"]["config"] == QWEN2_CONFIG
    assert parse_job(dumped) == job


@pytest.mark.parametrize(("config", "line"), [
    ({**QWEN2_CONFIG, "num_hidden_layers": 0},
     "spec.model.config.num_hidden_layers: must be a positive integer (got 0)"),
    ({k: v for k, v in QWEN2_CONFIG.items() if k != "hidden_size"},
     "spec.model.config.hidden_size: missing; the config.json of this model family has it\n"),
    ({**QWEN2_CONFIG, "model_type": "t5"}, "give spec.model.parameterCount instead"),
])
def test_model_config_errors_name_the_config_key(config, line):
    with pytest.raises(SpecError) as err:
        parse_job(minimal(model={"uri": "/models/qwen", "config": config}))
    assert line in str(err.value) + "\n"


ZENFLOW = {"optimizer": "cpu", "overlap": "zenflow"}
ZENFLOW_JOB = {"training": {"gradientAccumulation": 1}, "checkpoint": {"everySteps": 8},
               "rollback": {"onDivergence": False}}


def zenflow_job(offload=None, **spec):
    """A job ZenFlow accepts, with `spec`'s sections merged into it."""
    merged = {key: {**value, **spec.pop(key, {})} for key, value in ZENFLOW_JOB.items()}
    return minimal(offload={**ZENFLOW, **(offload or {})}, **merged, **spec)


def zenflow_override(**settings):
    return {"deepspeed": {"zero_optimization": {"zenflow": settings}}}


def test_a_zenflow_job_with_its_settings_is_accepted():
    assert parse_job(zenflow_job()).spec.offload.overlap == "zenflow"


@pytest.mark.parametrize(("job", "words"), [
    (zenflow_job({"optimizer": "nvme"}), "optimizer 'nvme', parameters 'auto'"),
    (zenflow_job({"parameters": "cpu"}), "set optimizer cpu (or auto) and parameters gpu"),
    (zenflow_job({"policy": "none", "optimizer": "auto"}), "policy 'none' exclude it"),
    (zenflow_job(training={"gradientAccumulation": 4}), "set gradientAccumulation to 1"),
    (zenflow_job(checkpoint={"everySteps": 10}), "set everySteps to a multiple of 4"),
    (zenflow_job(training={"maxSteps": 10}), "set maxSteps to a multiple of 4"),
    (zenflow_job(rollback={"onDivergence": True}), "set rollback.onDivergence: false"),
    (zenflow_job(zenflow_override(update_interval=5, select_interval=4), checkpoint={"everySteps": 10}),
     "select_interval must be 5 with overlap zenflow (got 4)"),
    (zenflow_job(zenflow_override(update_interval="auto")), "update_interval must be a whole number of steps"),
    (zenflow_job(zenflow_override(update_interval=64)), "from 1 to 32"),
    (zenflow_job(zenflow_override(topk_ratio=1.5)), "topk_ratio must be a share of the columns"),
    (zenflow_job(zenflow_override(overlap_step=True)), "an overlapped CPU update is in flight there and in no checkpoint"),
    (zenflow_job(method={"type": "lora"}), "not yet tested with LoRA or DPO"),
])
def test_zenflow_is_refused_where_a_resume_could_not_be_exact(job, words):
    """offload.overlap zenflow: ZeRO-2 with the optimizer in CPU RAM, no gradient accumulation
    of Spillway's, every checkpoint on ZenFlow's update boundary, no in-process rollback,
    fixed intervals."""
    with pytest.raises(SpecError) as err:
        parse_job(job)
    assert words in str(err.value)


@pytest.mark.parametrize(("offload", "spec", "words"), [
    ({"optimizer": "nvme"}, {}, "optimizer 'nvme', parameters 'auto', policy 'auto', overlap 'none' exclude it"),
    ({"parameters": "nvme"}, {}, "set optimizer cpu (or auto), parameters gpu, cpu or auto and overlap none"),
    ({"policy": "none"}, {}, "policy 'none'"),
    ({"optimizer": "cpu", "overlap": "zenflow"}, ZENFLOW_JOB, "overlap 'zenflow' exclude it"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}}, {}, "needs ZeRO-3 (DeepSpeed's Twin-Flow)"),
    ({"gpuResidentFraction": 1}, {}, "less than 1"),
    ({}, {"method": {"type": "lora"}}, "not yet tested with LoRA"),
    ({}, {"method": {"type": "lora", "objective": "dpo"}, "dataset": {"uri": "pairs.jsonl", "format": "preference"}},
     "not yet tested with LoRA"),
    ({"cpuResidentFraction": 0.5}, {}, "remove cpuResidentFraction, or remove gpuResidentFraction"),
    ({"deepspeed": {"zero_optimization": {"super_offload": True}}}, {}, "remove those overrides"),
    ({"deepspeed": {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}}, {}, "remove those overrides"),
])
def test_a_share_on_the_gpu_is_refused_where_twin_flow_cannot_run(offload, spec, words):
    """offload.gpuResidentFraction: DeepSpeed's Twin-Flow, ZeRO-3 with the optimizer in CPU RAM."""
    with pytest.raises(SpecError) as err:
        parse_job(minimal(offload={"gpuResidentFraction": 0.3, **offload}, **copy.deepcopy(spec)))
    assert words in str(err.value)


def test_a_raw_twin_flow_ratio_is_refused_for_the_share_that_spillway_plans():
    with pytest.raises(SpecError) as err:
        parse_job(minimal(offload={"deepspeed": {"zero_optimization": {"offload_optimizer": {"ratio": 0.7}}}}))
    assert "remove the ratio and set gpuResidentFraction" in str(err.value)
    assert parse_job(minimal(offload={"gpuResidentFraction": 0.3})).spec.offload.gpu_resident_fraction == 0.3
    dpo = parse_job(minimal(offload={"gpuResidentFraction": 0.3}, method={"type": "full", "objective": "dpo"},
                            dataset={"uri": "pairs.jsonl", "format": "preference"}))
    assert dpo.spec.offload.gpu_resident_fraction == 0.3 and dpo.spec.method.objective == "dpo"  # full DPO: allowed


def test_zenflow_settings_are_spillways_with_the_interval_the_job_gives():
    from spillway_runtime.core.spec import zenflow_settings

    job = parse_job(zenflow_job(zenflow_override(update_interval=5, topk_ratio=0.2), checkpoint={"everySteps": 10}))
    # the columns are chosen afresh at each update boundary: select_interval follows update_interval
    assert zenflow_settings(job.spec.offload) == {
        "topk_ratio": 0.2, "select_strategy": "step", "select_interval": 5, "update_interval": 5,
        "full_warm_up_rounds": 0, "overlap_step": False}
