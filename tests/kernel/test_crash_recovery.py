"""Crash recovery under a kill storm on real rxe (and netdevsim VFs when the lab has them): `vrnic daemon` is
killed with SIGKILL a random moment into allocate, attach, create_qp, connect, release, token re-issue, SR-IOV
allocate and a forced VF count change, under guest traffic, and restarted; after each restart the database,
vrnicd, `rdma res` and netlink must agree, and the guest attaches again with its token and rebuilds.
VRNIC_KILL_STORM_KILLS sets the size (default 4 in `make test`; `make bench` runs 50: bench/recovery.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vrnic.config import lab_output_dir
from vrnic.lab.kill_storm import KillStorm

pytestmark = pytest.mark.kernel


def test_kill_storm_leaves_database_kernel_and_netlink_in_agreement(device_pair: tuple[str, str]) -> None:
    kills = int(os.environ.get("VRNIC_KILL_STORM_KILLS", "4"))
    # the daemon's log where it outlives a lost guest (the lab's output dir), unless VRNIC_KILL_STORM_DIR says
    workdir = Path(os.environ.get("VRNIC_KILL_STORM_DIR") or lab_output_dir("kill-storm"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "daemon.log").unlink(missing_ok=True)  # the log appends across the storm's restarts, not runs
    storm = KillStorm(workdir, device_pair, pf=os.environ.get("VRNIC_LAB_NETDEVSIM_PF") or None, seed=15,
                      say=print)
    try:
        result = storm.run(kills)
    finally:
        storm.stop()
    print(f"kill storm: {result}")
    assert result.disagreements == []
    assert result.kills == result.restarts == kills
    assert result.guest_rebuilds >= kills  # every kill cut the guest off; it attached again each time
    assert result.guest_round_trips > kills
