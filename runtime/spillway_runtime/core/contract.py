"""What the runtime, the operator, the API and the dashboard agree on, defined once: the exit
codes of a training run, what each means for the job (`exit_outcome`) and the phases of a job.

Where this sits: the bottom of every package (pure, no imports of ours). The dashboard's
copy of the phases (dashboard/src/jobs.js) is checked against this by a unit test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal, get_args


class ExitCode(IntEnum):
    """How a training run (the runtime, `spillway run`, a pod's trainer) ends."""

    OK = 0
    FAILED = 1  # anything unforeseen: retried within the job's backoffLimit
    BAD_INPUT = 2  # the job or its inputs: retrying cannot help; the message names what to fix
    PLAN_INFEASIBLE = 3  # no placement fits the hardware
    DIVERGED = 4  # the loss diverged after every allowed rollback
    PREEMPTED = 75  # EX_TEMPFAIL: stopped on request after a checkpoint; restartable
    ABORTED = 130  # 128 + SIGINT: a second Ctrl-C stopped it without the stop checkpoint


# The runtime's own Prometheus endpoint (tracking.py): served on rank 0 when this variable
# names a port; the operator sets it in every trainer pod and names the container port `metrics`.
METRICS_PORT_ENV = "SPILLWAY_METRICS_PORT"
# The rest of a training pod's environment that the operator sets (pod_specs.build_pod) and
# the runtime reads: which job it reports to (k8s_status), the attempt (tracking), and the
# seconds it has to checkpoint after SIGTERM (the pod's terminationGracePeriodSeconds).
JOB_NAME_ENV = "SPILLWAY_JOB_NAME"
JOB_NAMESPACE_ENV = "SPILLWAY_JOB_NAMESPACE"
ATTEMPT_ENV = "SPILLWAY_ATTEMPT"
STOP_GRACE_SECONDS_ENV = "SPILLWAY_STOP_GRACE_SECONDS"
# `spillway run --verbose`: a terminal shows every event's full record (as logs do) and the
# Hugging Face Hub's progress bars, not only the progress bar and events in words.
VERBOSE_ENV = "SPILLWAY_VERBOSE"
POD_METRICS_PORT = 9400  # in the exporters' range; the pod has its own network namespace, so no node's exporter collides

# Every phase a job can be in, in the operator (cluster) or the API's local launcher.
Phase = Literal[
    "Pending",  # accepted, not yet planned
    "Queued",  # cluster: waiting for Kueue to admit it (spec.queueName), or re-queued after an eviction
    "Planning",  # local: the plan is being made
    "Planned",  # cluster: planned, children being created
    "Scheduled",  # cluster: pods created, not yet running
    "Running",
    "Suspended",  # spec.suspend: stopped after a checkpoint, resumes when unset
    "Preempted",  # stopped from outside after a checkpoint; restarts
    "Succeeded",
    "Failed",
    "Diverged",
    "BudgetExceeded",
]
PHASES: tuple[str, ...] = get_args(Phase)
# Phases a job never leaves (but for a rollback, which starts a new attempt).
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed", "Diverged", "BudgetExceeded"})
# Phases only the API's records know, beside the contract's: a row whose FineTuneJob was deleted
# from the cluster, and (attempts only) an attempt a rollback or a resume replaced while it ran.
RecordPhase = Literal["Deleted"]
AttemptEndPhase = Literal["Stopped"]
JobPhase = Literal[Phase, RecordPhase]
AttemptPhase = Literal[Phase, RecordPhase, AttemptEndPhase]
RECORD_PHASES: tuple[str, ...] = get_args(RecordPhase)


# What a run's exit means for its job. Only a cluster retries by itself: there `retryable` starts
# a new attempt counted against spec.backoffLimit, `preempted` one that is not counted; a local
# run ends in `phase` either way (a user runs it again).
OutcomeKind = Literal["succeeded", "preempted", "retryable", "permanent"]
Where = Literal["cluster", "local"]


@dataclass(frozen=True)
class ExitOutcome:
    kind: OutcomeKind
    phase: Phase  # the job's phase when this exit ends it (no retry follows)


_OUTCOMES: dict[int, ExitOutcome] = {
    ExitCode.OK: ExitOutcome("succeeded", "Succeeded"),
    ExitCode.FAILED: ExitOutcome("retryable", "Failed"),
    ExitCode.BAD_INPUT: ExitOutcome("permanent", "Failed"),
    ExitCode.PLAN_INFEASIBLE: ExitOutcome("permanent", "Failed"),
    ExitCode.DIVERGED: ExitOutcome("permanent", "Diverged"),
    ExitCode.PREEMPTED: ExitOutcome("preempted", "Preempted"),
    ExitCode.ABORTED: ExitOutcome("preempted", "Preempted"),
}
# Where a cluster differs from a local run, and why:
# - 3, the plan did not fit what the process found on its node: a cluster has other nodes (and
#   node pools) and the next attempt plans again, so it is retried (counted, so it ends); on one
#   machine nothing else can be tried.
# - 130, a second SIGINT before the stop checkpoint: locally that is the user's Ctrl-C, a stop
#   like 75 that resumes from the last good checkpoint when run again. Nobody the operator
#   knows of sends SIGINT to a pod (the kubelet, Kueue and the operator stop it with SIGTERM,
#   which exits 75), so there it is unexplained: counted against backoffLimit, which keeps a
#   pod that keeps dying this way from restarting forever.
_CLUSTER_OUTCOMES: dict[int, ExitOutcome] = {
    ExitCode.PLAN_INFEASIBLE: ExitOutcome("retryable", "Failed"),
    ExitCode.ABORTED: ExitOutcome("retryable", "Failed"),
}
# Any other code (a crash, death by a signal: 128 + N) is an unforeseen failure.
_UNFORESEEN = ExitOutcome("retryable", "Failed")


def exit_outcome(code: int, where: Where) -> ExitOutcome:
    """What a training run's exit code means for its job, in a cluster or on this machine."""
    if where == "cluster" and code in _CLUSTER_OUTCOMES:
        return _CLUSTER_OUTCOMES[code]
    return _OUTCOMES.get(code, _UNFORESEEN)


# Preference tuning (DPO): the metrics of a step and of held-out pairs (`eval_`-prefixed), by
# TRL's names, as the runtime reports them and the trackers, the API and the dashboard read them.
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                      "logps/chosen", "logps/rejected")


def preference_metrics(fields: dict[str, Any], prefix: str = "") -> dict[str, float] | None:
    """The DPO metrics among `fields` (with `prefix`: eval_ for held-out pairs), unprefixed and
    finite (a mean over no pairs is NaN, which JSON columns refuse); None when there are none
    (a step of another objective)."""
    found = {name: float(value) for name in PREFERENCE_METRICS
             if isinstance(value := fields.get(prefix + name), int | float) and not isinstance(value, bool)
             and math.isfinite(value)}
    return found or None
