"""Alembic from code: upgrade, downgrade, the head and the current revision (the daemon's check that the schema is
at head is vrnic.db.schema, which does not load Alembic)."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from vrnic.config import PROJECT_DIR
from vrnic.db.schema import SCRIPT_LOCATION, SchemaOutOfDate


def alembic_config(engine: Engine) -> Config:
    config = Config(str(PROJECT_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    config.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    config.attributes["engine"] = engine
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    command.upgrade(alembic_config(engine), revision)


def downgrade(engine: Engine, revision: str = "base") -> None:
    command.downgrade(alembic_config(engine), revision)


def head_revision() -> str:
    heads = ScriptDirectory(str(SCRIPT_LOCATION)).get_heads()
    if len(heads) != 1:
        raise SchemaOutOfDate(f"the migrations have {len(heads)} heads ({', '.join(heads)}); merge them")
    return heads[0]


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()

