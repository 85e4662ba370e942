"""The phase machine (spillway_operator.phases): its table is closed over the contract's phases;
every transition in it happens through the reconciler against the in-memory cluster (one
scenario each: the stored phase asserted before the event and after it); and a phase change
it does not list raises (the unit tests run the operator strict, tests/unit/conftest.py) or,
in production, is reported and applied."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest
from prometheus_client import REGISTRY

from spillway_operator import builders as b
from spillway_operator import phases
from spillway_operator.reconciler import PermanentFailure, reconcile
from spillway_operator.settings import OperatorSettings
from spillway_operator.status import StatusChange
from spillway_runtime.core.contract import PHASES, TERMINAL_PHASES, ExitCode

from .fake_cluster import FakeCluster
from .test_queueing import KUEUE, admit, evict, queued_world
from .test_reconciler import NS, SETTINGS, status, world

EDGES = sorted((source, target) for source, nexts in phases.TRANSITIONS.items() for target in nexts)


def test_the_tests_run_the_phase_machine_strict() -> None:
    assert SETTINGS.strict_phases and KUEUE.strict_phases and not OperatorSettings.model_fields["strict_phases"].default


# -- the table -------------------------------------------------------------------------------

def test_the_table_has_an_entry_for_every_contract_phase_and_names_no_other() -> None:
    assert set(phases.TRANSITIONS) == set(PHASES)
    assert {target for _, target in EDGES} <= set(PHASES) and phases.INITIAL in PHASES
    assert all(phases.TRANSITIONS[s][t] for s, t in EDGES), "every transition names its event"


def test_a_terminal_phase_is_left_only_by_a_rollback_or_a_spec_that_no_longer_parses() -> None:
    documented = {"Pending": (phases.ROLLBACK,), "Failed": (phases.SPEC_INVALID,)}
    for phase in TERMINAL_PHASES:
        assert dict(phases.TRANSITIONS[phase]) in ({}, documented), phase


def test_the_phases_the_operator_never_writes_have_no_way_in_and_none_out() -> None:
    reached, todo = {phases.INITIAL}, [phases.INITIAL]
    while todo:
        for target in phases.TRANSITIONS[todo.pop()]:
            if target not in reached:
                reached.add(target)
                todo.append(target)
    never = set(PHASES) - reached
    assert never == {"Planning", "Preempted", "Diverged"}
    assert all(not phases.TRANSITIONS[p] for p in never)


# -- every transition, through the reconciler ------------------------------------------------

@dataclass
class Job:
    """The job `j` in an in-memory cluster, reconciled with `settings`."""

    cluster: FakeCluster
    settings: OperatorSettings = field(default_factory=lambda: SETTINGS)
    pod: str = b.pod_name("j", 0, 0)  # the first attempt's: every scenario's event happens to it

    @property
    def phase(self) -> str:
        return str(status(self.cluster).get("phase") or phases.INITIAL)

    def step(self, ends: bool = False) -> None:
        """One reconcile; `ends`: it ends the job Failed, raising PermanentFailure (no retry helps)."""
        if ends:
            with pytest.raises(PermanentFailure):
                reconcile(NS, "j", self.settings, self.cluster)
        else:
            reconcile(NS, "j", self.settings, self.cluster)

    def node(self) -> str:
        return str(status(self.cluster)["plan"]["nodeNames"][0])


# Each arrangement reaches its phase through reconciles, from a new job.
def pending() -> Job:
    return Job(world())


def queued() -> Job:
    job = Job(queued_world(), KUEUE)
    job.step()
    return job


def planned(queue: bool = False) -> Job:
    if queue:
        job = queued()
        admit(job.cluster)
    else:
        job = pending()
    job.step()
    return job


def scheduled(queue: bool = False) -> Job:
    job = planned(queue)
    bound(job)
    return job


def running(queue: bool = False) -> Job:
    job = planned(queue)
    started(job)
    return job


def ended(code: int) -> Callable[[], Job]:
    def arrange() -> Job:
        job = running()
        job.cluster.exit(NS, job.pod, code)
        job.step()
        return job
    return arrange


def suspended() -> Job:
    job = running()
    suspend(job)
    return job


def budget_exceeded() -> Job:
    job = pending()
    spend_budget(job)
    return job


# Each event changes the cluster as a user, the kubelet or Kueue would, then reconciles.
def reconciled(job: Job) -> None:
    job.step()


def refreshed(job: Job) -> None:
    """A self-transition rewrites the message, nothing else."""
    job.cluster.patch_job_status(NS, "j", {"status": {"message": "stale"}})
    job.step()
    assert status(job.cluster)["message"] != "stale"


def invalid_spec(job: Job) -> None:
    job.cluster.set_spec(NS, "j", training={"maxSteps": -1})
    job.step(ends=True)
    assert "maxSteps" in status(job.cluster)["message"]


def invalid_again(job: Job) -> None:
    invalid_spec(job)
    job.cluster.patch_job_status(NS, "j", {"status": {"message": "stale"}})
    job.step(ends=True)
    assert "maxSteps" in status(job.cluster)["message"]


def fits_nowhere(job: Job) -> None:
    job.cluster.set_spec(NS, "j", model={"parameterCount": "400B"})
    job.step(ends=True)


def kueue_off(job: Job) -> None:
    job.settings = SETTINGS
    job.step(ends=True)


def suspend(job: Job) -> None:
    job.cluster.set_spec(NS, "j", suspend=True)
    job.step()


def hold_for_input(job: Job) -> None:
    """The data claim is gone, so the next attempt waits, Pending, rather than being planned
    in the same reconcile."""
    del job.cluster.objects[("PersistentVolumeClaim", NS, "data")]


def waits_for_input(job: Job) -> None:
    """A new job whose data claim does not exist: stored Pending, the message naming the claim."""
    hold_for_input(job)
    job.step()
    assert status(job.cluster)["phase"] == "Pending" and "'data'" in status(job.cluster)["message"]


def resume(job: Job) -> None:
    hold_for_input(job)
    job.cluster.set_spec(NS, "j", suspend=False)
    job.step()


def roll_back(job: Job) -> None:
    hold_for_input(job)
    job.cluster.patch_job_status(NS, "j", {"status": {"checkpoints": [{"name": "step-00000009", "step": 9}]}})
    job.cluster.set_spec(NS, "j", resumeFrom="step-00000009", budget={"maxCostUSD": 1000.0})
    job.step()
    assert status(job.cluster)["appliedResumeFrom"] == "step-00000009"


def spend_budget(job: Job) -> None:
    job.cluster.set_spec(NS, "j", budget={"maxCostUSD": 0.5})
    job.cluster.patch_job_status(NS, "j", {"status": {"cost": {"settledUSD": 1.0, "usd": 1.0}}})
    job.step()


def admitted(job: Job) -> None:
    admit(job.cluster)
    job.step()


def evicted(job: Job) -> None:
    evict(job.cluster)
    job.step()


def bound(job: Job) -> None:
    job.cluster.set_pod(NS, job.pod, {"phase": "Pending"}, node_name=job.node())
    job.step()


def started(job: Job) -> None:
    job.cluster.run(NS, job.pod, job.node())
    job.step()


def exits(code: int, backoff_limit: int | None = None) -> Callable[[Job], None]:
    def event(job: Job) -> None:
        if backoff_limit is not None:
            job.cluster.set_spec(NS, "j", backoffLimit=backoff_limit)
        job.cluster.exit(NS, job.pod, code)
        job.step()
    return event


def preempted(job: Job) -> None:
    """Exit 75 starts the next attempt in the same reconcile: held, it stays Pending."""
    hold_for_input(job)
    exits(ExitCode.PREEMPTED)(job)
    assert status(job.cluster)["preemptions"] == 1


def pod_deleted(job: Job) -> None:
    """Someone deletes the attempt's pod: it is made again, and waits for the scheduler."""
    job.cluster.delete_pod(NS, job.pod)
    job.step()
    assert job.cluster.names("Pod") == [job.pod]
    job.step()


