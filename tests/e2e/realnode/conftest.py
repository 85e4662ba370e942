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
    (hack/cluster: SPILLWAY_CLUSTER_IMAGES_DIR), so that a session imports into node 1 only
    the images built since the last one: the training image (a 3.5 GB archive, 6.5 GB
    unpacked) took about 80 s of every gate's set-up there. Node 2 keeps its images in the
    session's state dir, as before (hack/cluster says why). The directory is locked for the session; a session beside it (another
    checkout's tests) gets fresh roots, as all did before. hack/images removes a node's
    older builds of an image when it loads a newer one, and hack/cluster `up` stops a
    cluster a killed session left running on the roots. The roots are used when a real-node
    test starts the session's cluster: with the default three workers the real-node tests
    have a worker and a cluster of their own."""
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
