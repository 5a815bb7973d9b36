"""Entry point of the `vrnic` command."""

from __future__ import annotations

import typer

from vrnic.cli import lab

app = typer.Typer(help="vrnic: virtual RDMA NICs for VMs and containers.", no_args_is_help=True)
app.add_typer(lab.app, name="lab")

if __name__ == "__main__":
    app()
