"""A real Kueue for the e2e tests: its manager (`hack/cluster build` builds it from the Go
module proxy, with the CRDs and webhook configurations of the same version) run against
the e2e control plane, inside the cluster's network namespace. Tests ask for the `kueue`
fixture (tests/e2e/conftest.py): one manager for the session.

Kueue manages Workloads and its own kinds only: Spillway's FineTuneJob is declared an
external framework (the operator makes its Workloads), batch Jobs stay Kueue's default
framework (it refuses an empty list) but their webhooks are not registered and no Job
without the queue-name label is touched. The webhooks reach the manager at
https://127.0.0.1:<port> with a throwaway CA; the manager's metrics serve a certificate
it can only read from /etc/kueue/metrics/certs, which it finds in a mount namespace of
its own (a bind mount over an empty /etc/kueue)."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import ipaddress
import json
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.e2e.cluster import HACK_CLUSTER, Cluster
from tests.e2e.operator_fixtures import free_port
from tests.integration.storage_fixtures import serving

GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta2"
# Kueue's own namespace: its default, made if missing (it holds nothing here).
KUEUE_NAMESPACE = "kueue-system"
# `Kind.version.group`, as Kueue's integrations.externalFrameworks wants it (crds/).
FINETUNEJOB_FRAMEWORK = "FineTuneJob.v1alpha1.spillway.dev"
# The loaded 2-core machine: the manager's start, CRD establishment, the first webhook call.
START_TIMEOUT_S = 120
# Where the manager reads its metrics certificate (hard-coded in cmd/kueue/main.go when
# internal cert management is off).
METRICS_CERT_MOUNT = Path("/etc/kueue")
# Every object a fixture made carries this label, so teardown finds what a helper made.
CREATED_BY = "spillway.dev/e2e-kueue"


def kueue_bin_dir() -> Path:
    """$KUEUE_BIN: the manager, crds/ and webhook.yaml."""
    out = subprocess.run([str(HACK_CLUSTER), "bin-path", "kueue"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()).parent


# ------------------------------------------------------------------ certificates --


def _write_certs(cert_dir: Path, metrics_dir: Path) -> bytes:
    """A throwaway CA and, signed by it, a serving certificate for 127.0.0.1 (an IP SAN),
    written as tls.crt/tls.key into both dirs; returns the CA's PEM (the caBundle)."""
    now = dt.datetime.now(dt.UTC)

    def build(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None,
              signer: ec.EllipticCurvePrivateKey | None, ca: bool) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(signer or key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build("spillway e2e kueue CA", ca_key, None, None, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = build("kueue webhook", key, ca.subject, ca_key, ca=False)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    for d in (cert_dir, metrics_dir):
        d.mkdir(parents=True, exist_ok=True)
        (d / "tls.crt").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
        (d / "tls.key").write_bytes(key_pem)
    return ca.public_bytes(serialization.Encoding.PEM)


# ----------------------------------------------------------------- configuration --


@dataclass(frozen=True)
class Ports:
    webhook: int
    metrics: int
    health: int


def configuration(ports: Ports, cert_dir: Path) -> dict[str, Any]:
    """Kueue's config.kueue.x-k8s.io/v1beta2 Configuration (apis/config/v1beta2)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        # Off: it would make a Secret and a webhook Service the API server cannot reach.
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": ports.webhook, "certDir": str(cert_dir)},
        "metrics": {"bindAddress": f"127.0.0.1:{ports.metrics}"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports.health}"},
        "leaderElection": {"leaderElect": False},
        "manageJobsWithoutQueueName": False,
        # An empty list means the default, batch/job: kept, with its webhooks unregistered.
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [FINETUNEJOB_FRAMEWORK]},
        # Its API would need an APIService and a Service the API server reaches; unused.
        "featureGates": {"VisibilityOnDemand": False},
    }


def own_webhooks(manifests: str, port: int, ca_bundle: bytes, suffix: str) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, kept to those of its own kinds (kueue.x-k8s.io), each
    calling the manager at https://127.0.0.1:<port><path>; renamed with ``suffix``."""
    configs = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        kept = []
        for hook in doc.get("webhooks") or []:
            if not all(rule.get("apiGroups") == [GROUP] for rule in hook.get("rules") or []):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                    "caBundle": base64.b64encode(ca_bundle).decode()}
            kept.append(hook)
        doc["metadata"] = {"name": f"kueue-{doc['metadata']['name']}-{suffix}", "labels": {CREATED_BY: "true"}}
        doc["webhooks"] = kept
        configs.append(doc)
    return configs


# ----------------------------------------------------------------------- objects --


@dataclass
class Kueue:
    """A running Kueue manager and helpers that make its objects (cleaned up at the end)."""

    cluster: Cluster
    log: Path
    made: list[tuple[str, str]] = field(default_factory=list)  # (resource, name), cluster-scoped

    def _create(self, kind: str, name: str, spec: dict[str, Any], namespace: str | None = None,
                annotations: dict[str, str] | None = None) -> str:
        meta: dict[str, Any] = {"name": name, "labels": {CREATED_BY: "true"}}
        if annotations:
            meta["annotations"] = annotations
        if namespace:
            meta["namespace"] = namespace
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(
            {"apiVersion": API_VERSION, "kind": kind, "metadata": meta, "spec": spec}))
        if namespace is None:
            self.made.append((f"{kind.lower()}s.{GROUP}", name))
        return name

    def flavor(self, name: str, node_labels: dict[str, str] | None = None,
               tolerations: list[dict[str, Any]] | None = None, annotations: dict[str, str] | None = None) -> str:
        """A ResourceFlavor whose workloads go to nodes with ``node_labels``."""
        spec: dict[str, Any] = {}
        if node_labels:
            spec["nodeLabels"] = node_labels
        if tolerations:
            spec["tolerations"] = tolerations
        return self._create("ResourceFlavor", name, spec, annotations=annotations)

    def cluster_queue(self, name: str, flavor_quotas: dict[str, dict[str, str]],
                      preemption: dict[str, Any] | None = None,
                      namespace_selector: dict[str, Any] | None = None) -> str:
        """A ClusterQueue with one resource group: flavour -> {resource: nominal quota}, in
        the order given (Kueue tries flavours in order). A resource a flavour does not name
        gets quota 0 there (Kueue wants every flavour of a group to cover the same ones).
        ``namespace_selector`` defaults to every namespace ({}; Kueue's null is none)."""
        covered = sorted({r for quotas in flavor_quotas.values() for r in quotas})
        spec: dict[str, Any] = {
            "namespaceSelector": {} if namespace_selector is None else namespace_selector,
            "resourceGroups": [{
                "coveredResources": covered,
                "flavors": [{"name": flv, "resources": [{"name": r, "nominalQuota": quotas.get(r, "0")}
                                                         for r in covered]}
                            for flv, quotas in flavor_quotas.items()],
            }],
        }
        if preemption is not None:
            spec["preemption"] = preemption
        return self._create("ClusterQueue", name, spec)

    def local_queue(self, namespace: str, name: str, cluster_queue: str) -> str:
        """A LocalQueue (deleted with its namespace)."""
        return self._create("LocalQueue", name, {"clusterQueue": cluster_queue}, namespace)

    def priority_class(self, name: str, value: int) -> str:
        """A WorkloadPriorityClass."""
        meta = {"name": name, "labels": {CREATED_BY: "true"}}
        self.cluster.kubectl("create", "-f", "-", input=json.dumps(
            {"apiVersion": API_VERSION, "kind": "WorkloadPriorityClass", "metadata": meta, "value": value}))
        self.made.append((f"workloadpriorityclasses.{GROUP}", name))
        return name

    def workloads(self, namespace: str) -> list[dict[str, Any]]:
        data = self.cluster.kubectl_json("get", f"workloads.{GROUP}", "-n", namespace)
        return list(data.get("items", []))

    def delete_made(self, timeout: float = 30) -> None:
        """Delete what the helpers made and wait (up to ``timeout``) until it is gone: Kueue's
        finalizers hold a ClusterQueue until its admitted Workloads are gone, and a
        flavour until no ClusterQueue names it; only a running manager lets go of them."""
        order = {"clusterqueues": 0, "resourceflavors": 1}
        made = [f"{resource}/{name}" for resource, name in
                sorted(reversed(self.made), key=lambda m: order.get(m[0].split(".")[0], 2))]
        self.made.clear()
        if not made:
            return
        self.cluster.kubectl("delete", *made, "--ignore-not-found", "--wait=false", check=False)
        self.cluster.kubectl("wait", "--for=delete", f"--timeout={timeout:.0f}s", *made, check=False,
                             timeout=timeout + 10)


