"""A test that hangs in the lab guest: show where, then end the guest's command as a lost guest.

Twice a kernel-tier test has stopped making progress for over ten minutes in the lab (once in CI, once in a
local run, both in tests that run nested KVM under TCG) and never when run alone. Python-level timeouts
(pytest-timeout's SIGALRM) cannot end a thread stuck in the kernel. So, inside the lab only, a watchdog per
test phase prints every Python thread's stack, the kernel stacks of tasks in uninterruptible sleep and the
kernel log's tail, records `hung <nodeid>` in the progress file (vrnic/lab/progress.py) and exits the
command with the lost-guest status. `vrnic lab run --rerun-on-guest-loss` then boots a new guest and runs
that test once more; a second hang, or any failure, still fails the stage.

That watchdog is a Python timer, so it needs the GIL, and a thread stuck in a C call that holds the GIL
(pyverbs calls into the kernel keep it) stops it too: in CI the migration test under traffic hung that way
until the lab's own timeout. `Backstop` is the same watch from another process: it fires BACKSTOP_GRACE_S
later, has the stuck process print its threads from a C signal handler (faulthandler), prints every thread's
kernel stack, records `hung`, kills the process and, if even SIGKILL cannot end it (a task in D state),
reboots the lab guest, which `vrnic lab run` sees as a lost guest.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from vrnic.lab import progress
from vrnic.lab.guest import EXIT_GUEST_LOST

HANG_AFTER_S = 600.0  # a phase's bound; the slowest phase on a loaded machine took about 400 s
AFTER_ENV = "VRNIC_HANG_WATCH_S"  # overrides HANG_AFTER_S (the watch's own test uses a second)
BACKSTOP_GRACE_S = 60.0  # the backstop fires this long after the in-process watch would have
BACKSTOP_GRACE_ENV = "VRNIC_HANG_BACKSTOP_GRACE_S"
DUMP_SIGNAL = signal.SIGUSR2  # the backstop's request for the stuck process's Python stacks
KILL_WAIT_S = 15.0  # how long SIGKILL gets to end the stuck process before the guest is rebooted


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


class Backstop:
    """The hang watch in a child process, armed and disarmed over a pipe: it fires even when no Python code of
    this process can run. `stderr` is the console's stderr (not pytest's capture), where both processes write."""

    def __init__(self, progress_file: Path, after_s: float, stderr: IO[str], reboot: bool = True) -> None:
        faulthandler.register(DUMP_SIGNAL, file=stderr, all_threads=True)
        argv = [sys.executable, "-m", "vrnic.lab.hang_watch", "--pid", str(os.getpid()),
                "--progress", str(progress_file), "--after", str(after_s)]
        self._proc = subprocess.Popen([*argv, *(["--reboot"] if reboot else [])], stdin=subprocess.PIPE,
                                      stdout=stderr, stderr=stderr, text=True)

    def arm(self, nodeid: str, when: str) -> None:
        self._send(f"arm {when} {nodeid}")

    def disarm(self) -> None:
        self._send("disarm")

    def _send(self, line: str) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:  # the backstop fired already and is ending this process
            pass


def watch(pid: int, progress_file: Path, after_s: float, reboot: bool, commands: int = 0) -> int:
    """The backstop's loop: `arm <when> <nodeid>` and `disarm` lines on the fd `commands`; end of file (the
    watched process ended) ends it."""
    pending = b""
    armed: tuple[str, str] | None = None
    deadline = 0.0
    while True:
        wait = None if armed is None else max(0.0, deadline - time.monotonic())
        readable, _, _ = select.select([commands], [], [], wait)
        if not readable:
            assert armed is not None
            _backstop_fired(pid, progress_file, after_s, *armed, reboot=reboot)
            return 1
        chunk = os.read(commands, 4096)
        if not chunk:
            return 0
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            kind, _, rest = line.decode().partition(" ")
            if kind == "arm":
                when, _, nodeid = rest.partition(" ")
                armed, deadline = (nodeid, when), time.monotonic() + after_s
            elif kind == "disarm":
                armed = None


def _backstop_fired(pid: int, progress_file: Path, after_s: float, nodeid: str, when: str, reboot: bool) -> None:
    err = sys.stderr
    err.write(f"\n[hang-watch] {nodeid} ({when}) made no progress for {after_s:.0f} s and its process runs no "
              "Python code (a thread holds the GIL in a C call); its threads, their kernel stacks, blocked kernel "
              "tasks and the kernel log follow\n")
    err.flush()
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return
    time.sleep(2.0)  # the handler writes from inside the stuck process
    err.write(thread_stacks(pid) + blocked_tasks() + kernel_log_tail())
    progress.record(progress_file, "hung", nodeid)
    err.write(f"[hang-watch] killing the test process {pid}: {nodeid} hung\n")
    err.flush()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid) and reboot:
        err.write(f"[hang-watch] process {pid} survived SIGKILL for {KILL_WAIT_S:.0f} s (stuck in the kernel): "
                  "rebooting the lab guest\n")
        err.flush()
        os.sync()
        Path("/proc/sysrq-trigger").write_text("b")


def name_and_state(stat: Path) -> tuple[str, str]:
    """A task's command name and state letter from its /proc stat file (the name may hold spaces and
    parentheses). OSError or IndexError if the task ended meanwhile."""
    head, tail = stat.read_text().rsplit(")", 1)
    return head.split("(", 1)[1], tail.split()[0]


def _alive(pid: int, proc: Path = Path("/proc")) -> bool:
    try:
        return name_and_state(proc / str(pid) / "stat")[1] != "Z"
    except (OSError, IndexError, ValueError):
        return False


def thread_stacks(pid: int, proc: Path = Path("/proc")) -> str:
    """Each thread of `pid` with its state, wait channel and kernel stack: where a C call that holds the GIL
    waits."""
    lines: list[str] = []
    for task in sorted((proc / str(pid) / "task").glob("[0-9]*"), key=lambda t: int(t.name)):
        try:
            name, state = name_and_state(task / "stat")
            wchan = (task / "wchan").read_text().strip() or "-"
            stack = (task / "stack").read_text()
        except (OSError, IndexError, ValueError):
            continue
        lines.append(f"[hang-watch] thread {task.name} ({name}) state {state} wchan {wchan}:\n{stack}")
    return "".join(lines) or f"[hang-watch] no threads of {pid} to show\n"


def blocked_tasks(proc: Path = Path("/proc")) -> str:
    """Every task in uninterruptible sleep (state D) with its kernel stack: where a thread is stuck in a syscall."""
    lines: list[str] = []
    for stat in proc.glob("[0-9]*/task/[0-9]*/stat"):
        try:
            name, state = name_and_state(stat)
            if state != "D":
                continue
            stack = (stat.parent / "stack").read_text()
        except (OSError, IndexError, ValueError):
            continue  # the task ended meanwhile
        lines.append(f"[hang-watch] task {stat.parent.name} ({name}) in D state:\n{stack}")
    return "".join(lines) or "[hang-watch] no task in D state\n"


def kernel_log_tail(lines: int = 40) -> str:
    try:
        shown = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=20).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"[hang-watch] dmesg: {exc}\n"
    return "[hang-watch] kernel log, last lines:\n" + "".join(f"  {line}\n" for line in shown[-lines:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=Backstop.__doc__)
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--progress", type=Path, required=True)
    parser.add_argument("--after", type=float, required=True)
    parser.add_argument("--reboot", action="store_true", help="reboot the guest if SIGKILL cannot end the process")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C for pytest is not one for its watch
    return watch(args.pid, args.progress, args.after, args.reboot)


if __name__ == "__main__":
    sys.exit(main())
