"""A lab test that failed because the emulator under it faulted: the lab kernel oopsed or stalled, a nested QEMU
crashed, or a nested guest's kernel saw its CPUs stall.

Nested KVM under the lab's TCG guest is the emulator's weak spot (FACTS.md): the lab kernel has panicked with
"TASK stack guard page was hit" in the KVM run loop, in CI a nested QEMU vanished in the middle of a test
(`shutting down, reason=crashed`) whose every other run passes, and once a nested VM stopped answering for two
minutes while everything around it lived on. So, inside the lab only, each test's call phase notes where the
kernel log, the nested QEMUs' logs and the nested guests' serial consoles end; if the test fails and any of them
logged a fault since, the failure is reported with those lines, recorded as `faulted <nodeid>` in the progress
file (vrnic/lab/progress.py) and the command ends with the lost-guest status. `vrnic lab run
--rerun-on-guest-loss` then runs that test again in a new guest (at most twice in all); any other failure fails
the stage.

Pure matching here; the readers are the thin functions at the end.
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
                          r"qemu-system-\S+\[\d+\]: segfault at|traps: qemu-system|Out of memory: Killed process|"
                          r"rcu_\w+ self-detected stall|rcu_\w+ detected stalls")
# A nested QEMU's own log: libvirt saw QEMU go away on its own (a destroy says reason=destroyed), or KVM gave up.
QEMU_FAULT = re.compile(r"reason=crashed|KVM internal error|KVM: entry failed")
# A nested guest's own kernel, on its serial console: its vCPUs stalled (nested KVM stopped running them long
# enough for the watchdogs to notice) or it oopsed. Nothing of vrnic runs in a nested kernel, only in its user space.
NESTED_FAULT = re.compile(r"soft lockup|rcu_\w+ self-detected stall|rcu_\w+ detected stalls|"
                          r"blocked for more than \d+ seconds|Kernel panic|BUG: |Oops|general protection fault")
CONSOLES = "*console*.log"  # the nested guests' serial consoles, under the tests' temporary directories


def faults(kernel_lines: Sequence[str], qemu_logs: dict[str, str], consoles: dict[str, str] | None = None) -> list[str]:
    """The lines that show an emulator fault: from the kernel log's new lines, each QEMU log's new text and each
    nested guest console's."""
    found = [f"lab kernel: {line}" for line in kernel_lines if KERNEL_FAULT.search(line)]
    for name, text in sorted(qemu_logs.items()):
        found += [f"{name}: {line}" for line in text.splitlines() if QEMU_FAULT.search(line)]
    for name, text in sorted((consoles or {}).items()):
        found += [f"nested console {name}: {line.strip()}" for line in text.splitlines() if NESTED_FAULT.search(line)]
    return found


@dataclass
class LogMark:
    """Where the kernel log, each QEMU log and each nested console under console_root ended when a test started;
    new() is what came after."""

    kernel_lines: int = 0
    qemu_sizes: dict[str, int] = field(default_factory=dict)
    console_root: Path | None = None
    console_sizes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def now(cls, read_kernel: Callable[[], list[str]] | None = None, log_dir: Path | None = None,
            console_root: Path | None = None) -> LogMark:
        kernel = (read_kernel or kernel_log)()
        return cls(len(kernel), _sizes(_logs(log_dir)), console_root, _sizes(_consoles(console_root)))

    def new(self, read_kernel: Callable[[], list[str]] | None = None,
            log_dir: Path | None = None) -> tuple[list[str], dict[str, str], dict[str, str]]:
        kernel = (read_kernel or kernel_log)()
        # A wrapped kernel ring buffer is shorter than the mark: then all of it is new.
        kernel_new = kernel[self.kernel_lines:] if len(kernel) >= self.kernel_lines else kernel
        return (kernel_new, _read_new(_logs(log_dir), self.qemu_sizes),
                _read_new(_consoles(self.console_root), self.console_sizes))

    def faults(self, read_kernel: Callable[[], list[str]] | None = None, log_dir: Path | None = None) -> list[str]:
        return faults(*self.new(read_kernel, log_dir))


def _sizes(paths: dict[str, Path]) -> dict[str, int]:
    sizes = {}
    for name, path in paths.items():
        try:
            sizes[name] = path.stat().st_size
        except OSError:
            continue
    return sizes


def _read_new(paths: dict[str, Path], sizes: dict[str, int]) -> dict[str, str]:
    """Each file's text past its marked size (all of a file that is new), up to 1 MiB."""
    text: dict[str, str] = {}
    for name, path in paths.items():
        try:
            with path.open("rb") as log:
                log.seek(sizes.get(name, 0))
                text[name] = log.read(1 << 20).decode(errors="replace")
        except OSError:
            continue
    return text


def _logs(log_dir: Path | None) -> dict[str, Path]:
    directory = log_dir or Path(os.environ.get(LOG_DIR_ENV) or QEMU_LOG_DIR)
    try:
        return {path.name: path for path in sorted(directory.glob("*.log"))}
    except OSError:
        return {}


def _consoles(root: Path | None) -> dict[str, Path]:
    if root is None:
        return {}
    try:
        return {str(path.relative_to(root)): path for path in sorted(root.rglob(CONSOLES)) if path.is_file()}
    except OSError:
        return {}


def kernel_log() -> list[str]:
    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=20).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []
