"""`vrnic hosts`: the hosts running `vrnic daemon` (operator)."""

from __future__ import annotations

import typer

from vrnic.cli.client import AllOpt, CursorOpt, JsonFlag, LimitOpt, api, show, show_fields

app = typer.Typer(help="Hosts running `vrnic daemon` (operator token needed).", no_args_is_help=True)


@app.command("list")
def list_(as_json: JsonFlag = False, limit: LimitOpt = 50, all_pages: AllOpt = False,
          cursor: CursorOpt = None) -> None:
    with api() as client:
        items = list(client.pages("/hosts", {"cursor": cursor}, limit, all_pages))
    show(items, as_json, ["name", "state", "api_url", "version", "registered_at", "last_seen_at"])


@app.command("show")
def show_(name: str, as_json: JsonFlag = False) -> None:
    with api() as client:
        show_fields(client.request("GET", f"/hosts/{name}"), as_json)
