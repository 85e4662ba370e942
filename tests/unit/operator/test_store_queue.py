"""The operator's informer-style cache and work queue (pure Python, no API server)."""

from __future__ import annotations

import threading
import time
from typing import Any

from spillway_operator.store import ObjectStore
from spillway_operator.workqueue import WorkQueue


def pod(name: str, rv: int, job: str = "j", ns: str = "ns", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": ns,
            "resourceVersion": str(rv),
            "labels": {"spillway.dev/job": job},
            "managedFields": [{"manager": "x"}],
        },
        "spec": spec,
    }


def test_older_copies_never_replace_newer_ones() -> None:
    s = ObjectStore(index_label="spillway.dev/job")
    assert s.upsert(pod("p", 10, nodeName="a"))
    assert not s.upsert(pod("p", 9, nodeName="stale"))
    got = s.get(("ns", "p"))
    assert got is not None and got["spec"]["nodeName"] == "a"
    assert "managedFields" not in got["metadata"]
    assert s.upsert(pod("p", 11, nodeName="b"))
    assert [p["spec"]["nodeName"] for p in s.by_index("ns", "j")] == ["b"]


def test_copies_are_private() -> None:
    s = ObjectStore()
    s.upsert(pod("p", 1))
    got = s.get(("ns", "p"))
    assert got is not None
    got["spec"]["x"] = 1
    assert s.get(("ns", "p")) == {**got, "spec": {}}


def test_a_deleted_object_is_not_revived_by_an_older_snapshot() -> None:
    s = ObjectStore(index_label="spillway.dev/job")
    s.upsert(pod("p", 5))
    s.delete(pod("p", 7))
    assert s.get(("ns", "p")) is None and s.by_index("ns", "j") == []
    assert not s.upsert(pod("p", 6))  # an event or list older than the deletion
    assert s.get(("ns", "p")) is None
    assert s.upsert(pod("p", 8))  # the same name created again
    assert s.get(("ns", "p")) is not None


def test_a_stale_deletion_leaves_a_newer_copy() -> None:
    s = ObjectStore()
    s.upsert(pod("p", 20))  # recreated under the same name; the old one's DELETED comes late
    s.delete(pod("p", 15))
    assert s.get(("ns", "p")) is not None
    s.delete(pod("p", 20))
    assert s.get(("ns", "p")) is None


def test_relist_drops_what_it_lacks_but_keeps_newer_copies() -> None:
    s = ObjectStore(index_label="spillway.dev/job")
    s.upsert(pod("gone", 3))  # deleted while a watch was down: no DELETED event came
    s.upsert(pod("new", 12))  # created after the list's snapshot
    s.upsert(pod("kept", 4))
    assert not s.synced.is_set()
    s.replace_all([pod("kept", 4), pod("other", 2, job="k")], list_rv="10")
    assert s.synced.is_set()
    assert s.list_keys() == [("ns", "kept"), ("ns", "new"), ("ns", "other")]
    assert [p["metadata"]["name"] for p in s.by_index("ns", "j")] == ["kept", "new"]
    assert s.generation(("ns", "kept")) == 0 and s.generation(("ns", "absent")) is None


def test_a_key_is_queued_once_and_processed_by_one_worker_at_a_time() -> None:
    q = WorkQueue()
    for _ in range(5):
        q.add("a")
    q.add("b")
    assert len(q) == 2
    assert q.get() == "a"
    q.add("a")  # changed while in flight: not handed to a second worker now...
    assert q.get() == "b"
    assert len(q) == 0
    q.done("a")  # ...but once more after the first finishes
    assert q.get() == "a"
    q.done("a")
    q.done("b")
    assert len(q) == 0


def test_delays_and_rate_limits() -> None:
    q = WorkQueue(base_delay=0.05, max_delay=0.2)
    q.add_after("late", 0.15)
    q.add_after("soon", 0.05)
    started = time.monotonic()
    assert q.get() == "soon"
    assert q.get() == "late"
    assert time.monotonic() - started >= 0.14
    assert [q.add_rate_limited("x") for _ in range(4)] == [0.05, 0.1, 0.2, 0.2]
    q.forget("x")
    assert q.add_rate_limited("x") == 0.05


def test_one_delayed_entry_per_key_the_earliest() -> None:
    q = WorkQueue()
    for _ in range(1000):  # a resync re-arming the same TTL each pass
        q.add_after("ttl", 60)
    q.add_after("ttl", 0.05)  # an earlier deadline replaces it
    assert len(q._delayed) <= 2 and len(q._due) == 1
    assert q.get() == "ttl"
    q.done("ttl")
    assert len(q._due) == 0


def test_shutdown_wakes_waiting_workers() -> None:
    q = WorkQueue()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(q.get()))
    t.start()
    time.sleep(0.05)
    q.shutdown()
    t.join(2)
    assert got == [None]
