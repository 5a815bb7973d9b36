"""`make demo`: what vrnic does, shown on real Soft-RoCE inside the lab.

Run inside the lab: `vrnic lab run -- python -m vrnic.demo`.
1. the lab's RDMA devices;
2. a native RDMA WRITE between them (the baseline: the stack works);
3. examples/two_guests.py: vrnicd with two vRNICs of one tenant, two guest
   processes doing SEND/RECV ping-pong and RDMA WRITE + READ through it;
4. SEND latency side by side: native pyverbs, the shared-ring engine (vrnicd posts
   for the guest) and the direct engine (the guest drives the NIC's own queues);
5. the kernel's object counts back where they started: nothing leaked.
"""

from __future__ import annotations

import subprocess
import sys

from rich.console import Console

from vrnic.backend.pyverbs_edge import describe
from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.sysfs import rdma_devices
from vrnic.config import PROJECT_DIR
from vrnic.errors import VrnicError
from vrnic.lab import latency, smoke

EXAMPLE = PROJECT_DIR / "examples" / "two_guests.py"


def main() -> int:
    console = Console(highlight=False)
    devices = rdma_devices()
    if len(devices) < 2:
        console.print(f"demo needs two RDMA devices (the lab's pair topology); found {devices or 'none'}")
        return 1
    console.print("[bold]1. Soft-RoCE devices inside the lab guest[/bold]")
    for device in devices:
        gids = ", ".join(f"{g.gid} ({g.type})" for port in describe(device).ports for g in port.gids)
        console.print(f"   {device}: {gids}")
    before = resource_counts()
    console.print("[bold]2. Native pyverbs RDMA WRITE (no vrnic in the path)[/bold]")
    try:
        result = smoke.local_write(devices[0], devices[1], length=65536)
    except VrnicError as exc:
        console.print(f"[red]RDMA WRITE failed:[/red] {exc}")
        return 1
    console.print(f"   [green]ok[/green] {result.describe()}")
    console.print("[bold]3. Two guests on two vRNICs of one tenant, through vrnicd[/bold]")
    run = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, check=False)
    for line in run.stdout.splitlines():
        console.print(f"   {line}", markup=False)
    if run.returncode != 0:
        console.print(f"[red]the two-guest example failed (exit {run.returncode})[/red]")
        console.print(run.stderr, markup=False)
        return 1
    console.print("[bold]4. SEND/RECV latency, 64 B one way (ping-pong / 2), median of 3 runs[/bold]")
    try:
        latency.native_send_latency_us((devices[0], devices[1]), 20)  # warm-up: the first run in a lab is slow
        native = latency.native_send_latency_us((devices[0], devices[1]))
        console.print(f"   native pyverbs         {native:8.1f} us")
        for engine, label in (("ring", "vrnic, shared-ring"), ("direct", "vrnic, direct")):
            value = latency.vrnic_send_latency_us((devices[0], devices[1]), engine)
            console.print(f"   {label:<22} {value:8.1f} us   ({value / native:.2f}x native)")
    except VrnicError as exc:
        console.print(f"[red]latency run failed:[/red] {exc}")
        return 1
    after = resource_counts()
    if after != before:
        console.print(f"[red]kernel objects leaked:[/red] before {before}, after {after}")
        return 1
    console.print("[bold]5.[/bold] [green]ok[/green] kernel objects back to baseline (rdma res show): nothing leaked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
