"""Where a run's metrics go besides its events file: MLflow (spec.tracking.mlflow),
TensorBoard event files (spec.tracking.tensorboard) and the runtime's own Prometheus
endpoint (SPILLWAY_METRICS_PORT, which the operator sets in every trainer pod).

Where this sits: listeners of the Reporter (reporting.py), built by the recipe on rank 0
and closed with the reporter. Each turns the same event records into the same scalars
(`scalars`). None may stop or slow training: MLflow is written from a background thread
through a bounded queue that drops when full, with short HTTP timeouts, and its first
failure is one `warning` event; the MLflow and TensorBoard clients are imported only when
the spec asks for them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spillway_runtime.core.contract import ATTEMPT_ENV, METRICS_PORT_ENV, PREFERENCE_METRICS
from spillway_runtime.core.spec import MlflowTracking
from spillway_runtime.training.reporting import EventListener
from spillway_runtime.training.runconfig import RuntimeConfig

TENSORBOARD_DIR = "tensorboard"  # under the checkpoint directory: it outlives the pod like the checkpoints

# How an MLflow run ends, by the event that ended the training run; a run closed without one
# (the process failed unforeseen) is FAILED.
MLFLOW_OUTCOMES = {"finished": "FINISHED", "failed": "FAILED", "diverged": "FAILED", "preempted": "KILLED"}
# MLflow's own HTTP settings, unless the environment sets them: a few seconds per request and
# two retries, instead of 120 s and seven retries with backoff, so that a dead server costs the
# background thread seconds and the end of the run at most MLFLOW_CLOSE_SECONDS.
CREATE_TAG = "spillway.create_id"  # marks the runs one create_run made, retries included
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
# The most the end of a run waits for the last metrics and the run's status: a healthy server
# takes well under a second, and a stopped pod's grace period is for its checkpoint.
MLFLOW_CLOSE_SECONDS = 5.0
MLFLOW_QUEUE_EVENTS = 10_000  # events with metrics held for the server; more are dropped (and counted)
MLFLOW_BATCH_METRICS = 1000  # MLflow's limit per log_batch request
MLFLOW_BATCH_PARAMS = 100  # likewise for params
MLFLOW_PARAM_CHARS = 6000  # MLflow's limit on a param's value
# What a DPO step and evaluation report beside the loss, as TRL names them (dpo.STATS)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers an event carries, by the names every tracker shows them under (at the
    record's `step`): loss, learning rate, tokens/s and bytes per tier from a step, eval loss
    from an evaluation, the seconds a checkpoint took; with preference tuning (DPO) the
    rewards and log-probabilities under TRL's names, `eval_`-prefixed for held-out pairs."""
    kind = record.get("event")
    out: dict[str, float] = {}
    if kind == "step":
        for name, key in (("loss", "loss"), ("learning_rate", "lr"), ("tokens_per_s", "tokens_per_s"),
                          ("step_seconds", "step_seconds"), ("step_time_vs_plan", "step_time_vs_plan"),
                          *((n, n) for n in PREFERENCE_METRICS)):
            if isinstance(record.get(key), int | float):
                out[name] = float(record[key])
        for tier, count in (record.get("bytes") or {}).items():
            out[f"bytes/{tier}"] = float(count)
    elif kind == "eval" and isinstance(record.get("eval_loss"), int | float):
        out["eval_loss"] = float(record["eval_loss"])
        for name in PREFERENCE_METRICS:
            if isinstance(record.get(f"eval_{name}"), int | float):
                out[f"eval_{name}"] = float(record[f"eval_{name}"])
    elif kind == "checkpoint":
        for name in ("stall_seconds", "background_seconds"):
            if isinstance(record.get(name), int | float):
                out[f"checkpoint/{name}"] = float(record[name])
    return out


