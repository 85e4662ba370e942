"""`spillway probe` as the node-probe DaemonSet runs it: in a container, where the NVMe
directory it measures is mounted from a different path on the node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spillway_runtime.cli", "probe", "--quick", "--output=json", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_the_annotated_nvme_path_is_the_nodes_not_the_containers(tmp_path: Path) -> None:
    proc = _probe(f"--nvme-path={tmp_path}", "--nvme-host-path=/mnt/nvme0/spillway")
    assert proc.returncode == 0, proc.stderr
    hw = json.loads(proc.stdout)
    # Measured in the container's mount, reported at the node's path: the path the
    # operator will mount into training pods as a hostPath.
    assert hw["nvme_path"] == "/mnt/nvme0/spillway"
    assert hw["nvme_capacity_bytes"] > 0


def test_a_host_path_without_a_measured_path_is_refused(tmp_path: Path) -> None:
    proc = _probe("--nvme-host-path=/mnt/nvme0")
    assert proc.returncode != 0
    assert "--nvme-path" in proc.stderr


def test_plan_max_params_answers_per_placement_and_exits_3_when_nothing_fits() -> None:
    from typer.testing import CliRunner

    from spillway_api.cli import build_app

    runner = CliRunner()
    ok = runner.invoke(build_app(), ["plan", "--max-params", "--gpu-memory", "24GiB", "--cpu-memory", "64GiB",
                                     "--nvme", "2TB", "--output", "json"])
    assert ok.exit_code == 0, ok.output
    fits = json.loads(ok.output)
    assert {f["placement"] for f in fits} >= {"Z2 opt:gpu par:gpu", "Z3 opt:nvme par:nvme"}
    assert max(f["parameters"] for f in fits) > 13 * 10**9
    none = runner.invoke(build_app(), ["plan", "--max-params", "--cpu-memory", "256MiB", "--nvme", "0"])
    assert none.exit_code == 3 and "no placement fits" in none.output, none.output


def test_plan_config_counts_the_shape_from_config_json(tmp_path) -> None:
    from typer.testing import CliRunner

    from spillway_api.cli import build_app

    config = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
              "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    runner = CliRunner()
    ok = runner.invoke(build_app(), ["plan", "--config", str(tmp_path / "config.json"), "--gpu-memory", "80GiB",
                                     "--cpu-memory", "256GiB", "--nvme", "0", "--output", "json"])
    assert ok.exit_code == 0, ok.output
    model = json.loads(ok.output)["model"]
    assert (model["params"], model["largest_param_numel"]) == (7_615_616_512, 152064 * 3584)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "t5"}))
    bad = runner.invoke(build_app(), ["plan", "--config", str(tmp_path / "config.json"), "--gpu-memory", "80GiB"])
    assert bad.exit_code == 2 and "parameterCount" in bad.output, bad.output


def test_plan_under_a_memlock_limit_names_it_and_exits_3() -> None:
    from typer.testing import CliRunner

    from spillway_api.cli import build_app

    runner = CliRunner()
    node = ["plan", "--params", "13B", "--gpu-memory", "24GiB", "--cpu-memory", "64GiB", "--nvme", "2TB"]
    free = runner.invoke(build_app(), [*node, "--memlock", "unlimited", "--output", "json"])
    assert free.exit_code == 0 and json.loads(free.output)["feasible"], free.output
    # A container's 8 MiB: the embedding's swap buffers alone need 2.4 GiB locked, and the
    # optimizer does not fit 64 GiB of RAM
    limited = runner.invoke(build_app(), [*node, "--memlock", "8MiB"])
    assert limited.exit_code == 3, limited.output
    error = next(line for line in limited.output.splitlines() if line.startswith("error:"))
    assert "do not fit" in error and "Memory a process may lock (RLIMIT_MEMLOCK) is short by 2.4 GiB" in error, error
    assert "LimitMEMLOCK" in error
