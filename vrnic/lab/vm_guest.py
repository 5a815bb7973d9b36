"""A VM with a vRNIC inside the lab: its boot image, its domain, and both ends of the RDMA it does.

The nested VM boots the lab's own kernel with a busybox initramfs that mounts the
lab's root over virtio-9p (read-only) and runs vrnic.frontend.peer_program with
the host's python3: the VM installs nothing. The program takes commands on a
second virtio-serial port (ControlPort). Its partner is a container guest on
the lab host (HostPeer), attached to vrnicd through the Unix socket.

Used by tests/kernel/test_vm_*.py, `make demo-vm` (vrnic.vm.demo) and the bench.
"""

from __future__ import annotations

import gzip
import itertools
import json
import lzma
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from vrnic.core.rings import Access, RecvRequest, SendRequest, WcOpcode, WcStatus, WrOpcode
from vrnic.core.specs import AttachInfo
from vrnic.errors import LabError, VrnicError
from vrnic.frontend.guest_library import CQ, MR, PD, QP, Context
from vrnic.lab.kernel import kernel_image, module_files
from vrnic.lab.qemu_vm import QemuVmSpec
from vrnic.vm.domain_xml import (
    DEFAULT_CHANNEL,
    DirectKernelBoot,
    DomainType,
    HostDirShare,
    SerialConsole,
    VirtioSerialChannel,
    VmDomain,
    VrnicAttachment,
)

BUSYBOX = Path("/bin/busybox")
MODULES = ("virtio_pci", "virtio_console", "9pnet_virtio", "9p", "button", "evdev")
CONTROL_PORT = "org.vrnic.ctl"
HUGEPAGES = 8  # 16 MiB: the frontend's default arena is four
MARK = "vrnic-vm:"
BOOT_STEPS = ("init at", "root mounted at")  # what the images' /init prints before the program runs

INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
fail() {{ echo "{mark} boot failed: $*"; echo o > /proc/sysrq-trigger; sleep 5; }}
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
echo "{mark} init at $(cut -d' ' -f1 /proc/uptime) s"
for m in {modules}; do insmod /modules/$m || fail "insmod $m"; done
echo {hugepages} > /proc/sys/vm/nr_hugepages
mkdir -p /newroot
mount -t 9p -o ro,trans=virtio,version=9p2000.L,msize=262144,cache=loose hostroot /newroot || fail "mount hostroot"
for d in tmp run; do mount -t tmpfs tmpfs /newroot/$d || fail "tmpfs $d"; done
cp /run.sh /newroot/run/vrnic-vm.sh
for d in dev proc sys; do mount --move /$d /newroot/$d; done
echo "{mark} root mounted at $(cut -d' ' -f1 /newroot/proc/uptime) s"
exec switch_root /newroot /bin/sh /run/vrnic-vm.sh
"""

# Runs on the lab's root after switch_root (dash and coreutils, not busybox). The power button (ACPI, as
# `virsh shutdown` presses it) stops the program with SIGTERM, which detaches cleanly, then powers off.
RUN = """work=
for word in $(cat /proc/cmdline); do case "$word" in vrnic.work=*) work=${{word#vrnic.work=}};; esac; done
cd /
PYTHONPATH=$work PYTHONDONTWRITEBYTECODE=1 python3 -m vrnic.frontend.peer_program --vm --control {control} &
program=$!
for event in /sys/class/input/event*; do
  if [ "$(cat $event/device/name 2>/dev/null)" = "Power Button" ]; then
    # evdev reads whole events (24 bytes on x86_64); any shorter read fails with EINVAL
    (dd if=/dev/input/${{event##*/}} bs=24 count=1 status=none >/dev/null && {{ echo "{mark} power button";
     kill -TERM $program; sleep 3; echo o > /proc/sysrq-trigger; }}) &
  fi
done
wait $program
echo "{mark} program exited ($?)"
echo o > /proc/sysrq-trigger
sleep 5
"""


def busybox_initramfs(version: str, modules: Sequence[str], init: Callable[[list[str]], str], target: Path,
                      files: Mapping[str, str] | None = None, copies: Mapping[str, Path] | None = None) -> Path:
    """A gzip'd newc cpio: busybox, the kernel modules (and what they need, in load order, decompressed),
    /init made from their file names, extra text files, and copies of host files (image path -> host file;
    metadata kept, so a .pyc still matches its source's mtime)."""
    if not BUSYBOX.exists():
        raise LabError("busybox is missing; run `make setup`")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for d in ("bin", "dev", "proc", "sys", "modules", "newroot"):
            (root / d).mkdir()
        shutil.copy2(BUSYBOX, root / "bin" / "busybox")
        names = []
        for module in module_files(version, modules):
            data = module.read_bytes()
            if module.suffix == ".xz":
                data = lzma.decompress(data)
            name = module.name.removesuffix(".xz")
            (root / "modules" / name).write_bytes(data)
            names.append(name)
        (root / "init").write_text(init(names))
        (root / "init").chmod(0o755)
        for name, text in (files or {}).items():
            (root / name).write_text(text)
        for name, source in (copies or {}).items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
        listing = "\n".join(sorted(str(p.relative_to(root)) for p in root.rglob("*")))
        archive = subprocess.run(["cpio", "--quiet", "-o", "-H", "newc"], cwd=root, input=listing.encode(),
                                 capture_output=True, check=True)
    target.write_bytes(gzip.compress(archive.stdout, compresslevel=1))
    return target


def build_initramfs(version: str, target: Path) -> Path:
    """The peer VM's boot image: INIT mounts the lab root over 9p and runs RUN (the peer program)."""
    return busybox_initramfs(
        version, MODULES, lambda names: INIT.format(mark=MARK, modules=" ".join(names), hugepages=HUGEPAGES), target,
        {"run.sh": RUN.format(mark=MARK, control=CONTROL_PORT)})


# ----- a migratable guest: everything in the initramfs, no 9p (a mounted 9p export blocks migration) -------------
GUEST_PYTHON = Path("/usr/bin/python3")  # Debian's 3.11, the same on the lab and in the image
GUEST_PREFIX = "/opt/vrnic-guest"  # the project's vrnic files in the image (PYTHONPATH)
MIGRATABLE_MODULES = ("virtio_pci", "virtio_console", "button", "evdev")
# Optional accelerators the stdlib falls back from (hashlib, shutil): _hashlib alone drags in 4.5 MiB of libcrypto.
SKIPPED_EXTENSIONS = ("_hashlib", "_bz2", "_lzma")
EXTRA_STDLIB = ("encodings.ascii", "encodings.latin_1")  # what Python falls back to when the locale is odd
LIBRARY_PATH = "/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu"

# Run by the guest's python3 on the host: import what the VM program imports (and what `-m` needs), print every
# loaded module's file; compile the project's into argv[1] (the lab root is read-only, its __pycache__ stale).
TRACE = """import sys, runpy, py_compile, importlib.util
import vrnic.frontend.peer_program
for name in sys.argv[3:]:
    __import__(name)
project = sys.argv[2]
for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None)
    if not path:
        continue
    print(path)
    if path.startswith(project + "/"):
        rel = path[len(project) + 1:]
        py_compile.compile(path, cfile=sys.argv[1] + "/" + rel + "c", doraise=True)
"""

MIGRATABLE_INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
fail() {{ echo "{mark} boot failed: $*"; echo o > /proc/sysrq-trigger; sleep 5; }}
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in {modules}; do insmod /modules/$m || fail "insmod $m"; done
echo {hugepages} > /proc/sys/vm/nr_hugepages
mkdir -p /tmp && mount -t tmpfs tmpfs /tmp
echo "{mark} init at $(cut -d' ' -f1 /proc/uptime) s"
cd /
PYTHONPATH={prefix} PYTHONDONTWRITEBYTECODE=1 LD_LIBRARY_PATH={libpath} \
  /usr/bin/python3 -m vrnic.frontend.peer_program --vm --control {control} {args} &
program=$!
# The power button (system_powerdown) stops the program with SIGTERM, which detaches cleanly, then powers off.
for event in /sys/class/input/event*; do
  if [ "$(cat $event/device/name 2>/dev/null)" = "Power Button" ]; then
    (dd if=/dev/input/${{event##*/}} bs=24 count=1 2>/dev/null >/dev/null && {{ echo "{mark} power button";
     kill -TERM $program; sleep 3; echo o > /proc/sysrq-trigger; }}) &
  fi
done
wait $program
echo "{mark} program exited ($?)"
echo o > /proc/sysrq-trigger
sleep 5
"""


def parse_ldd(text: str) -> list[Path]:
    """The libraries `ldd` resolved ('libc.so.6 => /lib/.../libc.so.6 (0x...)', '/lib64/ld-linux... (0x...)')."""
    found = []
    for line in text.splitlines():
        words = line.split()
        if "=>" in words:
            path = words[words.index("=>") + 1]
        elif words and words[0].startswith("/"):
            path = words[0]
        else:
            continue
        if path.startswith("/"):
            found.append(Path(path))
    return found


def guest_python_files(loaded: Sequence[str], stdlib: Path, project: Path, compiled: Path, cache_tag: str,
                       skipped: Sequence[str] = SKIPPED_EXTENSIONS) -> dict[str, Path]:
    """Image path -> host file for the traced modules: the stdlib at its own path (python finds its prefix by
    it) with Debian's .pyc, and the project's under GUEST_PREFIX with the .pyc compiled into `compiled`."""
    copies: dict[str, Path] = {}
    for text in loaded:
        path = Path(text)
        if path.is_relative_to(stdlib):
            if path.name.split(".")[0] in skipped:
                continue
            copies[str(path).lstrip("/")] = path
            pyc = path.parent / "__pycache__" / f"{path.stem}.{cache_tag}.pyc"
            if path.suffix == ".py" and pyc.exists():  # Debian compiles its stdlib at install
                copies[str(pyc).lstrip("/")] = pyc
        elif path.is_relative_to(project):
            rel = path.relative_to(project)
            copies[f"{GUEST_PREFIX.lstrip('/')}/{rel}"] = path
            pyc = compiled / f"{rel}c"
            copies[f"{GUEST_PREFIX.lstrip('/')}/{rel.parent}/__pycache__/{rel.stem}.{cache_tag}.pyc"] = pyc
    return copies


def build_migratable_initramfs(version: str, target: Path, project: Path,
                               program_args: Sequence[str] = (), hugepages: int = HUGEPAGES) -> Path:
    """The peer VM's boot image with nothing on 9p: busybox, python3 with the libraries and stdlib modules the
    peer program loads, and the project's vrnic files it imports. program_args go to the peer program;
    hugepages (2 MiB) are reserved for its arena."""
    with tempfile.TemporaryDirectory() as tmp:
        compiled = Path(tmp)
        trace = subprocess.run([str(GUEST_PYTHON), "-c", TRACE, str(compiled), str(project), *EXTRA_STDLIB],
                               env={"PYTHONPATH": str(project), "PYTHONDONTWRITEBYTECODE": "1"},
                               capture_output=True, text=True, check=False)
        if trace.returncode != 0:
            raise LabError(f"tracing the peer program's imports failed: {trace.stderr.strip()[-2000:]}")
        where = subprocess.run([str(GUEST_PYTHON), "-c", "import os, sys; print(os.path.dirname(os.__file__), "
                                "sys.implementation.cache_tag)"], capture_output=True, text=True, check=True)
        stdlib, cache_tag = where.stdout.split()
        copies = guest_python_files(trace.stdout.split(), Path(stdlib), project, compiled, cache_tag)
        copies["usr/bin/python3"] = GUEST_PYTHON.resolve()
        binaries = [GUEST_PYTHON, *(Path(p) for p in copies.values() if p.suffix == ".so")]
        for binary in binaries:
            ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True)
            for library in parse_ldd(ldd.stdout):
                copies[str(library).lstrip("/")] = library.resolve()
        init = MIGRATABLE_INIT.format(mark=MARK, hugepages=hugepages, prefix=GUEST_PREFIX, libpath=LIBRARY_PATH,
                                      control=CONTROL_PORT, args=" ".join(program_args), modules="{modules}")
        return busybox_initramfs(version, MIGRATABLE_MODULES, lambda names: init.replace("{modules}", " ".join(names)),
                                 target, copies=copies)


def migratable_vm_spec(name: str, workdir: Path, initrd: Path, *, ram_path: Path | None = None,
                       incoming: str | None = None, accel: Literal["kvm", "tcg"] = "kvm", memory_mib: int = 256,
                       vrnic: bool = True) -> QemuVmSpec:
    """A raw-QEMU VM booting build_migratable_initramfs()'s image. Source and destination are made alike (same
    devices, in the same order) with their own name: their own RAM file, sockets and logs under workdir.
    Sockets: control_socket(spec), vrnic_socket(spec)."""
    channels = [(CONTROL_PORT, workdir / f"{name}.ctl.sock")]
    if vrnic:
        channels.insert(0, (DEFAULT_CHANNEL, workdir / f"{name}.vrnic.sock"))
    version = os.uname().release
    return QemuVmSpec(
        name=name, kernel=kernel_image(version), initrd=initrd,
        # Not init_on_free=1: it cut the RAM migrated by a fifth (99 -> 79 MiB) but slowed the boot by 40 % in the lab
        cmdline="console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off",
        ram_path=ram_path or workdir / f"{name}.ram", qmp_path=workdir / f"{name}.qmp",
        console_log=workdir / f"{name}.console.log", memory_mib=memory_mib, accel=accel,
        channels=tuple(channels), incoming=incoming)


def channel_socket(spec: QemuVmSpec, port: str) -> Path:
    for name, path in spec.channels:
        if name == port:
            return path
    raise LabError(f"VM {spec.name} has no virtio-serial port {port}")


def peer_domain(name: str, workdir: Path, project: Path, vrnic_id: str | None, domain_type: DomainType,
                memory_mib: int = 384) -> VmDomain:
    """The VM: direct kernel boot, the lab root over 9p, the vRNIC's channel and a control channel.

    vrnic_id None leaves the vRNIC out, as `vrnic vm attach` finds a domain before it adds one.
    """
    version = os.uname().release
    initrd = build_initramfs(version, workdir / "peer-initramfs.cpio.gz")
    channels = [VirtioSerialChannel(workdir / "ctl.sock", CONTROL_PORT)]
    if vrnic_id is not None:
        channels.insert(0, VirtioSerialChannel(workdir / f"{DEFAULT_CHANNEL}.sock", DEFAULT_CHANNEL))
    return VmDomain(
        name=name, domain_type=domain_type, memory_mib=memory_mib,
        boot=DirectKernelBoot(kernel=kernel_image(version), initrd=initrd,
                              cmdline=f"console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off vrnic.work={project}"),
        vrnics=(VrnicAttachment(vrnic_id),) if vrnic_id is not None else (),
        channels=tuple(channels),
        console=SerialConsole(log=workdir / "console.log"),
        shares=(HostDirShare(Path("/"), "hostroot"),),
    )


class ControlPort:
    """The host end of the VM program's control port: one JSON command per line, one reply each.

    Commands carry a sequence number that the reply echoes; replies to other numbers are skipped: after a
    migration (a new host end), a reply the program wrote while nobody was connected may arrive first."""

    def __init__(self, path: Path, timeout: float = 120.0, connect_timeout: float = 30.0,
                 report: Callable[[], str] | None = None) -> None:
        """report: what to add to the error when the VM program stops answering or the port closes under a call
        (its QEMU died): the domain's QEMU log, its console and the lab kernel's log say why."""
        self.path = path
        self.report = report
        deadline = time.monotonic() + connect_timeout
        while True:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(5)  # a unix connect can block when the listener's backlog is full
            try:
                self.sock.connect(str(path))
                break
            except OSError as exc:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise ConnectionError(f"cannot connect to the VM's control port {path} within "
                                          f"{connect_timeout:.0f} s: {exc}") from exc
                time.sleep(0.1)
        self.timeout = timeout
        self._buf = bytearray()
        self._seq = itertools.count(int.from_bytes(os.urandom(4), "little"))

    def read(self, timeout: float | None = None) -> dict[str, Any]:
        seconds = timeout or self.timeout
        deadline = time.monotonic() + seconds
        while b"\n" not in self._buf:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise TimeoutError(f"no reply from the VM program on {self.path} within {seconds:.0f} s"
                                   f"{self._why()}") from None
            except ConnectionResetError:  # it went with our command unread
                chunk = b""
            if not chunk:
                raise ConnectionError(f"the VM's control port {self.path} closed (its QEMU is gone?){self._why()}")
            self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf[:] = rest
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _why(self) -> str:
        return f"\n{self.report()}" if self.report is not None else ""

    def ready(self, timeout: float = 180.0) -> dict[str, Any]:
        reply = self.read(timeout)
        if reply.get("op") != "ready" or not reply.get("ok"):
            raise VrnicError(f"the VM program did not start: {reply}")
        return reply

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        seq = next(self._seq)
        self.sock.settimeout(self.timeout)  # bounded, and not the few ms a read may have left behind
        try:
            self.sock.sendall((json.dumps({"op": op, "seq": seq, **args}) + "\n").encode())
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ConnectionError(f"the VM's control port {self.path} closed (its QEMU is gone?): {exc.strerror}"
                                  f"{self._why()}") from exc
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self.read(max(0.01, deadline - time.monotonic()))
            if reply.get("seq") == seq:
                break
        if not reply.get("ok"):
            raise VrnicError(f"VM program: {op} failed: {reply.get('error')}")
        return reply

    def close(self) -> None:
        self.sock.close()


class HostPeer:
    """The VM's partner: a container guest on the lab host, with the same PD/CQ/MR/QP shape."""

    def __init__(self, info: AttachInfo, mr_bytes: int = 256 << 10) -> None:
        self.ctx = Context.attach(info)
        try:
            self.pd = PD(self.ctx)
            self.cq = CQ(self.ctx, 256)
            self.mr = MR(self.pd, mr_bytes, Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ)
            self.qp = QP(self.pd, self.cq, self.cq, max_send_wr=64, max_recv_wr=16)
        except BaseException:
            self.ctx.close()
            raise
        self._wr = 0

    def info(self) -> dict[str, Any]:
        return {"gid": self.ctx.gid, "qpn": self.qp.qpn, "addr": self.mr.addr, "rkey": self.mr.rkey}

    def connect(self, vm: dict[str, Any]) -> None:
        self.vm = vm
        self.qp.connect(vm["gid"], vm["qpn"])

    def _next(self) -> int:
        self._wr += 1
        return self._wr

    def _complete(self, count: int = 1, timeout: float = 30) -> list[Any]:
        done = self.cq.wait(count, timeout=timeout)
        bad = [c for c in done if c.status != WcStatus.SUCCESS]
        if bad:
            raise VrnicError(f"host peer: completion failed: {WcStatus(bad[0].status).name}")
        return done

    def post_recv(self, offset: int = 0, length: int = 4096) -> None:
        self.qp.post_recv(RecvRequest(self._next(), (self.mr.sge(offset, length),)), sync=True)

    def send(self, payload: bytes, offset: int = 8192) -> None:
        self.mr.write(payload, offset)
        self.qp.post_send(SendRequest(self._next(), WrOpcode.SEND, (self.mr.sge(offset, len(payload)),)))
        self._complete()

    def write_into_vm(self, payload: bytes, vm_offset: int, offset: int = 8192) -> None:
        self.mr.write(payload, offset)
        self.qp.post_send(SendRequest(self._next(), WrOpcode.RDMA_WRITE, (self.mr.sge(offset, len(payload)),),
                                      remote_addr=self.vm["addr"] + vm_offset, rkey=self.vm["rkey"]))
        self._complete()

    def read_from_vm(self, length: int, vm_offset: int, offset: int = 16384) -> bytes:
        self.qp.post_send(SendRequest(self._next(), WrOpcode.RDMA_READ, (self.mr.sge(offset, length),),
                                      remote_addr=self.vm["addr"] + vm_offset, rkey=self.vm["rkey"]))
        self._complete()
        return self.mr.read(length, offset)

    def echo(self, iterations: int, size: int = 64) -> None:
        """The far end of the VM's `ping`: every SEND that arrives is answered with one."""
        sge = self.mr.sge(8192, size)
        self.qp.post_recv(RecvRequest(self._next(), (self.mr.sge(0, 4096),)))
        received = sent = 0
        while sent < iterations:
            for completion in self._complete(1):
                if completion.opcode == WcOpcode.RECV:
                    received += 1
                    if received < iterations:
                        self.qp.post_recv(RecvRequest(self._next(), (self.mr.sge(0, 4096),)), doorbell=False)
                    self.qp.post_send(SendRequest(self._next(), WrOpcode.SEND, (sge,)))
                else:
                    sent += 1

    def close(self) -> None:
        self.ctx.close()
