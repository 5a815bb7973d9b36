"""Live migration of a VM with a busy vRNIC from lab host a to lab host b (topology two-hosts): bench/migration.py's
records, across hosts, the way tests/two_hosts/test_vm_handover_rxe.py moves it (vrnic.lab.two_hosts.vm_move).

Runs on host a inside `vrnic lab run --topology two-hosts -- python -m vrnic.lab.two_hosts -- python -m
bench.two_hosts --out FILE` (bench/run.py runs it with the other two-hosts suites).

The VM (raw QEMU, nested KVM where both lab hosts offer it, the migratable image) holds a vRNIC with 16
connected RC QPs and 65 MiB registered (a 1 MiB MR and 32 of 2 MiB), served by a's `vrnic daemon`; the peer is a
container guest process on a that streams sequence-numbered 8-byte RDMA WRITEs and SENDs into the VM on one QP
through the move. A's API prepares the hand-over to b, a's QEMU migrates to b's over the lab link, and a's API
switches the vRNIC over once b's QEMU is paused (QEMU's pre-copy, then vrnicd's switchover: hold, drain, copy
what the NIC wrote, b takes the state over, the database records the move, the peer is re-pointed). Each of
MOVES moves starts a fresh VM on a; the medians are recorded:

- migration.two_hosts.total_ms: from a's prepare to b's QEMU running.
- migration.two_hosts.qemu_downtime_ms: QEMU's own downtime, as a's QEMU reports it.
- migration.two_hosts.blackout_ms: the longest gap between two completions the peer saw during the move.
- migration.two_hosts.vrnic_overhead_ms = blackout - QEMU downtime, against the issue's budget of 100 ms.
- migration.two_hosts.switchover_ms: a's switchover call, as a's agent timed it.
- migration.two_hosts.guest_pause_ms: QEMU's downtime plus the time from a's completion to b's `cont`.
Every write and SEND the peer saw complete is checked in the VM on b at the end; a loss fails the bench.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import RESULTS, Record, write
from vrnic.config import PROJECT_DIR, lab_output_dir
from vrnic.errors import LabError
from vrnic.lab.migration_rig import largest_gap_ms
from vrnic.lab.two_hosts.rig import Rig
from vrnic.lab.two_hosts.vm_move import MovingVm
from vrnic.lab.vm_guest import build_migratable_initramfs
from vrnic.lab.vm_host import ensure_kvm

DOMAIN = "bench-xmig"
MOVES = 3
PORT = 18652
EXTRA_QPS = 15  # plus the streaming one: 16 connected QPs
EXTRA_MRS = 32  # of 2 MiB, plus the 1 MiB one: 65 MiB registered
MEMORY_MIB = 384
BUDGET_MS = 100.0


def run(out: Path, log: bool = True) -> int:
    runs: list[dict[str, Any]] = []
    with Rig.start(log=log, agent_env={"VRNIC_HOST_DOWN_AFTER_S": "120"}) as rig:
        kvm_b = rig.run_on_b([sys.executable, "-c", "from vrnic.lab.vm_host import ensure_kvm; print(ensure_kvm())"])
        accel = "kvm" if ensure_kvm() and str(kvm_b.get("stdout", "")).strip() == "True" else "tcg"
        shared = lab_output_dir("two-hosts", "xvm-bench")  # b reads the image here too
        shared.mkdir(parents=True, exist_ok=True)
        image = build_migratable_initramfs(
            os.uname().release, shared / "migratable.cpio.gz", PROJECT_DIR,
            program_args=("--mr-bytes", str(1 << 20), "--arena-bytes", str(72 << 20), "--extra-qps", str(EXTRA_QPS),
                          "--extra-mrs", str(EXTRA_MRS)), hugepages=40)
        token = rig.make_tenant("migration-bench")
        for n in range(1, MOVES + 1):
            runs.append(_one_move(rig, token, image, accel, n))
            print(f"migration.two_hosts: move {n}: {json.dumps(runs[-1], default=str)}", flush=True)
    blackouts = [r["blackout_ms"] for r in runs]
    downtimes = [float(r["qemu_downtime_ms"]) for r in runs]
    overheads = [b - d for b, d in zip(blackouts, downtimes, strict=True)]
    print(f"migration.two_hosts ({accel}): {runs[-1]['qps']} QPs, {runs[-1]['registered_mib']} MiB registered; "
          f"blackout {blackouts}, downtime {downtimes}, overhead {overheads}; last switchover {runs[-1]['report']}",
          flush=True)
    write([
        Record("migration.two_hosts.total_ms", "ms", statistics.median(r["total_ms"] for r in runs)),
        Record("migration.two_hosts.qemu_downtime_ms", "ms", statistics.median(downtimes)),
        Record("migration.two_hosts.blackout_ms", "ms", statistics.median(blackouts)),
        Record("migration.two_hosts.vrnic_overhead_ms", "ms", statistics.median(overheads), BUDGET_MS, target=1.0),
        Record("migration.two_hosts.switchover_ms", "ms", statistics.median(r["switchover_ms"] for r in runs)),
        Record("migration.two_hosts.guest_pause_ms", "ms", statistics.median(r["guest_pause_ms"] for r in runs)),
    ], out)
    return 0


def _one_move(rig: Rig, token: str, image: Path, accel: Any, n: int) -> dict[str, Any]:
    vm_row, peer_row = rig.allocate("a", token), rig.allocate("a", token)
    api = rig.client("a")
    moving = None
    with tempfile.TemporaryDirectory(prefix="vrnic-bench-xmig-", dir="/run") as tmp:
        try:
            moving = MovingVm.start(rig, api, DOMAIN, image, accel, Path(tmp), vm_row, peer_row, memory_mib=MEMORY_MIB)
            timings = moving.move(PORT + n)
            done = moving.stream.peer.ask({"op": "stop"})
            problems = moving.problems(done)
            if problems:
                raise LabError(f"move {n} lost or broke traffic: {problems}")
            report = timings["report"]
            return {"total_ms": timings["total_ms"], "qemu_downtime_ms": timings["qemu_downtime_ms"],
                    "blackout_ms": largest_gap_ms(done["times"], timings["started"], timings["resumed"]),
                    "switchover_ms": report["total_ms"],
                    "guest_pause_ms": timings["qemu_downtime_ms"] + (timings["resumed"] - timings["completed"]) * 1000,
                    "qps": report["qps"], "registered_mib": int(moving.stream.info["registered_bytes"]) >> 20,
                    "writes": len(done["writes"]), "report": report}
        finally:
            if moving is not None:
                moving.close()
            for row in (vm_row, peer_row):
                if (answer := rig.release(row["id"])).status_code != 200:
                    print(f"migration.two_hosts: releasing {row['id']}: {answer.status_code} {answer.text}", flush=True)
            api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "migration_two_hosts.json")
    return run(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
