"""Live migration of a VM with a vRNIC between two raw QEMU processes in the lab (issue 11, same host).

The VM boots the migratable image (python3 and the peer program in the initramfs, no 9p) under
nested KVM; vrnicd (the in-process verbs driver) maps its RAM file and serves its vRNIC channel; its
partner is a container guest on rxe. Proves, before the migration, SEND both ways, a receive stream
and sequence-numbered RDMA WRITEs into the VM; then a plain migration (vrnicd not told) to a second
QEMU: the destination runs the same program (pid, instance, boot_id), and an RDMA WRITE made before
the migration is in the destination's RAM (through the program and through QMP `xp`). The vRNIC is
not expected to work afterwards: moving vrnicd's side is another part of issue 11.

Run: vrnic lab run --topology pair --timeout 900 -e PYTHONPATH=$PWD -- pytest -m kernel -x -s \
     tests/kernel/test_qemu_migration.py
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from vrnic.core.specs import AttachInfo, VmBinding, VmVrnic
from vrnic.errors import LabError
from vrnic.lab.qemu_vm import QemuVm, migrate
from vrnic.lab.vm_guest import (
    CONTROL_PORT,
    ControlPort,
    HostPeer,
    build_migratable_initramfs,
    channel_socket,
    migratable_vm_spec,
)
from vrnic.lab.vm_host import ensure_kvm
from vrnic.vm.domain_xml import DEFAULT_CHANNEL
from vrnic.vm.guest_ram import parse_hmp_xp

pytestmark = pytest.mark.kernel
PROJECT = Path(__file__).resolve().parents[2]
MR_BYTES = 1 << 20
SLOTS_AT = 512 << 10  # where the peer's sequence-numbered writes land in the VM's MR
SLOT = 4096
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def accel() -> Iterator[Literal["kvm", "tcg"]]:
    if os.environ.get("VRNIC_LAB") != "1":
        pytest.skip("needs the lab guest (nested KVM): vrnic lab run --topology pair -- pytest "
                    "tests/kernel/test_qemu_migration.py")
    for tool in ("qemu-system-x86_64", "cpio", "ldd"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    kvm = ensure_kvm()
    if not kvm:
        print("no /dev/kvm: the VMs run under TCG (slow)")
    yield "kvm" if kvm else "tcg"
    print(f"\nTIMINGS {dict((k, round(v, 2)) for k, v in TIMINGS.items())}")


def _ready(control: ControlPort, vm: QemuVm) -> dict[str, Any]:
    try:
        return control.ready()
    except Exception as exc:
        raise AssertionError(f"{exc}; console:\n{vm.console()}\nqemu:\n{vm.log_tail()}") from exc


def test_plain_migration_keeps_the_program_and_rdma_written_memory(
        accel: Literal["kvm", "tcg"], driver: Any, make_vrnic: Callable[..., AttachInfo], device_pair: tuple[str, str],
        tmp_path: Path) -> None:
    vm_info = make_vrnic(device=device_pair[0])
    peer_info = make_vrnic(device=device_pair[1])
    t0 = time.monotonic()
    image = build_migratable_initramfs(os.uname().release, tmp_path / "migratable.cpio.gz", PROJECT,
                                       program_args=("--mr-bytes", str(MR_BYTES)))
    TIMINGS["image_build_s"] = time.monotonic() - t0
    TIMINGS["image_mib"] = image.stat().st_size / (1 << 20)
    uri = f"unix:{tmp_path}/mig.sock"
    source = QemuVm(migratable_vm_spec("src", tmp_path, image, accel=accel))
    dest = QemuVm(migratable_vm_spec("dst", tmp_path, image, accel=accel, incoming=uri))
    name = "vrnic-mig-1"
    peer = control = None
    try:
        t0 = time.monotonic()
        source.start()
        driver.bind_vm(VmBinding(domain=name, ram_path=str(source.ram_path), machine="q35", vrnics=[
            VmVrnic(vrnic_id=vm_info.vrnic_id, channel_socket=str(channel_socket(source.spec, DEFAULT_CHANNEL)))]))
        control = ControlPort(channel_socket(source.spec, CONTROL_PORT))
        vm = _ready(control, source)
        TIMINGS["boot_to_ready_s"] = time.monotonic() - t0
        print(f"\nVM program ready: {vm}\nconsole: {source.console()}")
        assert vm["gid"] == vm_info.virtual_gid and vm["length"] == MR_BYTES
        before = control.call("whoami")
        peer = HostPeer(peer_info)
        control.call("connect", **peer.info())
        peer.connect(vm)
        # SEND both ways
        hello = b"hello from the VM " + secrets.token_bytes(8)
        peer.post_recv()
        control.call("send", data=hello.hex())
        got = peer.cq.wait(1, timeout=30)[0]
        assert got.byte_len == len(hello) and peer.mr.read(len(hello)) == hello
        back = b"hello VM " + secrets.token_bytes(8)
        control.call("post_recv", count=1)
        peer.send(back)
        assert control.call("wait_recv", count=1)["received"] == [back.hex()]
        # a receive stream: sequence-numbered SENDs, more than the slots it keeps posted; the control port
        # answers meanwhile, and verbs on the QP are refused
        control.call("recv_stream_start", slots=8)
        assert control.call("whoami")["instance"] == before["instance"]
        with pytest.raises(Exception, match="receive stream"):
            control.call("send", data="00")
        for seq in range(1, 41):
            peer.send(seq.to_bytes(8, "little") + b"stream")
        stream = control.call("recv_stream_stop", expect=40, timeout=30)
        assert stream == {"ok": True, "op": "recv_stream_stop", "seq": stream["seq"],
                          "seqs": list(range(1, 41)), "errors": []}
        # sequence-numbered RDMA WRITEs into slots of the VM's MR, and a pattern to find after the migration
        for seq in range(1, 17):
            peer.write_into_vm(seq.to_bytes(8, "little") + secrets.token_bytes(24), vm_offset=SLOTS_AT + seq * SLOT)
        assert control.call("check_slots", offset=SLOTS_AT + SLOT, count=16, size=SLOT)["seqs"] == list(range(1, 17))
        pattern = b"WRITTEN BEFORE THE MIGRATION " + secrets.token_bytes(16)
        at = 200_000
        peer.write_into_vm(pattern, vm_offset=at)
        assert control.call("peek", offset=at, length=len(pattern))["data"] == pattern.hex()

        # a migration cancelled midway (from another thread, as a controller would): the source runs on
        doomed = QemuVm(migratable_vm_spec("dst0", tmp_path, image, accel=accel, incoming=f"unix:{tmp_path}/mig0.sock"))
        try:
            doomed.start()
            failures: list[str] = []

            def doomed_migration() -> None:
                try:  # throttled so that it is still running when cancelled
                    migrate(source, doomed, f"unix:{tmp_path}/mig0.sock", parameters={"max-bandwidth": 8 << 20},
                            timeout=60)
                except LabError as exc:
                    failures.append(str(exc))

            thread = threading.Thread(target=doomed_migration)
            thread.start()
            time.sleep(1.0)
            source.qmp.execute("migrate_cancel")
            thread.join(30)
            assert failures and "cancelled" in failures[0], failures
        finally:
            doomed.stop()
        assert source.qmp.execute("query-status")["status"] == "running"
        assert control.call("whoami")["instance"] == before["instance"]

        # plain migration (vrnicd not told) to a second QEMU on this host, through the switchover pause
        dest.start()
        seen: dict[str, Any] = {}
        stats = migrate(source, dest, uri, pause_before_switchover=True, parameters={"max-bandwidth": 1 << 30},
                        on_switchover=lambda: seen.update(source=source.qmp.execute("query-status")),
                        before_resume=lambda: seen.update(dest=dest.qmp.execute("query-status")), timeout=120)
        assert not seen["source"]["running"] and seen["dest"]["status"] == "paused", seen
        assert stats.total_ms and stats.downtime_ms, stats.raw  # QEMU fills them in just after "completed"
        marks = [stats.issued_at, stats.pre_switchover_at, stats.continue_at, stats.completed_at, stats.resumed_at]
        assert None not in marks and marks == sorted(marks), marks  # type: ignore[type-var]
        control.close()
        control = ControlPort(channel_socket(dest.spec, CONTROL_PORT))
        after = control.call("whoami")
        TIMINGS.update(migration_total_ms=stats.total_ms or -1, migration_downtime_ms=stats.downtime_ms or -1,
                       migration_wall_ms=stats.wall_ms or -1, migration_ram_mib=stats.ram_transferred / (1 << 20))
        print(f"migration: {stats}\nbefore {before}\nafter {after}")
        assert dest.qmp.execute("query-status")["status"] == "running"
        assert source.qmp.execute("query-status")["status"] == "postmigrate"
        assert {k: after[k] for k in ("pid", "instance", "boot_id")} == \
               {k: before[k] for k in ("pid", "instance", "boot_id")}
        assert after["uptime_s"] > before["uptime_s"]
        assert control.call("peek", offset=at, length=len(pattern))["data"] == pattern.hex()
        assert control.call("check_slots", offset=SLOTS_AT + SLOT, count=16, size=SLOT)["seqs"] == list(range(1, 17))
        address, seen = parse_hmp_xp(dest.qmp.hmp(f"xp /{len(pattern)}xb {vm['addr'] + at:#x}"))
        assert (address, seen) == (vm["addr"] + at, pattern)
        with dest.ram_path.open("rb") as ram:  # GPA = file offset below the ROM window
            ram.seek(vm["addr"] + at)
            assert ram.read(len(pattern)) == pattern
    finally:
        if peer is not None:
            peer.close()
        if control is not None:
            control.close()
        driver.unbind_vm(name)
        for vm_ in (dest, source):
            with contextlib.suppress(Exception):
                vm_.stop()
