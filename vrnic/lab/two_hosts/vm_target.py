"""One raw QEMU VM on either lab host, driven line by line: the two ends of a cross-host live migration.

    python -m vrnic.lab.two_hosts.vm_target      # reads JSON commands on stdin, answers one JSON line each

Commands: start {name, workdir, kernel, initrd, memory_mib, incoming, run, accel} -> pid; start_migratable {name,
workdir, image, accel, incoming, memory_mib} -> pid and the VM's RAM file and vRNIC channel socket (the
migratable image of vrnic.lab.vm_guest); status -> QEMU's query-status; digest -> sha256 of the RAM file
(the ROM window 0xc0000-0xfffff left out: QEMU migrates the ROM, not what lies under it in the file) and a
short digest per 64 KiB;
migrate {uri, timeout} -> QEMU's numbers (this VM is the source); cont; pmemsave {address, size, path};
control {verb, args} -> the VM program's reply on its control port; stop; quit. Host a's side:
tests/two_hosts/test_cross_host_vm_migration.py and test_vm_handover_rxe.py.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import signal
import sys
import time
from pathlib import Path
from typing import Any, Literal

from vrnic.errors import LabError, VrnicError
from vrnic.lab.qemu_vm import QemuVm, QemuVmSpec
from vrnic.lab.two_hosts.guest import serve_lines
from vrnic.lab.vm_guest import CONTROL_PORT, ControlPort, channel_socket, migratable_vm_spec
from vrnic.vm.domain_xml import DEFAULT_CHANNEL

ROM_WINDOW = (0xC0000, 0x100000)
# no-kvmclock: under KVM the destination host's KVM rewrites the guest's kvmclock wall-clock page when QEMU
# restores its MSR, so that page would differ from the source's by design, and the RAM digests could not match.
CMDLINE = "console=ttyS0 loglevel=4 panic=-1 mitigations=off no-kvmclock"
DIGEST_CHUNK = 64 << 10


def ram_digest(path: Path) -> str:
    """sha256 of a guest RAM file without the ROM window (equal on both ends after a migration)."""
    digest = hashlib.sha256()
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
        digest.update(view[:ROM_WINDOW[0]])
        digest.update(view[ROM_WINDOW[1]:])
    return digest.hexdigest()


def ram_chunk_digests(path: Path) -> list[str]:
    """A short digest per 64 KiB of the RAM file, so two ends that differ can say where."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
        return [hashlib.blake2b(view[at:at + DIGEST_CHUNK], digest_size=8).hexdigest()
                for at in range(0, len(view), DIGEST_CHUNK)]


def differing_chunks(a: list[str], b: list[str]) -> list[str]:
    """The guest-physical ranges (hex) where two chunk digest lists differ, the ROM window aside."""
    ranges = []
    for index, (one, other) in enumerate(zip(a, b, strict=True)):
        start = index * DIGEST_CHUNK
        if one != other and not ROM_WINDOW[0] <= start < ROM_WINDOW[1]:
            ranges.append(f"{start:#x}-{start + DIGEST_CHUNK:#x}")
    return ranges


