"""The control experiment for the lab's migration faults: nested VMs live-migrated back and forth inside the
lab guest with no vRNIC, no vrnicd and no RDMA into the VM, optionally while perftest streams RDMA WRITEs
between the lab's own rxe devices (rxe1 -> rxe0) meanwhile.

The VM runs a busybox init that prints `tick N` on its console every 0.2 s and keeps writing to its RAM.
Each migration starts once the source ticks; after it the destination must tick again; one that runs (QMP)
and does not tick for 20 s is frozen, and a QEMU that ends on its own says why (its SHUTDOWN event's reason).

    vrnic lab run -- python -m vrnic.lab.nested_control --migrations 20 [--rxe-load]

Results from this session (README, live migration's limits): without the load, 60 of 60 migrations were
fine (vgif 0 and 1); with it, frozen destinations and a guest reset mid-migration, as in the vRNIC tests.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from vrnic.lab.qemu_vm import QemuVm, migrate
from vrnic.lab.vm_guest import busybox_initramfs, migratable_vm_spec
from vrnic.lab.vm_host import ensure_kvm

INIT = """#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
( while :; do /bin/busybox dd if=/dev/urandom of=/scratch bs=65536 count=128 2>/dev/null
  /bin/busybox usleep 100000; done ) &
i=0
while :; do i=$((i+1)); echo "tick $i"; /bin/busybox usleep 200000; done
"""
# perftest between the lab's two rxe devices, over and over (the pair topology: rxe0 is 10.77.1.1)
RXE_LOAD = ("while :; do ib_write_bw -d rxe0 -x 1 -D 15 -F -s 65536 >/dev/null 2>&1 & sleep 2; "
            "ib_write_bw -d rxe1 -x 1 -D 15 -F -s 65536 10.77.1.1 >/dev/null 2>&1; wait; done")


FROZEN_S = 20.0  # a destination that runs and does not tick this long is frozen


def ticks(vm: QemuVm) -> int:
    found = re.findall(r"tick (\d+)", vm.console(2000))
    return int(found[-1]) if found else 0


def ticks_past(vm: QemuVm, after: int, within: float) -> int:
    """The VM's tick count once it passed `after`, or the last seen when `within` s ran out (a loaded lab guest
    slows the VM: a few ticks in 3 s, not 15)."""
    deadline = time.monotonic() + within
    while (now := ticks(vm)) <= after and time.monotonic() < deadline and vm.exit_report(0) is None:
        time.sleep(0.5)
    return now


def run(migrations: int, rxe_load: bool) -> dict[str, int]:
    accel: Literal["kvm", "tcg"] = "kvm" if ensure_kvm() else "tcg"
    vgif = Path("/sys/module/kvm_amd/parameters/vgif")
    print(f"nested {accel}, kvm_amd vgif {vgif.read_text().strip() if vgif.exists() else '-'}, "
          f"rxe load {rxe_load}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="nested-control-"))
    image = busybox_initramfs(os.uname().release, [], lambda names: INIT, work / "tick.cpio.gz")
    load = subprocess.Popen(["sh", "-c", RXE_LOAD], start_new_session=True) if rxe_load else None
    counts = {"ok": 0, "frozen": 0, "ended": 0, "failed": 0}

    def boot(name: str, incoming: str | None = None) -> QemuVm:
        return QemuVm(migratable_vm_spec(name, work, image, accel=accel, vrnic=False, incoming=incoming)).start()

    src = boot("v0")
    try:
        for i in range(1, migrations + 1):
            ticks_past(src, 0, 120)  # booted: migrating a guest still in its boot would be another experiment
            uri = f"unix:{work}/m{i}.sock"
            dst = boot(f"v{i}", uri)
            try:
                stats = migrate(src, dst, uri, timeout=120)
            except Exception as exc:  # counted and shown: the experiment goes on with a fresh VM
                counts["failed"] += 1
                print(f"{i}: migration failed: {exc}; source: {src.exit_report(0.5) or 'runs'}", flush=True)
                dst.stop()
                src.stop()
                src = boot(f"f{i}")
                continue
            src.stop()
            first = ticks(dst)
            later = ticks_past(dst, first, FROZEN_S)
            ended = dst.exit_report(0.5)
            if ended is None and later > first:
                counts["ok"] += 1
                print(f"{i}: ok (downtime {stats.downtime_ms} ms), ticks {first} -> {later}", flush=True)
                src = dst
                continue
            if ended is not None:
                counts["ended"] += 1
                print(f"{i}: the destination ended: {ended}", flush=True)
            else:
                counts["frozen"] += 1
                registers = [line.strip() for line in dst.qmp.hmp("info registers").splitlines()
                             if "RIP=" in line or "HLT=" in line]
                print(f"{i}: the destination runs but did not tick for {FROZEN_S:.0f} s ({first} -> {later}): "
                      + " | ".join(registers), flush=True)
            dst.stop()
            src = boot(f"f{i}")
    finally:
        src.stop()
        if load is not None:
            subprocess.run(["pkill", "-g", str(load.pid)], check=False)
    print(f"COUNTS {counts}", flush=True)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--migrations", type=int, default=20)
    parser.add_argument("--rxe-load", action="store_true", help="perftest between rxe1 and rxe0 meanwhile")
    args = parser.parse_args(argv)
    run(args.migrations, args.rxe_load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
