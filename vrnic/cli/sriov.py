"""`vrnic sriov`: SR-IOV PFs and VFs, the VF count, reconciliation (operator token needed)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from vrnic.cli.client import AllOpt, CursorOpt, JsonFlag, LimitOpt, api, show

app = typer.Typer(help="SR-IOV PFs and VFs: list, set the VF count, reconcile (operator token needed).",
                  no_args_is_help=True)


def _settings(vf_settings: dict[str, Any] | None) -> str:
    if not vf_settings:
        return "(gone)"
    s = vf_settings
    vlan = f"vlan {s['vlan']}" + (f" qos {s['qos']}" if s["qos"] else "") if s["vlan"] else "untagged"
    rates = f"tx {s['min_tx_rate']}..{s['max_tx_rate'] or '-'} Mbit/s"
    flags = ("spoofchk" if s["spoofchk"] else "no-spoofchk") + (" trust" if s["trust"] else "")
    return f"{s['mac']} {vlan} {rates} {flags} link {s['link_state']}"


def _holder(vf: dict[str, Any]) -> str:
    held = vf.get("allocation")
    if not held:
        return "free"
    state = "vanished" if held["vanished"] else ("in sync" if held["in_sync"] else "DRIFTED")
    where = f" netns {held['netns']}" if held.get("netns") else ""
    return f"{held['vrnic_id']} ({held['tenant']}, {state}{where})"


@app.command()
def pfs(as_json: JsonFlag = False, limit: LimitOpt = 50, all_pages: AllOpt = False, cursor: CursorOpt = None) -> None:
    """SR-IOV capable PFs: VF count and total, driver, eswitch mode, allocated and free VFs."""
    with api() as client:
        items = list(client.pages("/sriov/pfs", {"cursor": cursor}, limit, all_pages))
    show(items, as_json, ["name", "kind", "bus_id", "driver", "eswitch_mode", "num_vfs", "total_vfs",
                          "allocated_vfs", "free_vfs", ("vanished", lambda p: ", ".join(p["vanished_vrnics"]))])


@app.command()
def vfs(pf: Annotated[str, typer.Argument(help="The PF's netdev name.")], as_json: JsonFlag = False,
        limit: LimitOpt = 50, all_pages: AllOpt = False, cursor: CursorOpt = None) -> None:
    """A PF's VFs: the settings the kernel reports and who holds each."""
    with api() as client:
        items = list(client.pages(f"/sriov/pfs/{pf}/vfs", {"cursor": cursor}, limit, all_pages))
    show(items, as_json, ["index", ("pci", lambda v: v["pci_address"] or "-"), ("settings (kernel)",
                          lambda v: _settings(v["settings"])), ("held by", _holder)])


@app.command("set-numvfs")
def set_numvfs(pf: Annotated[str, typer.Argument(help="The PF's netdev name.")],
               count: Annotated[int, typer.Argument(min=0, help="The new number of VFs.")],
               force: Annotated[bool, typer.Option(help="Change it even though VFs are allocated: it goes "
                                                        "through zero; allocated VFs beyond the new count vanish.")
                                ] = False,
               as_json: JsonFlag = False) -> None:
    """Set a PF's VF count (refused while VFs are allocated, unless --force)."""
    with api() as client:
        typer.secho(f"setting {pf} to {count} VFs ...", err=True, dim=True)
        result = client.request("PUT", f"/sriov/pfs/{pf}/num-vfs", json_body={"num_vfs": count, "force": force})
    if as_json:
        show(result, True, [])
        return
    steps = " -> ".join(str(s) for s in result["steps"]) or "nothing to do"
    typer.echo(f"{pf}: {result['previous']} -> {result['num_vfs']} VFs (sriov_numvfs {steps})")
    _print_events(result["events"])


@app.command()
def reconcile(as_json: JsonFlag = False) -> None:
    """Compare desired VF state with the kernel now and restore what drifted."""
    with api() as client:
        result = client.request("POST", "/sriov/reconcile")
    if as_json:
        show(result, True, [])
        return
    if not result["events"]:
        typer.echo("in sync: nothing to correct")
    _print_events(result["events"])


def _print_events(events: list[dict[str, Any]]) -> None:
    for event in events:
        where = event["pf"] if event["vf"] is None else f"{event['pf']}/vf{event['vf']}"
        who = f" ({event['vrnic_id']})" if event.get("vrnic_id") else ""
        detail = ", ".join(f"{k}={v}" for k, v in sorted(event["detail"].items()))
        typer.echo(f"{event['kind']} {where}{who}" + (f": {detail}" if detail else ""))


@app.command("attach-container")
def attach_container(vrnic_id: Annotated[str, typer.Argument(help="The SR-IOV vRNIC.")],
                     netns: Annotated[str, typer.Argument(help="A named network namespace (`ip netns add`).")],
                     ethernet_only: Annotated[bool, typer.Option(
                         "--ethernet-only", help="Move the netdev even when its RDMA device cannot move along.")
                     ] = False,
                     as_json: JsonFlag = False) -> None:
    """Move a vRNIC's VF netdev (and its RDMA device) into a container's network namespace."""
    with api() as client:
        moved = client.request("PUT", f"/vrnics/{vrnic_id}/container",
                               json_body={"netns": netns, "require_rdma": not ethernet_only})
    if as_json:
        show(moved, True, [])
        return
    rdma = f" and {moved['rdma_device']}" if moved["rdma_device"] else " (Ethernet only)"
    typer.echo(f"moved {moved['netdev']}{rdma} of {vrnic_id} into netns {moved['netns']}")
    for note in moved["notes"]:
        typer.secho(f"note: {note}", err=True, dim=True)


@app.command("detach-container")
def detach_container(vrnic_id: Annotated[str, typer.Argument(help="The SR-IOV vRNIC.")]) -> None:
    """Bring a vRNIC's VF back from the container's network namespace."""
    with api() as client:
        vf = client.request("DELETE", f"/vrnics/{vrnic_id}/container")
    typer.echo(f"{vrnic_id}: VF {vf['pf']}/vf{vf['index']} is back in the host's namespace")