def pod_deleted_then_bound(job: Job) -> None:
    job.cluster.delete_pod(NS, job.pod)
    job.step()
    bound(job)


# (source, target) -> how to get a job to `source`, and the event that moves it to `target`.
SCENARIOS: dict[tuple[str, str], tuple[Callable[[], Job], Callable[[Job], None]]] = {
    ("Pending", "Pending"): (pending, waits_for_input),
    ("Pending", "Planned"): (pending, reconciled),
    ("Pending", "Queued"): (lambda: Job(queued_world(), KUEUE), reconciled),
    ("Pending", "Suspended"): (pending, suspend),
    ("Pending", "BudgetExceeded"): (pending, spend_budget),
    ("Pending", "Failed"): (pending, fits_nowhere),
    ("Queued", "Queued"): (queued, refreshed),
    ("Queued", "Planned"): (queued, admitted),
    ("Queued", "Suspended"): (queued, suspend),
    ("Queued", "BudgetExceeded"): (queued, spend_budget),
    ("Queued", "Failed"): (queued, kueue_off),
    ("Planned", "Scheduled"): (planned, bound),
    ("Planned", "Running"): (planned, started),
    ("Planned", "Succeeded"): (planned, exits(0)),
    ("Planned", "Failed"): (planned, exits(ExitCode.BAD_INPUT)),
    ("Planned", "Pending"): (planned, exits(1)),
    ("Planned", "Queued"): (lambda: planned(queue=True), evicted),
    ("Planned", "BudgetExceeded"): (planned, spend_budget),
    ("Planned", "Suspended"): (planned, suspend),
    ("Scheduled", "Scheduled"): (scheduled, refreshed),
    ("Scheduled", "Running"): (scheduled, started),
    ("Scheduled", "Planned"): (scheduled, pod_deleted),
    ("Scheduled", "Succeeded"): (scheduled, exits(0)),
    ("Scheduled", "Failed"): (scheduled, invalid_spec),
    ("Scheduled", "Pending"): (scheduled, preempted),
    ("Scheduled", "Queued"): (lambda: scheduled(queue=True), evicted),
    ("Scheduled", "BudgetExceeded"): (scheduled, spend_budget),
    ("Scheduled", "Suspended"): (scheduled, suspend),
    ("Running", "Running"): (running, refreshed),
    ("Running", "Scheduled"): (running, pod_deleted_then_bound),
    ("Running", "Planned"): (running, pod_deleted),
    ("Running", "Succeeded"): (running, exits(0)),
    ("Running", "Failed"): (running, exits(1, backoff_limit=0)),
    ("Running", "Pending"): (running, exits(1)),
    ("Running", "Queued"): (lambda: running(queue=True), evicted),
    ("Running", "BudgetExceeded"): (running, spend_budget),
    ("Running", "Suspended"): (running, suspend),
    ("Suspended", "Pending"): (suspended, resume),
    ("Suspended", "Failed"): (suspended, invalid_spec),
    ("Succeeded", "Pending"): (ended(0), roll_back),
    ("Succeeded", "Failed"): (ended(0), invalid_spec),
    ("Failed", "Pending"): (ended(ExitCode.BAD_INPUT), roll_back),
    ("Failed", "Failed"): (ended(ExitCode.BAD_INPUT), invalid_again),
    ("BudgetExceeded", "Pending"): (budget_exceeded, roll_back),
    ("BudgetExceeded", "Failed"): (budget_exceeded, invalid_spec),
}


