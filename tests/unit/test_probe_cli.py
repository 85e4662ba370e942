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
