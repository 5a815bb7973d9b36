"""A raw QEMU VM (no libvirt) that can be live-migrated to another QEMU process on the same machine.

    spec = QemuVmSpec(name="src", kernel=..., initrd=..., cmdline=..., ram_path=..., qmp_path=...,
                      console_log=..., channels=(("org.vrnic.0", sock0), ("org.vrnic.ctl", ctl)))
    with QemuVm(spec).start() as source, QemuVm(replace(spec, ..., incoming="unix:/tmp/mig")).start() as dest:
        stats = migrate(source, dest, "unix:/tmp/mig", timeout=60)

The RAM is a shared file (memory-backend-file, share=on) so vrnicd can map it, as under libvirt. The
guest gets no network and no 9p: a mounted 9p export blocks migration. A destination starts with
`-incoming URI -S`: it stays paused after the migration, so the caller decides when it resumes
(migrate()'s before_resume).

qemu_argv() and migration_stats() are pure; QemuVm and migrate() do the I/O.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vrnic.errors import InvalidArgument, LabError
from vrnic.lab.qemu import TCG_CPU
from vrnic.lab.qmp import QmpClient

QBOOT = Path("/usr/share/qemu/qboot.rom")  # boots a -kernel in a fraction of SeaBIOS's time
POLL_S = 0.005  # query-migrate interval: the pre-switchover pause is held for as long as this takes to see


@dataclass(frozen=True)
class QemuVmSpec:
    name: str
    kernel: Path
    initrd: Path
    cmdline: str
    ram_path: Path  # QEMU creates it; vrnicd maps it
    qmp_path: Path
    console_log: Path  # the guest's serial console (ttyS0)
    memory_mib: int = 256
    accel: Literal["kvm", "tcg"] = "kvm"
    cpus: int = 1
    channels: tuple[tuple[str, Path], ...] = ()  # virtio-serial ports: (port name, host unix socket)
    incoming: str | None = None  # a migration destination: listen on this URI, stay paused afterwards
    bios: Path | None = QBOOT
    qemu: str = "qemu-system-x86_64"

    def __post_init__(self) -> None:
        if self.memory_mib < 64 or self.cpus < 1:
            raise InvalidArgument(f"a VM needs at least 64 MiB and 1 vCPU (got {self.memory_mib}, {self.cpus})")
        if self.accel not in ("kvm", "tcg"):
            raise InvalidArgument(f"accel is kvm or tcg, not {self.accel!r}")
        names = [name for name, _ in self.channels]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"virtio-serial port names must be unique: {names}")

    @property
    def sockets(self) -> tuple[Path, ...]:
        return (self.qmp_path, *(path for _, path in self.channels))


def _opt(name: str, path: Path) -> str:
    text = str(path)
    if not path.is_absolute():
        raise InvalidArgument(f"{name} must be an absolute path: {text}")
    if "," in text:  # QEMU's option syntax splits on commas
        raise InvalidArgument(f"{name} may not contain commas: {text!r}")
    return text


def qemu_argv(spec: QemuVmSpec) -> list[str]:
    mem = f"{spec.memory_mib}M"
    argv = [
        spec.qemu, "-name", spec.name,
        "-machine", "q35,memory-backend=mem",
        "-accel", spec.accel, "-cpu", "host" if spec.accel == "kvm" else TCG_CPU,
        "-smp", str(spec.cpus), "-m", mem,
        "-object", f"memory-backend-file,id=mem,size={mem},mem-path={_opt('ram_path', spec.ram_path)},share=on",
    ]
    if spec.bios is not None:
        argv += ["-bios", _opt("bios", spec.bios)]
    argv += [
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-nic", "none",
        "-kernel", _opt("kernel", spec.kernel), "-initrd", _opt("initrd", spec.initrd), "-append", spec.cmdline,
        "-chardev", f"file,id=console,path={_opt('console_log', spec.console_log)}", "-serial", "chardev:console",
        "-qmp", f"unix:{_opt('qmp_path', spec.qmp_path)},server=on,wait=off",
    ]
    if spec.channels:
        argv += ["-device", "virtio-serial-pci,id=vser0"]
        for i, (name, path) in enumerate(spec.channels):
            argv += ["-chardev", f"socket,id=ch{i},path={_opt('channel socket', path)},server=on,wait=off",
                     "-device", f"virtserialport,bus=vser0.0,nr={i + 1},chardev=ch{i},id=port{i},name={name}"]
    if spec.incoming is not None:
        argv += ["-incoming", spec.incoming, "-S"]
    return argv


class QemuVm:
    """One QEMU process. start() returns once QMP answers; stop() quits it and removes its files."""

    def __init__(self, spec: QemuVmSpec, log: Path | None = None) -> None:
        self.spec = spec
        self.log = log or spec.console_log.with_name(f"{spec.name}.qemu.log")
        self.process: subprocess.Popen[bytes] | None = None
        self._qmp: QmpClient | None = None

    @property
    def qmp(self) -> QmpClient:
        if self._qmp is None:
            raise LabError(f"VM {self.spec.name} is not started")
        return self._qmp

    @property
    def pid(self) -> int:
        if self.process is None:
            raise LabError(f"VM {self.spec.name} is not started")
        return self.process.pid

    @property
    def ram_path(self) -> Path:
        return self.spec.ram_path

    def start(self, timeout: float = 30.0) -> QemuVm:
        for path in self.spec.sockets:  # a stale socket file makes QEMU's bind fail
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(qemu_argv(self.spec), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        try:
            while not self.spec.qmp_path.exists():
                if self.process.poll() is not None:
                    raise LabError(f"QEMU {self.spec.name} exited ({self.process.returncode}): {self.log_tail()}")
                if time.monotonic() > deadline:
                    raise LabError(f"QEMU {self.spec.name} made no QMP socket in {timeout} s: {self.log_tail()}")
                time.sleep(0.02)
            self._qmp = QmpClient(self.spec.qmp_path, timeout=timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def exit_report(self, wait_s: float = 1.0) -> str | None:
        """How QEMU ended (exit status or signal, and its log's tail), or None while it runs: a QMP socket that
        breaks under a command says nothing of why."""
        if self.process is None:
            return None
        try:
            code = self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            return None
        how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        console = self.console(1500).strip()  # a guest that powered off or panicked says so here (-no-reboot)
        events = self._last_events()
        return (f"QEMU {self.spec.name} {how}: {self.log_tail(1000).strip() or '(nothing in its log)'}"
                f"{f'; its last QMP events: {events}' if events else ''}"
                f"{f'; its console ends: {console}' if console else ''}")

    def _last_events(self) -> str:
        """SHUTDOWN's reason tells a guest reset (a triple fault under -no-reboot) from a poweroff or a panic."""
        if self._qmp is None:
            return ""
        shown = [f"{e['event']}{e.get('data') or ''}" for e in self._qmp.drain()
                 if e.get("event") in ("SHUTDOWN", "RESET", "GUEST_PANICKED", "STOP", "RESUME", "MIGRATION")]
        return ", ".join(shown[-8:])

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def console(self, chars: int = 4000) -> str:
        try:
            return self.spec.console_log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """QMP quit, SIGKILL if QEMU is still there after timeout; then its RAM file and sockets go."""
        if self._qmp is not None:
            with contextlib.suppress(LabError, OSError):
                self._qmp.execute("quit")
            self._qmp.close()
            self._qmp = None
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        for path in (self.spec.ram_path, *self.spec.sockets):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def __enter__(self) -> QemuVm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class MigrationStats:
    """QEMU's own numbers (query-migrate once completed) and wall-clock marks (time.monotonic()) of ours."""

    total_ms: float | None = None  # QEMU's total-time
    downtime_ms: float | None = None  # QEMU's downtime: source stopped until the destination could run
    setup_ms: float | None = None
    ram_transferred: int = 0  # bytes
    issued_at: float = 0.0  # `migrate` sent
    pre_switchover_at: float | None = None  # status pre-switchover seen (the source is stopped)
    continue_at: float | None = None  # migrate-continue sent
    completed_at: float | None = None  # status completed seen on the source
    resumed_at: float | None = None  # `cont` sent to the destination
    switchover_hold_ms: float = 0.0  # how long on_switchover took
    resume_hold_ms: float = 0.0  # how long before_resume took
    polls: int = 0
    raw: dict[str, Any] = field(default_factory=dict)  # the last query-migrate reply

    @property
    def wall_ms(self) -> float | None:
        """From `migrate` to the destination told to run."""
        end = self.resumed_at or self.completed_at
        return None if end is None else (end - self.issued_at) * 1000


def migration_stats(info: dict[str, Any], stats: MigrationStats) -> MigrationStats:
    """Fill QEMU's numbers from a query-migrate reply."""
    stats.raw = info
    for key, attr in (("total-time", "total_ms"), ("downtime", "downtime_ms"), ("setup-time", "setup_ms")):
        if key in info:
            setattr(stats, attr, float(info[key]))
    stats.ram_transferred = int((info.get("ram") or {}).get("transferred", 0))
    return stats


def migrate(source: QemuVm, dest: QemuVm, uri: str, *, pause_before_switchover: bool = False,
            on_switchover: Callable[[], None] | None = None, before_resume: Callable[[], None] | None = None,
            parameters: dict[str, Any] | None = None, cancel_after: float | None = None,
            timeout: float = 120.0) -> MigrationStats:
    """Live-migrate source to dest (started with incoming=uri) and resume dest.

    pause_before_switchover: the source stops its vCPUs, then waits in status pre-switchover until
    on_switchover() returned (the place to quiesce what QEMU cannot see, such as RDMA writes into RAM).
    before_resume(): called once the destination holds the whole state, paused, before `cont`.
    parameters: for migrate-set-parameters (e.g. {"max-bandwidth": ...}).
    cancel_after: seconds after `migrate` to send migrate_cancel (a test of the failure path).
    Failed or cancelled: LabError with QEMU's error-desc. Past timeout: migrate_cancel, then LabError.
    Another thread may also call source.qmp.execute("migrate_cancel") (QmpClient serializes commands).
    """
    qmp = source.qmp
    qmp.execute("migrate-set-capabilities", capabilities=[
        {"capability": "events", "state": True},
        # set either way: a capability outlives a migration on the same source
        {"capability": "pause-before-switchover", "state": pause_before_switchover}])
    if parameters:
        qmp.execute("migrate-set-parameters", **parameters)
    stats = MigrationStats()
    stats.issued_at = time.monotonic()
    deadline = stats.issued_at + timeout
    qmp.execute("migrate", uri=uri)
    cancelled = False
    while True:
        try:
            info = qmp.execute("query-migrate")
        except (LabError, OSError) as exc:  # a QMP socket reset or broken under the command: say how QEMU ended
            ended = [report for vm in (source, dest) if (report := vm.exit_report()) is not None]
            raise LabError("; ".join([f"QMP query-migrate: {exc}", *ended])) from exc
        stats.polls += 1
        status = info.get("status")
        now = time.monotonic()
        if status == "completed":
            stats.completed_at = now
            # QEMU 7.2 says completed a moment before it fills in total-time and downtime (0 until then)
            while not info.get("total-time") and time.monotonic() < now + 2:
                time.sleep(POLL_S)
                info = qmp.execute("query-migrate")
            migration_stats(info, stats)
            break
        if status in ("failed", "cancelled"):
            migration_stats(info, stats)
            raise LabError(f"migration of {source.spec.name} {status}: {info.get('error-desc', 'no reason given')}")
        if status == "pre-switchover" and stats.continue_at is None:
            stats.pre_switchover_at = now
            if on_switchover is not None:
                on_switchover()
            stats.continue_at = time.monotonic()
            stats.switchover_hold_ms = (stats.continue_at - now) * 1000
            qmp.execute("migrate-continue", state="pre-switchover")
            continue
        if not cancelled and cancel_after is not None and now - stats.issued_at >= cancel_after:
            qmp.execute("migrate_cancel")
            cancelled = True
        if now > deadline:
            with contextlib.suppress(LabError):
                qmp.execute("migrate_cancel")
            raise LabError(f"migration of {source.spec.name} still {status} after {timeout} s; cancelled")
        time.sleep(POLL_S)
    # The destination finishes loading a moment after the source reports completed.
    while True:
        state = dest.qmp.execute("query-status")
        if state.get("status") == "paused" and not state.get("running"):
            break
        if state.get("running"):
            raise LabError(f"destination {dest.spec.name} runs before `cont` (was it started without -S?)")
        if time.monotonic() > deadline:
            raise LabError(f"destination {dest.spec.name} still {state.get('status')} after the migration")
        time.sleep(POLL_S)
    if before_resume is not None:
        t0 = time.monotonic()
        before_resume()
        stats.resume_hold_ms = (time.monotonic() - t0) * 1000
    dest.qmp.execute("cont")
    stats.resumed_at = time.monotonic()
    return stats

