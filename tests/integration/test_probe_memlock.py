"""`spillway probe` where it may lock little memory: in a container run as a non-root uid
(RLIMIT_MEMLOCK 8 MiB under systemd's default, no CAP_IPC_LOCK). The async I/O sweep locks
its buffer; past the limit DeepSpeed died of SIGSEGV and the node-probe DaemonSet wrote no
figures. Here the probe runs with that limit and without the capability, as in such a pod."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LIMIT = 8 << 20


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (LIMIT, LIMIT))


def _probe(tmp_path: Path, limit_caps: bool) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "spillway_runtime.cli", "probe", "--output=json",
               f"--nvme-path={tmp_path}", "--aio-seconds=2"]
    if limit_caps:
        # root keeps CAP_IPC_LOCK, which ignores the limit: drop it as a pod's non-root uid lacks it
        command = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", *command]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, preexec_fn=_limited)


@pytest.mark.integration
def test_the_probe_measures_nvme_under_an_8_mib_memlock_limit(tmp_path: Path) -> None:
    as_root = os.geteuid() == 0
    if as_root and shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to drop CAP_IPC_LOCK for this test")
    proc = _probe(tmp_path, limit_caps=as_root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    hw = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert hw["nvme_read_bytes_per_s"] > 0 and hw["nvme_write_bytes_per_s"] > 0
    assert hw["aio"]["block_size"] <= LIMIT
    assert hw["memlock_bytes"] == LIMIT  # what the planner fits DeepSpeed's swap buffers under (the node annotation)
    assert not list(tmp_path.glob(".spillway-aio-probe-*"))  # its scratch file is gone
