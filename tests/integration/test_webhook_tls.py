"""The webhook over real TLS, checked as the API server checks it: the certificate chain
against the caBundle the operator keeps, the hostname against the Service's DNS name.
A renewed certificate is served to new connections without a restart, and the old
bundle's trust is kept until the next renewal."""

from __future__ import annotations

import datetime as dt
import http.client
import json
import socket
import ssl
from typing import Any

import pytest

from spillway_operator.certs import CERT_KEY, KEY_KEY, CertKeeper, ServingCert, bundle, make_cert, service_dns_names
from spillway_operator.webhook import PATH, WebhookServer
from tests.bad_jobs import with_
from tests.polling import wait_for
from tests.unit.operator.fake_tls_store import FakeTlsStore

NAMES = service_dns_names("spillway-operator-webhook", "spillway-system")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Connection(http.client.HTTPSConnection):
    """HTTPS to 127.0.0.1, verified as if dialled by the Service's name (as the API server does)."""

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=10)
        self.sock = self._context.wrap_socket(sock, server_hostname=NAMES[0])  # type: ignore[attr-defined]


def _post(port: int, trusted: bytes, body: dict[str, Any]) -> tuple[int, dict[str, Any], bytes]:
    context = ssl.create_default_context(cadata=trusted.decode())
    conn = _Connection("127.0.0.1", port, context=context, timeout=10)
    try:
        conn.request("POST", PATH, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        peer = ssl.DER_cert_to_PEM_cert(conn.sock.getpeercert(binary_form=True)).encode()  # type: ignore[union-attr]
        return response.status, json.loads(response.read()), peer
    finally:
        conn.close()


@pytest.fixture()
def server() -> Any:
    store = FakeTlsStore()
    webhook = WebhookServer(CertKeeper(store, NAMES, 365), _free_port(), host="127.0.0.1", check_seconds=3600)
    webhook.start()

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", webhook.port), timeout=1).close()
            return True
        except OSError:
            return False

    wait_for(listening, 60, what="the webhook listening")
    yield webhook, store
    webhook.shutdown()


def _bad_review() -> dict[str, Any]:
    job = {**with_("model.uri", "gs://bucket/llama"), "metadata": {"name": "bad"}}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u1", "operation": "CREATE", "object": job}}


def _hold(store: FakeTlsStore, made: ServingCert) -> None:
    """What another replica leaves: its certificate in the Secret, trusted by the bundle."""
    store.secret, store.version = {CERT_KEY: made.cert_pem, KEY_KEY: made.key_pem}, store.version + 1
    store.bundle = bundle(made.cert_pem, store.bundle)


def test_the_api_servers_view_denial_over_tls_and_a_renewal_without_restart(server: Any) -> None:
    webhook, store = server
    status, answer, served = _post(webhook.port, store.bundle, _bad_review())
    assert status == 200 and answer["response"]["allowed"] is False
    assert "spec.model.uri: unsupported URI scheme 'gs'" in answer["response"]["status"]["message"]
    assert served.strip() in store.bundle
    now = dt.datetime.now(dt.UTC)

    # Another replica renewed: this one serves what the Secret holds from its next check on.
    other = make_cert(NAMES, 365, now - dt.timedelta(days=10))
    _hold(store, other)
    assert webhook.check() is True
    assert _post(webhook.port, store.bundle, _bad_review())[2] == other.cert_pem
    assert webhook.check() is False

    # The Secret's certificate is past two thirds of its life: this replica renews it, and
    # new connections get the new one without a restart, trusted by the new bundle only.
    aging = make_cert(NAMES, 365, now - dt.timedelta(days=250))
    _hold(store, aging)
    before = store.bundle
    assert webhook.check() is True
    status, answer, renewed = _post(webhook.port, store.bundle, _bad_review())
    assert status == 200 and answer["response"]["allowed"] is False
    assert renewed not in (served, other.cert_pem, aging.cert_pem) and renewed.strip() in store.bundle
    assert aging.cert_pem.strip() in store.bundle  # a replica not yet moved over is still trusted
    with pytest.raises(ssl.SSLCertVerificationError):
        _post(webhook.port, before, _bad_review())


def test_a_body_that_is_no_admission_review_is_a_400(server: Any) -> None:
    webhook, store = server
    status, answer, _ = _post(webhook.port, store.bundle, {"kind": "Pod"})
    assert status == 400 and "AdmissionReview" in answer["detail"]


def test_a_client_that_does_not_trust_the_bundle_is_refused(server: Any) -> None:
    webhook, _ = server
    other = CertKeeper(FakeTlsStore(), NAMES, 365).current()
    with pytest.raises(ssl.SSLCertVerificationError):
        _post(webhook.port, other.cert_pem, _bad_review())
