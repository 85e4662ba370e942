"""A deduplicating, delaying work queue of job keys: client-go's workqueue, in Python.

Where this sits: under `handlers`, which feed it from watch events and drain it with
worker threads that call `reconciler.reconcile`. A key is queued at most once and
processed by one worker at a time: a burst of events for one job (its pod created,
bound, started; its status patched) costs one reconcile, not one per event, and a
key that changes while it is processed is processed once more afterwards.

Delays: `add_after` for "look again in N seconds" (backoff expiry, TTL, a missing
input), `add_rate_limited` for failures (doubling per consecutive failure of that
key, reset by `forget`).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Hashable


class WorkQueue:
    def __init__(self, base_delay: float = 0.5, max_delay: float = 60.0):
        self._cond = threading.Condition()
        self._queue: deque[Hashable] = deque()
        self._queued: set[Hashable] = set()
        self._processing: set[Hashable] = set()
        self._dirty: set[Hashable] = set()
        self._delayed: list[tuple[float, int, Hashable]] = []
        self._due: dict[Hashable, float] = {}
        self._seq = 0
        self._failures: dict[Hashable, int] = {}
        self._base_delay = base_delay
        self._max_delay = max_delay
        self._shutdown = False

    def add(self, key: Hashable) -> None:
        with self._cond:
            self._add_locked(key)

    def _add_locked(self, key: Hashable) -> None:
        if self._shutdown or key in self._queued:
            return
        if key in self._processing:
            self._dirty.add(key)  # re-queued by done()
            return
        self._queued.add(key)
        self._queue.append(key)
        self._cond.notify()

    def add_after(self, key: Hashable, seconds: float) -> None:
        if seconds <= 0:
            self.add(key)
            return
        with self._cond:
            due = time.monotonic() + seconds
            if self._due.get(key, float("inf")) <= due:
                return  # already due at least as soon: one entry per key, as client-go keeps
            self._due[key] = due
            self._seq += 1
            heapq.heappush(self._delayed, (due, self._seq, key))
            self._cond.notify()

    def add_rate_limited(self, key: Hashable) -> float:
        """Retry `key` after a delay that doubles with each consecutive failure; returns it."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay: float = min(self._max_delay, self._base_delay * 2.0**failures)
        self.add_after(key, delay)
        return delay

    def forget(self, key: Hashable) -> None:
        with self._cond:
            self._failures.pop(key, None)

    def get(self) -> Hashable | None:
        """The next ready key, blocking; None once shut down."""
        with self._cond:
            while True:
                if self._shutdown:
                    return None
                now = time.monotonic()
                while self._delayed and self._delayed[0][0] <= now:
                    due, _, key = heapq.heappop(self._delayed)
                    if self._due.get(key) == due:  # else superseded by an earlier deadline
                        del self._due[key]
                        self._add_locked(key)
                if self._queue:
                    key = self._queue.popleft()
                    self._queued.discard(key)
                    self._processing.add(key)
                    return key
                timeout = self._delayed[0][0] - now if self._delayed else None
                self._cond.wait(timeout)

    def done(self, key: Hashable) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                self._dirty.discard(key)
                self._add_locked(key)

    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)
