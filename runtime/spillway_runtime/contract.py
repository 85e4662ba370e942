"""What the runtime, the operator, the API and the dashboard agree on, defined once: the exit
codes of a training run and the phases of a job.

Where this sits: the bottom of every package (pure, no imports of ours). The dashboard's
copy of the phases (dashboard/src/jobs.js) is checked against this by a unit test.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Literal, get_args


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
