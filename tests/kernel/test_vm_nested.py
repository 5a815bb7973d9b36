"""A nested libvirt/QEMU VM inside the lab: the foundation of attaching a vRNIC to a VM (issue 9).

Proves on real libvirtd + nested KVM that
(a) a domain built by vrnic.vm.domain_xml reaches running,
(b) its RAM file exists under memory_backing_dir, and a MAP_SHARED mapping of it (as vrnicd would
    map it) sees bytes the guest wrote, at a file offset QEMU's monitor (`xp`) confirms is the same
    guest-physical address; bytes stored through the mapping are seen at that address too, and an
    RDMA WRITE (rxe0) into an MR registered over the RAM file lands in a file the guest then reads,
(c) a line round-trips over the virtio-serial channel's unix socket, the channel survives the host end
    reconnecting (vrnicd restarting), and vrnic.core.proto frames up to the cap echo byte-exactly,
(d) destroy + undefine leave no QEMU, no domain and no RAM file behind.

Run: vrnic lab run --topology single -e PYTHONPATH=$PWD -- python -m pytest -s tests/kernel/test_vm_nested.py
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from vrnic.backend.guest_memory import GuestMemory
from vrnic.backend.sysfs import rdma_devices
from vrnic.core.proto import MAX_BODY, FrameDecoder, encode
from vrnic.lab.kernel import kernel_image
from vrnic.lab.vm_guest import busybox_initramfs
from vrnic.lab.vm_host import (
    URI,
    VmHost,
    VmHostConfig,
    boot_and_wait,
    bounded,
    domain_report,
    leftover_processes,
    ram_file,
    virsh,
)
from vrnic.vm.domain_xml import (
    DEFAULT_CHANNEL,
    DirectKernelBoot,
    DomainType,
    SerialConsole,
    VirtioSerialChannel,
    VmDomain,
    VrnicAttachment,
)
from vrnic.vm.guest_ram import GuestRamFile, parse_hmp_xp

BUSYBOX = Path("/bin/busybox")
NESTED_MODULES = ("virtio_pci", "virtio_console")
MEMORY_MIB = 256
NESTED_MARK = "vrnic-nested:"  # the first thing the guest's /init prints on its console
PAGE = 4096
TIMINGS: dict[str, float] = {}

# The nested guest's /init. There is no udev, so it finds its port in sysfs and makes the
# /dev/virtio-ports/<name> link itself. It opens the port once and keeps it open (read in 6.1's
# virtio_console.c: one opener at a time, else EBUSY; data arriving while no guest process holds the
# port open is discarded; a read returns EOF while the host end is disconnected), says "ready", so the
# host knows it may send, echoes one line, writes a
# pattern derived from that line into its own RAM (a file on the initramfs rootfs = page cache),
# says "written", then serves: check (first line of that file), ping (pong, with the number of EOFs
# seen while the host end was disconnected), raw (becomes `cat`: a byte-exact echo).
NESTED_INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
echo "vrnic-nested: init at $(cut -d' ' -f1 /proc/uptime) s"
for m in {modules}; do insmod /modules/$m || echo "vrnic-nested: insmod $m failed"; done
dev=
for _ in $(seq 200); do
  for p in /sys/class/virtio-ports/*; do
    [ "$(cat $p/name 2>/dev/null)" = "{port}" ] && dev=/dev/${{p##*/}}
  done
  [ -n "$dev" ] && [ -e "$dev" ] && break
  sleep 0.05
done
[ -n "$dev" ] || {{ echo "vrnic-nested: no port {port}"; ls /sys/class/virtio-ports; poweroff -f; }}
mkdir -p /dev/virtio-ports && ln -s $dev /dev/virtio-ports/{port}
exec 3<>/dev/virtio-ports/{port}
echo "vrnic-nested: port open at $(cut -d' ' -f1 /proc/uptime) s"
echo ready >&3
read -r line <&3
echo "echo:$line" >&3
token=${{line#hello }}
i=0
while [ $i -lt 256 ]; do echo "RAMPROOF:$token:"; i=$((i+1)); done > /ramproof
echo written >&3
echo "vrnic-nested: pattern written"
eofs=0
while true; do
  if read -r line <&3; then
    case "$line" in
      check) head -n1 /ramproof >&3;;
      "ping "*) echo "pong:${{line#ping }} eofs=$eofs" >&3;;
      raw) echo raw >&3; exec cat <&3 >&3;;
      bye) poweroff -f;;
    esac
  else
    eofs=$((eofs+1)); sleep 0.05  # the host end is not connected: reads return EOF at once
  fi
done
sleep 3600
"""


