"""Fixtures of the real-node tests alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.local_volumes import LocalStorage, running_local_path


@pytest.fixture(scope="session")
def local_storage(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStorage]:
    """A local-volume provisioner and its StorageClass (tests/e2e/local_volumes.py) for the
    session, started by the first test that asks for it."""
    with running_local_path(cluster, tmp_path_factory.mktemp("local-path")) as storage:
        yield storage
