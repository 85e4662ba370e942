"""Fixtures of the real-node tests alone."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.local_volumes import LocalStorage, running_local_path


@pytest.fixture(scope="session")
def cluster_images_dir() -> Iterator[Path | None]:
    """The real-node tests' cluster keeps its nodes' containerd roots in the cache
    (hack/cluster: SPILLWAY_CLUSTER_IMAGES_DIR), so that a session imports only the images
    built since the last one: importing the 3.3 GB training image into a fresh containerd
    cost every gate about 80 s of CPU a node. The directory is locked for the session; a
    session beside it (another checkout's tests) gets fresh roots, as all did before.
    hack/images removes a node's older builds of an image when it loads a newer one."""
    cache = Path(os.environ.get("SPILLWAY_CACHE") or Path.home() / ".cache" / "spillway") / "test-node-images"
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / "lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield cache


@pytest.fixture(scope="session")
def local_storage(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStorage]:
    """A local-volume provisioner and its StorageClass (tests/e2e/local_volumes.py) for the
    session, started by the first test that asks for it."""
    with running_local_path(cluster, tmp_path_factory.mktemp("local-path")) as storage:
        yield storage
