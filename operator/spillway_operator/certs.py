"""The admission webhook's serving certificate: made, shared by every replica, and
rotated by the operator itself, with no manual step and no cert-manager.

Where this sits: under `webhook` (which serves with what `CertKeeper.current` gives),
above `k8s`. The certificate and its key live in one Secret of the operator's namespace;
the ValidatingWebhookConfiguration's caBundle is what the API server trusts.

The certificate is self-signed and is its own CA (the API server verifies the chain
against caBundle; Go accepts a root that is also the leaf). Rotation never leaves the
API server without trust in what a replica serves: the new certificate is added to
caBundle *before* the Secret changes, and the old one stays in caBundle until the next
rotation. Replicas read the Secret on every check and serve what it holds.

Every replica runs the same check; two that rotate at once are serialised by the
Secret's resourceVersion (the loser reads the winner's certificate).
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
from dataclasses import dataclass
from typing import Protocol

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from spillway_operator import k8s

log = logging.getLogger(__name__)

CERT_KEY = "tls.crt"
KEY_KEY = "tls.key"


@dataclass(frozen=True)
class ServingCert:
    cert_pem: bytes
    key_pem: bytes

    @property
    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


def make_cert(dns_names: list[str], days: float, now: dt.datetime) -> ServingCert:
    """A self-signed ECDSA P-256 certificate for ``dns_names``, valid from a minute before
    ``now`` (clock skew between replicas and the API server) for ``days``."""
    key = ec.generate_private_key(ec.SECP256R1())
    # A name of its own per certificate: while the old and new one are both in caBundle, a
    # verifier looking for the issuer by name must not find the other one.
    serial = x509.random_serial_number()
    # The names are in subjectAltName (what verifiers check); a common name is at most 64
    # characters, which a Service's DNS name in a long namespace is not.
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spillway admission webhook"),
                      x509.NameAttribute(NameOID.SERIAL_NUMBER, f"{serial:x}")])
    key_id = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          crl_sign=False, encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(key_id, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(key_id), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return ServingCert(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def renewal_due(cert: x509.Certificate, dns_names: list[str], now: dt.datetime) -> str | None:
    """Why ``cert`` must be replaced now (None: it may stay): past two thirds of its
    lifetime (as cert-manager renews), or not naming every DNS name the Service has."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if now >= start + (end - start) * 2 / 3:
        return f"it expires at {end.isoformat()}"
    try:
        named = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                    .get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        named = set()
    missing = sorted(set(dns_names) - named)
    return f"it does not name {', '.join(missing)}" if missing else None


def service_dns_names(service: str, namespace: str) -> list[str]:
    """The names the API server may dial a webhook Service by."""
    return [f"{service}.{namespace}.svc", service, f"{service}.{namespace}", f"{service}.{namespace}.svc.cluster.local"]


def bundle(*pems: bytes) -> bytes:
    """A caBundle of these certificates, each once, expired ones dropped by the caller."""
    seen: list[bytes] = []
    for pem in pems:
        for block in _split(pem):
            if block not in seen:
                seen.append(block)
    return b"".join(seen)


def _split(pem: bytes) -> list[bytes]:
    end = b"-----END CERTIFICATE-----"
    return [block.strip() + b"\n" + end + b"\n" for block in pem.split(end) if block.strip()]


def unexpired(pem: bytes, now: dt.datetime) -> bytes:
    """The certificates of a bundle that are still valid at ``now``."""
    keep = [b for b in _split(pem) if x509.load_pem_x509_certificate(b).not_valid_after_utc > now]
    return b"".join(keep)


class TlsStore(Protocol):
    """Where the certificate is kept and who must trust it (the API server, in `KubeTlsStore`)."""

    def read_secret(self) -> tuple[dict[str, bytes], str] | None:
        """The Secret's data and resourceVersion; None when there is none."""

    def create_secret(self, data: dict[str, bytes]) -> bool:
        """False when another replica created it first."""

    def replace_secret(self, data: dict[str, bytes], resource_version: str) -> bool:
        """False when it changed since ``resource_version`` was read."""

    def ca_bundle(self) -> bytes:
        """The webhook configuration's caBundle (first webhook), b"" when unset."""

    def set_ca_bundle(self, pem: bytes) -> None:
        """Set caBundle on every webhook of the configuration."""


