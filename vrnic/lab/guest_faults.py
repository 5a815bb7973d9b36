"""A lab test that failed because the emulator under it faulted: the lab kernel oopsed, or a nested QEMU crashed.

Nested KVM under the lab's TCG guest is the emulator's weak spot (FACTS.md): the lab kernel has panicked with
"TASK stack guard page was hit" in the KVM run loop, and in CI a nested QEMU vanished in the middle of a test
(`shutting down, reason=crashed`) whose every other run passes. So, inside the lab only, each test's call phase
notes where the kernel log and the nested QEMUs' logs end; if the test fails and either logged a fault since,
the failure is reported with those lines, recorded as `faulted <nodeid>` in the progress file
(vrnic/lab/progress.py) and the command ends with the lost-guest status. `vrnic lab run --rerun-on-guest-loss`
then runs that one test once more in a new guest; a second failure of any kind fails the stage.

Pure matching here; the readers are the two thin functions at the end.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

QEMU_LOG_DIR = Path("/var/log/libvirt/qemu")  # libvirt's per-domain QEMU logs in the lab guest
LOG_DIR_ENV = "VRNIC_QEMU_LOG_DIR"  # overrides it (the fault path's own test writes a log of its own)

# The lab kernel: an oops or BUG (a process-context oops kills the task, here the nested QEMU, and goes on),
# a user-space crash of a QEMU (show_unhandled_signals logs it), or the OOM killer (the lab guest's memory is
# fixed; a fresh guest starts with all of it, and the report shows what was killed).
KERNEL_FAULT = re.compile(r"BUG: |Oops|general protection fault|stack guard page|kernel BUG at|"
                          r"qemu-system-\S+\[\d+\]: segfault at|traps: qemu-system|Out of memory: Killed process")
# A nested QEMU's own log: libvirt saw QEMU go away on its own (a destroy says reason=destroyed), or KVM gave up.
QEMU_FAULT = re.compile(r"reason=crashed|KVM internal error|KVM: entry failed")


def faults(kernel_lines: Sequence[str], qemu_logs: dict[str, str]) -> list[str]:
    """The lines that show an emulator fault: from the kernel log's new lines and each QEMU log's new text."""
    found = [f"lab kernel: {line}" for line in kernel_lines if KERNEL_FAULT.search(line)]
    for name, text in sorted(qemu_logs.items()):
        found += [f"{name}: {line}" for line in text.splitlines() if QEMU_FAULT.search(line)]
    return found


@dataclass
class LogMark:
    """Where the kernel log and each QEMU log ended when a test started; new() is what came after."""

    kernel_lines: int = 0
    qemu_sizes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def now(cls, read_kernel: Callable[[], list[str]] | None = None, log_dir: Path | None = None) -> LogMark:
        kernel = (read_kernel or kernel_log)()
        return cls(len(kernel), {path.name: path.stat().st_size for path in _logs(log_dir)})

    def new(self, read_kernel: Callable[[], list[str]] | None = None,
            log_dir: Path | None = None) -> tuple[list[str], dict[str, str]]:
        kernel = (read_kernel or kernel_log)()
        # A wrapped kernel ring buffer is shorter than the mark: then all of it is new.
        kernel_new = kernel[self.kernel_lines:] if len(kernel) >= self.kernel_lines else kernel
        qemu: dict[str, str] = {}
        for path in _logs(log_dir):
            try:
                with path.open("rb") as log:
                    log.seek(self.qemu_sizes.get(path.name, 0))
                    qemu[path.name] = log.read(1 << 20).decode(errors="replace")
            except OSError:
                continue
        return kernel_new, qemu

    def faults(self, read_kernel: Callable[[], list[str]] | None = None, log_dir: Path | None = None) -> list[str]:
        return faults(*self.new(read_kernel, log_dir))


def _logs(log_dir: Path | None) -> list[Path]:
    directory = log_dir or Path(os.environ.get(LOG_DIR_ENV) or QEMU_LOG_DIR)
    try:
        return sorted(directory.glob("*.log"))
    except OSError:
        return []


def kernel_log() -> list[str]:
    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=20).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []
