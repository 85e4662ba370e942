"""Settings every test session shares, and the test tiers.

Tiers (a marker each, given here by folder so that no test is left out of one; each
is a make target, see the Makefile):
    unit         tests/unit: pure functions and the reconciler against the in-memory
                 cluster; no server, no DeepSpeed step, no cluster.
    integration  tests/integration: real DeepSpeed training on the CPU, real databases,
                 the FastAPI app over HTTP, real S3 and MLflow servers.
    e2e          tests/e2e on the test cluster's control plane and kwok nodes.
    realnode     tests/e2e whose module marks itself `realnode`: real containers on
                 the cluster's real node (kubelet, containerd, runc).
Every e2e test shares one cluster per session: under pytest-xdist (`-n`, as
hack/test.sh runs the tiers) `ClusterOnOneWorker` sends them all to one worker, first,
while the other workers take the rest one test at a time. (xdist's own `--dist loadgroup`
does not group under pytest 9: it renames items through an attribute pytest no longer
reads.)
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "e2e", "realnode")


def pytest_configure(config: pytest.Config) -> None:
    for tier, what in zip(TIERS, ("pure functions, no server", "real DeepSpeed, databases, servers",
                                  "the test cluster with kwok nodes", "real pods on the real node"), strict=True):
        config.addinivalue_line("markers", f"{tier}: tier {tier}: {what}")


def tier_of(item: pytest.Item) -> str:
    parts = item.path.relative_to(TESTS).parts
    if parts[:2] == ("e2e", "realnode") or (parts[0] == "e2e" and item.get_closest_marker("realnode")):
        return "realnode"
    return parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier_of(item))


class ClusterOnOneWorker(LoadScopeScheduling):
    """xdist's scope scheduling with four kinds of unit: tests/e2e/realnode (real pods on a
    cluster of their own, whose start and training image are paid once), the rest of
    tests/e2e (kwok nodes, one cluster), the modules in UNITS whose tests share a module
    fixture's run or server, and each other test alone. The largest units go out
    first (xdist orders units by size), so each cluster's tests start at once on a worker of
    their own, which takes no other test until they are nearly done; the other workers take
    the integration tests one at a time. Each worker that holds a unit starts its own
    cluster (the `cluster` fixture is per session, and a session is per worker): the
    chart's cluster-wide webhook and policies, installed by a test for its duration, never
    meet another worker's test."""

    UNITS = ("tests/e2e/realnode/", "tests/e2e/",
             # Modules whose tests share what a module fixture starts: run apart, each worker
             # that took one of them (and any test of another module between two of them, which
             # tears module fixtures down) started it again.
             "tests/integration/test_tiered_optimizer.py::",  # the 28-step tiered reference run
             "tests/integration/test_faults.py::",  # the finished runs its tests damage copies of
             "tests/integration/api/test_dashboard.py::",  # the API server and Chromium
             "tests/integration/api/test_client.py::")  # the API server

    def _split_scope(self, nodeid: str) -> str:
        return next((unit for unit in self.UNITS if nodeid.startswith(unit)), nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadScopeScheduling | None:
    return ClusterOnOneWorker(config, log) if config.getvalue("dist") == "load" else None


_tier_seconds: dict[str, float] = defaultdict(float)
_tier_tests: dict[str, int] = defaultdict(int)
_started = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """The time of each tier's tests (setup, call and teardown), summed; under xdist the
    reports reach the controller, so the sums cover every worker."""
    # realnode first: a real-node test carries the e2e keyword too (its folder).
    tier = next((t for t in ("realnode", "unit", "integration", "e2e") if t in report.keywords), None)
    if tier is None:
        return
    _tier_seconds[tier] += report.duration
    if report.when == "call":
        _tier_tests[tier] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _tier_tests:
        return
    wall = time.monotonic() - _started
    terminalreporter.section("time per tier")
    for tier in TIERS:
        if _tier_tests.get(tier):
            terminalreporter.write_line(f"{tier:<12} {_tier_tests[tier]:4d} tests  {_tier_seconds[tier]:8.1f} s of test time")
    terminalreporter.write_line(f"{'wall':<12} {'':10} {wall:8.1f} s for the whole session")


@pytest.fixture(scope="session", autouse=True)
def probe_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`spillway run` keeps its NVMe async-I/O sweep in ~/.cache/spillway: here it goes into the
    session's own directory instead (child processes inherit it), so tests never write into
    the user's cache and the session pays one sweep per disk, in the first run on NVMe. That
    sweep gets one second: tests check where the settings go, not how fast the disk is.
    Outside the probe-cache tests (which turn it on) no run sweeps: every run plans with
    DeepSpeed's default async I/O, as a sweep's winner varies and its block size decides
    which of a tiny model's optimizer sub-groups are swapped at all."""
    directory = str(tmp_path_factory.mktemp("probe-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILLWAY_PROBE_CACHE_DIR", directory)
        mp.setenv("SPILLWAY_PROBE_AIO_SECONDS", "1")
        mp.delenv("SPILLWAY_PROBE_REFRESH", raising=False)
        mp.setenv("SPILLWAY_PROBE_SWEEP", "0")
        yield directory
