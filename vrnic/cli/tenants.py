"""`vrnic tenants`: create and manage tenants and their API tokens (operator)."""

from __future__ import annotations

from typing import Annotated

import typer

from vrnic.cli.client import AllOpt, CursorOpt, JsonFlag, LimitOpt, api, parse_pairs, show, show_fields

app = typer.Typer(help="Tenants and their API tokens (operator token needed).", no_args_is_help=True)

COLUMNS = ["name", "vpc_id", "vpc_cidr", "max_vrnics", "live_vrnics", "created_at"]


@app.command()
def create(name: str,
           vpc_id: Annotated[int | None, typer.Option(help="Default: the next free VPC id.")] = None,
           max_vrnics: Annotated[int | None, typer.Option(help="Live vRNICs at most (default: no limit).")] = None,
           vpc_cidr: Annotated[str | None, typer.Option(help="The IPv4 range of its virtual IPs (default: "
                                                             "10.0.0.0/16).")] = None,
           quota: Annotated[list[str] | None, typer.Option(help="Default per-vRNIC quota, KEY=N (repeat).")] = None,
           as_json: JsonFlag = False) -> None:
    """Create a tenant and print its first token (shown only now)."""
    body = {"name": name, "vpc_id": vpc_id, "max_vrnics": max_vrnics, "vpc_cidr": vpc_cidr,
            **({"default_quota": parse_pairs(quota, "--quota")} if quota else {})}
    with api() as client:
        created = client.request("POST", "/tenants", json_body={k: v for k, v in body.items() if v is not None})
    show_fields(created, as_json)
    if not as_json:
        typer.secho("Keep the token now: it is not shown again.", err=True, fg="yellow")


@app.command("list")
def list_(as_json: JsonFlag = False, limit: LimitOpt = 50, all_pages: AllOpt = False,
          cursor: CursorOpt = None) -> None:
    with api() as client:
        items = list(client.pages("/tenants", {"cursor": cursor}, limit, all_pages))
    show(items, as_json, COLUMNS)


@app.command("show")
def show_(name: str, as_json: JsonFlag = False) -> None:
    with api() as client:
        show_fields(client.request("GET", f"/tenants/{name}"), as_json)


@app.command()
def update(name: str,
           max_vrnics: Annotated[int | None, typer.Option(help="New limit of live vRNICs.")] = None,
           unlimited: Annotated[bool, typer.Option(help="Remove the limit of live vRNICs.")] = False,
           quota: Annotated[list[str] | None, typer.Option(help="New default quota, KEY=N (repeat).")] = None,
           as_json: JsonFlag = False) -> None:
    body: dict[str, object] = {"unlimited": unlimited}
    if max_vrnics is not None:
        body["max_vrnics"] = max_vrnics
    if quota:
        body["default_quota"] = parse_pairs(quota, "--quota")
    with api() as client:
        show_fields(client.request("PATCH", f"/tenants/{name}", json_body=body), as_json)


@app.command()
def delete(name: str) -> None:
    """Delete a tenant that has no live vRNICs."""
    with api() as client:
        client.request("DELETE", f"/tenants/{name}")
    typer.echo(f"deleted tenant {name}")


@app.command()
def token(name: str, as_json: JsonFlag = False) -> None:
    """Issue another token for a tenant (shown only now)."""
    with api() as client:
        show_fields(client.request("POST", f"/tenants/{name}/tokens"), as_json)


@app.command()
def tokens(name: str, as_json: JsonFlag = False) -> None:
    """A tenant's tokens (prefixes only)."""
    with api() as client:
        show(client.request("GET", f"/tenants/{name}/tokens"), as_json, ["id", "prefix", "created_at", "revoked_at"])


@app.command()
def revoke(name: str, token_id: int, as_json: JsonFlag = False) -> None:
    """Revoke one of a tenant's tokens."""
    with api() as client:
        show_fields(client.request("DELETE", f"/tenants/{name}/tokens/{token_id}"), as_json)
