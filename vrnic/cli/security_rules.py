"""`vrnic security-rules`: a VPC's security group (a tenant: its own; the operator: any tenant's)."""

from __future__ import annotations

from typing import Annotated

import typer

from vrnic.cli.client import AllOpt, CursorOpt, JsonFlag, LimitOpt, api, show, show_fields
from vrnic.core.peering import RuleAction

app = typer.Typer(help="Security groups: allow or deny peers of other tenants' VPCs (cross-VPC peering needs an "
                       "allow on both sides).", no_args_is_help=True)

COLUMNS = ["id", "tenant", "action", "peer_tenant", "created_at"]


@app.command()
def add(action: Annotated[RuleAction, typer.Argument(help="allow or deny.")],
        peer_tenant: Annotated[str, typer.Argument(help="The peer tenant (its VPC), or * for any other.")],
        tenant: Annotated[str | None, typer.Option(help="Operator: whose VPC the rule belongs to.")] = None,
        as_json: JsonFlag = False) -> None:
    """Add a rule to a VPC's security group."""
    body = {"action": action.value, "peer_tenant": peer_tenant, **({"tenant": tenant} if tenant else {})}
    with api() as client:
        show_fields(client.request("POST", "/security-rules", json_body=body), as_json)


@app.command("list")
def list_(tenant: Annotated[str | None, typer.Option(help="Operator: only this tenant's rules.")] = None,
          as_json: JsonFlag = False, limit: LimitOpt = 50, all_pages: AllOpt = False,
          cursor: CursorOpt = None) -> None:
    with api() as client:
        items = list(client.pages("/security-rules", {"cursor": cursor, "tenant": tenant}, limit, all_pages))
    show(items, as_json, COLUMNS)


@app.command()
def delete(rule_id: int) -> None:
    """Delete a rule (connections it allowed stay up; new ones are checked without it)."""
    with api() as client:
        client.request("DELETE", f"/security-rules/{rule_id}")
    typer.echo(f"deleted security rule {rule_id}")
