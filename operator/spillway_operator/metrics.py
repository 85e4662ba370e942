"""Prometheus metrics of the operator, served on settings.metrics_port.

Where this sits: a leaf module imported by `k8s` (API calls and errors) and by
`reconciler` (phases, durations, planning failures).
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram, start_http_server

JOBS_BY_PHASE = Gauge("spillway_jobs", "FineTuneJobs by phase, as last reconciled", ["phase"])
RECONCILE_SECONDS = Histogram(
    "spillway_reconcile_duration_seconds",
    "Wall time of one FineTuneJob reconcile",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECONCILE_ERRORS = Counter("spillway_reconcile_errors_total", "Reconciles that raised", ["kind"])
PLANNING_FAILURES = Counter("spillway_planning_failures_total", "Jobs that fit on no node shape")
ILLEGAL_PHASE_TRANSITIONS = Counter(
    "spillway_illegal_phase_transitions_total",
    "Phase changes the phase machine does not allow, applied anyway (an operator bug)",
    ["source", "target"],
)
API_REQUESTS = Counter("spillway_api_requests_total", "Requests to the Kubernetes API server, by client call", ["call"])
API_ERRORS = Counter("spillway_api_errors_total", "Kubernetes API errors by HTTP status", ["code"])
QUEUE_DEPTH = Gauge("spillway_workqueue_depth", "Job keys waiting for a reconcile worker")
PODS_CREATED = Counter("spillway_pods_created_total", "Training pods created")

_phases: dict[tuple[str, str], str] = {}
_phases_lock = threading.Lock()


def record_phase(namespace: str, name: str, phase: str | None) -> None:
    """Track each job's phase; None forgets a deleted job."""
    with _phases_lock:
        if phase is None:
            _phases.pop((namespace, name), None)
        else:
            _phases[(namespace, name)] = phase
        counts: dict[str, int] = {}
        for p in _phases.values():
            counts[p] = counts.get(p, 0) + 1
        for p in {*counts, *(s.labels[0] for s in _known_phase_labels())}:
            JOBS_BY_PHASE.labels(phase=p).set(counts.get(p, 0))


class _Label:
    def __init__(self, labels: tuple[str, ...]):
        self.labels = labels


def _known_phase_labels() -> list[_Label]:
    return [_Label(tuple(k)) for k in JOBS_BY_PHASE._metrics]


_serving: set[int] = set()


def serve(port: int) -> None:
    """Start the /metrics server once (kopf retries a failed start-up handler)."""
    if port and port not in _serving:
        start_http_server(port)
        _serving.add(port)
