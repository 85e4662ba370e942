"""A process killed at any moment of a checkpoint write never damages the last good checkpoint.

A writer process commits checkpoint 1, then is SIGKILLed (what a second Ctrl-C, an OOM kill
or a node's eviction does) at eighty moments spread over the write of checkpoint 2: while its
shards are written, hashed, fsynced, renamed, while the `latest` pointer moves and while
checkpoint 1 is pruned. After every kill a restart must find a checkpoint whose every file
matches its manifest, checkpoint 1 or 2, and nothing half-written or half-deleted may look committed.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spillway_runtime.checkpoints.store import LATEST, PREFIX, CheckpointStore, checkpoint_name

pytestmark = pytest.mark.integration

WRITER = """
import os, sys
from pathlib import Path
from spillway_runtime.checkpoints.store import CheckpointStore

root, step = Path(sys.argv[1]), int(sys.argv[2])
store = CheckpointStore(root, keep=1, log=lambda message: None)

def write(staging):
    for shard in range(8):  # 16 MiB in shards, as ranks and DeepSpeed write them
        (staging / f"shard-{shard}.bin").write_bytes(os.urandom(2 << 20))

print("saving", flush=True)
store.save(step, write, {"loss": 1.0 / step})
print("saved", flush=True)
"""
# Moments to kill at, as fractions of the measured write time: evenly over the whole write,
# and densely over its end, where the commit's renames, the pointer and the pruning happen fast.
KILL_AT = [1.2 * i / 40 for i in range(40)] + [0.8 + 0.3 * i / 40 for i in range(40)]


def start_writer(root: Path, step: int) -> tuple[subprocess.Popen[str], float]:
    """The writer, once it reports the save has begun, and when it did."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(step)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "saving"
    return proc, time.monotonic()


def kill_and_restart(base: Path, root: Path, after: float) -> int:
    """The step a restart finds after the writer of checkpoint 2 is SIGKILLed `after` seconds in."""
    shutil.copytree(base, root)
    proc, began = start_writer(root, 2)
    time.sleep(max(0.0, began + after - time.monotonic()))
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    store = CheckpointStore(root, keep=1, log=lambda _message: None)
    found = store.find_good()
    assert found is not None and found.name in (checkpoint_name(1), checkpoint_name(2)), root.name
    assert store.verify(found.path) is None
    for committed in root.glob(f"{PREFIX}*"):  # a visible checkpoint is a whole one
        assert store.verify(committed) is None, f"{root.name}: {committed.name} is damaged"
    latest = (root / LATEST).read_text()
    assert latest in (checkpoint_name(1), checkpoint_name(2)) and (root / latest).is_dir(), root.name
    return found.step


def test_kill_at_any_moment_of_a_checkpoint_write_keeps_a_good_one(tmp_path):
    base = tmp_path / "base"
    proc, _ = start_writer(base, 1)
    assert proc.wait(timeout=120) == 0
    timing = tmp_path / "timing"
    shutil.copytree(base, timing)
    proc, began = start_writer(timing, 2)
    assert proc.wait(timeout=120) == 0
    write_seconds = time.monotonic() - began

    outcomes = [
        kill_and_restart(base, tmp_path / f"kill-{point}", write_seconds * fraction) for point, fraction in enumerate(KILL_AT)
    ]
    # The kills must really spread over the write, some before the commit and some after it. On a
    # loaded machine one write can take much longer (or shorter) than the timed one, so where every
    # kill came before the commit, later moments are tried, each one more kill point, until one comes
    # after it; and earlier ones where every kill came after it.
    late, early = KILL_AT[-1], KILL_AT[1]
    while 2 not in outcomes and late < 8:
        late *= 1.25
        outcomes.append(kill_and_restart(base, tmp_path / f"kill-late-{len(outcomes)}", write_seconds * late))
    while 1 not in outcomes and early > 1e-4:
        early /= 2
        outcomes.append(kill_and_restart(base, tmp_path / f"kill-early-{len(outcomes)}", write_seconds * early))
    assert 1 in outcomes and 2 in outcomes, outcomes
