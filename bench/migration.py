"""Live migration of a VM with a busy vRNIC between two QEMU processes on one host (inside the lab).

The VM (raw QEMU, nested KVM, the migratable image) holds a vRNIC with 16 connected RC QPs and 65 MiB
registered (a 1 MiB MR and 32 of 2 MiB); vrnicd is the verbs driver in this process, on rxe0; the peer
is a container guest process on rxe1 that streams sequence-numbered 8-byte RDMA WRITEs and SENDs into
the VM on one of the QPs through every migration. The VM goes back and forth MIGRATIONS times, each
to a fresh destination QEMU; the medians are recorded.

- migration.total_ms: from vrnicd's prepare to the destination running (QEMU's pre-copy dominates).
- migration.qemu_downtime_ms: QEMU's own downtime, as QEMU reports it.
- migration.blackout_ms: the longest gap between two completions the peer saw during the migration,
  i.e. from its last completion before the pause to its first after the resume.
- migration.vrnic_overhead_ms = blackout - QEMU downtime. Its baseline is the issue's budget, 100 ms:
  the ratio is the share of the budget used (target <= 1).
- migration.switchover_ms: vrnicd's own part, with the VM stopped (hold, drain, copy of what the NIC
  wrote, the pre-set-up QPs taken into use, peers re-pointed, release).
- migration.guest_pause_ms: what the VM sits out: QEMU's downtime plus the time from the source's
  completion to the destination's `cont` (the destination's last loading, and vrnicd's switchover).
Every write and SEND the peer saw complete is checked in the VM at the end; a loss fails the bench.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import Record
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.core.specs import Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.lab.live_migration import migrate_vm
from vrnic.lab.migration_rig import (
    WRITE_AT,
    binding,
    boot_and_stream,
    largest_gap_ms,
    start_vm,
    stream_problems,
)
from vrnic.lab.vm_guest import build_migratable_initramfs
from vrnic.lab.vm_host import ensure_kvm

DOMAIN = "bench-mig"
MIGRATIONS = 3
EXTRA_QPS = 15  # plus the streaming one: 16 connected QPs
EXTRA_MRS = 32  # of 2 MiB, plus the 1 MiB one: 65 MiB registered
MEMORY_MIB = 384
BUDGET_MS = 100.0


def run() -> list[Record]:
    accel = "kvm" if ensure_kvm() else "tcg"
    with tempfile.TemporaryDirectory(prefix="vrnic-bench-mig-", dir="/run") as tmp:
        work = Path(tmp)
        image = build_migratable_initramfs(
            os.uname().release, work / "migratable.cpio.gz", Path(__file__).resolve().parents[1],
            program_args=("--mr-bytes", str(1 << 20), "--arena-bytes", str(72 << 20), "--extra-qps", str(EXTRA_QPS),
                          "--extra-mrs", str(EXTRA_MRS)), hugepages=40)
        driver = VerbsDriver(socket_path=work / "vrnicd.sock")
        try:
            vm_info, peer_info = (driver.create_vrnic(VrnicSpec(id=f"m{i}", tenant="bench", vpc_id=1, quota=Quota(),
                                                                virtual_gid=make_virtual_gid(1, 900 + i)), device)
                                  for i, device in enumerate(("rxe0", "rxe1")))

            rig = boot_and_stream(driver, lambda: driver.unbind_vm(DOMAIN), DOMAIN,  # an unborn death boots again
                                  lambda boot_dir: start_vm("mig0", image, boot_dir, accel, memory_mib=MEMORY_MIB),
                                  work, vm_info, peer_info)
            runs: list[dict[str, Any]] = []
            try:
                for n in range(1, MIGRATIONS + 1):
                    uri = f"unix:{work}/mig{n}.sock"
                    dest = start_vm(f"mig{n}", image, work, accel, incoming=uri, memory_mib=MEMORY_MIB)
                    result = migrate_vm(driver, DOMAIN, rig.vm, dest, binding(DOMAIN, dest, vm_info.vrnic_id), uri)
                    rig.vm.stop()
                    rig.follow(dest)
                    runs.append({"result": result, "window": (result.stats.issued_at, result.stats.resumed_at)})
                done = rig.peer.ask({"op": "stop"})
                _check(rig, done)
            finally:
                rig.close()
                driver.unbind_vm(DOMAIN)
                rig.vm.stop()
        finally:
            driver.close()
    registered = int(rig.info["registered_bytes"])
    qps = 1 + len(rig.info["extra_qpns"])
    blackouts = [largest_gap_ms(done["times"], *r["window"]) for r in runs]
    downtimes = [float(r["result"].stats.downtime_ms or 0) for r in runs]
    overheads = [b - d for b, d in zip(blackouts, downtimes, strict=True)]
    switchovers = [float(r["result"].switchover["total_ms"]) + float(r["result"].switchover["release_ms"])
                   for r in runs]
    totals = [r["result"].total_ms for r in runs]
    # What the guest itself sits out: QEMU's downtime ends when the source is done; the destination then
    # still loads the rest, vrnicd switches over, and only then does `cont` run it.
    pauses = [d + (r["result"].stats.resumed_at - r["result"].stats.completed_at) * 1000
              for d, r in zip(downtimes, runs, strict=True)]
    print(f"migration: {qps} QPs, {registered >> 20} MiB registered; per run: total {totals}, downtime {downtimes}, "
          f"blackout {blackouts}, overhead {overheads}, switchover {switchovers}, guest pause {pauses}; "
          f"last switchover "
          f"{runs[-1]['result'].switchover}")
    return [
        Record("migration.total_ms", "ms", statistics.median(totals)),
        Record("migration.qemu_downtime_ms", "ms", statistics.median(downtimes)),
        Record("migration.blackout_ms", "ms", statistics.median(blackouts)),
        Record("migration.vrnic_overhead_ms", "ms", statistics.median(overheads), BUDGET_MS, target=1.0),
        Record("migration.switchover_ms", "ms", statistics.median(switchovers)),
        Record("migration.guest_pause_ms", "ms", statistics.median(pauses)),
    ]


def _check(rig: Any, done: dict[str, Any]) -> None:
    """Nothing the peer saw complete may be missing in the VM, and nothing may be doubled."""
    received = rig.control.call("recv_stream_stop", expect=len(done["sends"]), timeout=60)
    slots = rig.control.call("check_slots", offset=WRITE_AT, count=len(done["writes"]) + 1, size=8)["seqs"]
    problems = stream_problems(done, received, slots)
    if problems:
        raise RuntimeError(f"the migrations lost or broke traffic: {problems}")
