"""A test that hangs in the lab guest: show where, then end the guest's command as a lost guest.

Twice a kernel-tier test has stopped making progress for over ten minutes in the lab (once in CI, once in a
local run, both in tests that run nested KVM under TCG) and never when run alone. Python-level timeouts
(pytest-timeout's SIGALRM) cannot end a thread stuck in the kernel. So, inside the lab only, a watchdog per
test phase prints every Python thread's stack, the kernel stacks of tasks in uninterruptible sleep and the
kernel log's tail, records `hung <nodeid>` in the progress file (vrnic/lab/progress.py) and exits the
command with the lost-guest status. `vrnic lab run --rerun-on-guest-loss` then boots a new guest and runs
that test once more; a second hang, or any failure, still fails the stage.
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from vrnic.lab import progress
from vrnic.lab.guest import EXIT_GUEST_LOST

HANG_AFTER_S = 600.0  # a phase's bound; the slowest phase on a loaded machine took about 400 s
AFTER_ENV = "VRNIC_HANG_WATCH_S"  # overrides HANG_AFTER_S (the watch's own test uses a second)


class HangWatch:
    def __init__(self, progress_file: Path, after_s: float | None = None,
                 uncapture: Callable[[], str] = lambda: "") -> None:
        """uncapture: stops pytest's output capture (the report must reach the console) and returns what the
        test printed so far."""
        self.progress_file, self.uncapture = progress_file, uncapture
        self.after_s = after_s if after_s is not None else float(os.environ.get(AFTER_ENV, HANG_AFTER_S))
        self._timer: threading.Timer | None = None

    def arm(self, nodeid: str, when: str) -> None:
        self.disarm()
        self._timer = threading.Timer(self.after_s, self._hung, args=(nodeid, when))
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _hung(self, nodeid: str, when: str) -> None:
        printed = self.uncapture()
        err = sys.stderr
        if printed:
            err.write(f"\n[hang-watch] what {nodeid} printed before it hung:\n{printed}")
        err.write(f"\n[hang-watch] {nodeid} ({when}) made no progress for {self.after_s:.0f} s; "
                  "its threads, blocked kernel tasks and the kernel log follow\n")
        err.flush()
        faulthandler.dump_traceback(file=err, all_threads=True)
        err.write(blocked_tasks() + kernel_log_tail())
        err.write(f"[hang-watch] ending the command as a lost guest (exit {EXIT_GUEST_LOST}): {nodeid} hung\n")
        err.flush()
        progress.record(self.progress_file, "hung", nodeid)
        os._exit(EXIT_GUEST_LOST)


def blocked_tasks(proc: Path = Path("/proc")) -> str:
    """Every task in uninterruptible sleep (state D) with its kernel stack: where a thread is stuck in a syscall."""
    lines: list[str] = []
    for stat in proc.glob("[0-9]*/task/[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            if fields[1].split()[0] != "D":
                continue
            name = fields[0].split("(", 1)[1]
            stack = (stat.parent / "stack").read_text()
        except (OSError, IndexError):
            continue  # the task ended meanwhile
        lines.append(f"[hang-watch] task {stat.parent.name} ({name}) in D state:\n{stack}")
    return "".join(lines) or "[hang-watch] no task in D state\n"


def kernel_log_tail(lines: int = 40) -> str:
    try:
        shown = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=20).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"[hang-watch] dmesg: {exc}\n"
    return "[hang-watch] kernel log, last lines:\n" + "".join(f"  {line}\n" for line in shown[-lines:])
