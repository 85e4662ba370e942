"""DeepSpeed locks (mlock) its NVMe swap buffers in RAM, and a pod run as a non-root uid may
lock only its container runtime's RLIMIT_MEMLOCK (8 MiB under systemd's default) without
CAP_IPC_LOCK to ignore it; past it DeepSpeed prints "mlock failed" and dies of SIGSEGV. The
runtime counts what DeepSpeed will lock, byte for byte (`memlock.locked_swap_bytes`), and fits
it under the limit or refuses by name. Here each job runs under that limit without the
capability, as in such a pod, and the bytes this process has locked once the engine is built
(Linux's VmLck) are compared with the count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from spillway_runtime.training.runconfig import FaultInjection

from .conftest import job_document, run_job
from .test_planner_measured import _model

pytestmark = pytest.mark.integration

LIMIT = 8 << 20
# One tensor of 1M elements (the input embedding, and the head beside it): DeepSpeed's four
# optimizer swap buffers each hold a whole one in fp32, 16 MiB, whatever the sub-group size.
WIDE_VOCABULARY = {"model_type": "llama", "vocab_size": 16384, "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                   "tie_word_embeddings": False}


@pytest.mark.parametrize(("optimizer", "parameters"), [("nvme", "cpu"), ("cpu", "nvme"), ("nvme", "nvme")])
def test_what_deepspeed_locks_is_counted_to_the_byte_and_fits_under_a_pods_limit(
        make_job, tmp_path: Path, optimizer: str, parameters: str) -> None:
    memlock = LIMIT
    job = make_job(f"locked-{optimizer}-{parameters}", training={"maxSteps": 6},
                   offload={"policy": "nvme", "optimizer": optimizer, "parameters": parameters,
                            "nvme": {"path": str(tmp_path / "nvme")}})
    run = run_job(job, tmp_path / "run", memlock=memlock)
    assert run.returncode == 0, run.log[-3000:]
    assert run.config.plan.label == f"Z3 opt:{optimizer} par:{parameters}"
    engine = next(e for e in run.of("memory") if e["stage"] == "engine")
    assert engine["locked"] == engine["swap_locked"] > 0, engine
    assert engine["locked"] <= memlock
    assert [e["step"] for e in run.of("step")] == [1, 2, 3, 4, 5, 6]
    # The plan was made under the limit `spillway run` found (as a cluster's under the node probe's
    # annotation): the runtime, counting the model as built, finds nothing left to fit.
    assert not any("optimizer swap:" in e["message"] or "optimizer sub-groups of" in e["message"]
                   for e in run.of("log")), run.log[-3000:]
    if optimizer == "nvme":  # the plan's sub-group (the whole model, 12 x 3 MB) was cut to fit
        assert any("RLIMIT_MEMLOCK of 8.0 MiB: optimizer swap: 4 buffers of" in r for r in run.config.plan.reasons)
        assert not run.config.plan.swap.pipeline
        # SIGKILLed after step 3's checkpoint, resumed under the same limit: the swap files and the
        # checkpoint read back through the same locked buffers, to the same losses
        killed = run_job(job, tmp_path / "killed", memlock=memlock, faults=FaultInjection(step_sleep_seconds=0.4),
                         signal_at_step=4)
        assert killed.returncode != 0
        resumed = run_job(job, tmp_path / "killed", memlock=memlock)
        assert resumed.returncode == 0, resumed.log[-3000:]
        assert [e["step"] for e in resumed.of("resumed")] == [3]
        losses = {e["step"]: e["loss"] for e in run.of("step")}
        after = {e["step"]: e["loss"] for e in resumed.of("step")}  # the last launch's, where a step ran twice
        assert after == losses, (after, losses)


def test_a_tensor_whose_swap_buffers_cannot_fit_is_refused_by_name(tiny_model, tmp_path: Path) -> None:
    # A tensor whose four fp32 optimizer buffers (16 MiB) no sub-group size can shrink.
    _model(tiny_model["model"], tmp_path / "model", WIDE_VOCABULARY)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_document(
        "wide", tmp_path / "model", tiny_model["data"], training={"maxSteps": 2},
        offload={"policy": "nvme", "optimizer": "nvme", "parameters": "cpu", "nvme": {"path": str(tmp_path / "nvme")}},
    )))
    # Refused by the plan, before the model loads: no placement the job allows fits (exit 3)
    refused = run_job(job, tmp_path / "refused", memlock=LIMIT)
    assert refused.returncode == 3, refused.log[-3000:]
    assert "Memory a process may lock (RLIMIT_MEMLOCK) is short by" in refused.log, refused.log[-3000:]
    assert "LimitMEMLOCK" in refused.log
    assert not refused.of("step")
    # Planned where no limit is known (a node the probe never measured): the runtime refuses by
    # name, with exit 2, before DeepSpeed starts
    unprobed = run_job(job, tmp_path / "unprobed", memlock=LIMIT, planned_unlimited=True)
    assert unprobed.returncode == 2, unprobed.log[-3000:]
    failure = unprobed.of("failed")[-1]["reason"]
    assert "lock 16.0 MiB, as each holds a whole one (the largest: 1,048,576 elements" in failure, failure
    assert "RLIMIT_MEMLOCK" in failure and "LimitMEMLOCK=infinity" in failure
    assert not unprobed.of("step")
    # Where nothing limits it (root's CAP_IPC_LOCK) the same job trains, locked as counted.
    unlimited = run_job(job, tmp_path / "unlimited")
    assert unlimited.returncode == 0, unlimited.log[-3000:]
    engine = next(e for e in unlimited.of("memory") if e["stage"] == "engine")
    assert engine["locked"] == engine["swap_locked"] >= 4 * (1 << 20) * 4, engine
