"""The webhook's serving certificate: made once for all replicas, trusted before it is
served, renewed at two thirds of its life with the old one still trusted, and a race
between two replicas renewing at once ends with both serving the winner's."""

from __future__ import annotations

import datetime as dt

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from spillway_operator.certs import CERT_KEY, CertKeeper, _split, make_cert, renewal_due, service_dns_names
from tests.unit.operator.fake_tls_store import FakeTlsStore

NAMES = service_dns_names("spillway-operator-webhook", "spillway-system")
T0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def _serials(pem: bytes) -> list[int]:
    return [x509.load_pem_x509_certificate(block).serial_number for block in _split(pem)]


def test_a_made_certificate_names_the_service_and_is_its_own_authority() -> None:
    made = make_cert(NAMES, 365, T0)
    cert = made.certificate
    assert NAMES[0] == "spillway-operator-webhook.spillway-system.svc"
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == NAMES
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.not_valid_after_utc == T0 + dt.timedelta(days=365)
    assert cert.not_valid_before_utc == T0 - dt.timedelta(minutes=1)
    key = serialization.load_pem_private_key(made.key_pem, password=None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    cert.verify_directly_issued_by(cert)


def test_a_namespace_of_the_longest_name_kubernetes_allows_gets_a_certificate() -> None:
    # Found in a real pod: the chart in a 63-character namespace, whose Service DNS name
    # exceeds the 64 characters a common name may have; the operator crashed at start.
    names = service_dns_names("r5a0d6b-spillway-operator-webhook", "n" * 63)
    cert = make_cert(names, 365, T0).certificate
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == names


def test_renewal_is_due_at_two_thirds_of_the_lifetime_or_when_a_name_is_missing() -> None:
    cert = make_cert(NAMES, 300, T0).certificate
    two_thirds = T0 - dt.timedelta(minutes=1) + (dt.timedelta(days=300, minutes=1)) * 2 / 3
    assert renewal_due(cert, NAMES, two_thirds - dt.timedelta(seconds=1)) is None
    assert "expires" in (renewal_due(cert, NAMES, two_thirds) or "")
    other = service_dns_names("other", "spillway-system")
    assert renewal_due(cert, other, T0) == f"it does not name {', '.join(sorted(other))}"


def test_the_first_replica_makes_it_and_the_second_serves_the_same() -> None:
    store = FakeTlsStore()
    first = CertKeeper(store, NAMES, 365).current(T0)
    assert store.secret == {CERT_KEY: first.cert_pem, "tls.key": first.key_pem}
    assert store.bundle == first.cert_pem
    second = CertKeeper(store, NAMES, 365).current(T0 + dt.timedelta(hours=1))
    assert second == first
    assert (store.secret_writes, store.bundle_writes) == (1, 1)


def test_a_renewal_is_trusted_before_it_is_served_and_the_old_one_stays_trusted() -> None:
    store = FakeTlsStore()
    keeper = CertKeeper(store, NAMES, 365)
    old = keeper.current(T0)
    trusted_when_written: list[list[int]] = []
    store.before_write = lambda: trusted_when_written.append(_serials(store.bundle))
    new = keeper.current(T0 + dt.timedelta(days=244))
    assert new != old
    assert trusted_when_written == [[new.certificate.serial_number, old.certificate.serial_number]]
    assert _serials(store.bundle) == [new.certificate.serial_number, old.certificate.serial_number]
    # The next renewal, after the first certificate has expired, drops it from the bundle.
    newer = keeper.current(T0 + dt.timedelta(days=244 + 244))
    assert _serials(store.bundle) == [newer.certificate.serial_number, new.certificate.serial_number]


def test_two_replicas_renewing_at_once_both_end_up_with_the_winners_certificate() -> None:
    store = FakeTlsStore()
    CertKeeper(store, NAMES, 365).current(T0)
    later = T0 + dt.timedelta(days=250)
    winner = CertKeeper(store, NAMES, 365)
    loser = CertKeeper(store, NAMES, 365)
    won: list[object] = []

    def other_replica_first() -> None:
        if not won:
            store.before_write = lambda: None
            won.append(winner.current(later))

    store.before_write = other_replica_first
    got = loser.current(later)
    assert got == won[0]
    assert got.certificate.serial_number in _serials(store.bundle)
    assert store.secret is not None and store.secret[CERT_KEY] == got.cert_pem


def test_a_secret_without_a_usable_key_is_replaced() -> None:
    store = FakeTlsStore()
    store.secret, store.version = {CERT_KEY: b"not a certificate", "tls.key": b"nor a key"}, 7
    made = CertKeeper(store, NAMES, 365).current(T0)
    assert store.secret == {CERT_KEY: made.cert_pem, "tls.key": made.key_pem} and store.version == 8
