"""Boot lab guests, run a command in them, stream their consoles, return the exit code.

This is the side-effect edge of the lab: files, QEMU processes, timeouts.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rich.console import Console

from vrnic.config import PROJECT_DIR, LabSettings
from vrnic.errors import LabError
from vrnic.lab.guest import (
    EXIT_BOOT_FAILURE,
    EXIT_GUEST_LOST,
    EXIT_TIMEOUT,
    MARKER,
    ROLES,
    TWO_HOSTS_MACS,
    GuestPlan,
    Topology,
    guest_script,
    heartbeat_file,
)
from vrnic.lab.initramfs import ensure_initramfs
from vrnic.lab.kernel import choose_kernel, installed_kernels, kernel_image
from vrnic.lab.qemu import DgramLink, GuestSpec, qemu_argv

NETDEVSIM_BUILD = PROJECT_DIR / "kernel" / "netdevsim" / "build.sh"
HIDDEN_IN_GUEST = (Path("/tmp"), Path("/run"), Path("/var/tmp"))  # tmpfs inside the guest
KEEP_RUNS = 20
# The kernel's soft-lockup watchdog, every ~26 s while a CPU does not schedule. Nested KVM under TCG has been
# seen to wedge the lab kernel this way for good (the nested QEMU stuck in the KVM run loop on one CPU, a
# kworker on the other): nothing in the guest runs any more, so no timeout inside it can fire.
SOFT_LOCKUP = re.compile(r"watchdog: BUG: soft lockup - CPU#\d+ stuck for (\d+)s!")
LOCKED_UP_S = 120  # a CPU stuck this long is a dead kernel, not a slow host starving the guest for a moment
# The same wedge without a console line: the CPU stuck in the nested guest never takes its timer interrupt, so
# its own lockup watchdog never runs, and every task whose timer sits on that CPU sleeps for good (the test, its
# hang watch), while the other CPUs carry on. Each beat of the guest's heartbeat (vrnic/lab/guest.py) runs a
# task on every CPU, so it stops.
STALLED_S = 150.0


def quiet_for(heartbeat: Path, ready_at: float, now: float) -> float:
    """Seconds (wall clock) since the guest last beat, or since it became ready if it has not beaten yet."""
    try:
        last = heartbeat.stat().st_mtime
    except FileNotFoundError:
        last = ready_at
    return now - max(last, ready_at)


def locked_up(line: str, limit: int = LOCKED_UP_S) -> bool:
    """A console line saying a CPU of the guest has not scheduled for `limit` seconds or more."""
    match = SOFT_LOCKUP.search(line)
    return match is not None and int(match.group(1)) >= limit


@dataclass(frozen=True)
class LabRequest:
    command: Sequence[str]
    topology: Topology = Topology.PAIR
    netdevsim: bool = False
    sriov_nic: bool = False
    timeout: float = 600.0
    cwd: Path = field(default_factory=Path.cwd)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class _Guest:
    role: str
    process: subprocess.Popen[bytes]
    rc_file: Path
    log: IO[str]
    ready: bool = False  # the guest reached the command
    finished: bool = False  # the command ended; later lines are shutdown noise
    locked_up: str | None = None  # the soft-lockup line (or stopped heartbeat) that made us give the guest up
    ready_at: float = 0.0  # wall clock, when it reached the command
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LabRunner:
    def __init__(self, settings: LabSettings | None = None, console: Console | None = None,
                 out: IO[str] | None = None, stalled_after: float = STALLED_S) -> None:
        self.settings = settings or LabSettings()
        self.stalled_after = stalled_after
        self.console = console or Console(stderr=True, highlight=False, markup=False, soft_wrap=True)
        self.out = out or sys.stdout

    # --- preparation -------------------------------------------------------------------------
    def _netdevsim_module(self, kernel_version: str) -> Path:
        module = self.settings.cache_dir / kernel_version / "netdevsim.ko"
        if not module.exists():
            self.console.print(f"[lab] building netdevsim for {kernel_version} (once, cached)")
            build = subprocess.run([str(NETDEVSIM_BUILD), kernel_version, str(module.parent)], check=False)
            if build.returncode != 0 or not module.exists():
                raise LabError("netdevsim build failed; `make setup` installs linux-source and headers")
        return module

    def _guest_cwd(self, cwd: Path) -> Path:
        cwd = cwd.resolve()
        if cwd.is_relative_to(self.settings.work_dir):
            return cwd
        if not any(cwd.is_relative_to(p) for p in HIDDEN_IN_GUEST):
            self.console.print(f"[lab] {cwd} is outside the lab's work dir {self.settings.work_dir}: the guest sees"
                               f" it read-only; lab output goes to {self.settings.work_dir / '.lab'}")
            return cwd
        self.console.print(f"[lab] {cwd} is not visible in the guest; running in {self.settings.work_dir}")
        return self.settings.work_dir

    def _new_run_dir(self) -> Path:
        runs = self.settings.work_dir / ".lab" / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        for old in sorted(runs.iterdir())[:-KEEP_RUNS]:
            shutil.rmtree(old, ignore_errors=True)
        run_dir = runs / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        run_dir.mkdir()
        return run_dir

    def prepare(self, request: LabRequest) -> tuple[Path, list[tuple[str, list[str], Path]]]:
        """Write the guest scripts; return the run dir and (role, QEMU argv, rc file) per guest."""
        s = self.settings
        if s.venv.resolve().is_relative_to(s.work_dir.resolve()):
            raise LabError(f"the venv {s.venv} must live outside {s.work_dir}: imports over 9p are slow")
        version = choose_kernel(installed_kernels(), s.kernel_version)
        initrd = ensure_initramfs(version, s.cache_dir)
        netdevsim_ko = self._netdevsim_module(version) if request.netdevsim else None
        run_dir = self._new_run_dir()
        cwd = self._guest_cwd(request.cwd)
        two_hosts = request.topology is Topology.TWO_HOSTS
        roles = ROLES if two_hosts else ROLES[:1]
        ports = [_free_udp_port() for _ in roles]
        guests = []
        for index, role in enumerate(roles):
            rc_file = run_dir / f"rc-{role}"
            plan = GuestPlan(topology=request.topology, command=request.command, cwd=cwd, rc_file=rc_file,
                             venv=s.venv, role=role, netdevsim_ko=netdevsim_ko, output_dir=s.work_dir / ".lab",
                             netdevsim_vfs=s.netdevsim_vfs, sriov_nic=request.sriov_nic, env=request.env)
            (run_dir / f"guest-{role}.sh").write_text(guest_script(plan))
            link = (DgramLink(local_port=ports[index], remote_port=ports[1 - index], mac=TWO_HOSTS_MACS[index])
                    if two_hosts else None)
            spec = GuestSpec(kernel=kernel_image(version), initrd=initrd, work_dir=s.work_dir,
                             run_dir=run_dir, role=role, link=link, sriov_nic=request.sriov_nic,
                             qemu=s.qemu_for(request.sriov_nic),
                             cpus=s.two_hosts_cpus if two_hosts else s.cpus,
                             memory_mb=min(s.memory_mb, 1536) if two_hosts else s.memory_mb)
            guests.append((role, qemu_argv(spec), rc_file))
        return run_dir, guests

    def new_progress_file(self) -> Path:
        """An empty file, visible to the guest, for a pytest run's progress (vrnic/lab/progress.py)."""
        runs = self.settings.work_dir / ".lab" / "progress"
        runs.mkdir(parents=True, exist_ok=True)
        for old in sorted(runs.iterdir())[:-KEEP_RUNS]:
            old.unlink(missing_ok=True)
        path = runs / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
        path.write_text("")
        return path

    # --- running -------------------------------------------------------------------------------
    def run(self, request: LabRequest) -> int:
        started = time.monotonic()
        self.panicked: str | None = None  # the guest kernel's panic (or lockup) line, when that is how it died
        qemu = self.settings.qemu_for(request.sriov_nic)
        if shutil.which(qemu) is None:
            raise LabError(f"{qemu} not found; run `make setup`"
                           + (" (it unpacks QEMU 10 from bookworm-backports)" if request.sriov_nic else ""))
        run_dir, specs = self.prepare(request)
        two_hosts = len(specs) > 1
        events: queue.Queue[tuple[str, str | None]] = queue.Queue()
        guests: list[_Guest] = []
        self.console.print(f"[lab] booting {len(specs)} guest(s), topology {request.topology}"
                           f"{' + netdevsim' if request.netdevsim else ''}"
                           f"{' + SR-IOV NIC' if request.sriov_nic else ''}, under QEMU TCG (about 10 s);"
                           f" console log in {run_dir}")
        try:
            for role, argv, rc_file in specs:
                log = (run_dir / f"console-{role}.log").open("w")
                log.write(" ".join(argv) + "\n\n")
                process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, start_new_session=True)
                guest = _Guest(role=role, process=process, rc_file=rc_file, log=log)
                guests.append(guest)
                threading.Thread(target=self._pump, args=(guest, events), daemon=True).start()
            timed_out = self._stream(guests, events, started, request.timeout, prefix=two_hosts)
        finally:
            for guest in guests:
                if guest.process.poll() is None:
                    os.killpg(guest.process.pid, signal.SIGKILL)
                guest.process.wait()
                guest.log.close()
        return self._verdict(guests, timed_out, started, request.timeout)

    @staticmethod
    def _pump(guest: _Guest, events: queue.Queue[tuple[str, str | None]]) -> None:
        assert guest.process.stdout is not None
        for raw in guest.process.stdout:
            line = raw.decode(errors="replace").rstrip("\r\n").replace("\r", "")
            guest.log.write(line + "\n")
            guest.log.flush()
            events.put((guest.role, line))
        events.put((guest.role, None))

    def _stream(self, guests: list[_Guest], events: queue.Queue[tuple[str, str | None]], started: float,
                timeout: float, prefix: bool) -> bool:
        by_role = {g.role: g for g in guests}
        open_streams = len(guests)
        next_beat_check = 0.0
        with self.console.status("[lab] booting kernel", spinner="dots") as status:
            while open_streams:
                if time.monotonic() - started > timeout:
                    return True
                if time.monotonic() >= next_beat_check:
                    next_beat_check = time.monotonic() + 2.0
                    if self._stalled(guests, prefix) is not None:
                        return False
                try:
                    role, line = events.get(timeout=0.2)
                except queue.Empty:
                    if not all(g.ready for g in guests):
                        status.update(f"[lab] booting ({time.monotonic() - started:.0f} s)")
                    continue
                if line is None:
                    open_streams -= 1
                    continue
                guest = by_role[role]
                guest.tail.append(line)
                tag = f"[{role}] " if prefix else ""
                if locked_up(line):
                    guest.locked_up = line.strip()
                    self.console.print(f"[lab] {tag}the guest's kernel has locked up; stopping it: {line.strip()}",
                                       style="red")
                    return False
                if line.startswith(MARKER):
                    kind, _, detail = line.removeprefix(MARKER).partition(" ")
                    elapsed = time.monotonic() - started
                    if kind == "ready":
                        guest.ready, guest.ready_at = True, time.time()
                        self.console.print(f"[lab] {tag}guest ready after {elapsed:.1f} s; running the command")
                        if all(g.ready for g in guests):
                            status.stop()
                    elif kind == "exit":
                        guest.finished = True
                    elif kind in ("step", "setup-failed", "boot-failed"):
                        self.console.print(f"[lab] {tag}{detail}" if kind == "step"
                                           else f"[lab] {tag}{kind}: {detail}")
                elif guest.ready and not guest.finished:
                    self.out.write(f"{tag}{line}\n")
                    self.out.flush()
        return False

    def _stalled(self, guests: list[_Guest], prefix: bool) -> _Guest | None:
        """A guest running its command whose heartbeat stopped: marked locked up (a lost guest) and returned."""
        for guest in guests:
            if not guest.ready or guest.finished:
                continue
            quiet = quiet_for(heartbeat_file(guest.rc_file), guest.ready_at, time.time())
            if quiet >= self.stalled_after:
                guest.locked_up = (f"no heartbeat for {quiet:.0f} s: the guest runs nothing any more (a CPU stuck "
                                   "in nested KVM under TCG takes no interrupts, and no console line says so)")
                tag = f"[{guest.role}] " if prefix else ""
                self.console.print(f"[lab] {tag}{guest.locked_up}; stopping it", style="red")
                return guest
        return None

    def _verdict(self, guests: list[_Guest], timed_out: bool, started: float, timeout: float) -> int:
        elapsed = time.monotonic() - started
        if timed_out:
            self.console.print(f"[lab] timed out after {timeout:.0f} s", style="red")
            return EXIT_TIMEOUT
        codes = []
        for guest in guests:
            tag = f"[{guest.role}] " if len(guests) > 1 else ""
            if guest.rc_file.exists():
                codes.append(int(guest.rc_file.read_text().strip() or EXIT_GUEST_LOST))
                continue
            code = EXIT_GUEST_LOST if guest.ready else EXIT_BOOT_FAILURE
            what = "died while running the command" if guest.ready else "failed to boot"
            panic = next((line for line in guest.tail if "Kernel panic" in line), None) or guest.locked_up
            if panic is not None and guest.ready:
                self.panicked = panic.strip()
            self.console.print(f"[lab] {tag}guest {what}; last console lines:", style="red")
            for line in guest.tail:
                self.console.print(f"    {line}", style="dim")
            codes.append(code)
        rc = next((c for c in codes if c != 0), 0)
        if any(c == EXIT_BOOT_FAILURE for c in codes):
            rc = EXIT_BOOT_FAILURE
        self.console.print(f"[lab] exit {rc} after {elapsed:.1f} s", style="green" if rc == 0 else "red")
        return rc
