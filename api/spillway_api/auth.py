"""Who may call the API.

Local mode: one bearer token, generated on first start into a file only the user
can read (0600). Cluster mode: the caller's bearer token goes to the Kubernetes
API server — TokenReview says who it is, SubjectAccessReview whether they may do
the verb on `finetunejobs.spillway.dev` in the namespace — so the cluster's own
RBAC decides. `none` skips both and is only ever bound to 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from spillway_api.errors import ApiError
from spillway_api.service import LOCAL_CALLER, Caller

API_GROUP = "spillway.dev"
RESOURCE = "finetunejobs"
# Decisions are cached briefly so a busy client does not cost two API-server calls per request;
# 10 s bounds how long a revoked RoleBinding keeps working.
CACHE_SECONDS = 10.0
# The Host header a `--no-auth` API answers (its port aside): the names of 127.0.0.1 only.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def unauthorized(detail: str) -> ApiError:
    err = ApiError(401, "unauthorized", detail)
    return err


class Authenticator(Protocol):
    def authenticate(self, token: str | None) -> Caller: ...

    def authorize(self, caller: Caller, token: str | None, verb: str, namespace: str | None) -> None: ...


class NoAuth:
    def authenticate(self, token: str | None) -> Caller:
        return LOCAL_CALLER

    def authorize(self, caller: Caller, token: str | None, verb: str, namespace: str | None) -> None:
        return None


def ensure_token_file(path: Path) -> str:
    """Read the local token, creating it (mode 0600, in a 0700 directory) on first start."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)  # someone widened it: the token must stay private
        if token:
            return token
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC, 0o600)
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


class TokenAuth:
    def __init__(self, token: str):
        self.token = token

    def authenticate(self, token: str | None) -> Caller:
        if token is None:
            raise unauthorized("send the token from the API's token file as 'Authorization: Bearer <token>'")
        if not secrets.compare_digest(token.encode(), self.token.encode()):
            raise unauthorized("the bearer token does not match the API's token file")
        return LOCAL_CALLER

    def authorize(self, caller: Caller, token: str | None, verb: str, namespace: str | None) -> None:
        return None


def _digest(token: str) -> str:
    """Caches are keyed by a hash: the process never keeps a caller's token beyond the request."""
    return hashlib.sha256(token.encode()).hexdigest()


def _cluster_unavailable(what: str, err: Exception) -> ApiError:
    status = getattr(err, "status", None)
    why = f"{status} {getattr(err, 'reason', '')}".strip() if status else type(err).__name__
    return ApiError(503, "auth_unavailable", f"the Kubernetes API server could not {what} ({why}); retry later")


class KubernetesAuth:
    """TokenReview + SubjectAccessReview through the API server (needs RBAC to create both).

    Authentication and each (user, verb, namespace) decision are cached for CACHE_SECONDS;
    a failed review is never cached, and an API server that cannot be asked gives 503,
    not a 401/403 the caller would take for a verdict."""

    MAX_CACHED = 4096

    def __init__(self, api_client: Any, audience: str = "spillway"):
        from kubernetes import client

        self.audience = audience
        self.auth = client.AuthenticationV1Api(api_client)
        self.authz = client.AuthorizationV1Api(api_client)
        self._users: dict[str, tuple[float, Caller, dict[str, Any]]] = {}
        self._decisions: dict[tuple[str, str, str], tuple[float, bool, str]] = {}
        self._lock = threading.Lock()

    def _prune(self, now: float) -> None:
        """Drop expired entries once a cache grows past MAX_CACHED (called with the lock held)."""
        for cache in (self._users, self._decisions):
            if len(cache) > self.MAX_CACHED:
                for key in [k for k, v in cache.items() if now - v[0] >= CACHE_SECONDS]:
                    del cache[key]  # type: ignore[arg-type]
                if len(cache) > self.MAX_CACHED:
                    cache.clear()

    def authenticate(self, token: str | None) -> Caller:
        from kubernetes import client

        if not token:
            raise unauthorized("send a Kubernetes bearer token: 'Authorization: Bearer <token>'")
        key = _digest(token)
        now = time.monotonic()
        cached = self._users.get(key)
        if cached and now - cached[0] < CACHE_SECONDS:
            return cached[1]
        try:
            review = self.auth.create_token_review(
                client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[self.audience])))
        except Exception as err:  # ApiException, or the connection itself
            raise _cluster_unavailable("review the token", err) from None
        status = review.status
        # The API server answers with the audiences the token is valid for among those asked;
        # a token for any other audience (the API server's own) is not authenticated.
        if (not status or not status.authenticated or not status.user
                or self.audience not in (status.audiences or [])):
            raise unauthorized(f"the Kubernetes API server did not accept this token for audience "
                               f"{self.audience!r}: make one with `kubectl create token NAME --audience "
                               f"{self.audience}`")
        user = status.user
        caller = Caller(user.username or "", tuple(user.groups or ()))
        extra = {k: list(v) for k, v in (user.extra or {}).items()}
        with self._lock:
            self._users[key] = (now, caller, {"uid": user.uid, "extra": extra})
            self._prune(now)
        return caller

    def authorize(self, caller: Caller, token: str | None, verb: str, namespace: str | None) -> None:
        from kubernetes import client

        key = (caller.name + "|" + ",".join(caller.groups), verb, namespace or "")
        now = time.monotonic()
        cached = self._decisions.get(key)
        if cached is None or now - cached[0] >= CACHE_SECONDS:
            info = self._users.get(_digest(token) if token else "", (0.0, caller, {}))[2]
            try:
                review = self.authz.create_subject_access_review(client.V1SubjectAccessReview(
                    spec=client.V1SubjectAccessReviewSpec(
                        user=caller.name, groups=list(caller.groups), uid=info.get("uid"),
                        extra=info.get("extra") or None,
                        resource_attributes=client.V1ResourceAttributes(
                            group=API_GROUP, resource=RESOURCE, verb=verb, namespace=namespace),
                    )))
            except Exception as err:
                raise _cluster_unavailable("check access", err) from None
            allowed = bool(review.status and review.status.allowed)
            why = (review.status.reason or "") if review.status else ""
            cached = (now, allowed, why)
            with self._lock:
                self._decisions[key] = cached
                self._prune(now)
        if not cached[1]:
            where = f"in namespace {namespace!r}" if namespace else "cluster-wide"
            raise ApiError(403, "forbidden", f"{caller.name} may not {verb} {RESOURCE}.{API_GROUP} {where}; "
                           "ask for a RoleBinding that grants it")