def build_listeners(config: RuntimeConfig, warn: Callable[[str], None]) -> list[EventListener]:
    """The listeners spec.tracking and the environment ask for (rank 0 only: the caller's
    choice). Each one that cannot start warns and is left out."""
    tracking = config.job.spec.tracking
    listeners: list[EventListener] = []
    port = os.environ.get(METRICS_PORT_ENV)
    if port:
        try:
            listeners.append(PrometheusListener(int(port)))
        except (OSError, ValueError) as err:
            warn(f"{METRICS_PORT_ENV}={port}: cannot serve /metrics ({err}); training goes on without it")
    if tracking.tensorboard:
        logdir = Path(config.checkpoint_dir) / TENSORBOARD_DIR
        try:
            listeners.append(TensorBoardListener(logdir))
        except OSError as err:
            warn(f"tracking.tensorboard: cannot write {logdir} ({err}); training goes on without it")
    if tracking.mlflow is not None:
        listeners.append(MlflowListener(tracking.mlflow, MlflowRun.of(config), warn))
    return listeners


# --- MLflow ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlflowRun:
    """What the MLflow run is called and holds as params, from the runtime config."""

    experiment: str
    name: str
    tags: dict[str, str]
    params: dict[str, str]

    @classmethod
    def of(cls, config: RuntimeConfig) -> MlflowRun:
        job = config.job
        assert job.spec.tracking.mlflow is not None
        attempt = os.environ.get(ATTEMPT_ENV)  # set in the operator's pods
        tags = {"spillway.job": job.metadata.name, "spillway.namespace": job.metadata.namespace,
                "spillway.plan": config.plan.label}
        if attempt:
            tags["spillway.attempt"] = attempt
        plan = config.plan.summary().model_dump(mode="json", exclude={"reasons", "rejected", "shortfalls"})
        spec = job.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
        return cls(
            experiment=job.spec.tracking.mlflow.experiment or job.metadata.namespace,
            name=f"{job.metadata.name}-a{attempt}" if attempt else job.metadata.name,
            tags=tags,
            params=dict(_flatten("plan", plan)) | dict(_flatten("spec", spec)),
        )


def _flatten(prefix: str, value: Any) -> Iterator[tuple[str, str]]:
    """`spec.training.maxSteps` = `8`: nested mappings by dotted key, anything else as JSON
    (lists) or text, cut to MLflow's limit."""
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            # MLflow's key characters: a user's key (offload.deepspeed, nodeSelector) may hold others
            yield from _flatten(f"{prefix}.{re.sub(r'[^A-Za-z0-9_./ -]', '_', str(key))}", inner)
        return
    text = value if isinstance(value, str) else json.dumps(value)
    yield prefix, text[:MLFLOW_PARAM_CHARS]


@dataclass
class _Metrics:
    step: int
    timestamp_ms: int
    values: dict[str, float]


_CLOSE = object()


