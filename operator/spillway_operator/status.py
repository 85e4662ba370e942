"""One reconcile's change to a FineTuneJob's status: fields, conditions and Events.

Where this sits: used by `reconciler` for every status write; writes through the
`Cluster` it was made with (the patch, the Events) and records the job's phase metric.
Every phase it writes is checked against the phase machine (`phases`), and every field
against the status contract (`StatusPatch`: a field of `FineTuneJobStatus`, of its type).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import TypeAdapter, ValidationError

from spillway_operator import builders as b
from spillway_operator import k8s, metrics, phases
from spillway_operator.cluster import Cluster
from spillway_runtime.core.status import FineTuneJobStatus, read_status

log = logging.getLogger("spillway.operator")


class StatusContractError(TypeError):
    """The operator wrote a status field the contract does not have, or a value of another type."""


@functools.cache
def _field_types() -> dict[str, TypeAdapter[Any]]:
    """Each status field by the name it is stored under (camelCase), with its type."""
    return {info.alias or name: TypeAdapter(info.annotation if info.annotation is not None else Any)
            for name, info in FineTuneJobStatus.model_fields.items()}


def _contract_problem(key: str, value: Any) -> str | None:
    types = _field_types()
    if key not in types:
        return f"status.{key} is not a field of FineTuneJobStatus (one of: {', '.join(types)})"
    if value is not None:
        try:
            types[key].validate_python(value)
        except ValidationError as err:
            return f"status.{key} = {value!r} is not of its type in FineTuneJobStatus: {err.errors()[0]['msg']}"
    return None


class StatusPatch(dict[str, Any]):
    """A merge patch of a FineTuneJob's status as the operator writes it: each key a field of
    `FineTuneJobStatus` under its stored name, each value of that field's type, or None (a
    merge patch's null clears the field). A write outside the contract is an operator bug:
    strict (the tests) it raises `StatusContractError` naming the field, at the line that
    wrote it; otherwise it is logged as an error and written, as an illegal phase is (see
    `phases`: refusing one field of a decision already acted on would wedge the job). A
    write into a value already set (`status["plan"]["attempt"]`) is not checked again."""

    def __init__(self, *args: Any, strict: bool = False, **kwargs: Any):
        super().__init__()
        self.strict = strict
        self.update(*args, **kwargs)

    def __setitem__(self, key: str, value: Any) -> None:
        problem = _contract_problem(key, value)
        if problem is not None:
            if self.strict:
                raise StatusContractError(problem)
            log.error("%s; written anyway, this is an operator bug", problem)
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]


@dataclass
class StatusChange:
    """Status fields to merge-patch, Events to post once the patch is stored."""

    job: dict[str, Any]
    now: datetime
    cluster: Cluster
    status: StatusPatch = field(default_factory=StatusPatch)
    # Written only along with a patch that happens anyway: live cost between its due
    # writes, the mark that an attempt's children all exist.
    piggyback: StatusPatch = field(default_factory=StatusPatch)
    conditions: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    conditional: bool = False
    strict: bool = False  # an illegal phase change or status field raises (settings.strict_phases)
    _was: FineTuneJobStatus | None = field(default=None, init=False, repr=False)
    _was_of: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.status, self.piggyback = StatusPatch(self.status, strict=self.strict), StatusPatch(strict=self.strict)
        self._generation = int(self.job["metadata"].get("generation", 1))
        self.conditions = list((self.job.get("status") or {}).get("conditions") or [])
        self._original_conditions = list(self.conditions)

    @property
    def old(self) -> dict[str, Any]:
        """The stored status as it is on the wire: what a commit's patch is diffed against."""
        return dict(self.job.get("status") or {})

    @property
    def was(self) -> FineTuneJobStatus:
        """The stored status, typed: what a decision reads. Another version's value of a known
        field that this one cannot read reads as absent (`read_status`). Parsed once per
        stored status (a commit or a fresh read replaces `job`), not at every read."""
        raw = self.job.get("status")
        if self._was is None or self._was_of is not raw:
            self._was, self._was_of = read_status(raw), raw
        return self._was

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
        source = self.status.get("phase") or self.was.phase or phases.INITIAL
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
        if self.was.phase != phase and not any(r == reason and m == message for _, r, m in self.events):
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
        self.status = StatusPatch(strict=self.strict)
        self.piggyback = StatusPatch(strict=self.strict)
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
