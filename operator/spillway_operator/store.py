"""In-memory copies of the objects every reconcile reads: FineTuneJobs, their pods, nodes.

Where this sits: beside `k8s` under `reconciler`. `handlers` feeds it from kopf's
watch streams, the reconciler writes its own API responses through it (a created
pod, a patched status) and reads jobs and pods from it instead of a GET and a
LIST per reconcile: client-go's informer cache, for the three kinds the operator
reads on every event. At 300 jobs that removed most of the operator's requests
(benchmarks/bench_operator_scale.py).

Staleness is safe by construction: child names are deterministic (a create of an
object the cache has not seen yet answers 409, which counts as done), and every
decision that moves a job to a new attempt is a status patch conditional on the
job's resourceVersion (a stale job answers 409 and the key is retried). What a
stale cache can cost is a late status, never a duplicate pod.

Ordering: an event older than the copy held (a relist snapshot taken before a
watch event, a watch event behind our own write) must not overwrite it. Object
resourceVersions are compared as integers, which etcd-backed API servers hand
out; when either is not an integer the newest arrival wins. Deletions leave a
tombstone until the next relist, so a snapshot taken before a delete cannot
bring the object back.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable
from typing import Any

Key = tuple[str, str]


def key_of(obj: dict[str, Any]) -> Key:
    meta = obj["metadata"]
    return (meta.get("namespace") or "default", meta["name"])


def _rv(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def _not_older(new: str, old: str) -> bool:
    try:
        return int(new) >= int(old)
    except ValueError:
        return True


class ObjectStore:
    """Latest known copy of each object of one kind, by (namespace, name)."""

    def __init__(self, index_label: str | None = None):
        self._items: dict[Key, dict[str, Any]] = {}
        self._tombstones: dict[Key, str] = {}
        self._index_label = index_label
        self._by_index: dict[Key, set[Key]] = {}
        self._lock = threading.Lock()
        self.synced = threading.Event()

    def _index_key(self, obj: dict[str, Any]) -> Key | None:
        if self._index_label is None:
            return None
        value = ((obj.get("metadata") or {}).get("labels") or {}).get(self._index_label)
        return (key_of(obj)[0], value) if value else None

    def _put(self, key: Key, obj: dict[str, Any]) -> None:
        old = self._items.get(key)
        if old is not None:
            self._unindex(key, old)
        self._items[key] = obj
        index = self._index_key(obj)
        if index is not None:
            self._by_index.setdefault(index, set()).add(key)

    def _unindex(self, key: Key, obj: dict[str, Any]) -> None:
        index = self._index_key(obj)
        if index is not None:
            members = self._by_index.get(index)
            if members is not None:
                members.discard(key)
                if not members:
                    del self._by_index[index]

    def upsert(self, obj: dict[str, Any]) -> bool:
        """Keep `obj` unless the copy held (or the tombstone) is newer. True when kept."""
        key = key_of(obj)
        obj = {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "managedFields"}}
        rv = _rv(obj)
        with self._lock:
            held = self._items.get(key)
            if held is not None and not _not_older(rv, _rv(held)):
                return False
            dead = self._tombstones.get(key)
            if dead is not None:
                if not _not_older(rv, dead) or rv == dead:
                    return False
                del self._tombstones[key]
            self._put(key, obj)
            return True

    def delete(self, obj: dict[str, Any]) -> None:
        """Forget `obj`, unless the copy held is newer (a same-name object created since)."""
        key = key_of(obj)
        rv = _rv(obj)
        with self._lock:
            held = self._items.get(key)
            if held is not None and rv and _rv(held) != rv and _not_older(_rv(held), rv):
                return
            if held is not None:
                del self._items[key]
                self._unindex(key, held)
            self._tombstones[key] = rv or (_rv(held) if held else "")

    def replace_all(self, items: Iterable[dict[str, Any]], list_rv: str) -> None:
        """A full LIST at `list_rv`: what it lacks and is not newer than it is gone (a watch
        that reconnected may have missed the DELETED event); newer copies held stay."""
        items = list(items)
        with self._lock:
            listed = {key_of(o) for o in items}
            for key, held in list(self._items.items()):
                if key not in listed and _not_older(list_rv, _rv(held)):
                    del self._items[key]
                    self._unindex(key, held)
            self._tombstones = {k: rv for k, rv in self._tombstones.items() if not _not_older(list_rv, rv)}
        for obj in items:
            self.upsert(obj)
        self.synced.set()

    def get(self, key: Key) -> dict[str, Any] | None:
        """A private copy: callers may modify it."""
        with self._lock:
            obj = self._items.get(key)
            return copy.deepcopy(obj) if obj is not None else None

    def by_index(self, namespace: str, value: str) -> list[dict[str, Any]]:
        """Copies of the objects whose index label equals `value` in `namespace`."""
        with self._lock:
            keys = self._by_index.get((namespace, value), set())
            return [copy.deepcopy(self._items[k]) for k in sorted(keys)]

    def snapshot(self) -> list[dict[str, Any]]:
        """Every object held, not copied: for readers that do not modify them."""
        with self._lock:
            return list(self._items.values())

    def generation(self, key: Key) -> int | None:
        """metadata.generation of the copy held (None: none held)."""
        with self._lock:
            obj = self._items.get(key)
            return int(obj["metadata"].get("generation") or 0) if obj is not None else None

    def list_keys(self) -> list[Key]:
        with self._lock:
            return sorted(self._items)

    def select(self, predicate: Any) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(o) for o in self._items.values() if predicate(o)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


# The operator's caches; `handlers` fills them, `reconciler` reads them once synced.
jobs = ObjectStore()
pods = ObjectStore(index_label="spillway.dev/job")
nodes = ObjectStore()
