"""`vrnic daemon`: run the backend and the REST API of this host (see vrnic.daemon)."""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import ValidationError

from vrnic.config import DaemonSettings, settings_problem
from vrnic.errors import VrnicError


def daemon(
    listen_host: Annotated[str | None, typer.Option(help="Address to listen on (VRNIC_LISTEN_HOST).")] = None,
    listen_port: Annotated[int | None, typer.Option(help="Port to listen on (VRNIC_LISTEN_PORT).")] = None,
) -> None:
    """Run vrnicd and the REST API of this host until interrupted.

    Settings come from VRNIC_* variables and the file VRNIC_CONFIG names: VRNIC_DATABASE_URL,
    VRNIC_OPERATOR_TOKEN, VRNIC_PARAVIRTUAL_DRIVER (default verbs), VRNIC_SRIOV_DRIVER, VRNIC_STATE_DIR.
    Refuses to start on a database schema other than head (run `vrnic db upgrade`).
    """
    from vrnic.daemon import run

    overrides = {k: v for k, v in {"listen_host": listen_host, "listen_port": listen_port}.items() if v is not None}
    try:
        settings = DaemonSettings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:  # e.g. a machine whose host name is the kernel's "(none)"
        typer.secho(f"vrnic daemon: {settings_problem(exc)}", err=True, fg="red")
        raise typer.Exit(2) from exc
    try:
        run(settings)
    except VrnicError as exc:
        typer.secho(f"vrnic daemon: {exc}", err=True, fg="red")
        raise typer.Exit(2) from exc
