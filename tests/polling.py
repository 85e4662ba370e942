"""Polling for tests that wait on another process (an API, an operator, a training run)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Each poll costs: a cluster test's is a kubectl process and an API request (~0.1 s of CPU
# on this 2-core machine), so polling at 0.25 s for minutes took a third of a core away
# from the tests running beside it. The interval grows from `interval` by half at each
# poll up to this: the first second answers as fast as before, a long wait polls once a
# second.
MAX_INTERVAL = 1.0
GROWTH = 1.5


def wait_for(predicate: Callable[[], T], timeout: float, what: str = "condition", interval: float = 0.2,
             max_interval: float = MAX_INTERVAL) -> T:
    """Call `predicate` until it returns something truthy and return that; fail after `timeout` s.
    Polls every `interval` s at first, then less often, up to every `max_interval` s."""
    deadline = time.monotonic() + timeout
    delay = interval
    while True:
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {value!r}")
        time.sleep(min(delay, max(deadline - now, 0.0) + 0.01))
        delay = min(delay * GROWTH, max(interval, max_interval))
