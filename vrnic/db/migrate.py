"""Alembic from code: upgrade, downgrade, and the daemon's check that the schema is at head."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from vrnic.config import PROJECT_DIR
from vrnic.errors import VrnicError

SCRIPT_LOCATION = PROJECT_DIR / "migrations"
UPGRADE_COMMAND = "vrnic db upgrade"


class SchemaOutOfDate(VrnicError):
    """The database schema is not the one this code was written for."""

    code = "schema_out_of_date"


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


def check_schema(engine: Engine) -> None:
    """SchemaOutOfDate, naming what to run, unless the database is exactly at head."""
    head, current = head_revision(), current_revision(engine)
    if current == head:
        return
    where = engine.url.render_as_string(hide_password=True)
    if current is None:
        raise SchemaOutOfDate(f"the database {where} has no vrnic schema; run `{UPGRADE_COMMAND}` first")
    known = {rev.revision for rev in ScriptDirectory(str(SCRIPT_LOCATION)).walk_revisions()}
    if current not in known:
        raise SchemaOutOfDate(f"the database {where} is at schema {current}, newer than this vrnic knows "
                              f"(head {head}); upgrade vrnic")
    raise SchemaOutOfDate(f"the database {where} is at schema {current}, older than head {head}; "
                          f"run `{UPGRADE_COMMAND}`")
