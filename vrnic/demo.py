"""`make demo`: what vrnic does, shown on real Soft-RoCE inside the bench.

Run inside the bench: `vrnic lab run -- python -m vrnic.demo`.
"""

from __future__ import annotations

import sys

from rich.console import Console

from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.sysfs import gid_table, rdma_devices
from vrnic.errors import VrnicError
from vrnic.lab import smoke


def main() -> int:
    console = Console(highlight=False)
    devices = rdma_devices()
    if len(devices) < 2:
        console.print(f"demo needs two RDMA devices (the bench's pair topology); found {devices or 'none'}")
        return 1
    console.print("[bold]vrnic demo[/bold]: Soft-RoCE devices inside the bench guest")
    for device in devices:
        gids = ", ".join(f"{gid} ({kind})" for _, gid, kind in gid_table(device))
        console.print(f"  {device}: {gids}")
    before = resource_counts()
    try:
        result = smoke.local_write(devices[0], devices[1], length=65536)
    except VrnicError as exc:
        console.print(f"[red]RDMA WRITE failed:[/red] {exc}")
        return 1
    console.print(f"[green]ok[/green] {result.describe()}")
    after = resource_counts()
    leaked = {d: {k: after[d][k] - before[d][k] for k in before[d] if after[d][k] != before[d][k]}
              for d in before if after.get(d) != before[d]}
    if leaked:
        console.print(f"[red]kernel objects leaked:[/red] {leaked}")
        return 1
    console.print("[green]ok[/green] kernel objects back to baseline (rdma res show)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