class CertKeeper:
    """Keeps the Secret holding a current certificate and caBundle trusting it."""

    def __init__(self, store: TlsStore, dns_names: list[str], days: float):
        self.store, self.dns_names, self.days = store, dns_names, days

    def current(self, now: dt.datetime | None = None) -> ServingCert:
        """The certificate to serve with: the Secret's, made or renewed first if due, and
        trusted by caBundle before this returns."""
        now = now or dt.datetime.now(dt.UTC)
        for _ in range(5):
            stored = self.store.read_secret()
            held = _held(stored[0]) if stored else None
            why = "there is none" if held is None else renewal_due(held.certificate, self.dns_names, now)
            if why is None and held is not None:
                self._trust(held, now)
                return held
            fresh = make_cert(self.dns_names, self.days, now)
            # Trusted before any replica can serve it; the old one stays trusted until the
            # replicas have moved over (they read the Secret on their next check).
            self._trust(fresh, now, also=held)
            data = {CERT_KEY: fresh.cert_pem, KEY_KEY: fresh.key_pem}
            won = self.store.create_secret(data) if stored is None else self.store.replace_secret(data, stored[1])
            if won:
                log.info("webhook serving certificate made: %s", why)
                return fresh
        raise RuntimeError("the webhook's certificate Secret kept changing under five attempts to renew it")

    def _trust(self, cert: ServingCert, now: dt.datetime, also: ServingCert | None = None) -> None:
        have = self.store.ca_bundle()
        if cert.cert_pem.strip() in have and (also is None or also.cert_pem.strip() in have):
            return
        keep = [cert.cert_pem] + ([also.cert_pem] if also else [])
        # The previous bundle's still-valid certificates stay too: a replica may serve one.
        self.store.set_ca_bundle(bundle(*keep, unexpired(have, now)))


def _held(data: dict[str, bytes]) -> ServingCert | None:
    cert, key = data.get(CERT_KEY), data.get(KEY_KEY)
    if not cert or not key:
        return None
    try:
        held = ServingCert(cert, key)
        _ = held.certificate
        serialization.load_pem_private_key(key, password=None)
    except ValueError:
        log.warning("the webhook's certificate Secret holds no valid certificate and key; making new ones")
        return None
    return held


class KubeTlsStore:
    """The Secret in the operator's namespace and the ValidatingWebhookConfiguration."""

    def __init__(self, namespace: str, secret: str, configuration: str):
        self.namespace, self.secret, self.configuration = namespace, secret, configuration

    def read_secret(self) -> tuple[dict[str, bytes], str] | None:
        found = k8s.read_secret(self.namespace, self.secret)
        if found is None:
            return None
        data = {k: base64.b64decode(v) for k, v in (found.get("data") or {}).items()}
        return data, found["metadata"]["resourceVersion"]

    def _body(self, data: dict[str, bytes], resource_version: str | None = None) -> dict[str, object]:
        # Owned by the webhook configuration, so `helm uninstall` (which deletes that) leaves
        # no Secret behind; a namespaced object may have a cluster-scoped owner.
        owner = k8s.read_webhook_configuration(self.configuration)["metadata"]
        metadata: dict[str, object] = {
            "name": self.secret, "namespace": self.namespace,
            "labels": {"app.kubernetes.io/component": "webhook"},
            "ownerReferences": [{"apiVersion": "admissionregistration.k8s.io/v1",
                                 "kind": "ValidatingWebhookConfiguration", "name": self.configuration,
                                 "uid": owner["uid"]}],
        }
        if resource_version:
            metadata["resourceVersion"] = resource_version
        return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls", "metadata": metadata,
                "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}

    def create_secret(self, data: dict[str, bytes]) -> bool:
        return k8s.create_if_absent(self._body(data)) is not None

    def replace_secret(self, data: dict[str, bytes], resource_version: str) -> bool:
        return k8s.replace_secret(self._body(data, resource_version))

    def ca_bundle(self) -> bytes:
        webhooks = k8s.read_webhook_configuration(self.configuration).get("webhooks") or [{}]
        encoded = (webhooks[0].get("clientConfig") or {}).get("caBundle") or ""
        return base64.b64decode(encoded)

    def set_ca_bundle(self, pem: bytes) -> None:
        k8s.set_webhook_ca_bundle(self.configuration, base64.b64encode(pem).decode())
