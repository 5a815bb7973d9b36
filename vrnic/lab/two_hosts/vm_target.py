"""One raw QEMU VM on either lab host, driven line by line: the two ends of a cross-host live migration.

    python -m vrnic.lab.two_hosts.vm_target      # reads JSON commands on stdin, answers one JSON line each

Commands: start {name, workdir, kernel, initrd, memory_mib, incoming, run} -> pid; status -> QEMU's
query-status; digest -> sha256 of the RAM file (the ROM window 0xc0000-0xfffff left out: QEMU migrates
the ROM, not what lies under it in the file); migrate {uri, timeout} -> QEMU's numbers (this VM is the
source); cont; stop; quit. Host a's side is tests/two_hosts/test_cross_host_vm_migration.py.
"""

from __future__ import annotations

import hashlib
import mmap
import sys
import time
from pathlib import Path
from typing import Any

from vrnic.errors import LabError, VrnicError
from vrnic.lab.qemu_vm import QemuVm, QemuVmSpec
from vrnic.lab.two_hosts.guest import serve_lines

ROM_WINDOW = (0xC0000, 0x100000)
CMDLINE = "console=ttyS0 loglevel=4 panic=-1 mitigations=off"


def ram_digest(path: Path) -> str:
    """sha256 of a guest RAM file without the ROM window (equal on both ends after a migration)."""
    digest = hashlib.sha256()
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
        digest.update(view[:ROM_WINDOW[0]])
        digest.update(view[ROM_WINDOW[1]:])
    return digest.hexdigest()


class VmTarget:
    def __init__(self) -> None:
        self.vm: QemuVm | None = None

    def _vm(self) -> QemuVm:
        if self.vm is None:
            raise LabError("no VM started")
        return self.vm

    def do_start(self, name: str, workdir: str, kernel: str, initrd: str, memory_mib: int = 128,
                 incoming: str | None = None, run: bool = True) -> dict[str, Any]:
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        spec = QemuVmSpec(name=name, kernel=Path(kernel), initrd=Path(initrd), cmdline=CMDLINE,
                          ram_path=work / f"{name}.ram", qmp_path=work / f"{name}.qmp",
                          console_log=work / f"{name}.console.log", memory_mib=memory_mib, accel="tcg",
                          incoming=incoming)
        self.vm = QemuVm(spec).start()
        if run and incoming is None:
            self.vm.qmp.execute("cont")  # started without -S it runs already; harmless then
        return {"pid": self.vm.pid}

    def do_status(self) -> dict[str, Any]:
        status: dict[str, Any] = self._vm().qmp.execute("query-status")
        return status

    def do_digest(self) -> dict[str, Any]:
        return {"sha256": ram_digest(self._vm().ram_path)}

    def do_migrate(self, uri: str, timeout: float = 300.0) -> dict[str, Any]:
        """The source's part only (qemu_vm.migrate() wants both QMPs local); the caller checks the destination."""
        return migrate_source_only(self._vm(), uri, timeout)

    def do_cont(self) -> dict[str, Any]:
        self._vm().qmp.execute("cont")
        return {}

    def do_console(self) -> dict[str, Any]:
        return {"text": self._vm().console(2000)}

    def do_stop(self) -> dict[str, Any]:
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


def main() -> int:
    target = VmTarget()
    try:
        return serve_lines(target, sys.stdin, sys.stdout, errors=(VrnicError, OSError))
    finally:
        target.do_stop()


if __name__ == "__main__":
    sys.exit(main())

