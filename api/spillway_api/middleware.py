"""ASGI middleware: refuse oversized bodies before any handler reads them; count requests for /metrics."""

from __future__ import annotations

import json
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _problem(status: int, code: str, detail: str) -> bytes:
    return json.dumps({"status": status, "code": code, "detail": detail}).encode()


class BodySizeLimit:
    """413 for a body above `max_bytes`, by Content-Length or, when chunked, as it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                await self._refuse(send, 400, "bad_content_length", "Content-Length is not a number")
                return
            if too_big:
                await self._refuse(send, 413, "body_too_large",
                                   f"the request body exceeds {self.max_bytes} bytes; a FineTuneJob is a few KiB")
                return
        # Read the whole body first (it is at most max_bytes), so a chunked body that grows too large
        # is refused before any handler has seen a byte of it.
        chunks: list[bytes] = []
        received = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)  # disconnect: let the app see it
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                await self._refuse(send, 413, "body_too_large", f"the request body exceeds {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send: Send, status: int, code: str, detail: str) -> None:
        body = _problem(status, code, detail)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class Metrics:
    """Request count and latency per route template (not per URL, which would explode the series)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("spillway_api_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("spillway_api_request_seconds", "HTTP request latency", ["method", "route"],
                                 registry=self.registry)
        self.events = Counter("spillway_api_events_recorded", "Runtime events and watch changes recorded",
                              ["source"], registry=self.registry)


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route: Any = scope.get("route")
            template = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(scope["method"], template, str(status)).inc()
            self.metrics.latency.labels(scope["method"], template).observe(time.perf_counter() - start)
