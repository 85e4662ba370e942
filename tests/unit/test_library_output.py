"""On a terminal, what DeepSpeed, transformers, torch and Python's warnings print goes into the
run's folder and is counted once (library_output.py); --verbose and logs keep it where it was.
Run in a fresh interpreter: installing it changes the process's logging for good."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import logging, sys, warnings
from pathlib import Path
from spillway_runtime import library_output
# DeepSpeed's logger as DeepSpeed makes it: its own handler on stdout, not propagated
ds = logging.getLogger("DeepSpeed")
ds.addHandler(logging.StreamHandler(sys.stdout))
ds.propagate = False
from transformers.utils import logging as hf_logging

log = library_output.for_terminal(Path(sys.argv[1]), int(sys.argv[2]), interactive=sys.argv[3] == "tty",
                                  verbose=sys.argv[4] == "verbose")
ds.warning("deepspeed says")
hf_logging.get_logger("transformers.modeling_utils").warning("transformers says")
warnings.warn("a library warns")
logging.getLogger("torch.distributed").warning("torch says")
with library_output.stdout_of(log):
    print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
ds.warning("deepspeed again")  # after the print: the two writers append, neither writes over the other
print("ours", flush=True)
print(log.summary() if log else "no library log")
"""


def run(tmp_path: Path, rank: int, interactive: str, verbose: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(rank), interactive, verbose],
                          capture_output=True, text=True, timeout=120)


def test_on_a_terminal_the_libraries_lines_go_to_the_run_folder_and_are_counted(tmp_path: Path) -> None:
    done = run(tmp_path, 0, "tty", "quiet")
    assert done.returncode == 0, done.stderr
    assert "says" not in done.stdout + done.stderr and "warns" not in done.stdout + done.stderr
    assert "built successfully" not in done.stdout
    lines = [line for line in (tmp_path / "libraries.log").read_text().splitlines() if line.strip()]
    assert [line.split(" ", 2)[2] for line in lines[:4]] == [
        "DeepSpeed WARNING deepspeed says", "transformers.modeling_utils WARNING transformers says",
        f"py.warnings WARNING {lines[2].split('WARNING ', 1)[1]}", "torch.distributed WARNING torch says"]
    assert "a library warns" in lines[2] and "built successfully" in lines[4] and len(lines) == 6
    assert lines[5].endswith("DeepSpeed WARNING deepspeed again")
    assert done.stdout.splitlines() == [
        "ours", f"6 lines from DeepSpeed, transformers and Python warnings in {tmp_path / 'libraries.log'} "
        "(spillway run --verbose shows them here)"]


def test_another_rank_has_its_own_file_and_verbose_or_a_log_changes_nothing(tmp_path: Path) -> None:
    assert run(tmp_path, 1, "tty", "quiet").returncode == 0
    assert (tmp_path / "libraries.rank1.log").is_file() and not (tmp_path / "libraries.log").exists()
    for interactive, verbose in (("tty", "verbose"), ("log", "quiet")):
        shown = run(tmp_path / interactive, 0, interactive, verbose)
        assert "deepspeed says" in shown.stdout and "transformers says" in shown.stderr
        assert "a library warns" in shown.stderr and "built successfully" in shown.stdout
        assert shown.stdout.splitlines()[-1] == "no library log" and not (tmp_path / interactive).exists()
