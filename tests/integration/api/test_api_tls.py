"""`spillway api` over HTTPS (SPILLWAY_TLS_CERT_FILE / _KEY_FILE, the chart's api.tls):
a client that trusts the certificate gets answers, plain HTTP gets none, and a renewed
certificate written over the files (as the kubelet swaps a renewed Secret in place) is
served to new connections without a restart."""

from __future__ import annotations

import datetime as dt
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from spillway_operator.certs import ServingCert, make_cert
from tests.polling import wait_for

from .servers import free_port

NAMES = ["localhost", "spillway-api.spillway-system.svc"]


def _write(directory: Path, cert: ServingCert) -> None:
    """Both files replaced by a rename each, as the kubelet's atomic writer swaps a Secret."""
    for name, data in (("tls.key", cert.key_pem), ("tls.crt", cert.cert_pem)):
        tmp = directory / f".{name}.new"
        tmp.write_bytes(data)
        tmp.replace(directory / name)


def _served(port: int, trusted: list[ServingCert]) -> bytes:
    """The certificate a new connection to the API gets, verified against `trusted`."""
    context = ssl.create_default_context(cadata="".join(c.cert_pem.decode() for c in trusted))
    with socket.create_connection(("localhost", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        return ssl.DER_cert_to_PEM_cert(tls.getpeercert(binary_form=True)).encode()  # type: ignore[arg-type]


@pytest.fixture
def tls_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "tls"
    directory.mkdir()
    return directory


@pytest.fixture
def api(tmp_path: Path, tls_dir: Path) -> Iterator[tuple[int, ServingCert]]:
    first = make_cert(NAMES, 30, dt.datetime.now(dt.UTC))
    _write(tls_dir, first)
    port = free_port()
    env = {**os.environ, "SPILLWAY_DATABASE_URL": f"sqlite:///{tmp_path / 'api.db'}",
           "SPILLWAY_DATA_DIR": str(tmp_path / "data"), "SPILLWAY_TLS_CERT_FILE": str(tls_dir / "tls.crt"),
           "SPILLWAY_TLS_KEY_FILE": str(tls_dir / "tls.key"), "SPILLWAY_TLS_RELOAD_SECONDS": "0.5"}
    log = (tmp_path / "api.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "spillway_api.cli", "api", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"spillway api exited {proc.returncode}:\n{(tmp_path / 'api.log').read_text()}")
        try:
            _served(port, [first])
            return True
        except OSError:
            return False

    try:
        wait_for(up, 60, "spillway api answering over TLS")
        yield port, first
    finally:
        proc.terminate()
        proc.wait(20)


def test_the_api_serves_https_and_a_renewed_certificate_without_a_restart(
        api: tuple[int, ServingCert], tls_dir: Path) -> None:
    port, first = api
    context = ssl.create_default_context(cadata=first.cert_pem.decode())
    with httpx.Client(verify=context, timeout=10) as client:
        assert client.get(f"https://localhost:{port}/healthz").json()["status"] == "ok"
    with pytest.raises(httpx.HTTPError):  # no plain HTTP beside it
        httpx.get(f"http://localhost:{port}/healthz", timeout=5).raise_for_status()
    with pytest.raises(ssl.SSLCertVerificationError):  # nor a certificate the client does not trust
        _served(port, [make_cert(NAMES, 30, dt.datetime.now(dt.UTC))])
    assert _served(port, [first]).strip() == first.cert_pem.strip()

    renewed = make_cert(NAMES, 30, dt.datetime.now(dt.UTC))
    _write(tls_dir, renewed)
    wait_for(lambda: _served(port, [first, renewed]).strip() == renewed.cert_pem.strip(), 30,
             "the renewed certificate served")
    with httpx.Client(verify=ssl.create_default_context(cadata=renewed.cert_pem.decode()), timeout=10) as client:
        assert client.get(f"https://localhost:{port}/healthz").status_code == 200


def test_a_certificate_without_its_key_is_refused_at_start(tmp_path: Path, tls_dir: Path) -> None:
    _write(tls_dir, make_cert(NAMES, 30, dt.datetime.now(dt.UTC)))
    env = {**os.environ, "SPILLWAY_DATABASE_URL": f"sqlite:///{tmp_path / 'api.db'}",
           "SPILLWAY_DATA_DIR": str(tmp_path / "data"), "SPILLWAY_TLS_CERT_FILE": str(tls_dir / "tls.crt")}
    env.pop("SPILLWAY_TLS_KEY_FILE", None)
    done = subprocess.run([sys.executable, "-m", "spillway_api.cli", "api", "--port", str(free_port())], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "SPILLWAY_TLS_KEY_FILE" in done.stderr, done.stderr
