"""`spillway run` end to end on this machine: plan, train with the optimizer on NVMe,
checkpoint, export a Hugging Face model that loads."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import job_document

SPILLWAY = [sys.executable, "-m", "spillway_api.cli"]


@pytest.fixture(autouse=True)
def _own_database(tmp_path, monkeypatch):
    # `spillway run` records the job in the API's database; keep the user's default one clean
    monkeypatch.setenv("SPILLWAY_DATABASE_URL", f"sqlite:///{tmp_path / 'spillway.db'}")


def spillway(*args, cwd=None, env=None):
    env = {**os.environ, **(env or {})}
    return subprocess.run([*SPILLWAY, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=900)


def spillway_on_a_terminal(*args, cwd=None, env=None) -> tuple[int, str]:
    """`spillway ...` with a pseudo-terminal as its stdin, stdout and stderr, as a user runs it:
    its exit status and everything the terminal received, escape sequences removed."""
    import pty
    import re
    import select

    controller, terminal = pty.openpty()
    child = subprocess.Popen([*SPILLWAY, *args], stdin=terminal, stdout=terminal, stderr=terminal, cwd=cwd,
                             env={**os.environ, "TERM": "xterm-256color", **(env or {})}, close_fds=True)
    os.close(terminal)
    received = bytearray()
    while True:
        ready, _, _ = select.select([controller], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                chunk = b""
            if not chunk:
                break
            received += chunk
        elif child.poll() is not None:
            break
    os.close(controller)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07", "", received.decode(errors="replace"))
    return child.wait(timeout=60), text.replace("\r\n", "\n")


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.integration
def test_spillway_run_fine_tunes_on_chat_data_learning_the_answers_only(tmp_path, tiny_model):
    """Chat records through `spillway run`, from a Parquet file as data tools write them (JSON
    lines: the chat examples below): packed whole and apart, the loss on the assistant's turns
    only; a bad row is skipped and counted when asked to."""
    import pyarrow as pa
    import pyarrow.parquet

    records = [{"messages": [{"role": "user", "content": f"what is {a} plus {b}?"},
                             {"role": "assistant", "content": f"{a + b}"}]}
               for a in range(12) for b in range(12)]
    data = tmp_path / "chat.parquet"
    pyarrow.parquet.write_table(pa.Table.from_pylist([*records, {"messages": None}]), data, row_group_size=50)
    doc = job_document("chat", tiny_model["model"], data,
                       training={"maxSteps": 30, "learningRate": 3e-3, "microBatchSize": 4, "sequenceLength": 64},
                       offload={"policy": "cpu"}, checkpoint={"everySteps": 15, "keep": 1})
    doc["spec"]["dataset"].update({"format": "chat", "chatTemplate": CHAT_TEMPLATE, "onBadRecord": "skip"})
    # mixed in: more sums from a JSON lines file, a seeded half of its sequences per epoch
    more = tmp_path / "more-chat.jsonl"
    more.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"what is {a} plus {b}?"},
                                                     {"role": "assistant", "content": f"{a + b}"}]}) + "\n"
                            for a in range(12, 20) for b in range(12)))
    doc["spec"]["dataset"]["mixture"] = [{"uri": str(more), "weight": 0.5}]
    job = tmp_path / "chat.yaml"
    job.write_text(yaml.safe_dump(doc))
    result = spillway("run", str(job), "--run-dir", str(tmp_path / "run"), env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "144 chat records tokenized" in log and "1 bad records skipped" in log and "chat.parquet: row 145" in log
    assert "mixture: dataset.uri " in log and "dataset.mixture[0].uri " in log and "x 0.5 (96 chat records" in log
    steps = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in steps if e["event"] == "step"]
    assert len(losses) == 30 and losses[-1] < 0.6 * losses[0], losses

    # What it learned is the answers: the exported model's loss on an answer falls more
    # than on the question that precedes it.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spillway_runtime.core.spec_inputs import DatasetSource
    from spillway_runtime.training.data import PackedDataset, read_documents

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    source = DatasetSource(uri=str(data), format="chat", chatTemplate=CHAT_TEMPLATE, onBadRecord="skip")
    batch = PackedDataset.build_documents(list(read_documents(source, data, tokenizer, 64))[:8],
                                          tokenizer.pad_token_id, 64, packing=False).micro_batch(0, 0, 1, 8, 0)
    answers = batch["labels"]
    questions = batch["input_ids"].masked_fill(answers != -100, -100)
    questions[:, 0] = -100

    def loss(model_dir, labels):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            return model(**{**batch, "labels": labels}).loss.item()

    before = {k: loss(tiny_model["model"], v) for k, v in (("answer", answers), ("question", questions))}
    after = {k: loss(tmp_path / "run" / "final", v) for k, v in (("answer", answers), ("question", questions))}
    assert after["answer"] < 0.5 * before["answer"], (before, after)
    assert after["answer"] / before["answer"] < after["question"] / before["question"], (before, after)


@pytest.mark.integration
@pytest.mark.parametrize("example", ["chat-local", "chat-lora"])
def test_the_chat_examples_run_as_their_comments_say(tmp_path, example):
    """examples/chat-local.yaml and chat-lora.yaml with the commands in their comments (a shorter run)."""
    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "examples").mkdir()
    doc = yaml.safe_load((repo / "examples" / f"{example}.yaml").read_text())
    steps = 20 if example == "chat-local" else 10  # LoRA: the same path, shorter (its own tests go further)
    doc["spec"]["training"].update(maxSteps=steps, evalEverySteps=5)
    if example == "chat-local":
        # 50 held-out sequences, not 200: each of the 4 evaluations took ~20 s of the ~150 s run
        doc["spec"]["dataset"]["validation"] = {"fraction": 0.025}
    doc["spec"]["checkpoint"]["everySteps"] = 5
    (tmp_path / "examples" / f"{example}.yaml").write_text(yaml.safe_dump(doc))
    made = spillway("make-tiny", "runs/models/tiny-llama", "--chat-dataset", "runs/data/arithmetic-chat.jsonl",
                    cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    if example == "chat-local":  # on a terminal, as a user runs it: a progress bar and plain lines, no noise
        code, shown = spillway_on_a_terminal("run", f"examples/{example}.yaml", cwd=tmp_path, env={"COLUMNS": "200"})
        assert code == 0, shown[-3000:]
        assert "━" in shown and "finished at step 20" in shown and "done: model exported to" in shown, shown[-3000:]
        noise = [line for line in shown.splitlines()
                 if "Writing model shards" in line or "sha256" in line or "bytes={" in line or "SSD endurance" in line]
        assert noise == [], noise[:5]
        # what DeepSpeed and the others print (its comm op's "built successfully") is in the
        # run's folder, said in one line
        assert "built successfully" not in shown, shown[-3000:]
        assert "from DeepSpeed, transformers and Python warnings in" in shown, shown[-3000:]
        assert "built successfully" in (tmp_path / "runs" / example / "libraries.log").read_text()
    else:
        result = spillway("run", f"examples/{example}.yaml", cwd=tmp_path, env={"COLUMNS": "200"})
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = tmp_path / "runs" / example
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    evals = {e["step"]: e["eval_loss"] for e in events if e["event"] == "eval"}
    assert sorted(evals) == list(range(5, steps + 1, 5)) and evals[steps] < evals[5]
    best = min(evals, key=lambda s: (evals[s], s))
    kept = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert kept == sorted({f"step-{best:08d}", f"step-{steps:08d}"})
    if example == "chat-lora":  # the adapter, and the merged model beside it
        assert (run / "final" / "adapter_model.safetensors").is_file()
        assert (run / "final" / "merged" / "model.safetensors").is_file()


@pytest.mark.integration
def test_plan_cli_reference_points_and_infeasible_exit():
    ok = spillway("plan", "--params", "13B", "--gpu-memory", "24GiB", "--cpu-memory", "64GiB", "--nvme", "2TB",
                  "--output", "json")
    assert ok.returncode == 0, ok.stderr
    plan = json.loads(ok.stdout)
    assert plan["feasible"] and plan["optimizer"] == "nvme" and plan["zero_stage"] == 3
    assert set(plan["bytes"]) >= {"gpu", "cpu", "nvme"} and isinstance(plan["bytes"]["nvme"], int)
    assert plan["predicted_step_seconds"] > 0 and plan["reasons"]

    short = spillway("plan", "--params", "13B", "--gpu-memory", "24GiB", "--cpu-memory", "64GiB", "--nvme", "0")
    assert short.returncode == 3
    assert "CPU RAM is short by" in short.stderr and "GiB" in short.stderr

    # LoRA, as docs/methods.md gives it: 13B in CPU RAM, 70B with the frozen base on NVMe
    def lora(params: str) -> dict:
        out = spillway("plan", "--params", params, "--gpu-memory", "24GiB", "--cpu-memory", "128GiB", "--nvme", "2TB",
                       "--method", "lora", "--output", "json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    p13, p70 = lora("13B"), lora("70B")
    assert (p13["zero_stage"], p13["optimizer"], p13["parameters"]) == (3, "cpu", "cpu")
    assert round(p13["model"]["trainable_params"] / 1e6, 1) == 62.3 and round(p13["bytes"]["cpu"] / 2**30) == 27
    assert p70["feasible"] and p70["parameters"] == "nvme" and round(p70["bytes"]["nvme"] / 2**30) == 130


@pytest.mark.integration
def test_run_refuses_missing_model_and_unwritable_nvme(tmp_path, tiny_model):
    doc = job_document("bad", tmp_path / "no-such-model", tiny_model["data"])
    job = tmp_path / "bad.yaml"
    job.write_text(yaml.safe_dump(doc))
    result = spillway("run", str(job), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "spec.model.uri" in result.stderr and "no-such-model" in result.stderr

    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "file").write_text("a file where a directory should be")
    doc = job_document("bad2", tiny_model["model"], tiny_model["data"],
                       offload={"optimizer": "nvme", "nvme": {"path": str(locked / "file" / "nvme")}})
    job.write_text(yaml.safe_dump(doc))
    result = spillway("run", str(job), "--run-dir", str(tmp_path / "run2"))
    assert result.returncode == 2
    assert "spec.offload.nvme.path" in result.stderr and "not writable" in result.stderr
    assert not Path(tmp_path / "run2" / "checkpoints").exists()


@pytest.mark.integration
@pytest.mark.parametrize("aio_block", [1 << 20, 8 << 20])  # the probe's two block sizes
def test_the_demo_swaps_its_optimizer_state_to_nvme(tmp_path, aio_block):
    """`make demo` as the Makefile has it: the model its make-tiny line builds is large enough
    that examples/tiny-local.yaml's plan keeps the optimizer state in swap files whatever aio
    block the probe picks (under DeepSpeed's minimum swap size it would stay in RAM, and the
    README's "swapped to runs/tiny-local/nvme" would be false)."""
    import shlex

    from spillway_runtime.core.hardware import AioSettings, NodeHardware
    from spillway_runtime.core.spec import FineTuneJob
    from spillway_runtime.local import plan_for_job

    repo = Path(__file__).resolve().parents[2]
    recipe = (repo / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    [make_tiny] = [shlex.split(line)[1:] for line in recipe.splitlines() if "make-tiny" in line]
    made = spillway(*make_tiny, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    doc = yaml.safe_load((repo / "examples" / "tiny-local.yaml").read_text())
    model_dir = (repo / "examples" / doc["spec"]["model"]["uri"]).resolve().relative_to(repo)
    assert str(model_dir) == make_tiny[1], "the example trains another model than the demo builds"
    gib = 1 << 30
    hw = NodeHardware(cpu_cores=2, cpu_memory_bytes=16 * gib, nvme_path=str(tmp_path), nvme_capacity_bytes=100 * gib,
                      nvme_free_bytes=100 * gib, nvme_read_bytes_per_s=1.5e9, nvme_write_bytes_per_s=2e9,
                      aio=AioSettings(block_size=aio_block))
    plan = plan_for_job(FineTuneJob.model_validate(doc), hw, tmp_path / model_dir)
    assert plan.optimizer == "nvme" and plan.bytes.nvme > 32 << 20, plan.reasons
    assert not [r for r in plan.reasons if "minimum swap size" in r], plan.reasons


@pytest.mark.integration
def test_the_readmes_one_machine_commands_run_as_written(tmp_path):
    """The README's "On one machine" shell block, as written, in a fresh bash after `make demo`'s
    set-up (the model and data its make-tiny line builds): every command succeeds; while the
    run trains, its optimizer state is in swap files under runs/tiny-local/nvme (watched from
    beside it), the step events count those bytes, and the exported checkpoint is a model."""
    import re
    import shlex
    import shutil
    import threading

    repo = Path(__file__).resolve().parents[2]
    [block] = re.findall(r"## On one machine\n\n```sh\n(.*?)```", (repo / "README.md").read_text(), re.S)
    recipe = (repo / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    [make_tiny] = [shlex.split(line)[1:] for line in recipe.splitlines() if "make-tiny" in line]
    shutil.copytree(repo / "examples", tmp_path / "examples")
    (tmp_path / ".venv").symlink_to(repo / ".venv")
    assert spillway(*make_tiny, cwd=tmp_path).returncode == 0

    nvme = tmp_path / "runs" / "tiny-local" / "nvme"
    swapped: list[int] = []  # bytes of swap files, each time some were there
    finished = threading.Event()

    def watch() -> None:
        while not finished.wait(0.1):
            sizes = [p.stat().st_size for p in nvme.rglob("*.swp")] if nvme.is_dir() else []
            if sizes:
                swapped.append(sum(sizes))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # A fresh shell: the checkout's environment only from the block's own `source`
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if ".venv" not in p)
    env = {**os.environ, "PATH": path, "COLUMNS": "200"}
    env.pop("VIRTUAL_ENV", None)
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=900)
    finally:
        finished.set()
        watcher.join()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((tmp_path / "hw.json").read_text())["cpu_cores"] >= 1  # the JSON alone, no log line
    assert "13.0B parameters" in done.stdout and "largest model" in done.stdout
    run = tmp_path / "runs" / "tiny-local"
    assert "Z3 opt:nvme" in done.stdout
    assert len(list((run / "checkpoints" / ".tokens").glob("tokens-*.json"))) == 1  # tokenized once, kept

    # the optimizer state lived in swap files: 12 B/param (fp32 master + 2 moments), seen on
    # the disk while it trained and counted by every step
    assert swapped and max(swapped) > 32 << 20, f"swap files seen during the run: {swapped[:5]}"
    plan = json.loads((run / "runtime.json").read_text())["plan"]
    assert plan["bytes"]["nvme"] >= 12 * plan["model"]["params"] * 0.99
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 61))
    assert all(e["bytes"]["nvme"] >= 0.9 * plan["bytes"]["nvme"] for e in steps)
    first = steps[0]["loss"]
    assert steps[-1]["loss"] < 0.6 * first, (first, steps[-1]["loss"])
    # the end says where the state lived and what went to disk
    assert f"optimizer state (fp32 masters, Adam moments): in NVMe swap files under {run / 'nvme'}" in done.stdout
    assert "most held:" in done.stdout and "NVMe swap files" in done.stdout.split("most held:")[1]
    [end] = [e for e in events if e["event"] == "finished"]
    assert end["disk"]["written"] > max(swapped), end["disk"]
    assert "disk: the training process read" in done.stdout
    # and how long a step took beside the plan's prediction: the status's window, the run's mean
    last = steps[-1]
    window = statistics.fmean(e["step_seconds"] for e in steps[-20:])
    assert abs(last["step_seconds_mean"] - window) <= 1e-4, (last, window)  # each step's seconds in 4 digits
    assert abs(last["step_time_vs_plan"] - last["step_seconds_mean"] / plan["predicted_step_seconds"]) < 2e-3
    mean = statistics.fmean(e["step_seconds"] for e in steps[1:])
    assert f"step time: {mean:.3g} s on average over 59 steps" in done.stdout, done.stdout
    assert f"the plan predicted {plan['predicted_step_seconds']:.3g} s: " in done.stdout

    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000040", "step-00000060"]
    assert (run / "checkpoints" / "latest").read_text() == "step-00000060"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for export in (run / "final", tmp_path / "runs" / "step-40"):  # the run's own, and `spillway export`'s
        model = AutoModelForCausalLM.from_pretrained(export)
        text = "Question: what is two plus three? Answer: 2 plus 3 is 5."
        ids = AutoTokenizer.from_pretrained(export)(text, return_tensors="pt")["input_ids"]
        assert model(input_ids=ids, labels=ids).loss.item() < first, export  # trained weights, not the initial
