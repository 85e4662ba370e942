"""Settings every test session shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


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
