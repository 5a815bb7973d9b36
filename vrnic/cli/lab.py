"""`vrnic lab`: run commands inside the lab (a throw-away QEMU guest with Soft-RoCE)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from vrnic.errors import VrnicError
from vrnic.lab.guest import EXIT_GUEST_LOST, EXIT_TIMEOUT, Topology

if TYPE_CHECKING:
    from vrnic.lab.runner import LabRequest, LabRunner

# New guests a command gets after the lab guest died under it. Nested KVM under TCG has killed two guests in a
# row under the same test on one host (its soft lockups come and go with the host's load); the third has always
# run it. A test that kills every guest it runs in still fails, after three.
GUEST_LOSS_RERUNS = 2

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
    rerun_on_guest_loss: Annotated[bool, typer.Option(
        "--rerun-on-guest-loss", "--rerun-on-panic",
        help="If the lab guest dies under the command (its kernel panics or locks up, or the emulator exits), "
             "say so and run the command again in a new guest, up to twice. A pytest command resumes: tests that "
             "already have an outcome are not run again, and an earlier failure still fails the run "
             "(nested KVM under TCG, rarely).")] = False,
) -> None:
    """Boot the lab, run COMMAND in it and exit with its exit code.

    Exit 124 on timeout, 125 if the guest failed to boot, 126 if it died while running the command.
    """
    from vrnic.lab import progress
    from vrnic.lab.runner import LabRequest, LabRunner

    pairs = dict(item.split("=", 1) for item in env or [] if "=" in item)
    if len(pairs) != len(env or []):
        raise typer.BadParameter("--env takes NAME=VALUE", param_hint="--env")
    try:
        runner = LabRunner()
        progress_file = None
        if rerun_on_guest_loss:
            progress_file = runner.new_progress_file()
            pairs.setdefault(progress.ENV, str(progress_file))
        request = LabRequest(command=command, topology=topology, netdevsim=netdevsim, sriov_nic=sriov_nic,
                             timeout=timeout, env=pairs)
        rc = runner.run(request)
        if progress_file is not None:
            rc = _rerun_on_guest_loss(runner, request, progress_file, rc)
        if rc == EXIT_TIMEOUT and progress_file is not None:
            # Last, so that a log cut to its tail still names the test that hung.
            typer.secho(progress.Progress.read(progress_file).summary("when the lab timed out"), err=True, fg="red")
    except VrnicError as exc:
        typer.secho(f"vrnic lab: {exc}", err=True, fg="red")
        raise typer.Exit(125) from exc
    raise typer.Exit(rc)


def _rerun_on_guest_loss(runner: LabRunner, request: LabRequest, progress_file: Path, rc: int) -> int:
    """Runs the command again in a new guest while the lab guest dies under it, at most GUEST_LOSS_RERUNS times."""
    from vrnic.lab import progress

    for attempt in range(1, GUEST_LOSS_RERUNS + 1):
        # The hang watch's backstop kills the stuck test: its exit status is then SIGKILL's, not the lost guest's.
        hung = rc != 0 and progress.Progress.read(progress_file).running_hung
        if rc != EXIT_GUEST_LOST and not hung:
            break
        rc = _rerun(runner, request, progress_file, attempt)
    return rc


def _rerun(runner: LabRunner, request: LabRequest, progress_file: Path, attempt: int = 1) -> int:
    from vrnic.lab import progress

    before = progress.Progress.read(progress_file)
    # The lab guest (Debian's kernel under QEMU TCG) running nested KVM has been seen to panic with "TASK stack
    # guard page was hit" in the KVM run loop, to lock up with the nested QEMU stuck on one CPU, and to vanish
    # without a console line: the emulator's failure, not the command's.
    hung, faulted = before.running_hung, before.running_faulted
    if hung:
        what = "a test hung (vrnic/lab/hang_watch.py printed where) and the command was ended"
    elif faulted:
        what = ("a test failed while the lab guest under it faulted (vrnic/lab/guest_faults.py printed the "
                "lines) and the command was ended")
    else:
        what = f"the lab guest died ({runner.panicked or 'no panic on its console'})"
    typer.secho(f"vrnic lab: {what} while {before.running or 'the command'} ran; running "
                f"the command again in a new guest, rerun {attempt} of {GUEST_LOSS_RERUNS} "
                f"({len(before.outcomes)} test(s) already have an outcome and are not run again)",
                err=True, fg="yellow")
    rc = runner.run(request)
    if rc == 0 and (hung or faulted):
        typer.secho(f"vrnic lab: {before.running} {'hung' if hung else 'failed on a lab guest fault'} in the "
                    "first guest and passed in a new one (the report is above)", err=True, fg="yellow")
    if before.failed:
        reports = progress.failure_reports(progress_file)
        typer.secho(f"vrnic lab: {len(before.failed)} test(s) failed before the guest died: "
                    + ", ".join(before.failed) + (f"; as reported then ({progress.failures_file(progress_file)}):"
                                                  if reports else ""), err=True, fg="red")
        if reports:
            typer.echo(reports, err=True)
        return rc or 1
    return rc
