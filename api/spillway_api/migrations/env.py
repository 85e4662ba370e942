"""Alembic environment: run with the connection or engine that spillway_api.db hands over."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from spillway_api.models import Base

config = context.config


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    engine = config.attributes.get("engine")
    if engine is None:
        from spillway_api.db import make_engine
        from spillway_api.settings import get_settings

        engine = make_engine(get_settings().database_url)
    with engine.begin() as conn:
        _run(conn)
