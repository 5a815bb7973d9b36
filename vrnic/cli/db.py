"""`vrnic db`: schema migrations of the daemon's database (Alembic), for the operator on the host."""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import ValidationError
from sqlalchemy import Engine

from vrnic.config import DaemonSettings, settings_problem

app = typer.Typer(help="The daemon's database schema (VRNIC_DATABASE_URL; default SQLite in VRNIC_STATE_DIR).",
                  no_args_is_help=True)

UrlOpt = Annotated[str | None, typer.Option("--url", help="Database URL (default: the daemon's).")]


def _engine(url: str | None) -> Engine:
    from vrnic.db.engine import make_engine

    if url:
        return make_engine(url)
    try:
        return make_engine(DaemonSettings().database)
    except ValidationError as exc:
        typer.secho(f"vrnic db: {settings_problem(exc)}", err=True, fg="red")
        raise typer.Exit(2) from exc


@app.command()
def upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head", url: UrlOpt = None) -> None:
    """Migrate the schema up to REVISION (default: head)."""
    from vrnic.db import migrate

    engine = _engine(url)
    before = migrate.current_revision(engine)
    migrate.upgrade(engine, revision)
    typer.echo(f"database schema: {before or 'empty'} -> {migrate.current_revision(engine)}")


@app.command()
def downgrade(revision: Annotated[str, typer.Argument(help="Target revision ('base': drop everything).")],
              url: UrlOpt = None) -> None:
    """Migrate the schema down to REVISION."""
    from vrnic.db import migrate

    engine = _engine(url)
    before = migrate.current_revision(engine)
    migrate.downgrade(engine, revision)
    typer.echo(f"database schema: {before or 'empty'} -> {migrate.current_revision(engine) or 'empty'}")


@app.command()
def current(url: UrlOpt = None) -> None:
    """Show the schema revision and whether it is at head (exit 1 if not)."""
    from vrnic.db import migrate

    engine = _engine(url)
    revision, head = migrate.current_revision(engine), migrate.head_revision()
    typer.echo(f"current {revision or 'empty'}, head {head}")
    raise typer.Exit(0 if revision == head else 1)
