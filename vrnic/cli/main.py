"""Entry point of the `vrnic` command."""

from __future__ import annotations

import typer

from vrnic.cli import db, devices, events, hosts, lab, security_rules, sriov, tenants, vm, vrnics
from vrnic.cli.daemon import daemon

app = typer.Typer(help="vrnic: virtual RDMA NICs for VMs and containers.", no_args_is_help=True)
app.add_typer(lab.app, name="lab")
app.add_typer(tenants.app, name="tenants")
app.add_typer(vrnics.app, name="vrnics")
app.add_typer(devices.app, name="devices")
app.add_typer(hosts.app, name="hosts")
app.add_typer(events.app, name="events")
app.add_typer(security_rules.app, name="security-rules")
app.add_typer(sriov.app, name="sriov")
app.add_typer(db.app, name="db")
app.add_typer(vm.app, name="vm")
app.add_typer(vm.hook_app, name="hook")
app.command("daemon")(daemon)

if __name__ == "__main__":
    app()
