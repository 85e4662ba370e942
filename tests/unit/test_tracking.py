"""The reporter's listeners without training (tracking.py, reporting.py): /metrics answers
with the last event's numbers over HTTP and stops with the reporter; a listener that fails
is one warning in the events file and the events go on; the scalars every tracker shows."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from spillway_runtime.training.reporting import Reporter, read_events
from spillway_runtime.training.tracking import PrometheusListener, scalars


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _metrics(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(f"{s.name}/{s.labels['tier']}" if "tier" in s.labels else s.name): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _reporter(tmp_path: Path) -> Reporter:
    return Reporter(tmp_path / "events.jsonl", total_steps=10, interactive=False)


def test_scalars_of_a_step_an_evaluation_and_a_checkpoint():
    step = {"event": "step", "step": 3, "loss": 2.5, "lr": 1e-4, "tokens_per_s": 800.0, "step_seconds": 0.5,
            "eta_seconds": 4.0, "data_position": 12, "bytes": {"cpu": 100, "nvme": 7}}
    assert scalars(step) == {"loss": 2.5, "learning_rate": 1e-4, "tokens_per_s": 800.0, "step_seconds": 0.5,
                             "bytes/cpu": 100.0, "bytes/nvme": 7.0}
    assert scalars({"event": "eval", "step": 3, "eval_loss": 2.25, "perplexity": 9.5}) == {"eval_loss": 2.25}
    assert scalars({"event": "checkpoint", "step": 3, "stall_seconds": 0.25, "background_seconds": 1.5}) == {
        "checkpoint/stall_seconds": 0.25, "checkpoint/background_seconds": 1.5}
    assert scalars({"event": "log", "message": "hello"}) == {}
    dpo = {"event": "step", "step": 3, "loss": 0.6, "rewards/margins": 0.5, "rewards/accuracies": 0.75, "pairs": 4}
    assert scalars(dpo) == {"loss": 0.6, "rewards/margins": 0.5, "rewards/accuracies": 0.75}
    assert scalars({"event": "eval", "step": 3, "eval_loss": 0.7, "eval_rewards/margins": 0.25, "pairs": 8}) == {
        "eval_loss": 0.7, "eval_rewards/margins": 0.25}


def test_metrics_endpoint_serves_the_last_events_numbers_until_the_reporter_closes(tmp_path, capsys):
    port = _free_port()
    reporter = _reporter(tmp_path)
    reporter.listeners = [PrometheusListener(port)]
    reporter.event("started", step=0, total_steps=10)
    assert _metrics(port)["spillway_step"] == 0
    reporter.step(1, loss=3.0, lr=1e-3, tokens_per_s=500.0, step_seconds=0.2, bytes={"cpu": 1000, "nvme": 64})
    reporter.step(2, loss=2.75, lr=9e-4, tokens_per_s=520.0, step_seconds=0.19, bytes={"cpu": 1001, "nvme": 128})
    reporter.event("checkpoint", step=2, stall_seconds=0.125, background_seconds=0.5)
    reporter.event("eval", step=2, eval_loss=2.9, **{"eval_rewards/margins": 0.25})
    seen = _metrics(port)
    assert "spillway_dpo_reward_margin" not in seen and seen["spillway_dpo_eval_reward_margin"] == 0.25
    reporter.step(3, loss=0.6, **{"rewards/margins": 0.5, "rewards/accuracies": 0.75})
    assert _metrics(port)["spillway_dpo_reward_margin"] == 0.5 and _metrics(port)["spillway_dpo_reward_accuracy"] == 0.75
    reporter.step(2, loss=2.75, lr=9e-4, tokens_per_s=520.0, step_seconds=0.19, bytes={"cpu": 1001, "nvme": 128})
    seen = _metrics(port)
    assert seen["spillway_step"] == 2 and seen["spillway_loss"] == 2.75
    assert seen["spillway_learning_rate"] == 9e-4 and seen["spillway_tokens_per_second"] == 520.0
    assert seen["spillway_tier_bytes/cpu"] == 1001 and seen["spillway_tier_bytes/nvme"] == 128
    assert seen["spillway_checkpoint_stall_seconds"] == 0.125 and seen["spillway_checkpoints_total"] == 1
    assert seen["spillway_eval_loss"] == 2.9 and seen["spillway_rollbacks_total"] == 0
    assert seen["spillway_disk_read_bytes_total"] >= 0 and seen["spillway_disk_written_bytes_total"] >= 0
    reporter.close()
    with pytest.raises(urllib.error.URLError):
        _metrics(port)
    capsys.readouterr()


class _Breaks:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def handle(self, record: dict[str, Any]) -> None:
        self.seen.append(record["event"])
        if record["event"] == "step":
            raise OSError(28, "No space left on device")

    def close(self) -> None:
        pass


def test_a_failing_listener_is_one_warning_and_the_events_go_on(tmp_path, capsys):
    reporter = _reporter(tmp_path)
    broken = _Breaks()
    reporter.listeners = [broken]
    reporter.event("started", step=0, total_steps=10)
    reporter.step(1, loss=1.0)
    reporter.step(2, loss=0.9)
    reporter.close()
    events = read_events(tmp_path / "events.jsonl")
    assert [e["event"] for e in events] == ["started", "step", "warning", "step"]
    assert "No space left on device" in events[2]["message"]
    assert broken.seen == ["started", "step"]  # dropped after its failure
    capsys.readouterr()


def test_a_warning_from_another_thread_is_written_by_the_next_event_or_at_close(tmp_path, capsys):
    import threading

    reporter = _reporter(tmp_path)
    thread = threading.Thread(target=reporter.warn_soon, args=("from the side",))
    thread.start()
    thread.join()
    reporter.event("log", message="next")
    reporter.warn_soon("at the end")
    reporter.close()
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["event"], e["message"]) for e in events] == [
        ("warning", "from the side"), ("log", "next"), ("warning", "at the end")]
    capsys.readouterr()


def test_params_are_the_spec_flattened_by_dotted_keys_mlflow_accepts():
    from spillway_runtime.training.tracking import _flatten

    spec = {"training": {"maxSteps": 8, "learningRate": 0.001}, "method": {"targetModules": ["q_proj", "v_proj"]},
            "resources": {"nodeSelector": {"pool:gpu": "a100", "nvidia.com/gpu.product": "A100"}}, "budget": {},
            "export": {"merge": False}}
    assert dict(_flatten("spec", spec)) == {
        "spec.training.maxSteps": "8", "spec.training.learningRate": "0.001",
        "spec.method.targetModules": '["q_proj", "v_proj"]',
        "spec.resources.nodeSelector.pool_gpu": "a100", "spec.resources.nodeSelector.nvidia.com/gpu.product": "A100",
        "spec.budget": "{}", "spec.export.merge": "false",
    }


def test_a_terminal_shows_events_in_words_and_the_events_file_keeps_every_field(tmp_path: Path, capsys,
                                                                                 monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at the terminal's width
    reporter = Reporter(tmp_path / "events.jsonl", total_steps=60, interactive=True)
    reporter.event("memory", stage="engine", bytes={"cpu": 840134656})
    reporter.event("log", message="rank 0/1 on cpu, plan Z3 opt:nvme par:gpu")
    reporter.event("checkpoint", name="step-00000020", step=20, loss=1.2345678901, sizeBytes=65377448,
                   sha256="bf09f2b66699bbe0fc580bd1bd828f53ec027ef040bc35dc4ce21c0ac5b8f2ac", stall_seconds=1.5515)
    reporter.event("eval", step=20, eval_loss=1.1111111, perplexity=3.03)
    reporter.event("something_new", ratio=0.123456789, nested={"a": 1})
    reporter.event("finished", step=60, loss=1.100219190120697, rollbacks=0)
    reporter.close()
    shown = [line.rstrip() for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert shown == [
        "rank 0/1 on cpu, plan Z3 opt:nvme par:gpu",
        "checkpoint step-00000020 at step 20: 62.3 MiB, loss 1.235, training paused 1.55 s",
        "held-out loss 1.111 at step 20",
        "something_new ratio=0.1235",
        "finished at step 60, loss 1.1",
    ]
    kept = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert kept[0]["event"] == "memory" and kept[2]["sha256"].startswith("bf09f2b6")
    assert kept[2]["loss"] == 1.2345678901


def test_verbose_shows_every_record_in_full_on_a_terminal(tmp_path: Path, capsys, monkeypatch) -> None:
    """`spillway run --verbose` (SPILLWAY_VERBOSE=1): each event's whole record, steps and
    memory dumps included, exactly as the events file keeps it; nothing in words instead."""
    monkeypatch.setenv("COLUMNS", "60")  # narrower than a record: still one line each
    monkeypatch.setenv("SPILLWAY_VERBOSE", "1")
    reporter = Reporter(tmp_path / "events.jsonl", total_steps=60, interactive=True)
    reporter.event("memory", stage="engine", bytes={"cpu": 840134656})
    reporter.step(1, loss=2.5, tokens_per_s=800.0, bytes={"nvme": 7})
    reporter.event("checkpoint", name="step-00000020", step=20, loss=1.2345678901, sha256="bf09f2b6[x]")
    reporter.close()
    shown = [line.rstrip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("{")]
    assert shown == (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in shown] == ["memory", "step", "checkpoint"]
    assert "[x]" in shown[2]  # printed as written: no rich markup eaten
