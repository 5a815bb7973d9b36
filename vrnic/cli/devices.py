"""`vrnic devices`: the physical RNICs the hosts' drivers discovered (operator)."""

from __future__ import annotations

import typer

from vrnic.cli.client import AllOpt, CursorOpt, JsonFlag, LimitOpt, api, show, show_fields

app = typer.Typer(help="Physical RNICs per host (operator token needed).", no_args_is_help=True)


@app.command("list")
def list_(as_json: JsonFlag = False, limit: LimitOpt = 50, all_pages: AllOpt = False,
          cursor: CursorOpt = None) -> None:
    with api() as client:
        items = list(client.pages("/devices", {"cursor": cursor}, limit, all_pages))
    show(items, as_json, ["id", "host", "name", "driver", "node_guid", "present", "live_vrnics",
                          ("ports", lambda d: ", ".join(f"{p['port']}:{p['state']}" for p in d["ports"]))])


@app.command("show")
def show_(device_id: int, as_json: JsonFlag = False) -> None:
    with api() as client:
        show_fields(client.request("GET", f"/devices/{device_id}"), as_json)
