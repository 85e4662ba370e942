"""HTTPS for `spillway api`: a renewed certificate (a Secret that cert-manager or the
admin updates, which the kubelet swaps in place) is served to new connections without a
restart, the way the operator's webhook keeps its own (spillway_operator.webhook)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _stamp(*paths: Path) -> tuple[tuple[int, int], ...]:
    return tuple((p.stat().st_mtime_ns, p.stat().st_size) for p in paths)


def keep_certificate_current(server: Any, cert: Path, key: Path, every_seconds: float) -> threading.Thread:
    """Check ``cert`` and ``key`` every ``every_seconds``; when they changed, load them into
    the live TLS context of the uvicorn ``server`` (made at its start). A half-written pair
    fails to load: the served one stays, and the next check tries again."""
    served = _stamp(cert, key)

    def watch() -> None:
        nonlocal served
        while not server.should_exit:
            time.sleep(every_seconds)
            context = getattr(server.config, "ssl", None)
            try:
                now = _stamp(cert, key)
                if now != served and context is not None:
                    context.load_cert_chain(str(cert), str(key))
                    served = now
                    log.info("serving the renewed certificate %s", cert)
            except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
                log.warning("the certificate %s could not be loaded (%s); serving the previous one", cert, err)

    thread = threading.Thread(target=watch, name="tls-reload", daemon=True)
    thread.start()
    return thread
