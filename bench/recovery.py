"""Crash recovery under a kill storm (inside the lab, with netdevsim VFs): `vrnic daemon` killed with SIGKILL at
random points under guest traffic, at least 50 times; after each restart the checker compares the database,
vrnicd, `rdma res` and netlink (vrnic.lab.kill_storm). Records: kills, restarts, disagreements (target 0),
mean recovery time (SIGKILL to the new daemon answering), guest rebuilds."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bench.harness import Record

KILLS = 50


def run(pair: tuple[str, str] = ("rxe0", "rxe1")) -> list[Record]:
    from vrnic.lab.kill_storm import KillStorm

    with tempfile.TemporaryDirectory(prefix="vrnic-storm-") as workdir:
        storm = KillStorm(Path(workdir), pair, pf=os.environ.get("VRNIC_LAB_NETDEVSIM_PF"),
                          seed=2026, say=print)
        try:
            result = storm.run(KILLS)
        finally:
            storm.stop()
    for line in result.disagreements:
        print(f"recovery: DISAGREEMENT {line}")
    print(f"recovery: kill points {result.kill_points}")
    return [
        Record("recovery.kills", "kills", result.kills),
        Record("recovery.restarts", "restarts", result.restarts),
        Record("recovery.disagreements_found", "count", len(result.disagreements), at_most=0),
        Record("recovery.mean_recovery_time", "s", result.mean_recovery_s),
        Record("recovery.max_recovery_time", "s", max(result.recovery_s, default=0.0)),
        Record("recovery.guest_rebuilds", "rebuilds", result.guest_rebuilds),
        Record("recovery.guest_round_trips", "round trips", result.guest_round_trips),
    ]