class VmTarget:
    def __init__(self) -> None:
        self.vm: QemuVm | None = None
        self.port: ControlPort | None = None

    def _vm(self) -> QemuVm:
        if self.vm is None:
            raise LabError("no VM started")
        return self.vm

    def do_start(self, name: str, workdir: str, kernel: str, initrd: str, memory_mib: int = 128,
                 incoming: str | None = None, run: bool = True,
                 accel: Literal["kvm", "tcg"] = "tcg") -> dict[str, Any]:
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        spec = QemuVmSpec(name=name, kernel=Path(kernel), initrd=Path(initrd), cmdline=CMDLINE,
                          ram_path=work / f"{name}.ram", qmp_path=work / f"{name}.qmp",
                          console_log=work / f"{name}.console.log", memory_mib=memory_mib, accel=accel,
                          incoming=incoming)
        self.vm = QemuVm(spec).start()
        if run and incoming is None:
            self.vm.qmp.execute("cont")  # started without -S it runs already; harmless then
        return {"pid": self.vm.pid}

    def do_start_migratable(self, name: str, workdir: str, image: str, accel: str = "kvm",
                            incoming: str | None = None, memory_mib: int = 256) -> dict[str, Any]:
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        spec = migratable_vm_spec(name, work, Path(image), incoming=incoming, memory_mib=memory_mib,
                                  accel="kvm" if accel == "kvm" else "tcg")
        self.vm = QemuVm(spec).start()
        return {"pid": self.vm.pid, "ram_path": str(spec.ram_path),
                "channel_socket": str(channel_socket(spec, DEFAULT_CHANNEL))}

    def do_control(self, verb: str, args: dict[str, Any] | None = None, timeout: float = 60.0) -> dict[str, Any]:
        if self.port is None:
            self.port = ControlPort(channel_socket(self._vm().spec, CONTROL_PORT), timeout=timeout)
        return self.port.call(verb, **(args or {}))

    def do_pmemsave(self, address: int, size: int, path: str) -> dict[str, Any]:
        self._vm().qmp.execute("pmemsave", val=address, size=size, filename=path)
        return {}

    def do_status(self) -> dict[str, Any]:
        status: dict[str, Any] = self._vm().qmp.execute("query-status")
        return status

    def do_digest(self) -> dict[str, Any]:
        path = self._vm().ram_path
        return {"sha256": ram_digest(path), "chunks": ram_chunk_digests(path)}

    def do_migrate(self, uri: str, timeout: float = 300.0) -> dict[str, Any]:
        """The source's part only (qemu_vm.migrate() wants both QMPs local); the caller checks the destination."""
        return migrate_source_only(self._vm(), uri, timeout)

    def do_cont(self) -> dict[str, Any]:
        self._vm().qmp.execute("cont")
        return {}

    def do_console(self) -> dict[str, Any]:
        return {"text": self._vm().console(2000)}

    def do_stop(self) -> dict[str, Any]:
        if self.port is not None:
            self.port.close()
            self.port = None
        if self.vm is not None:
            self.vm.stop()
            self.vm = None
        return {}


def migrate_source_only(vm: QemuVm, uri: str, timeout: float) -> dict[str, Any]:
    """QMP migrate on the source and wait until completed; QEMU's own numbers. Raises LabError if it failed."""
    qmp = vm.qmp
    qmp.execute("migrate-set-capabilities", capabilities=[{"capability": "events", "state": True}])
    issued = time.monotonic()
    qmp.execute("migrate", uri=uri)
    while True:
        info = qmp.execute("query-migrate")
        status = info.get("status")
        if status == "completed" and info.get("total-time"):
            break
        if status in ("failed", "cancelled"):
            raise LabError(f"migration {status}: {info.get('error-desc', 'no reason given')}")
        if time.monotonic() - issued > timeout:
            qmp.execute("migrate_cancel")
            raise LabError(f"migration still {status} after {timeout} s; cancelled")
        time.sleep(0.01)
    ram = info.get("ram") or {}
    return {"total_ms": float(info["total-time"]), "downtime_ms": float(info.get("downtime", 0)),
            "setup_ms": float(info.get("setup-time", 0)), "transferred": int(ram.get("transferred", 0)),
            "wall_ms": (time.monotonic() - issued) * 1000, "mbps": float(ram.get("mbps", 0))}


class RemoteVm:
    """This program on host b, through b's control server (vrnic.lab.two_hosts.control)."""

    def __init__(self, control: Any) -> None:
        self.control = control
        self.id = int(control.call("spawn", argv=[sys.executable, "-m", "vrnic.lab.two_hosts.vm_target"],
                                   stdin=True)["id"])

    def call(self, op: str, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
        """Its answer; LabError if it ended or answered with an error."""
        self.control.call("write", id=self.id, text=json.dumps({"op": op, **args}) + "\n")
        answer = self.control.call("readline", id=self.id, timeout=timeout)
        if answer["line"] is None:
            raise LabError(f"vm_target on b ended or timed out: {answer.get('stderr', '')}")
        result: dict[str, Any] = json.loads(answer["line"])
        if "error" in result:
            raise LabError(f"vm_target on b: {op}: {result['error']}: {result.get('message')}")
        return result

    def close(self) -> None:
        self.control.call("signal", id=self.id, signal=int(signal.SIGTERM))
        self.control.call("wait", id=self.id, timeout=20)


def main() -> int:
    target = VmTarget()
    try:
        return serve_lines(target, sys.stdin, sys.stdout, errors=(VrnicError, OSError))
    finally:
        target.do_stop()


if __name__ == "__main__":
    sys.exit(main())