def build_nested_initramfs(version: str, target: Path) -> Path:
    """busybox + virtio_pci/virtio_console modules + NESTED_INIT as a gzip'd newc cpio."""
    return busybox_initramfs(version, NESTED_MODULES,
                             lambda names: NESTED_INIT.format(modules=" ".join(names), port=DEFAULT_CHANNEL), target)


@pytest.fixture(scope="module")
def host() -> Iterator[VmHost]:
    if os.environ.get("VRNIC_LAB") != "1":
        pytest.skip("needs the lab guest (nested KVM, libvirtd on a tmpfs): "
                    "vrnic lab run --topology single -- pytest tests/kernel/test_vm_nested.py")
    pytest.importorskip("libvirt", reason="libvirt-python is not installed (make setup)")
    for tool in ("libvirtd", "virtlogd", "virsh", "cpio"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    vm_host = VmHost(VmHostConfig())
    try:
        vm_host.start()
    except Exception as exc:
        if not Path("/dev/kvm").exists():
            pytest.skip(f"no /dev/kvm in this lab guest: {exc}")
        raise
    yield vm_host
    problems = vm_host.stop()
    leftovers = leftover_processes()
    print(f"\nTIMINGS {dict((k, round(v, 2)) for k, v in {**vm_host.timings, **TIMINGS}.items())}")
    assert not problems, problems
    assert not leftovers, f"processes left after stopping the VM host: {leftovers}"


def _readline(sock: socket.socket, buf: bytearray, deadline: float) -> str:
    while b"\n" not in buf:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("channel closed")
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line.decode()


def _rdma_write_into(address: int, payload: bytes) -> dict[str, float]:
    """RC RDMA WRITE rxe0 -> rxe0 into an MR registered at `address` (inside our mapping of the VM's RAM)."""
    import pyverbs.enums as e
    from pyverbs.mr import MR

    from vrnic.lab.native import ACCESS, EndpointInfo, RcEndpoint

    with RcEndpoint("rxe0", PAGE) as source, RcEndpoint("rxe0", PAGE) as target:
        t0 = time.monotonic()
        guest_mr = MR(target.pd, PAGE, ACCESS, address=address)
        reg = time.monotonic() - t0
        try:
            into_guest = EndpointInfo(gid=target.gid, qpn=target.qp.qp_num, rkey=guest_mr.rkey,
                                      addr=address, length=PAGE)
            source.connect(target.info())
            target.connect(source.info())
            source.mr.write(payload, len(payload), 0)
            t1 = time.monotonic()
            source.post_rdma(e.IBV_WR_RDMA_WRITE, into_guest, len(payload))
            source.poll()
            write = time.monotonic() - t1
        finally:
            guest_mr.close()
    return {"reg_mr_on_ram_file_ms": reg * 1000, "rdma_write_into_guest_ms": write * 1000}


def _hmp(domain: Any, command: str, report: Callable[[], str]) -> str:
    import libvirt_qemu

    return str(bounded(lambda: libvirt_qemu.qemuMonitorCommand(
        domain, command, libvirt_qemu.VIR_DOMAIN_QEMU_MONITOR_COMMAND_HMP), 60, f"QEMU monitor: {command}", report))


def _connect(channel: Path, deadline: float) -> socket.socket:
    """The host end of the guest's channel (QEMU listens on it from the start)."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        try:
            sock.connect(str(channel))
            return sock
        except OSError as exc:
            sock.close()
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot connect to {channel}: {exc}") from exc
            time.sleep(0.1)


def _boot(domain: Any, name: str, channel: Path, console: Path) -> tuple[socket.socket, bytearray, float]:
    """Start the domain and wait for the guest's `ready` on its channel: (socket, buffer, start time). A guest
    that died unborn is booted once more (boot_and_wait)."""
    import libvirt

    report = partial(domain_report, name, console)
    t0 = 0.0

    def start() -> None:
        nonlocal t0
        t0 = time.monotonic()
        bounded(domain.create, 180, f"starting {name} (virDomainCreate)", report)
        TIMINGS["domain_create_s"] = time.monotonic() - t0
        # (a) running
        assert bounded(domain.state, 30, "virDomainGetState", report)[0] == libvirt.VIR_DOMAIN_RUNNING
        assert bounded(domain.isActive, 30, "virDomainIsActive", report) == 1

    def ready() -> tuple[socket.socket, bytearray, str]:
        # the guest says ready once it opened its port
        deadline = time.monotonic() + 240  # a bound on a hang, not a budget: a loaded lab is slow
        sock, buf = _connect(channel, deadline), bytearray()
        try:
            return sock, buf, _readline(sock, buf, deadline)
        except BaseException:
            sock.close()
            raise

    sock, buf, said = boot_and_wait(name, start, ready, console, report, NESTED_MARK)
    TIMINGS["create_to_guest_ready_s"] = time.monotonic() - t0
    assert said == "ready", f"{said!r}\n{report()}"
    return sock, buf, t0


def test_nested_vm_ram_file_and_channel(host: VmHost, tmp_path: Path) -> None:
    import libvirt

    version = os.uname().release
    kernel = kernel_image(version)
    assert kernel.exists(), f"{kernel} (the lab's own kernel) is not visible"
    initrd = build_nested_initramfs(version, tmp_path / "nested.cpio.gz")
    channel = tmp_path / "org.vrnic.0.sock"
    console = tmp_path / "console.log"
    name = "vrnic-nested-1"
    spec = VmDomain(
        name=name,
        domain_type=DomainType.KVM if "kvm" in host.domain_types else DomainType.QEMU,
        boot=DirectKernelBoot(kernel=kernel, initrd=initrd,
                              cmdline="console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off"),
        memory_mib=MEMORY_MIB,
        vrnics=(VrnicAttachment("v-nested-1"),),
        channels=(VirtioSerialChannel(socket=channel),),
        console=SerialConsole(log=console),
    )
    token = secrets.token_hex(8)
    report = partial(domain_report, name, console)
    conn = bounded(lambda: libvirt.open(URI), 60, f"connecting to libvirtd ({URI})")
    domain = bounded(lambda: conn.defineXML(spec.to_xml()), 60, f"defining {name} (virDomainDefineXML)")
    try:
        # (a) running, and the guest's ready on the channel; a guest that died unborn is booted once more
        sock, buf, t0 = _boot(domain, name, channel, console)
        # (b1) the RAM file, where libvirt puts it
        ram_path = ram_file(host.config, bounded(domain.ID, 30, "virDomainGetID", report), name)
        assert ram_path.exists(), sorted(str(p) for p in host.config.memory_backing_dir.rglob("*"))
        assert ram_path.stat().st_size == MEMORY_MIB << 20
        ram = GuestRamFile(ram_path)
        # (c) the channel: the guest echoes
        t1 = time.monotonic()
        sock.sendall(f"hello {token}\n".encode())
        echoed = _readline(sock, buf, time.monotonic() + 30)
        TIMINGS["channel_round_trip_ms"] = (time.monotonic() - t1) * 1000
        assert echoed == f"echo:hello {token}"
        assert _readline(sock, buf, time.monotonic() + 30) == "written"
        # (b2) the guest's bytes, seen through our MAP_SHARED mapping of the RAM file. The file's first
        # page in the guest's page cache starts with the pattern on a page boundary.
        needle = f"RAMPROOF:{token}:".encode()
        t2 = time.monotonic()
        offset = ram.find(needle)
        page = offset
        while page >= 0 and page % PAGE:
            page = ram.find(needle, page + 1)
        TIMINGS["scan_ram_file_s"] = time.monotonic() - t2
        assert offset >= 0, "the guest's pattern is not in the RAM file"
        assert page >= 0, "the guest's pattern is in the RAM file, but not page-aligned (no page cache page)"
        print(f"\npattern first at file offset {offset:#x}; /ramproof's first page at {page:#x}")
        # ... at the same guest-physical address, as QEMU's monitor reads it
        address, seen = parse_hmp_xp(_hmp(domain, f"xp /32xb {page:#x}", report))
        assert address == page
        assert seen == ram.read_gpa(page, 32)
        assert seen.startswith(needle)
        # vrnicd's stores into its arena-shaped mapping are what the guest has at that address
        memory = GuestMemory.from_vm_ram(ram_path)
        try:
            # (inside /ramproof's page: the next page of the file is elsewhere in guest RAM)
            memory.view[page + 2048:page + 2048 + 9] = b"HOSTWROTE"
            _, seen = parse_hmp_xp(_hmp(domain, f"xp /9xb {page + 2048:#x}", report))
            assert seen == b"HOSTWROTE"
            # an RDMA WRITE (rxe0 -> an MR over the RAM file) lands in the guest's file
            if "rxe0" in rdma_devices():
                payload = f"RDMAWROTE:{secrets.token_hex(8)}\n".encode()
                assert memory.layout.locate(page, PAGE, "MR") == page  # RAM, and GPA == offset
                TIMINGS.update(_rdma_write_into(memory.base + page, payload))
                sock.sendall(b"check\n")
                line = _readline(sock, buf, time.monotonic() + 30)
                assert line.encode() + b"\n" == payload, f"the guest read {line!r} from /ramproof"
            else:
                print("no rxe0: RDMA WRITE into guest RAM not tried")
        finally:
            memory.close()
        ram.close()
        # (c2) vrnicd restarting: the host end disconnects and reconnects; the guest keeps its port open
        sock.close()
        time.sleep(0.5)
        sock = _connect(channel, time.monotonic() + 30)
        buf = bytearray()
        sock.sendall(b"ping again\n")
        pong = _readline(sock, buf, time.monotonic() + 30)
        print(f"after reconnecting: {pong!r}")
        assert pong.startswith("pong:again eofs=")
        # (c3) vrnic's framed protocol (vrnic.core.proto) rides the channel byte-exactly, up to the frame cap
        sock.sendall(b"raw\n")
        assert _readline(sock, buf, time.monotonic() + 30) == "raw"
        decoder = FrameDecoder()
        assert not decoder.feed(bytes(buf))
        sent = 0
        t4 = time.monotonic()
        for index, size in enumerate((0, 1, 255, 4096, 20000, MAX_BODY - 100)):
            blob = "\u00e9\x00" * (size // 12) + "a" * (size % 12)  # each pair is 12 bytes of JSON
            message = {"id": index, "op": "echo", "args": {"blob": blob}}
            frame = encode(message)
            sock.sendall(frame)
            sent += len(frame)
            got: list[dict[str, Any]] = []
            deadline = time.monotonic() + 30
            while not got:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(1 << 16)
                assert chunk, "channel closed during the raw echo"
                got = decoder.feed(chunk)
            assert got == [message] and decoder.pending == 0
        seconds = time.monotonic() - t4
        TIMINGS["frames_echo_s"] = seconds
        TIMINGS["frames_echo_kib_per_s"] = 2 * sent / 1024 / seconds
        # (d) destroy + undefine: nothing left (destroy first: `cat` exits when we hang up, and so would init)
        t3 = time.monotonic()
        bounded(domain.destroy, 60, f"destroying {name} (virDomainDestroy)", report)
        sock.close()
        TIMINGS["destroy_s"] = time.monotonic() - t3
        bounded(domain.undefine, 60, f"undefining {name}", report)
        domain = None
        assert bounded(conn.listAllDomains, 30, "virConnectListAllDomains") == []
        assert not ram_path.exists()
        assert not [p for p in leftover_processes() if "qemu" in p]
    finally:
        if domain is not None:
            print(f"the nested guest, as the test left it:\n{report()}")
            # virsh, not this connection: a libvirt call of ours may still be stuck on it
            for command in ("destroy", "undefine"):
                done = virsh(command, name)
                print(f"virsh {command} {name}: {done.returncode} {(done.stdout + done.stderr).strip()}")
        with contextlib.suppress(Exception):
            bounded(conn.close, 10, "closing the libvirt connection")