class MlflowListener:
    """Logs to one MLflow run from a background thread: params once, then each event's
    scalars. The training thread only puts on a bounded queue (dropping when it is full);
    the first failure of any request is one warning, and later batches are still tried."""

    def __init__(self, settings: MlflowTracking, run: MlflowRun, warn: Callable[[str], None]):
        self.settings = settings
        self.run = run
        self._warn = warn
        self._warned = False
        self._warning = threading.Lock()  # the training thread (close) and the logging thread may both fail
        self.dropped = 0
        self.outcome = "FAILED"
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=MLFLOW_QUEUE_EVENTS)
        self._stopped = threading.Event()  # the thread has given up or finished
        for name, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        # Imported here, on the training thread (about 1 s, once): imported on the logging
        # thread it would race the recipe's own imports of the packages both use.
        import mlflow.entities
        import mlflow.exceptions
        import mlflow.tracking

        self._mlflow = mlflow
        self._thread = threading.Thread(target=self._log_all, name="spillway-mlflow", daemon=True)
        self._thread.start()

    def handle(self, record: dict[str, Any]) -> None:
        self.outcome = MLFLOW_OUTCOMES.get(record.get("event", ""), self.outcome)
        values = scalars(record)
        if not values or self._stopped.is_set():
            return
        try:
            self._queue.put_nowait(_Metrics(int(record.get("step", 0)), int(record["time"] * 1000), values))
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        deadline = time.monotonic() + MLFLOW_CLOSE_SECONDS
        while not self._stopped.is_set():
            try:
                self._queue.put(_CLOSE, timeout=0.1)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    break
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._failed(f"gave up waiting for it after {MLFLOW_CLOSE_SECONDS:.0f} s at the end of the run")

    def _failed(self, what: str) -> None:
        with self._warning:
            if self._warned:
                return
            self._warned = True
            self._warn(f"tracking.mlflow {self.settings.tracking_uri}: {what}; training goes on without it")

    def _log_all(self) -> None:
        try:
            client, run_id = self._start()
        except Exception as err:  # whatever the client raises (refused, timed out, a bad answer): never training's
            self._failed(f"cannot start a run in experiment {self.run.experiment!r} ({_brief(err)})")
            self._stopped.set()
            return
        try:
            while True:
                batch, closing = self._next_batch()
                if batch:
                    self._try(functools.partial(client.log_batch, run_id, metrics=batch), "cannot log metrics")
                if closing:
                    break
            if self.dropped:
                self._failed(f"{self.dropped} events' metrics dropped (the server is slower than training)")
            self._try(functools.partial(client.set_terminated, run_id, status=self.outcome), "cannot end the run")
        finally:
            self._stopped.set()

    def _create_run(self, client: Any, experiment_id: str) -> str:
        """One run, even when the client retries: a server slower than the client's timeout
        creates the run it then answers too late for, and the retry a second. Each attempt of
        this call is marked with one id; runs of that id beyond the one kept are deleted."""
        import uuid

        marker = uuid.uuid4().hex
        run = client.create_run(experiment_id, run_name=self.run.name, tags={**self.run.tags, CREATE_TAG: marker})
        run_id: str = run.info.run_id
        with contextlib.suppress(Exception):  # the duplicates are untidy, not wrong: never training's failure
            for twin in client.search_runs([experiment_id], filter_string=f"tags.`{CREATE_TAG}` = '{marker}'"):
                if twin.info.run_id != run_id:
                    client.delete_run(twin.info.run_id)
        return run_id

    def _start(self) -> tuple[Any, str]:
        mlflow = self._mlflow
        client = mlflow.tracking.MlflowClient(tracking_uri=self.settings.tracking_uri)
        experiment = client.get_experiment_by_name(self.run.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = client.create_experiment(self.run.experiment)
            except mlflow.exceptions.MlflowException:  # another job made it meanwhile, or the answer is the failure
                made = client.get_experiment_by_name(self.run.experiment)
                if made is None:
                    raise
                experiment_id = made.experiment_id
        run_id = self._create_run(client, experiment_id)
        params = [mlflow.entities.Param(key, value) for key, value in self.run.params.items()]
        for first in range(0, len(params), MLFLOW_BATCH_PARAMS):
            self._try(functools.partial(client.log_batch, run_id, params=params[first:first + MLFLOW_BATCH_PARAMS]),
                      "cannot log the params")
        return client, run_id

    def _next_batch(self) -> tuple[list[Any], bool]:
        """The metrics waiting now, up to one request's worth (blocking for the first)."""
        metric = self._mlflow.entities.Metric
        batch: list[Any] = []
        item = self._queue.get()
        while item is not _CLOSE:
            batch.extend(metric(key, value, item.timestamp_ms, item.step) for key, value in item.values.items())
            if len(batch) >= MLFLOW_BATCH_METRICS - 50:
                return batch, False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, False
        return batch, True

    def _try(self, request: Callable[[], Any], what: str) -> None:
        try:
            request()
        except Exception as err:  # as in _log_all: the server's trouble stays in this thread
            self._failed(f"{what} ({_brief(err)})")


def _brief(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


# --- TensorBoard -----------------------------------------------------------------------------


class TensorBoardListener:
    """TensorBoard event files under `logdir`, the same scalars as MLflow (tensorboardX
    writes them from its own thread; a scalar is stored as float32, TensorBoard's format)."""

    def __init__(self, logdir: Path):
        from tensorboardX import SummaryWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(logdir=str(logdir), flush_secs=10)

    def handle(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=step, walltime=record["time"])

    def close(self) -> None:
        self.writer.close()


# --- Prometheus ------------------------------------------------------------------------------


class PrometheusListener:
    """The runtime's own /metrics on `port` (all interfaces: in a pod, Prometheus scrapes the
    pod's IP), served until the reporter closes. The numbers are one snapshot, replaced whole
    by each event, so a scrape never pairs one step's number with another step's loss."""

    GAUGES = {
        "step": ("spillway_step", "Optimizer steps done"),
        "loss": ("spillway_loss", "Training loss of the last step"),
        "eval_loss": ("spillway_eval_loss", "Held-out loss of the last evaluation"),
        "learning_rate": ("spillway_learning_rate", "Learning rate of the last step"),
        "tokens_per_s": ("spillway_tokens_per_second", "Tokens per second of the last step"),
        "step_seconds": ("spillway_step_seconds", "Seconds the last step took"),
        "step_time_vs_plan": ("spillway_step_time_vs_plan", "The mean of the last 20 steps' seconds over the "
                              "plan's predicted step time (outside 0.75-1.33 the step-time model missed)"),
        "rewards/margins": ("spillway_dpo_reward_margin", "DPO: mean chosen minus rejected reward of the last step"),
        "rewards/accuracies": ("spillway_dpo_reward_accuracy",
                               "DPO: share of the last step's pairs whose chosen reward is the higher"),
        "eval_rewards/margins": ("spillway_dpo_eval_reward_margin", "DPO: reward margin on held-out pairs"),
        "checkpoint/stall_seconds": ("spillway_checkpoint_stall_seconds",
                                     "Seconds training waited for the last checkpoint"),
        "checkpoint/background_seconds": ("spillway_checkpoint_background_seconds",
                                          "Seconds the last checkpoint wrote in the background"),
    }
    COUNTERS = {"checkpoint": ("spillway_checkpoints", "Checkpoints written"),
                "rollback": ("spillway_rollbacks", "Divergence rollbacks")}
    TIER_BYTES = ("spillway_tier_bytes", "Bytes the run holds in each tier (cpu: resident, gpu: allocated, "
                  "nvme: swap files)")

    def __init__(self, port: int):
        from prometheus_client import CollectorRegistry, start_http_server

        self.values: dict[str, float] = {}
        registry = CollectorRegistry()
        registry.register(self)
        self.server, self._thread = start_http_server(port, registry=registry)

    def handle(self, record: dict[str, Any]) -> None:
        kind = record.get("event")
        values = dict(self.values)
        if kind in ("step", "started", "resumed", "rolled_back", "rollback") and isinstance(record.get("step"), int):
            values["step"] = record["step"]
        if kind in self.COUNTERS:
            values[kind] = values.get(kind, 0) + 1
        values.update(scalars(record))
        self.values = values  # one assignment: a scrape sees all of this event's numbers or none

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        values = self.values
        for key, (name, text) in self.GAUGES.items():
            if key in values:
                yield GaugeMetricFamily(name, text, value=values[key])
        for key, (name, text) in self.COUNTERS.items():
            yield CounterMetricFamily(name, text, value=values.get(key, 0))
        tiers = GaugeMetricFamily(*self.TIER_BYTES, labels=["tier"])
        for key, value in values.items():
            if key.startswith("bytes/"):
                tiers.add_metric([key.removeprefix("bytes/")], value)
        yield tiers
        yield from _disk_counters()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _disk_counters() -> Iterator[Any]:
    """This process's block-device reads and writes, read at each scrape: the swap traffic
    of an NVMe plan (DeepSpeed's async I/O runs in this process; checkpoints and the dataset
    count too), whose rate() is the swap bytes/s. Rank 0's process only."""
    import psutil
    from prometheus_client.core import CounterMetricFamily

    try:
        io = psutil.Process().io_counters()
    except (AttributeError, psutil.AccessDenied):  # not on this platform, or /proc/self/io hidden
        return
    yield CounterMetricFamily("spillway_disk_read_bytes", "Bytes this process read from block devices "
                              "(NVMe swap, checkpoints, data)", value=io.read_bytes)
    yield CounterMetricFamily("spillway_disk_written_bytes", "Bytes this process wrote to block devices "
                              "(NVMe swap, checkpoints)", value=io.write_bytes)
