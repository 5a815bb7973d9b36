"""`make demo-migrate`: live migration of a VM whose program is in the middle of RDMA traffic, inside the lab.

Run inside the lab: `vrnic lab run --topology pair --timeout 900 -- python -m vrnic.lab.migrate_demo`.
1. a raw QEMU VM boots the migratable image (nested KVM, or TCG); vrnicd (in-process verbs driver, rxe0) binds it;
2. a peer process (a container guest on rxe1, same tenant and VPC) streams numbered RDMA WRITEs and SENDs into it;
3. QEMU live-migrates the VM to a second QEMU while vrnicd moves the vRNIC (prepare, switchover);
4. on the destination: the same program, every completed write in its RAM, every SEND once and in order, the
   kernel's RDMA objects replaced one for one;
5. cleanup: the kernel's RDMA objects back at their baseline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape

from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.sysfs import rdma_devices
from vrnic.config import PROJECT_DIR
from vrnic.core.specs import Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import VrnicError
from vrnic.lab.live_migration import LiveMigration, migrate_vm
from vrnic.lab.migration_rig import (
    SLOTS,
    WRITE_AT,
    Streaming,
    binding,
    boot_and_stream,
    identity,
    largest_gap_ms,
    start_vm,
)
from vrnic.lab.qemu_vm import QemuVm
from vrnic.lab.vm_guest import build_migratable_initramfs
from vrnic.lab.vm_host import ensure_kvm

DOMAIN = "demo-mig"
TENANT, VPC = "acme", 1
Counts = dict[str, dict[str, int]]


class Failed(Exception):
    """A check of the demo did not hold."""


class Steps:
    def __init__(self, console: Console) -> None:
        self.console, self.step = console, 0

    def title(self, text: str) -> None:
        self.step += 1
        self.console.print(f"[bold]{self.step}. {text}[/bold]")

    def say(self, text: str) -> None:
        self.console.print(f"   {text}", markup=False, highlight=False)


# Pure: what the numbers say.

def counts_line(counts: Counts) -> str:
    return "; ".join(f"{device}: " + " ".join(f"{kind} {count[kind]}" for kind in ("pd", "cq", "qp", "mr"))
                     for device, count in sorted(counts.items()))


def migration_lines(result: LiveMigration, blackout_ms: float) -> list[str]:
    s, q = result.switchover, result.stats
    return [f"QEMU: total {q.total_ms or 0:.0f} ms, downtime {q.downtime_ms or 0:.0f} ms "
            f"({q.ram_transferred >> 20} MiB of RAM sent)",
            f"vrnicd: prepare {result.prepare_ms:.0f} ms (while the VM runs); switchover {s['total_ms']:.1f} ms (VM "
            f"paused): {s['qps']} QP rebuilt, {s['peers_repointed']} peer QP re-pointed, {s['dirty_pages']} pages "
            f"the NIC wrote ({s['copied_bytes']} B) copied, {s['recvs_reposted']} receives re-posted",
            f"the peer's blackout: {blackout_ms:.0f} ms (its longest wait for a completion during the migration)"]


def leading_seqs(raw: bytes) -> list[int]:
    """Slot s holds s once the peer's write s landed: the numbers 1, 2, ... found in a row."""
    seqs = [int.from_bytes(raw[i:i + 8], "little") for i in range(8, len(raw) - 7, 8)]
    n = next((i for i, seq in enumerate(seqs) if seq != i + 1), len(seqs))
    return seqs[:n]


def check(ok: bool, failure: str) -> None:
    if not ok:
        raise Failed(failure)


# I/O

def pmem_slots(vm: QemuVm, info: dict[str, Any], count: int, path: Path) -> list[int]:
    """The peer's slots in the VM's memory, read by QEMU (QMP pmemsave of guest-physical memory)."""
    vm.qmp.execute("pmemsave", val=info["addr"] + WRITE_AT, size=8 * (count + 1), filename=str(path))
    return leading_seqs(path.read_bytes())


def wait_for(baseline: Counts, timeout: float = 15.0) -> Counts:
    deadline = time.monotonic() + timeout
    while (now := resource_counts()) != baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


def verify(out: Steps, rig: Streaming, done: dict[str, Any], who: dict[str, Any], objects: Counts,
           work: Path) -> None:
    check(not done["errors"], f"the peer's traffic failed: {done['errors']}")
    writes, sends = done["writes"], done["sends"]
    check(len(writes) > 0 and writes == list(range(1, len(writes) + 1)), "the peer's writes are not 1, 2, ...")
    out.say(f"the peer completed {len(writes)} RDMA WRITEs and {len(sends)} SENDs, no errors")
    now = rig.control.call("whoami")
    check(identity(now) == identity(who), f"the VM's program restarted: before {who}, after {now}")
    out.say(f"same program: pid {now['pid']}, instance {now['instance']}, boot {now['boot_id'][:8]}, "
            f"up {now['uptime_s']:.0f} s")
    slots = rig.control.call("check_slots", offset=WRITE_AT, count=len(writes) + 1, size=8)["seqs"]
    missing = [seq for seq in writes if slots[seq] != seq]
    check(not missing, f"{len(missing)} completed RDMA WRITEs are not in the destination's memory: {missing[:10]}")
    check(pmem_slots(rig.vm, rig.info, len(writes), work / "slots.bin") == writes,
          "QMP pmemsave on the destination does not show every completed write")
    out.say(f"all {len(writes)} completed RDMA WRITEs are in the destination's RAM "
            f"(read by the program, and by QEMU through QMP pmemsave)")
    stream = rig.control.call("recv_stream_stop", expect=len(sends), timeout=30)
    check(not stream["errors"] and stream["seqs"] == sends,
          f"SENDs lost or doubled: {len(sends)} sent, {len(stream['seqs'])} received, errors {stream['errors'][:3]}")
    out.say(f"all {len(sends)} SENDs received once each, in order")
    after = resource_counts()
    check(after == objects, f"rdma res: {counts_line(objects)} before the migration, {counts_line(after)} after")
    out.say(f"rdma res show: {counts_line(after)}, as before the migration (the source's objects were replaced)")


