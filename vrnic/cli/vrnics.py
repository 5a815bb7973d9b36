"""`vrnic vrnics`: allocate, list, show and release vRNICs."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from vrnic.cli.client import AllOpt, CursorOpt, JsonFlag, LimitOpt, api, parse_pairs, show, show_fields
from vrnic.core.lifecycle import VrnicState
from vrnic.core.specs import DataEngine, VrnicMode

app = typer.Typer(help="vRNICs: allocate, list, show, release (attach state is what vrnicd observes).",
                  no_args_is_help=True)

COLUMNS = ["id", "tenant", "mode", "engine", "state", "host", "reachable", "device", "virtual_gid", "virtual_ip",
           "created_at"]


def _flat(vrnic: dict[str, Any]) -> dict[str, Any]:
    attach = vrnic.pop("attach", {}) or {}
    return {**vrnic, "socket_path": attach.get("socket_path"), "attach_token": attach.get("token"),
            **{f"attach.{k}": v for k, v in (attach.get("extra") or {}).items()}}


@app.command()
def allocate(
    tenant: Annotated[str | None, typer.Option(help="Operator: the tenant to allocate for.")] = None,
    mode: Annotated[VrnicMode, typer.Option(help="paravirtual or sriov.")] = VrnicMode.PARAVIRTUAL,
    engine: Annotated[DataEngine, typer.Option(help="Paravirtual data path: ring (vrnicd moves posts) or direct "
                                                    "(the guest drives the NIC's queues; not for VMs).")
                      ] = DataEngine.RING,
    device: Annotated[str | None, typer.Option(help="A physical device (default: the least loaded).")] = None,
    host: Annotated[str | None, typer.Option(help="The host to place it on (default: the least loaded device of "
                                                  "the hosts that are up).")] = None,
    virtual_ip: Annotated[str | None, typer.Option(help="Its address in the tenant's VPC (default: the next free)."
                                                   )] = None,
    quota: Annotated[list[str] | None, typer.Option(help="Quota KEY=N (repeat), e.g. max_qps=8.")] = None,
    rate_cap: Annotated[int | None, typer.Option(help="QoS rate cap, Mbit/s.")] = None,
    guarantee: Annotated[int | None, typer.Option(help="QoS guaranteed rate, Mbit/s.")] = None,
    weight: Annotated[int, typer.Option(help="QoS weight of its fair share of what no guarantee holds.")] = 1,
    idempotency_key: Annotated[str | None, typer.Option(help="Retry-safe: the same key returns the same vRNIC.")
                               ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Allocate a vRNIC and print its attach information (the attach token is shown only now)."""
    body: dict[str, Any] = {"mode": mode.value, "qos": {"rate_cap_mbps": rate_cap, "guarantee_mbps": guarantee,
                                                       "weight": weight}}
    if engine is not DataEngine.RING:
        body["engine"] = engine.value
    if tenant:
        body["tenant"] = tenant
    if device:
        body["device"] = device
    if host:
        body["host"] = host
    if virtual_ip:
        body["virtual_ip"] = virtual_ip
    if quota:
        body["quota"] = parse_pairs(quota, "--quota")
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
    with api() as client:
        vrnic = client.request("POST", "/vrnics", json_body=body, headers=headers)
    show_fields(vrnic if as_json else _flat(vrnic), as_json)
    if idempotency_key and vrnic["mode"] == "paravirtual" and not vrnic["attach"].get("token"):
        typer.secho(f"(a replay of an earlier allocation: its attach token is not shown again; "
                    f"`vrnic vrnics new-token {vrnic['id']}` issues a new one)", err=True, dim=True)


@app.command("list")
def list_(state: Annotated[VrnicState | None, typer.Option(help="Only this state.")] = None,
          tenant: Annotated[str | None, typer.Option(help="Operator: only this tenant.")] = None,
          as_json: JsonFlag = False, limit: LimitOpt = 50, all_pages: AllOpt = False, cursor: CursorOpt = None) -> None:
    params = {"state": state.value if state else None, "tenant": tenant, "cursor": cursor}
    with api() as client:
        items = list(client.pages("/vrnics", params, limit, all_pages))
    show(items, as_json, COLUMNS)


@app.command("show")
def show_(vrnic_id: str, as_json: JsonFlag = False) -> None:
    """A vRNIC, with what it sent and received (bytes, packets, the rates since the previous reading) when QoS
    counts it."""
    with api() as client:
        vrnic = client.request("GET", f"/vrnics/{vrnic_id}")
        vrnic["counters"] = client.request("GET", f"/vrnics/{vrnic_id}/counters")
    show_fields(vrnic if as_json else _flat(vrnic), as_json)


@app.command("set-qos")
def set_qos(vrnic_id: str,
            rate_cap: Annotated[int | None, typer.Option(help="Rate cap, Mbit/s (none: no cap).")] = None,
            guarantee: Annotated[int | None, typer.Option(help="Guaranteed rate, Mbit/s (none: none).")] = None,
            weight: Annotated[int, typer.Option(help="Weight of its fair share.")] = 1,
            as_json: JsonFlag = False) -> None:
    """Change a live vRNIC's QoS; its QPs stay connected. The whole policy is replaced."""
    body = {"qos": {"rate_cap_mbps": rate_cap, "guarantee_mbps": guarantee, "weight": weight}}
    with api() as client:
        vrnic = client.request("PATCH", f"/vrnics/{vrnic_id}", json_body=body)
    show_fields(vrnic if as_json else _flat(vrnic), as_json)


@app.command()
def release(vrnic_id: str,
            force: Annotated[bool, typer.Option(help="Operator: release even while a guest is attached.")] = False,
            as_json: JsonFlag = False) -> None:
    """Release a vRNIC: its backend state is torn down."""
    with api() as client:
        vrnic = client.request("DELETE", f"/vrnics/{vrnic_id}", params={"force": force or None})
    if as_json:
        show_fields(vrnic, True)
    else:
        typer.echo(f"released {vrnic['id']} (was on {vrnic['device']})")



@app.command("new-token")
def new_token(vrnic_id: str, as_json: JsonFlag = False) -> None:
    """Issue a new attach token for a paravirtual vRNIC; the old one stops working (e.g. when the allocation's
    answer was lost and a retry with the same --idempotency-key got the vRNIC without its token)."""
    with api() as client:
        vrnic = client.request("POST", f"/vrnics/{vrnic_id}/token")
    if as_json:
        show_fields(vrnic, True)
    else:
        typer.echo(vrnic["attach"]["token"])
