"""The FastAPI application: settings, database, launchers and routes put together.

`create_app(settings)` is what `spillway api` serves and the tests call. The schema
is migrated at startup; in kubernetes mode a watch records FineTuneJob changes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from starlette.middleware.trustedhost import TrustedHostMiddleware

from spillway_api import errors
from spillway_api.auth import LOOPBACK_HOSTS, KubernetesAuth, NoAuth, TokenAuth, ensure_token_file
from spillway_api.db import make_engine, make_sessionmaker, migrate
from spillway_api.deps import reject_unknown_query
from spillway_api.launchers.local import LocalLauncher, end_orphaned_runs
from spillway_api.middleware import BodySizeLimit, Metrics, MetricsMiddleware
from spillway_api.routes import cost, dashboard, health, jobs, plan
from spillway_api.settings import Settings, get_settings


def create_app(settings: Settings | None = None, *, kube_api_client: Any = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        migrate(app.state.engine)
        end_orphaned_runs(app.state.sessions, settings.local_price_per_hour)
        watch = None
        if app.state.kube is not None and settings.kube_watch:
            from spillway_api.launchers.kubernetes import FineTuneJobWatch

            watch = FineTuneJobWatch(app.state.kube, app.state.sessions, settings)
            watch.start()
        try:
            yield
        finally:
            if watch is not None:
                watch.stop()
            app.state.launchers["local"].shutdown()
            app.state.engine.dispose()

    app = FastAPI(title="Spillway", version="v1", lifespan=lifespan, dependencies=[Depends(reject_unknown_query)],
                  description="Fine-tuning jobs that spill training state to CPU RAM and NVMe: submit, watch, "
                  "roll back, and account for cost.")
    app.state.settings = settings
    app.state.engine = make_engine(settings.database_url)
    app.state.sessions = make_sessionmaker(app.state.engine)
    app.state.metrics = Metrics()
    app.state.kube = kube_api_client
    app.state.launchers = {"local": LocalLauncher(app.state.sessions, settings.local_runs_dir,
                                                  price_per_hour=settings.local_price_per_hour,
                                                  poll_seconds=settings.local_poll_seconds)}
    if kube_api_client is not None or settings.launcher == "kubernetes" or settings.auth == "kubernetes":
        from spillway_api.launchers.kubernetes import KubernetesLauncher, load_kube_client

        app.state.kube = kube_api_client or load_kube_client()
        app.state.launchers["kubernetes"] = KubernetesLauncher(app.state.kube)
    if settings.auth == "none":
        app.state.auth = NoAuth()
    elif settings.auth == "kubernetes":
        app.state.auth = KubernetesAuth(app.state.kube, audience=settings.audience)
    else:
        app.state.auth = TokenAuth(ensure_token_file(settings.resolved_token_file))
    errors.install(app)
    for module in (health, jobs, cost, plan, dashboard):
        app.include_router(module.router)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    if settings.auth == "none":
        # No credential protects it: a web page the user opens must not reach it through a
        # name of its own that resolves to 127.0.0.1 (DNS rebinding). Outermost: checked first.
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(LOOPBACK_HOSTS))
    return app
