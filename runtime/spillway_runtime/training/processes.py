"""Training child processes and the signals between a launcher and them.

Where this sits: below `spillway run` (the API's local launcher), the runtime's own
`launch` and the multi-rank supervisor. The contract users rely on, in one place:
- A stop request (SIGTERM, or one Ctrl-C) reaches the training process exactly once; it
  finishes the step, writes a checkpoint and exits 75. Sending it again is harmless: the
  child is already stopping. (A repeated signal used to land while the runtime shut down,
  after Python had restored the default action, and the run ended killed by SIGTERM.)
- A second Ctrl-C aborts at once (SIGKILL of the child's whole process group): checkpoints
  are atomic, so an abort mid-write leaves the last good one as it was; exit 130.
- The child runs in its own session, so a terminal's Ctrl-C reaches the launcher only and
  the launcher decides; if the launcher dies, the child gets SIGTERM (PR_SET_PDEATHSIG) and
  checkpoints instead of training on unowned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import Any, Protocol

from spillway_runtime.core.contract import ExitCode

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A port the kernel has just handed out from its ephemeral range: outside Kubernetes' NodePort
    range (30000-32767), which a kube-proxy on the same host holds open."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """preexec_fn: SIGTERM this process when the thread that started it exits (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def exit_status(returncode: int, stop_sent: bool) -> int:
    """A child's exit as a shell reports it (128 + N for death by signal N). A child that the
    stop request killed before its handler was installed (Python still starting) lost
    nothing a checkpoint would hold: that is a preemption too."""
    if returncode == -signal.SIGTERM and stop_sent:
        return ExitCode.PREEMPTED
    return 128 - returncode if returncode < 0 else returncode


class TrainingProcess:
    """One training child (the runtime, or the supervisor of several ranks)."""

    def __init__(self, command: list[str], env: dict[str, str], *, tie_to_parent: bool = False, **popen: Any):
        # preexec_fn is only safe from a single-threaded parent: the foreground CLI, the supervisor
        self.proc = subprocess.Popen(command, env=env, start_new_session=True,
                                     preexec_fn=die_with_parent if tie_to_parent else None, **popen)
        self._stop_once = threading.Lock()  # held for good once the stop request is sent
        self.aborted = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stop_sent(self) -> bool:
        return self._stop_once.locked()

    def stop(self) -> None:
        """Ask the child to checkpoint and exit 75; only the first call sends anything."""
        if self._stop_once.acquire(blocking=False) and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def abort(self) -> None:
        """Kill the child and everything it started, now."""
        self.aborted = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def poll(self) -> int | None:
        code = self.proc.poll()
        return None if code is None else self._status(code)

    def wait(self) -> int:
        return self._status(self.proc.wait())

    def _status(self, code: int) -> int:
        if self.aborted and code == -signal.SIGKILL:  # not a child that had finished by itself
            return ExitCode.ABORTED
        return exit_status(code, self.stop_sent)


class Stoppable(Protocol):
    def stop(self) -> None: ...
    def abort(self) -> None: ...


class StopSignals:
    """A launcher's SIGTERM/SIGINT handling: the first asks for a checkpoint and stop, a second
    Ctrl-C aborts, a repeated SIGTERM is ignored (a supervisor that means it sends SIGKILL).
    A context manager that restores the previous handlers."""

    def __init__(self, target: Stoppable, say: Callable[[str], None] = lambda _m: None):
        self.target = target
        self.say = say
        self.stopping = False
        self._previous: dict[int, Any] = {}

    def __call__(self, signum: int, _frame: Any) -> None:
        if not self.stopping:
            self.stopping = True
            self.say("stopping: the current step finishes and a checkpoint is written "
                     "(press Ctrl-C again to abort without waiting; the last good checkpoint is kept)")
            self.target.stop()
        elif signum == signal.SIGINT:
            self.say("aborted: no checkpoint for the steps since the last one; a new run resumes from it")
            self.target.abort()

    def __enter__(self) -> StopSignals:
        self._previous = {s: signal.signal(s, self) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *_exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
