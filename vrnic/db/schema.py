"""The daemon's check that the database schema is the one this code was written for.

It reads alembic_version and compares it with SCHEMA_HEAD. Alembic's script directory is loaded only when they
differ, to tell an older schema from a newer one: importing Alembic is seconds under the lab's TCG, and the
daemon checks at every start. (vrnic.db.migrate is Alembic itself: upgrade, downgrade.)
"""

from __future__ import annotations

from sqlalchemy import Engine, inspect, text

from vrnic.config import PROJECT_DIR
from vrnic.errors import VrnicError

SCHEMA_HEAD = "0006"  # the newest migration's revision (tests/api/test_migrations.py checks it is Alembic's head)
SCRIPT_LOCATION = PROJECT_DIR / "migrations"
UPGRADE_COMMAND = "vrnic db upgrade"


class SchemaOutOfDate(VrnicError):
    """The database schema is not the one this code was written for."""

    code = "schema_out_of_date"


def stored_revisions(engine: Engine) -> list[str]:
    """The revisions alembic_version holds (none on a database that was never migrated)."""
    with engine.connect() as connection:
        if not inspect(connection).has_table("alembic_version"):
            return []
        return list(connection.execute(text("SELECT version_num FROM alembic_version")).scalars())


def check_schema(engine: Engine) -> None:
    """SchemaOutOfDate, naming what to run, unless the database is exactly at head."""
    stored = stored_revisions(engine)
    if stored == [SCHEMA_HEAD]:
        return
    where = engine.url.render_as_string(hide_password=True)
    if not stored:
        raise SchemaOutOfDate(f"the database {where} has no vrnic schema; run `{UPGRADE_COMMAND}` first")
    if len(stored) > 1:
        raise SchemaOutOfDate(f"the database {where} is at {len(stored)} schema heads ({', '.join(stored)}), "
                              f"not at head {SCHEMA_HEAD}")
    from alembic.script import ScriptDirectory

    current = stored[0]
    if current not in {rev.revision for rev in ScriptDirectory(str(SCRIPT_LOCATION)).walk_revisions()}:
        raise SchemaOutOfDate(f"the database {where} is at schema {current}, newer than this vrnic knows "
                              f"(head {SCHEMA_HEAD}); upgrade vrnic")
    raise SchemaOutOfDate(f"the database {where} is at schema {current}, older than head {SCHEMA_HEAD}; "
                          f"run `{UPGRADE_COMMAND}`")
