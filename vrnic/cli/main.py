"""Entry point of the `vrnic` command."""

from __future__ import annotations

from importlib import import_module
from typing import Any

import typer
from typer.core import TyperGroup

from vrnic.cli.daemon import daemon

# name -> (module, its typer app). Each is imported when it runs (or for --help): the command groups between
# them import httpx, SQLAlchemy, Alembic, libvirt and pyroute2, seconds under the lab's TCG, and `vrnic daemon`
# and the libvirt hook's `vrnic ...` calls need one or none of them.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "lab": ("vrnic.cli.lab", "app"),
    "tenants": ("vrnic.cli.tenants", "app"),
    "vrnics": ("vrnic.cli.vrnics", "app"),
    "devices": ("vrnic.cli.devices", "app"),
    "hosts": ("vrnic.cli.hosts", "app"),
    "events": ("vrnic.cli.events", "app"),
    "security-rules": ("vrnic.cli.security_rules", "app"),
    "sriov": ("vrnic.cli.sriov", "app"),
    "db": ("vrnic.cli.db", "app"),
    "vm": ("vrnic.cli.vm", "app"),
    "hook": ("vrnic.cli.vm", "hook_app"),
}


class LazyGroup(TyperGroup):
    """The top-level group: SUBCOMMANDS are loaded by name, when asked for. (ctx and the command are the click
    types Typer vendors privately, hence Any.)"""

    def list_commands(self, ctx: Any) -> list[str]:
        return [*SUBCOMMANDS, *super().list_commands(ctx)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in SUBCOMMANDS:
            return super().get_command(ctx, cmd_name)
        module, attribute = SUBCOMMANDS[cmd_name]
        group = typer.main.get_group(getattr(import_module(module), attribute))
        group.name = cmd_name
        return group


app = typer.Typer(cls=LazyGroup, no_args_is_help=True)
app.command("daemon")(daemon)


@app.callback()
def vrnic() -> None:  # a group, not its one eager command (Typer collapses a Typer with a single command)
    """vrnic: virtual RDMA NICs for VMs and containers."""

if __name__ == "__main__":
    app()
