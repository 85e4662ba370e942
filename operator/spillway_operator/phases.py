"""The FineTuneJob's phase machine: which phase may follow which, and the event that moves it.

Where this sits: a leaf beside `builders`, over the contract's phases
(`spillway_runtime.core.contract.Phase`). `status.StatusChange.enter` checks every phase the
operator writes against `TRANSITIONS`; the reconcile steps (`reconciler`, `waits`,
`attempts`) decide which phase to write, never whether they may.

The table is what the reconciler does, read off every call site and the guards around it,
not what a tidier machine would do. It is level-triggered: each reconcile starts from the
stored phase, and one call may chain two moves before it writes (Suspended -> Pending ->
Planned when a resumed job is planned at once); each move is checked on its own.

- A job without a phase is `INITIAL` (Pending), as the reconciler reads it.
- A self-transition is listed only where the code writes it (the message of a queued,
  starting or running job is refreshed; a spec that stays invalid). It is a no-op for the
  machine: the phase is not patched and no Event is posted, only the message may change.
- Planning, Preempted and Diverged are contract phases the operator never writes (the local
  launcher plans in Planning; a preempted attempt goes back to Pending, counted in
  status.preemptions; a diverged run ends Failed with a `Diverged` condition): they have no
  entry to and none out of them.
- A terminal phase is left only by a rollback (spec.resumeFrom, back to Pending) or by a
  spec that no longer parses (to Failed, whatever the phase; a live attempt's pods stop).

An illegal transition is an operator bug, not a job's. With `OperatorSettings.strict_phases`
(on in the unit tests, `SPILLWAY_OPERATOR_STRICT_PHASES=true`) it raises `IllegalTransition`
before anything is written, so a test that provokes it fails at the line that decided it. In
production it is logged as an error, counted (`spillway_illegal_phase_transitions_total`),
posted on the job as a Warning Event, and still applied. Refusing it would be worse than the
bug: the phase travels in one patch with what the same decision already did or is about to
do (the attempt counter moved, pods deleted or created, cost settled), so a refused phase
would contradict the rest of the status, and raising would make the work queue retry the same
decision forever, wedging the job. Applied and reported, the job keeps converging and the
report names the move to add to this table or to fix in the reconciler.
"""

from __future__ import annotations

from collections.abc import Mapping

INITIAL = "Pending"

# Events: what moves a job, named once so that the table below reads as prose.
SPEC_INVALID = "spec invalid"  # the spec does not parse, or (not yet started) admission refuses it
NO_KUEUE = "queue named, Kueue off"
CANNOT_START = "attempt cannot start"  # no model shape, fits nowhere, DeepSpeed settings, S3 inputs, no Kueue API
PLANNED = "planned, pods created"
WAITING_FOR_INPUTS = "a claim or StorageClass it names does not exist"  # a new job's first phase, with why
WAITING_FOR_KUEUE = "waiting for Kueue"  # the Workload of the plan is not admitted (yet)
STILL_QUEUED = "still waiting for Kueue"
ADMITTED = "admitted by Kueue"
EVICTED = "evicted by Kueue"
SUSPEND = "suspend requested"
RESUME = "resume requested"
BUDGET = "budget spent"
BOUND = "pods bound, containers starting"
STILL_STARTING = "containers still starting"
UNSCHEDULED = "a pod waits for the scheduler"  # a deleted or rolled-back attempt's pods, re-created
RUNNING = "pods running"
STILL_RUNNING = "pods still running"
SUCCEEDED = "pods succeeded"
POD_FAILED = "pod failed permanently"  # an exit code no retry helps, or a container that never starts
RETRIES_SPENT = "retry budget spent"
RETRY = "pod failed, retry after backoff"
PREEMPTED = "preempted"  # exit 75, node lost, pod evicted
REPLANNED = "re-planned"  # unschedulable while another plan fits, or a pool node unlike its template
ROLLBACK = "rollback applied"

# What a job whose attempt has pods may do next, from Planned, Scheduled or Running alike: the
# pods may get anywhere between two reconciles, and a re-created pod starts over.
_ATTEMPT_ENDS: Mapping[str, tuple[str, ...]] = {
    "Succeeded": (SUCCEEDED,),
    "Failed": (POD_FAILED, RETRIES_SPENT, SPEC_INVALID, CANNOT_START),
    "Pending": (RETRY, PREEMPTED, REPLANNED),
    "Queued": (EVICTED, WAITING_FOR_KUEUE),
    "BudgetExceeded": (BUDGET,),
    "Suspended": (SUSPEND,),
}
# A terminal phase: left by a rollback, or turned Failed by a spec that no longer parses.
_TERMINAL: Mapping[str, tuple[str, ...]] = {"Pending": (ROLLBACK,), "Failed": (SPEC_INVALID,)}

# phase -> the phases that may follow it -> the events that cause each move.
TRANSITIONS: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "Pending": {
        "Pending": (WAITING_FOR_INPUTS,),
        "Planned": (PLANNED,),
        "Queued": (WAITING_FOR_KUEUE,),
        "Suspended": (SUSPEND,),
        "BudgetExceeded": (BUDGET,),
        "Failed": (SPEC_INVALID, NO_KUEUE, CANNOT_START),
    },
    "Queued": {
        "Queued": (STILL_QUEUED,),
        "Planned": (ADMITTED,),
        "Suspended": (SUSPEND,),
        "BudgetExceeded": (BUDGET,),
        "Failed": (SPEC_INVALID, NO_KUEUE, CANNOT_START),
    },
    "Planning": {},
    "Planned": {
        "Scheduled": (BOUND,),
        "Running": (RUNNING,),
        **_ATTEMPT_ENDS,
    },
    "Scheduled": {
        "Scheduled": (STILL_STARTING,),
        "Running": (RUNNING,),
        "Planned": (UNSCHEDULED,),
        **_ATTEMPT_ENDS,
    },
    "Running": {
        "Running": (STILL_RUNNING,),
        "Scheduled": (BOUND,),
        "Planned": (UNSCHEDULED,),
        **_ATTEMPT_ENDS,
    },
    "Suspended": {
        "Pending": (RESUME,),
        "Failed": (SPEC_INVALID,),
    },
    "Preempted": {},
    "Succeeded": _TERMINAL,
    "Failed": _TERMINAL,  # Failed -> Failed: a spec that stays invalid, its message rewritten
    "Diverged": {},
    "BudgetExceeded": _TERMINAL,
}


class IllegalTransition(RuntimeError):
    """A phase change the table does not allow: a bug in the operator."""

    def __init__(self, source: str, target: str):
        allowed = ", ".join(TRANSITIONS.get(source, {})) or "none"
        super().__init__(f"phase {source} -> {target} is not in the phase machine (after {source}: {allowed})")
        self.source, self.target = source, target


def allowed(source: str, target: str) -> bool:
    return target in TRANSITIONS.get(source, {})

