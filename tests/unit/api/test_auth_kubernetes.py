"""KubernetesAuth without a cluster: what it decides before asking, and what it answers when
the API server cannot be asked (a real client against a closed port; no fakes). The reviews
themselves are tested against the real control plane in tests/e2e/test_api_cluster.py."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from spillway_api.auth import KubernetesAuth
from spillway_api.errors import ApiError
from spillway_api.service import Caller


@pytest.fixture
def unreachable() -> Iterator[Any]:
    from kubernetes import client

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = client.Configuration(host=f"https://127.0.0.1:{port}")
    config.verify_ssl = False
    config.retries = 0
    api = client.ApiClient(config)
    try:
        yield api
    finally:
        api.close()


@pytest.mark.parametrize("token", [None, ""])
def test_no_token_is_401_without_asking_the_api_server(unreachable: Any, token: str | None) -> None:
    with pytest.raises(ApiError) as err:
        KubernetesAuth(unreachable).authenticate(token)
    assert (err.value.status, err.value.code) == (401, "unauthorized")  # not 503: nothing was asked


def test_unreachable_api_server_is_503_not_a_verdict(unreachable: Any) -> None:
    auth = KubernetesAuth(unreachable)
    with pytest.raises(ApiError) as err:
        auth.authenticate("some-token")
    assert (err.value.status, err.value.code) == (503, "auth_unavailable")
    with pytest.raises(ApiError) as err:
        auth.authorize(Caller("alice", ("team",)), "some-token", "get", "team-a")
    assert (err.value.status, err.value.code) == (503, "auth_unavailable")
    # Failures are not cached: nothing was remembered about the token or the decision.
    assert not auth._users and not auth._decisions
