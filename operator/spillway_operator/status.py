"""One reconcile's change to a FineTuneJob's status: fields, conditions and Events.

Where this sits: used by `reconciler` for every status write; writes through the
`Cluster` it was made with (the patch, the Events) and records the job's phase metric.
Every phase it writes is checked against the phase machine (`phases`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from spillway_operator import builders as b
from spillway_operator import k8s, metrics, phases
from spillway_operator.cluster import Cluster

log = logging.getLogger("spillway.operator")


@dataclass
class StatusChange:
    """Status fields to merge-patch, Events to post once the patch is stored."""

    job: dict[str, Any]
    now: datetime
    cluster: Cluster
    status: dict[str, Any] = field(default_factory=dict)
    # Written only along with a patch that happens anyway: live cost between its due
    # writes, the mark that an attempt's children all exist.
    piggyback: dict[str, Any] = field(default_factory=dict)
    conditions: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    conditional: bool = False
    strict: bool = False  # an illegal phase change raises (settings.strict_phases)

    def __post_init__(self) -> None:
        self._generation = int(self.job["metadata"].get("generation", 1))
        self.conditions = list((self.job.get("status") or {}).get("conditions") or [])
        self._original_conditions = list(self.conditions)

    @property
    def old(self) -> dict[str, Any]:
        return dict(self.job.get("status") or {})

    @property
    def generation(self) -> int:
        """The generation of the spec this change was decided on; a patch response may carry
        a newer one, which the next reconcile handles."""
        return self._generation

    def cond(self, type_: str, status: bool, reason: str, message: str) -> None:
        self.conditions = b.set_condition(self.conditions, type_, status, reason, message, self.generation, self.now)

    def enter(self, phase: str) -> None:
        """Move to `phase` if the phase machine allows it, else see `_illegal`; no message and
        no Event (`phase` adds both; a rollback posts its own Event and keeps the message).
        Every phase the operator writes passes here."""
        source = self.status.get("phase") or self.old.get("phase") or phases.INITIAL
        if not phases.allowed(source, phase):
            self._illegal(phases.IllegalTransition(source, phase))
        self.status["phase"] = phase

    def _illegal(self, err: phases.IllegalTransition) -> None:
        """Strict (the tests): raise before anything is written. Else report it and let the move
        stand: it goes out with what the same decision did (see `phases`)."""
        if self.strict:
            raise err
        meta = self.job["metadata"]
        log.error("%s/%s: %s; applied anyway, this is an operator bug", meta["namespace"], meta["name"], err)
        metrics.ILLEGAL_PHASE_TRANSITIONS.labels(source=err.source, target=err.target).inc()
        self.events.append(("Warning", "IllegalPhaseTransition", f"{err}; applied anyway: please report this "
                                                                  "operator bug"))

    def phase(self, phase: str, reason: str, message: str, warning: bool = False) -> None:
        self.enter(phase)
        self.status["message"] = message
        # A change of phase is an Event, once: a step that already queued this one (say
        # Replanned, Evicted, Preempted) is not told twice.
        if self.old.get("phase") != phase and not any(r == reason and m == message for _, r, m in self.events):
            self.events.append(("Warning" if warning else "Normal", reason, message))

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def commit(self, post_events: bool = True) -> None:
        """Patch what changed; then post the Events (or keep them for `post_events()`)."""
        old = self.old
        patch_status = {k: v for k, v in self.status.items() if old.get(k) != v}
        if self.conditions != self._original_conditions:
            patch_status["conditions"] = self.conditions
        if old.get("observedGeneration") != self.generation:
            patch_status["observedGeneration"] = self.generation
        meta = self.job["metadata"]
        if patch_status:
            patch_status.update({k: v for k, v in self.piggyback.items() if old.get(k) != v})
            patch: dict[str, Any] = {"status": patch_status}
            if self.conditional:
                patch["metadata"] = {"resourceVersion": meta["resourceVersion"]}
            self.job = self.cluster.patch_job_status(meta["namespace"], meta["name"], patch)
        metrics.record_phase(meta["namespace"], meta["name"], (self.job.get("status") or {}).get("phase"))
        self.status = {}
        self.piggyback = {}
        self.conditional = False
        self._original_conditions = list(self.conditions)
        if post_events:
            self.post_events()

    def post_events(self) -> None:
        meta = self.job["metadata"]
        events, self.events = self.events, []
        for type_, reason, message in events:
            try:
                self.cluster.post_event(self.job, type_, reason, message, self.now)
            except Exception as err:  # an Event is best effort; the status already holds the truth
                if not k8s.is_transient(err):
                    raise
                log.warning("event %s for %s/%s not posted: %s", reason, meta["namespace"], meta["name"], err)
