"""Alembic environment: runs on the engine vrnic hands over, or on a URL (-x url=, VRNIC_DATABASE_URL)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Engine

from vrnic.config import DaemonSettings
from vrnic.db.engine import make_engine
from vrnic.db.tables import Base

config = context.config


def _engine() -> Engine:
    given = config.attributes.get("engine")
    if given is not None:
        return given  # type: ignore[no-any-return]
    url = context.get_x_argument(as_dictionary=True).get("url") or DaemonSettings().database
    return make_engine(url)


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=Base.metadata,
                      literal_binds=True, render_as_batch=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = _engine()
    with engine.connect() as connection:
        # render_as_batch: SQLite alters tables by copying them; harmless on PostgreSQL.
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True,
                          compare_type=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