def test_every_transition_of_the_table_has_a_scenario_and_no_scenario_is_outside_it() -> None:
    assert sorted(SCENARIOS) == EDGES


@pytest.mark.parametrize(("source", "target"), EDGES, ids=[f"{s}->{t}" for s, t in EDGES])
def test_each_transition_happens_through_the_reconciler(source: str, target: str) -> None:
    arrange, event = SCENARIOS[(source, target)]
    job = arrange()
    assert job.phase == source
    event(job)
    assert job.phase == target


# -- a change the table does not list --------------------------------------------------------

def _succeeded_job() -> tuple[FakeCluster, StatusChange]:
    job = ended(0)()
    stored = job.cluster.get("FineTuneJob", NS, "j")
    assert stored is not None and stored["status"]["phase"] == "Succeeded"
    return job.cluster, StatusChange(stored, datetime.now(UTC), job.cluster)


def test_an_illegal_transition_raises_when_strict_before_anything_is_written() -> None:
    cluster, change = _succeeded_job()
    change.strict = True
    with pytest.raises(phases.IllegalTransition, match="Succeeded -> Running"):
        change.phase(b.PHASE_RUNNING, "Running", "1 pod(s) running")
    assert "phase" not in change.status
    change.commit()
    assert status(cluster)["phase"] == "Succeeded"


def test_an_illegal_transition_in_production_is_reported_and_applied() -> None:
    cluster, change = _succeeded_job()
    labels = {"source": "Succeeded", "target": "Running"}
    before = REGISTRY.get_sample_value("spillway_illegal_phase_transitions_total", labels) or 0.0
    change.phase(b.PHASE_RUNNING, "Running", "1 pod(s) running")
    change.commit()
    assert status(cluster)["phase"] == "Running"
    assert ("Warning", "IllegalPhaseTransition") in [(t, r) for t, r, _ in cluster.events]
    assert REGISTRY.get_sample_value("spillway_illegal_phase_transitions_total", labels) == before + 1


def test_a_suspended_job_with_pods_of_its_attempt_is_not_suspended_again() -> None:
    """Suspended -> Suspended is left out of the table: the operator commits Suspended with the
    next attempt's number, whose pods it makes only after a resume, so the code path that would
    write it (a suspended job with pods of its current attempt) needs a write from outside."""
    job = running()
    job.cluster.patch_job_status(NS, "j", {"status": {"phase": "Suspended"}})
    job.cluster.set_spec(NS, "j", suspend=True)
    with pytest.raises(phases.IllegalTransition, match="Suspended -> Suspended"):
        job.step()
