"""`vrnic events`: the audit log (a tenant sees its own events)."""

from __future__ import annotations

from typing import Annotated

import typer

from vrnic.cli.client import AllOpt, CursorOpt, JsonFlag, LimitOpt, api, show

app = typer.Typer(help="The audit log: who did what, and when.", no_args_is_help=True)


@app.command("list")
def list_(subject: Annotated[str | None, typer.Option(help="e.g. vrnic/vr-..., tenant/acme")] = None,
          action: Annotated[str | None, typer.Option(help="e.g. vrnic.allocate")] = None,
          as_json: JsonFlag = False, limit: LimitOpt = 50, all_pages: AllOpt = False,
          cursor: CursorOpt = None) -> None:
    params = {"subject": subject, "action": action, "cursor": cursor}
    with api() as client:
        items = list(client.pages("/events", params, limit, all_pages))
    show(items, as_json, ["id", "at", "actor", "action", "subject", "tenant", "detail"])