def run(out: Steps, work: Path) -> None:
    devices = sorted(rdma_devices())
    check(len(devices) >= 2, f"needs two RDMA devices (the lab's pair topology); found {devices or 'none'}")
    out.title("Build the migratable image, boot a VM in QEMU, vrnicd binds it")
    t0 = time.monotonic()
    image = build_migratable_initramfs(os.uname().release, work / "migratable.cpio.gz", PROJECT_DIR,
                                       program_args=("--mr-bytes", str(1 << 20)))
    out.say(f"initramfs with python3 and the guest program: {image.stat().st_size >> 20} MiB, "
            f"{time.monotonic() - t0:.1f} s")
    accel: Literal["kvm", "tcg"] = "kvm" if ensure_kvm() else "tcg"
    out.say("QEMU runs under nested KVM" if accel == "kvm" else "no /dev/kvm: QEMU falls back to TCG (slow)")
    baseline = resource_counts()
    driver = VerbsDriver(socket_path=work / "vrnicd.sock")
    vms: list[QemuVm] = []
    rig: Streaming | None = None
    try:
        vm_info, peer_info = (driver.create_vrnic(VrnicSpec(id=name, tenant=TENANT, vpc_id=VPC, quota=Quota(),
                                                            virtual_gid=make_virtual_gid(VPC, 1 + i)), device)
                              for i, (name, device) in enumerate((("vm", devices[0]), ("peer", devices[1]))))
        out.say(f"vrnicd (in-process verbs driver): vRNIC {vm_info.vrnic_id} on {devices[0]} for the VM, "
                f"{peer_info.vrnic_id} on {devices[1]} for the peer; tenant {TENANT}, VPC {VPC}")

        rig = boot_and_stream(driver, lambda: driver.unbind_vm(DOMAIN), DOMAIN,  # an unborn death boots again
                              lambda boot_dir: start_vm("src", image, boot_dir, accel), work, vm_info, peer_info,
                              say=out.say)
        vms.append(rig.vm)
        who = rig.control.call("whoami")
        out.say(f"QEMU pid {vms[0].pid} booted; vrnicd bound {DOMAIN}; its program was ready {rig.ready_s:.1f} s "
                f"later: pid {who['pid']}, instance {who['instance']}, virtual GID {rig.info['gid']}")
        out.title("A peer process streams RDMA WRITEs and SENDs into the VM")
        out.say(f"peer pid {rig.peer.proc.pid}, QP {rig.peer.info['qpns'][0]} -> the VM's QP {rig.info['qpn']}: "
                f"number n as an 8-byte RDMA WRITE into slot n of the VM's MR, every 4th also as a SEND")
        time.sleep(1.0)
        landed = len(pmem_slots(vms[0], rig.info, SLOTS - 1, work / "before.bin"))
        out.say(f"after 1 s: writes 1..{landed} are in the VM's memory (QMP pmemsave), and still coming")
        objects = resource_counts()
        out.title("Live migration to a second QEMU; vrnicd moves the vRNIC")
        uri = f"unix:{work}/mig.sock"
        vms.append(start_vm("dst", image, work, accel, incoming=uri))
        out.say(f"destination QEMU pid {vms[1].pid}, paused, incoming on {uri}; migrating...")
        result = migrate_vm(driver, DOMAIN, vms[0], vms[1], binding(DOMAIN, vms[1], vm_info.vrnic_id), uri)
        vms[0].stop()
        rig.follow(vms[1])
        time.sleep(1.0)  # traffic on the destination
        done = rig.peer.ask({"op": "stop"})
        for line in migration_lines(result, largest_gap_ms(done["times"], result.stats.issued_at,
                                                           result.stats.resumed_at)):
            out.say(line)
        out.title("After 1 s more of traffic the peer stops: checks on the destination")
        verify(out, rig, done, who, objects, work)
        out.title("Clean up: unbind, stop QEMU, close vrnicd")
    finally:
        if rig is not None:
            rig.close()
        with contextlib.suppress(VrnicError):
            driver.unbind_vm(DOMAIN)
        for vm in vms:
            vm.stop()
        driver.close()
    final = wait_for(baseline)
    check(final == baseline, f"kernel objects leaked: before {counts_line(baseline)}, after {counts_line(final)}")
    out.say(f"rdma res show: {counts_line(final)} (the baseline from before the VM was bound)")


def run_demo(name: str, body: Callable[[Steps, Path], None]) -> int:
    """Run a lab demo's steps in a scratch directory under /run; 0, or 1 with the reason."""
    console = Console(highlight=False, soft_wrap=True)  # long ids and paths stay on one line
    logging.getLogger("vrnic").setLevel(logging.WARNING)  # vrnicd's INFO lines would bury the steps
    try:
        with tempfile.TemporaryDirectory(prefix=f"vrnic-{name}-", dir="/run") as tmp:
            body(Steps(console), Path(tmp))
    except (Failed, VrnicError, RuntimeError, OSError) as exc:
        console.print(f"[red]{name} failed:[/red] {escape(str(exc))}")
        return 1
    console.print(f"[green]{name}: ok[/green]")
    return 0


def main() -> int:
    return run_demo("demo-migrate", run)


if __name__ == "__main__":
    sys.exit(main())