# ------------------------------------------------------------------------ running --


def _install_crds(cluster: Cluster, crds: Path) -> None:
    # Server-side: the Workload CRD is over the 256 KiB a client-side apply annotation holds.
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crds), timeout=120)
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=120s",
                    *[f"crd/{p.stem.split('_', 1)[1]}.{GROUP}" for p in sorted(crds.glob("*.yaml"))], timeout=130)


def _answers(cluster: Cluster, health_port: int) -> bool:
    """Ready (its webhook server listens) and a ResourceFlavor passes its webhooks."""
    netns = cluster.settings()["NETNS"]
    probe = subprocess.run(["nsenter", f"--net=/run/netns/{netns}", "--", "curl", "-fsS", "-m", "5",
                            f"http://127.0.0.1:{health_port}/readyz"], capture_output=True, check=False)
    if probe.returncode != 0:
        return False
    flavor = {"apiVersion": API_VERSION, "kind": "ResourceFlavor",
              "metadata": {"name": f"e2e-probe-{secrets.token_hex(3)}"}}
    dry = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(flavor), check=False)
    return dry.returncode == 0


def _manager_command(cluster: Cluster, binary: Path, config: Path, etc_kueue: Path) -> list[str]:
    netns = cluster.settings()["NETNS"]
    # A private mount namespace: /etc/kueue (an empty mount point on this machine) shows
    # this run's metrics certificate to this manager only.
    mount_and_run = 'mount --bind "$0" /etc/kueue && exec "$@"'
    return ["nsenter", f"--net=/run/netns/{netns}", "--",
            "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", mount_and_run, str(etc_kueue),
            str(binary), f"--config={config}", f"--kubeconfig={cluster.kubeconfig}", "--zap-log-level=2"]


