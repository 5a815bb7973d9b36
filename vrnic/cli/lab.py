"""`vrnic lab`: run commands inside the lab (a throw-away QEMU guest with Soft-RoCE)."""

from __future__ import annotations

from typing import Annotated

import typer

from vrnic.errors import VrnicError
from vrnic.lab.guest import Topology

app = typer.Typer(help="The lab: Debian's kernel under QEMU TCG with Soft-RoCE (rxe) ready.",
                  no_args_is_help=True)


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    command: Annotated[list[str], typer.Argument(help="The command to run in the guest (after --).")],
    topology: Annotated[Topology, typer.Option(help="pair: rxe0+rxe1 over veth; single: rxe0; "
                                                    "two-hosts: two guests, rxe0 each.")] = Topology.PAIR,
    netdevsim: Annotated[bool, typer.Option(help="Add a netdevsim PF with SR-IOV VFs.")] = False,
    sriov_nic: Annotated[bool, typer.Option(help="Add an emulated igb NIC with real SR-IOV VFs (PCI functions "
                                                 "with netdevs); runs QEMU 10.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds before the guest is killed (exit 124).")] = 600.0,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="NAME=VALUE for the command.")] = None,
    rerun_on_panic: Annotated[bool, typer.Option(help="If the lab guest's own kernel panics or locks up (a CPU "
                                                      "stuck for 2 min), say so and run the command once more "
                                                      "(nested KVM under TCG, rarely).")] = False,
) -> None:
    """Boot the lab, run COMMAND in it and exit with its exit code.

    Exit 124 on timeout, 125 if the guest failed to boot, 126 if it died while running the command.
    """
    from vrnic.lab.guest import EXIT_GUEST_LOST
    from vrnic.lab.runner import LabRequest, LabRunner

    pairs = dict(item.split("=", 1) for item in env or [] if "=" in item)
    if len(pairs) != len(env or []):
        raise typer.BadParameter("--env takes NAME=VALUE", param_hint="--env")
    request = LabRequest(command=command, topology=topology, netdevsim=netdevsim, sriov_nic=sriov_nic,
                         timeout=timeout, env=pairs)
    try:
        runner = LabRunner()
        rc = runner.run(request)
        if rc == EXIT_GUEST_LOST and rerun_on_panic and runner.panicked:
            # The lab guest (Debian's kernel under QEMU TCG) running nested KVM has been seen to panic with
            # "TASK stack guard page was hit" in the KVM run loop, and to lock up with the nested QEMU stuck
            # on one CPU: the emulator's, not the command's, failure.
            typer.secho(f"vrnic lab: the lab guest's kernel panicked or locked up ({runner.panicked}); running "
                        "the command once more", err=True, fg="yellow")
            rc = runner.run(request)
    except VrnicError as exc:
        typer.secho(f"vrnic lab: {exc}", err=True, fg="red")
        raise typer.Exit(125) from exc
    raise typer.Exit(rc)
