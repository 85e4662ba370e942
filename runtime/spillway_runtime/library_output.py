"""On a terminal, what the libraries print goes into the run's folder, and is said once.

`spillway run` on a terminal shows the plan, one progress bar and the run's events in words
(`reporting`). DeepSpeed, transformers, torch and Python's `warnings` print besides it:
DeepSpeed's logger and its op loaders write to stdout, transformers' logger and warnings to
stderr, in the middle of the bar. On a terminal, unless `--verbose` (SPILLWAY_VERBOSE=1), they
go into `<run dir>/libraries.log` (`libraries.rankN.log` for the ranks after 0), and at the
end rank 0 says in one line how many lines went there. Without a terminal (a pod's log, a
file) nothing changes: what they print is the log.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The libraries' loggers (each with its children): DeepSpeed's and transformers' print on
# handlers of their own, the others through the root logger, which is left alone so that
# Spillway's own warnings still reach the terminal.
_LIBRARIES = ("py.warnings", "DeepSpeed", "transformers", "torch", "accelerate", "peft", "huggingface_hub",
              "datasets")


class LibraryLog:
    """Library logging, Python warnings and DeepSpeed's prints into one file (`install`)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # This run's lines only; appended by both the handler and `stdout`'s file (two handles
        # at one offset each would write over each other)
        path.write_text("", encoding="utf-8")
        self.handler = logging.FileHandler(path, mode="a", encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self._stream: Any = None

    def install(self) -> None:
        logging.captureWarnings(True)  # warnings.warn -> the `py.warnings` logger
        for name in _LIBRARIES:
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                    logger.removeHandler(handler)
            logger.addHandler(self.handler)
            logger.propagate = False
        with contextlib.suppress(ImportError):  # transformers keeps its own default handler
            from transformers.utils import logging as hf_logging

            hf_logging.disable_default_handler()

    @contextlib.contextmanager
    def stdout(self) -> Iterator[None]:
        """What is printed to stdout meanwhile (DeepSpeed's `... built successfully`) goes to the file."""
        if self._stream is None:
            self._stream = self.path.open("a", encoding="utf-8", buffering=1)
        with contextlib.redirect_stdout(self._stream):
            yield

    def lines(self) -> int:
        self.handler.flush()
        if self._stream is not None:
            self._stream.flush()
        return sum(1 for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip())

    def summary(self) -> str | None:
        """The one line rank 0 says at the end, when the libraries printed anything."""
        count = self.lines()
        if not count:
            return None
        return (f"{count} line{'s' if count != 1 else ''} from DeepSpeed, transformers and Python warnings "
                f"in {self.path} (spillway run --verbose shows them here)")

    def close(self) -> None:
        for name in _LIBRARIES:
            logging.getLogger(name).removeHandler(self.handler)
        self.handler.close()
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def for_terminal(run_dir: Path, rank: int, interactive: bool, verbose: bool) -> LibraryLog | None:
    """The run's library log, installed, when its output is a terminal and not --verbose."""
    if not interactive or verbose:
        return None
    log = LibraryLog(run_dir / ("libraries.log" if rank == 0 else f"libraries.rank{rank}.log"))
    log.install()
    return log


def stdout_of(log: LibraryLog | None) -> contextlib.AbstractContextManager[None]:
    return log.stdout() if log is not None else contextlib.nullcontext()