@contextlib.contextmanager
def running_kueue(cluster: Cluster, work: Path) -> Iterator[Kueue]:
    """Kueue's CRDs (left installed), its webhooks (removed at the end) and its manager
    (stopped at the end), with the cluster-scoped objects the helpers made deleted."""
    bins = kueue_bin_dir()
    _install_crds(cluster, bins / "crds")
    cluster.kubectl("create", "namespace", KUEUE_NAMESPACE, check=False)

    ports = Ports(webhook=free_port(), metrics=free_port(), health=free_port())
    cert_dir, etc_kueue = work / "certs", work / "etc-kueue"
    ca_bundle = _write_certs(cert_dir, etc_kueue / "metrics" / "certs")
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(configuration(ports, cert_dir)))
    METRICS_CERT_MOUNT.mkdir(exist_ok=True)

    webhooks = own_webhooks((bins / "webhook.yaml").read_text(), ports.webhook, ca_bundle, secrets.token_hex(3))
    log = work / "kueue.log"
    command = _manager_command(cluster, bins / "kueue", config, etc_kueue)
    k = Kueue(cluster, log)
    registered = [f"{hook['kind'].lower()}/{hook['metadata']['name']}" for hook in webhooks]

    def unregister() -> None:
        # With the manager gone, a webhook left behind would refuse every Kueue object.
        if registered:
            cluster.kubectl("delete", *registered, "--ignore-not-found", check=False)
            registered.clear()

    try:
        for hook in webhooks:
            cluster.kubectl("create", "-f", "-", input=json.dumps(hook))
        with serving(command, log, lambda: _answers(cluster, ports.health), "kueue manager",
                     timeout=START_TIMEOUT_S, grace=10):
            try:
                yield k
            finally:
                k.delete_made()
                unregister()  # before the manager stops: no moment with a dead webhook
    finally:
        unregister()


