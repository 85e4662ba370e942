"""Leader election on a coordination.k8s.io Lease, so that replicas never both reconcile.

Where this sits: beside the cli, below nothing else. A replica runs kopf only while it
holds the Lease; followers wait and take over when the holder stops renewing it (crash,
node loss) or releases it (clean shutdown). A leader that fails to renew within the lease
duration stops kopf and exits, so a partitioned old leader never overlaps a new one for
longer than one renew interval. The same protocol as client-go's leaderelection: the
holder identity, acquire and renew times, optimistic concurrency on resourceVersion.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

log = logging.getLogger("spillway.leader")


@dataclass(frozen=True)
class LeaseConfig:
    name: str
    namespace: str
    lease_seconds: int = 15  # a dead leader is replaced after at most this long (client-go default)
    renew_seconds: float = 5.0  # renew well inside the lease; two missed renewals still keep it
    retry_seconds: float = 2.0  # how often a follower checks for an expired lease


def identity() -> str:
    """Unique per process: pod name (HOSTNAME) plus a random suffix for restarts in place."""
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}-{uuid.uuid4().hex[:6]}"


def _now() -> datetime:
    return datetime.now(UTC)


def _parse(ts: Any) -> datetime | None:
    if ts is None:
        return None
    if isinstance(ts, datetime):
        return ts if ts.tzinfo else ts.replace(tzinfo=UTC)
    return datetime.fromisoformat(str(ts).replace("Z", "+00:00"))


class LeaderElector:
    def __init__(self, config: LeaseConfig, holder: str | None = None):
        from kubernetes import client

        from spillway_operator import k8s

        self.config = config
        self.holder = holder or identity()
        self.api: Any = client.CoordinationV1Api(k8s.api_client())  # dict bodies; responses read as V1Lease
        self.lost = threading.Event()
        self._stop = threading.Event()

    def _lease_body(self, acquire_time: datetime, resource_version: str | None = None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.config.name, "namespace": self.config.namespace}
        if resource_version:
            metadata["resourceVersion"] = resource_version
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": self.holder,
                "leaseDurationSeconds": self.config.lease_seconds,
                "acquireTime": acquire_time.isoformat(),
                "renewTime": _now().isoformat(),
            },
        }

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this process holds the lease afterwards."""
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self.api.read_namespaced_lease(self.config.name, self.config.namespace)
        except ApiException as err:
            if err.status != 404:
                raise
            try:
                self.api.create_namespaced_lease(self.config.namespace, self._lease_body(_now()))
                return True
            except ApiException as create_err:
                if create_err.status == 409:  # another replica created it first
                    return False
                raise
        spec = lease.spec
        holder = spec.holder_identity
        renewed = _parse(spec.renew_time)
        duration = spec.lease_duration_seconds or self.config.lease_seconds
        expired = renewed is None or _now() > renewed + timedelta(seconds=duration)
        if holder not in (self.holder, None, "") and not expired:
            return False
        acquire = _parse(spec.acquire_time) if holder == self.holder else _now()
        body = self._lease_body(acquire or _now(), lease.metadata.resource_version)
        try:
            self.api.replace_namespaced_lease(self.config.name, self.config.namespace, body)
            return True
        except ApiException as err:
            if err.status == 409:  # lost a race on resourceVersion
                return False
            raise

    def wait_for_leadership(self) -> None:
        while not self._stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    log.info("acquired lease %s/%s as %s", self.config.namespace, self.config.name, self.holder)
                    return
            except Exception as err:  # the API server may be away; keep trying
                log.warning("leader election: %s", err)
            self._stop.wait(self.config.retry_seconds)

    def keep_renewing(self, stop_flag: threading.Event) -> None:
        """Renew until stopped; on failure to renew within the lease, set `lost` and `stop_flag`."""
        last_ok = time.monotonic()
        while not self._stop.wait(self.config.renew_seconds):
            try:
                if self.try_acquire_or_renew():
                    last_ok = time.monotonic()
                    continue
                log.error("lease %s taken by another replica: stopping", self.config.name)
            except Exception as err:
                log.warning("lease renewal failed: %s", err)
                if time.monotonic() - last_ok < self.config.lease_seconds - self.config.renew_seconds:
                    continue
            self.lost.set()
            stop_flag.set()
            return

    def release(self) -> None:
        """Give the lease up on a clean shutdown so a follower takes over at once."""
        self._stop.set()
        if self.lost.is_set():
            return
        from kubernetes.client.exceptions import ApiException

        # A renewal in flight when the stop came may change the lease between our read and our
        # write (409): read it again and retry, or the follower waits out the whole lease.
        for attempt in range(5):
            try:
                lease = self.api.read_namespaced_lease(self.config.name, self.config.namespace)
                if lease.spec.holder_identity == self.holder:
                    lease.spec.holder_identity = ""
                    lease.spec.renew_time = None
                    self.api.replace_namespaced_lease(self.config.name, self.config.namespace, lease)
                return
            except ApiException as err:
                if err.status == 409 and attempt < 4:
                    continue
                problem: Exception = err
            except Exception as err:
                problem = err
            log.warning("could not release the lease: %s", problem)
            return
