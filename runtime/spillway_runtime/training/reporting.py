"""Progress and events from the training process (rank 0 only).

Every event is appended as one JSON line to the run's events file, which the
local launcher and the API read. On a terminal a rich progress bar shows step,
loss, tokens/s, ETA and bytes per tier, with the other events in words (with
SPILLWAY_VERBOSE=1, `spillway run --verbose`, every record in full above it too); elsewhere
the JSON lines go to stdout, so `kubectl logs` reads the same record. Listeners (tracking.py: MLflow,
TensorBoard, the /metrics endpoint) see every record too; what they have to say from
their own threads comes back through `warn_soon` and is written by the training thread.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from spillway_runtime.core.contract import VERBOSE_ENV
from spillway_runtime.core.units import format_bytes


def event_record(kind: str, **fields: Any) -> dict[str, Any]:
    """One line of the events file: when, what, and its fields."""
    return {"time": round(time.time(), 3), "event": kind, **fields}


def append_event(events_path: Path, kind: str, **fields: Any) -> None:
    """An event from outside the training process (planning, before it starts)."""
    events_path.parent.mkdir(parents=True, exist_ok=True)
    with events_path.open("a") as fh:
        fh.write(json.dumps(event_record(kind, **fields), default=str) + "\n")


def _loss(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else "n/a"


def _bytes(value: Any) -> str:
    return format_bytes(int(value)) if isinstance(value, int | float) else "?"


# What a terminal shows of each event, in words (the events file keeps every field, at full
# precision). A kind mapped to None is not shown there; one missing here is shown compactly.
_TERMINAL: dict[str, Callable[[dict[str, Any]], str | None]] = {
    "memory": lambda f: None,
    "swap_removed": lambda f: None,
    "started": lambda f: f"training from step {f.get('step', 0)} of {f.get('total_steps')} ({f.get('plan')}, "
                         f"{f.get('world_size', 1)} process(es))",
    "log": lambda f: f"[dim]{f.get('message', '')}[/dim]",
    "warning": lambda f: f"[yellow]warning:[/yellow] {f.get('message', '')}",
    "lora": lambda f: f"LoRA rank {f.get('rank')}: {f.get('trainable', 0):,} of {f.get('total', 0):,} parameters train",
    "checkpoint": lambda f: f"checkpoint {f.get('name')} at step {f.get('step')}: {_bytes(f.get('sizeBytes'))}, "
                            f"loss {_loss(f.get('loss'))}, training paused {f.get('stall_seconds', 0):.2f} s",
    "checkpoint_failed": lambda f: f"[red]checkpoint at step {f.get('step')} failed:[/red] {f.get('reason')}",
    "eval": lambda f: f"held-out loss {_loss(f.get('eval_loss'))} at step {f.get('step')}",
    "resumed": lambda f: f"resumed from {f.get('checkpoint')} (step {f.get('step')})",
    "rolled_back": lambda f: f"[yellow]rolled back[/yellow] to {f.get('checkpoint')} (step {f.get('step')})",
    "diverged": lambda f: f"[red]diverged[/red] at step {f.get('step')}: {f.get('reason')}",
    "preempted": lambda f: f"stopped at step {f.get('step')} with a checkpoint; run again to resume",
    "exported": lambda f: f"model exported to {f.get('path')} ({_bytes(f.get('bytes'))})",
    "export_uploaded": lambda f: f"export uploaded to {f.get('uri')} ({_bytes(f.get('bytes'))})",
    "mirror_restored": lambda f: f"{f.get('checkpoint')} restored from {f.get('uri')} ({_bytes(f.get('bytes'))})",
    "mirror_behind": lambda f: f"[yellow]mirror {f.get('uri')} is behind:[/yellow] {f.get('reason')}",
    "resharded": lambda f: f"{f.get('checkpoint')} resharded for this run's processes",
    "finished": lambda f: f.get("message") or f"finished at step {f.get('step')}, loss {_loss(f.get('loss'))}",
    "early_stopped": lambda f: None,  # the finished line says it
    "failed": lambda f: f"[red]failed:[/red] {f.get('reason')}",
}


def terminal_line(kind: str, fields: dict[str, Any]) -> str | None:
    """The line a terminal shows for an event, or None for one it does not show."""
    if kind in _TERMINAL:
        return _TERMINAL[kind](fields)
    shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in fields.items()
             if not isinstance(v, dict | list) and k != "sha256"}
    return f"{kind} " + " ".join(f"{k}={v}" for k, v in shown.items())


class EventListener(Protocol):
    """Something else that follows the run's events (tracking.py). `handle` runs on the
    training thread after each event is written: it must return at once."""

    def handle(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class Reporter:
    def __init__(
        self,
        events_path: Path | None,
        total_steps: int,
        *,
        enabled: bool = True,
        interactive: bool | None = None,
        sink: Callable[[dict[str, Any]], None] | None = None,
        verbose: bool | None = None,
    ):
        self.enabled = enabled
        self.verbose = os.environ.get(VERBOSE_ENV) == "1" if verbose is None else verbose
        self.total_steps = total_steps
        self.sink = sink
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self._fh = None
        if enabled and events_path is not None:
            events_path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = events_path.open("a", buffering=1)
        self._progress: Any = None
        self._task: Any = None
        self.listeners: list[EventListener] = []
        self._deferred: queue.SimpleQueue[str] = queue.SimpleQueue()

    def warn_soon(self, message: str) -> None:
        """A `warning` event from any thread: written by the training thread with its next
        event (or at close), so that the events file has one writer."""
        self._deferred.put(message)

    def event(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        self._write_deferred()
        record = event_record(kind, **fields)
        line = json.dumps(record, default=str)
        if self._fh is not None:
            self._fh.write(line + "\n")
        if self.sink is not None:
            self.sink(record)
        if self.interactive:
            if self.verbose:
                self._console_print(line, markup=False)
            elif kind != "step" and (text := terminal_line(kind, fields)) is not None:
                self._console_print(text)
        else:
            print(line, flush=True)
        for listener in list(self.listeners):
            try:
                listener.handle(record)
            except Exception as err:  # a listener's fault (a full disk under tensorboard/): it goes, training does not
                self.listeners.remove(listener)
                self.warn_soon(f"{type(listener).__name__} stopped: {type(err).__name__}: {err}")

    def _write_deferred(self) -> None:
        messages = []
        while not self._deferred.empty():
            messages.append(self._deferred.get())
        for message in messages:
            self.event("warning", message=message)

    def _console_print(self, text: str, markup: bool = True) -> None:
        """`markup=False`: a record, printed as written and never broken into lines."""
        if self._progress is not None:
            self._progress.console.print(text, markup=markup, highlight=markup, soft_wrap=not markup)
        else:
            from rich.console import Console

            Console().print(text, markup=markup, highlight=markup, soft_wrap=not markup)

    def step(self, step: int, **fields: Any) -> None:
        self.event("step", step=step, **fields)
        if not (self.enabled and self.interactive):
            return
        if self._progress is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold blue]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total_steps, info="")
        tiers = fields.get("bytes", {})
        info = (
            f"loss {fields.get('loss', float('nan')):.4f}  {fields.get('tokens_per_s', 0):,.0f} tok/s  "
            + "  ".join(f"{k} {format_bytes(v)}" for k, v in tiers.items())
        )
        self._progress.update(self._task, completed=step, info=info)

    def close(self) -> None:
        listeners, self.listeners = self.listeners, []
        for listener in listeners:
            listener.close()  # each bounds its own wait (tracking.py)
        if self.enabled:
            self._write_deferred()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill mid-write
    return out


def where_state_lived(plan: Any, events: list[dict[str, Any]], nvme_dir: str | None = None) -> list[str]:
    """The end of a run in a few lines: where the optimizer state and the parameters lived, the
    most each tier held (the step events' bytes) and what the training process read and wrote
    on disk (its `finished` event). `plan` is the run's OffloadPlan."""
    steps = [e for e in events if e.get("event") == "step"]
    peak = {tier: max((int((e.get("bytes") or {}).get(tier, 0)) for e in steps), default=0)
            for tier in ("gpu", "cpu", "nvme")}
    places = {"gpu": "on the GPU" if plan.accelerator == "cuda" else "with the model (CPU accelerator)",
              "cpu": "in CPU RAM", "nvme": f"in NVMe swap files{f' under {nvme_dir}' if nvme_dir else ''}"}
    optimizer = places[plan.optimizer]
    if plan.optimizer == "nvme" and plan.swap.cpu_resident_fraction:
        optimizer += f", {plan.swap.cpu_resident_fraction:.0%} of its sub-groups kept in CPU RAM"
    lines = [f"optimizer state (fp32 masters, Adam moments): {optimizer}",
             f"parameters (16-bit): {places[plan.parameters]}"]
    held = [f"{label} {format_bytes(peak[tier])}" for tier, label in (("gpu", "GPU"), ("cpu", "CPU RAM"),
                                                                        ("nvme", "NVMe swap files")) if peak[tier]]
    if held:
        lines.append("most held: " + ", ".join(held))
    finished: dict[str, Any] = next((e for e in reversed(events) if e.get("event") == "finished"), {})
    disk = finished.get("disk") or {}
    if disk:
        lines.append(f"disk: the training process read {_bytes(disk.get('read'))} and wrote "
                     f"{_bytes(disk.get('written'))} (swap files, checkpoints, data)")
    return lines
