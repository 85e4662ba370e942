"""The validating admission webhook: `kubectl apply` of a FineTuneJob that `spillway run`
would refuse is refused by the API server, with the same field-named messages.

Where this sits: beside the reconciler, above `admission` (the checks) and `certs` (the
serving certificate). Every operator replica serves it, leader or not (the Service
routes to any Ready replica), on its own HTTPS port: `serve` starts it in a thread
before the replica waits for the lease.

What the API server sends: an AdmissionReview (admission.k8s.io/v1) for each CREATE and
each UPDATE that changes the spec (the chart's matchConditions leave out the operator's
and kopf's own metadata patches, and the status subresource is not matched at all).

When the webhook is down the chart's failurePolicy decides; see charts/spillway/README.md.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import ssl
import tempfile
import threading
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from spillway_operator.admission import problems
from spillway_operator.certs import CertKeeper, ServingCert

log = logging.getLogger(__name__)

PATH = "/validate-finetunejob"
_MAX_MESSAGE = 4000  # the API server truncates long denial messages; keep every line readable
# An AdmissionReview holds the job and, on an update, the stored one: etcd keeps objects
# under 1.5 MiB, so 4 MiB is room for both; anything larger is not from the API server.
MAX_BODY_BYTES = 4 << 20


def review(body: dict[str, Any]) -> dict[str, Any]:
    """The AdmissionReview answering ``body``'s request: allowed, or denied with one line
    per problem, each naming the field to change."""
    request = body.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    answer = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
    job = request.get("object") or {}
    old = request.get("oldObject") if request.get("operation") == "UPDATE" else None
    if old is not None and (old.get("spec") == job.get("spec") or job.get("metadata", {}).get("deletionTimestamp")):
        return answer  # a metadata change, or a job on its way out: nothing of the spec to judge
    found = problems(job, old)
    if found:
        name = (job.get("metadata") or {}).get("name") or "(generated name)"
        message = f"FineTuneJob {name!r} is invalid:\n" + "\n".join(f"- {line}" for line in found)
        response.update(allowed=False, status={
            "code": 422, "reason": "Invalid",
            "message": message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "...",
        })
    return answer


def create_app() -> FastAPI:
    """The ASGI app: POST `PATH` (AdmissionReview), GET /readyz."""
    app = FastAPI(title="spillway admission webhook", openapi_url=None, docs_url=None, redoc_url=None)

    @app.post(PATH)
    async def validate(request: Request) -> JSONResponse:
        too_large = JSONResponse({"detail": f"the body exceeds {MAX_BODY_BYTES} bytes: an AdmissionReview of a "
                                  "FineTuneJob is far smaller"}, status_code=413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return too_large
        chunks, received = [], 0
        async for chunk in request.stream():  # a chunked body is cut off as it grows, not after
            received += len(chunk)
            if received > MAX_BODY_BYTES:
                return too_large
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except ValueError:
            return JSONResponse({"detail": "the body is not JSON: send an admission.k8s.io/v1 AdmissionReview"},
                                status_code=400)
        if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
            return JSONResponse({"detail": "no .request: send an admission.k8s.io/v1 AdmissionReview"},
                                status_code=400)
        return JSONResponse(review(body))

    @app.get("/readyz")
    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    return app


class WebhookServer:
    """uvicorn over TLS in a daemon thread, serving with what a `CertKeeper` keeps; a
    changed certificate is loaded into the live TLS context, so new connections use it
    without a restart."""

    def __init__(self, keeper: CertKeeper, port: int, host: str = "0.0.0.0", check_seconds: float = 3600.0):
        self.keeper, self.port, self.host, self.check_seconds = keeper, port, host, check_seconds
        self._dir = Path(tempfile.mkdtemp(prefix="spillway-webhook-"))
        self._serving: ServingCert | None = None
        self._server: Any = None
        self.stop = threading.Event()

    def _write(self, cert: ServingCert) -> tuple[Path, Path]:
        cert_file, key_file = self._dir / "tls.crt", self._dir / "tls.key"
        key_file.touch(mode=0o600)
        key_file.write_bytes(cert.key_pem)
        cert_file.write_bytes(cert.cert_pem)
        return cert_file, key_file

    def start(self) -> None:
        """Make or read the certificate (and have the API server trust it), then serve."""
        import uvicorn

        self._serving = self.keeper.current()
        cert_file, key_file = self._write(self._serving)
        config = uvicorn.Config(create_app(), host=self.host, port=self.port, ssl_certfile=str(cert_file),
                                ssl_keyfile=str(key_file), log_level="warning", access_log=False,
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the operator's main thread owns signals
        threading.Thread(target=self._server.run, name="webhook", daemon=True).start()
        threading.Thread(target=self._keep_current, name="webhook-cert", daemon=True).start()
        log.info("admission webhook serving on https://%s:%d%s", self.host, self.port, PATH)

    def check(self, now: dt.datetime | None = None) -> bool:
        """Renew or reload the certificate if it changed; True when the served one changed."""
        cert = self.keeper.current(now)
        if cert == self._serving:
            return False
        cert_file, key_file = self._write(cert)
        context: ssl.SSLContext | None = getattr(getattr(self._server, "config", None), "ssl", None)
        if context is not None:
            context.load_cert_chain(str(cert_file), str(key_file))
        self._serving = cert
        log.info("admission webhook now serves certificate %x", cert.certificate.serial_number)
        return True

    def _keep_current(self) -> None:
        while not self.stop.wait(self.check_seconds):
            try:
                self.check()
            except Exception:  # an API server hiccup: the served certificate stays, try again later
                log.exception("checking the webhook's certificate failed; retrying in %.0f s", self.check_seconds)

    def shutdown(self) -> None:
        self.stop.set()
        if self._server is not None:
            self._server.should_exit = True
