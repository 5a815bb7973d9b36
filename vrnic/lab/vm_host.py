"""Turn the lab guest into a libvirt/QEMU VM host with nested KVM (no systemd, read-only root).

The lab guest's root is the host's root over read-only 9p, so libvirtd gets:
- tmpfs on its state directories (/var/lib/libvirt, /var/log/libvirt, /var/cache/libvirt, /run/libvirt);
- a writable copy of /etc/libvirt bind-mounted over it, with our qemu.conf settings appended and
  any hook scripts installed (hooks must exist when libvirtd starts);
- `memory_backing_dir` on tmpfs: guest RAM of `<memoryBacking><source type='file'/>` domains lands in
  `<memory_backing_dir>/libvirt/qemu/<id>-<name>/<alias>` (libvirt appends `libvirt/qemu` when the
  directory is set explicitly).

Pure parts (config text, argv, parsing) are module functions; `VmHost` is the edge (mounts,
processes). It refuses to run outside the lab: it bind-mounts over /etc/libvirt.

Every wait on libvirt, QEMU or a nested guest is bounded: libvirt's own calls have no timeout (a QEMU
monitor that never answers blocks the caller for good), so `bounded()` runs them in a thread, and a wait
that runs out raises LabError naming what it waited for, with `domain_report()` (libvirt's state of the
domain, the tails of its QEMU log and serial console, the QEMU processes, the lab kernel's last lines).

A nested guest under nested KVM in the TCG lab sometimes stops before its first word: the domain shuts
off with an empty console, or its QEMU dies; once it powered off silently right after its /init's own boot
steps (CI, late 2026). `early_stop()` recognises that; tests raise NestedBootFailed
and `retry_boot_once()` boots once more, saying so. Only the boot is retried, never a check of a feature.

`python -m vrnic.lab.vm_host` (inside the lab) starts the host, prints timings and capabilities, stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from vrnic.errors import LabError, VrnicError
from vrnic.vm.guest_ram import libvirt_ram_file

URI = "qemu:///system"
ETC_LIBVIRT = Path("/etc/libvirt")
STATE_TMPFS = (Path("/var/lib/libvirt"), Path("/var/log/libvirt"), Path("/var/cache/libvirt"), Path("/run/libvirt"))
# The lab guest is QEMU TCG's emulated AMD CPU. With its virtual GIF in use (kvm_amd's default when the CPU
# offers it), a nested VM under migration wedged the lab kernel (a CPU that never took an interrupt again) or
# reset silently, about one run of the migration tests in three; with vgif=0, none did (README, "Limits").
KVM_MODULES = (("kvm_amd", "vgif=0"), ("kvm_intel",))
QEMU_LOG_DIR = Path("/var/log/libvirt/qemu")  # <name>.log: QEMU's stderr and libvirt's start/stop lines
TIMED_OUT = 124  # the return code _run(check=False) gives a command that ran out of time

T = TypeVar("T")


class NestedBootFailed(LabError):
    """A nested guest stopped before its first word (see early_stop): nested KVM under TCG, not the feature."""


class NestedBootRetried(UserWarning):
    """A nested guest's boot failed the transient way and was retried once (shown in pytest's summary)."""


@dataclass(frozen=True)
class VmHostConfig:
    state_dir: Path = Path("/run/vrnic-vmhost")  # pid files and the writable /etc/libvirt copy
    memory_backing_dir: Path = Path("/var/lib/libvirt/qemu/ram")  # on the /var/lib/libvirt tmpfs
    hooks: Mapping[str, str] = field(default_factory=dict)  # hook name ('qemu') -> script text
    require_kvm: bool = True
    start_timeout: float = 60.0
    # A migration endpoint (`virsh migrate ... qemu+tcp://ADDR/system`): libvirtd listens on TCP without auth
    # (lab only), QEMU's incoming migrations listen on migration_address, and libvirt tells the source to reach
    # them at ADDR. host_uuid: the two lab guests boot alike, and libvirt refuses a migration between hosts
    # of one UUID ("Attempt to migrate guest to the same host").
    listen_address: str | None = None
    host_uuid: str | None = None


# --- pure ---------------------------------------------------------------------------------------

def qemu_conf_settings(config: VmHostConfig) -> str:
    """Lines appended to qemu.conf (the last assignment wins in libvirt's config parser)."""
    return "\n".join([
        "# appended by vrnic.lab.vm_host",
        'user = "root"',
        'group = "root"',
        "dynamic_ownership = 0",  # nothing to chown on a read-only root
        'security_driver = "none"',  # no AppArmor/SELinux in the lab
        'stdio_handler = "file"',  # QEMU logs go to files, not through virtlogd
        "cgroup_controllers = [ ]",  # no systemd/machined to place cgroups
        f"memory_backing_dir = {json.dumps(str(config.memory_backing_dir))}",
        *([f"migration_address = {json.dumps(config.listen_address)}",
           f"migration_host = {json.dumps(config.listen_address)}"] if config.listen_address else []),
        "",
    ])


def libvirtd_conf_settings(config: VmHostConfig) -> str:
    """Lines appended to libvirtd.conf: TCP without auth for a migration endpoint (lab only), the host UUID."""
    lines = ["# appended by vrnic.lab.vm_host"]
    if config.listen_address:
        lines += ["listen_tls = 0", "listen_tcp = 1", 'auth_tcp = "none"',
                  f"listen_addr = {json.dumps(config.listen_address)}"]
    if config.host_uuid:
        lines.append(f"host_uuid = {json.dumps(config.host_uuid)}")
    return "\n".join([*lines, ""])


def ram_dir(config: VmHostConfig) -> Path:
    """Where libvirt 9.0 puts file-backed guest RAM when memory_backing_dir is set."""
    return config.memory_backing_dir / "libvirt" / "qemu"


def ram_file(config: VmHostConfig, domain_id: int, name: str, alias: str = "pc.ram") -> Path:
    """The RAM file of a running domain: <ram_dir>/<id>-<name truncated to 20>/<alias> (q35/pc: pc.ram)."""
    return libvirt_ram_file(config.memory_backing_dir, domain_id, name, alias)


def virtlogd_argv(config: VmHostConfig) -> list[str]:
    return ["virtlogd", "-d", "--pid-file", str(config.state_dir / "virtlogd.pid")]


def libvirtd_argv(config: VmHostConfig) -> list[str]:
    listen = ["--listen"] if config.listen_address else []
    return ["libvirtd", "-d", *listen, "--pid-file", str(config.state_dir / "libvirtd.pid")]


def capabilities_domain_types(capabilities_xml: str) -> frozenset[str]:
    """Domain types (kvm, qemu) that `virsh capabilities` offers for x86_64 guests."""
    root = ET.fromstring(capabilities_xml)
    return frozenset(d.get("type", "") for guest in root.iter("guest")
                     for arch in guest.iter("arch") if arch.get("name") == "x86_64"
                     for d in arch.iter("domain"))


def early_stop(running: bool, console: str, marker: str, progress: Sequence[str] = ()) -> str | None:
    """Why a nested guest's boot counts as the transient failure (None: it does not).

    That is: the domain no longer runs, and its serial console never showed `marker`, the first thing the
    guest's own /init prints, or showed only the lines with `marker` that contain one of `progress` (the boot's
    own steps, before the program runs): the guest's kernel went down without a word from its scripts, which
    say why when they fail. A guest that said anything else and then failed is not transient: what follows is
    the feature's business.
    """
    if running:
        return None
    said = [line for line in console.splitlines() if marker in line]
    if said and progress and all(any(step in line for step in progress) for line in said):
        return f"the domain stopped after its boot steps alone, before its program spoke; last: {said[-1][-200:]!r}"
    if said:
        return None
    text = console.strip()
    seen = f"its console holds {len(text)} bytes, last: {text.splitlines()[-1][-200:]!r}" if text else \
        "its console is empty"
    return f"the domain stopped before the guest printed {marker!r}; {seen}"


def tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


# --- edges --------------------------------------------------------------------------------------

def _run(argv: list[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a command for at most `timeout` s. Out of time: LabError (check) or return code TIMED_OUT."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        if check:
            raise LabError(f"`{shlex.join(argv)}` did not finish within {timeout:.0f} s") from None
        return subprocess.CompletedProcess(argv, TIMED_OUT, "", f"did not finish within {timeout:.0f} s")
    if check and result.returncode != 0:
        raise LabError(f"`{shlex.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def ensure_kvm() -> bool:
    """Load the KVM module the CPU supports; True when /dev/kvm exists afterwards."""
    if not Path("/dev/kvm").exists():
        for module in KVM_MODULES:
            if _run(["modprobe", *module], check=False).returncode == 0 and Path("/dev/kvm").exists():
                break
    return Path("/dev/kvm").exists()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of ours would still answer; daemons are reparented to init, so this is fine
    return True


def bounded(call: Callable[[], T], timeout: float, what: str, report: Callable[[], str] | None = None) -> T:
    """call() -- a libvirt call, which has no timeout of its own -- if it returns within `timeout` s; else
    LabError naming `what`, with report(). The call goes on in a daemon thread: whoever catches the error
    should destroy the domain (`virsh destroy`, bounded) or stop libvirtd, which ends it."""
    outcome: list[tuple[bool, object]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name=f"bounded: {what}", daemon=True).start()
    if not done.wait(timeout):
        raise LabError(f"{what} did not return within {timeout:.0f} s{_report(report)}")
    ok, value = outcome[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, report: Callable[[], str] | None = None,
               step: float = 0.25) -> float:
    """Poll predicate() until it holds; the seconds it took, or LabError naming `what` after `timeout` s."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise LabError(f"{what}: not within {timeout:.0f} s{_report(report)}")
        time.sleep(step)
    return time.monotonic() - started


def _report(report: Callable[[], str] | None) -> str:
    if report is None:
        return ""
    try:
        return "\n" + report()
    except Exception as exc:  # a report must never hide the error it explains
        return f"\n(no report: {exc!r})"


def virsh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`virsh -c URI ARGS`, whatever its exit code; TIMED_OUT when it ran out of time. Never raises: for cleanups."""
    return _run(["virsh", "-c", URI, *args], check=False, timeout=timeout)


def domain_state(name: str, timeout: float = 15) -> str:
    """`virsh domstate --reason NAME` ('running (booted)', 'shut off (crashed)', ...), bounded."""
    result = _run(["virsh", "-c", URI, "domstate", "--reason", name], check=False, timeout=timeout)
    return (result.stdout.strip() if result.returncode == 0 else f"unknown: {result.stderr.strip()}") or "unknown"


def domain_running(name: str) -> bool:
    return domain_state(name).startswith(("running", "paused", "in shutdown"))


def _qemu_dirs(proc: Path = Path("/proc")) -> list[Path]:
    """/proc/<pid> of every QEMU in this guest."""
    found = []
    for process in proc.iterdir():
        with contextlib.suppress(OSError):
            if process.name.isdigit() and (process / "comm").read_text().startswith("qemu-system"):
                found.append(process)
    return found


def qemu_processes() -> list[str]:
    """`pid state wchan cmdline-head` of every QEMU in this guest (a D state or a zombie says a lot)."""
    found = []
    for proc in _qemu_dirs():
        with contextlib.suppress(OSError):
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
            wchan = (proc / "wchan").read_text().strip() or "-"
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{proc.name} {state} {wchan} {cmdline[:160]}")
    return found


def thread_stat(text: str) -> tuple[str, str, int]:
    """(name, state, CPU ticks used: utime + stime) from a /proc/<pid>/task/<tid>/stat line."""
    head, _, rest = text.rpartition(")")  # the name may hold spaces and parentheses ("CPU 0/KVM")
    fields = rest.split()
    return head.partition("(")[2], fields[0], int(fields[11]) + int(fields[12])


def qemu_threads(sample_s: float = 1.0, proc: Path = Path("/proc")) -> list[str]:
    """`pid/tid name state wchan +ticks` of every QEMU thread in this guest, ticks being the CPU it used over
    sample_s (100 a second): a vCPU thread that spins shows about +100, one that never runs +0 and where it
    waits. What tells a stalled nested VM from a VM program that is stuck."""
    def snapshot() -> dict[str, tuple[str, str, int, str]]:
        found = {}
        for process in _qemu_dirs(proc):
            tasks: list[Path] = []
            with contextlib.suppress(OSError):  # a QEMU that ended meanwhile
                tasks = list((process / "task").iterdir())
            for task in tasks:
                with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that ended meanwhile
                    name, state, ticks = thread_stat((task / "stat").read_text())
                    wchan = (task / "wchan").read_text().strip()
                    wchan = "-" if wchan in ("", "0") else wchan  # "0" while it runs
                    found[f"{process.name}/{task.name}"] = (name, state, ticks, wchan)
        return found

    before = snapshot()
    time.sleep(sample_s)
    after = snapshot()
    return [f"{key} {name} {state} {wchan} +{ticks - before[key][2] if key in before else '?'}"
            for key, (name, state, ticks, wchan) in sorted(after.items())]


def read_from(path: Path, offset: int = 0) -> str:
    """A file's text from byte `offset` on ('' when there is no file): a console log is appended to, so what
    one boot printed starts at the size the file had before it."""
    try:
        with path.open("rb") as file:
            file.seek(offset)
            return file.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def domain_report(name: str, console: Path | None = None, lines: int = 40) -> str:
    """What to know when a nested guest misbehaves: libvirt's state of it, the tails of its QEMU log and
    its serial console, the QEMU processes and their threads, and the lab kernel's last lines (KVM complains
    there)."""
    parts = [f"--- domain {name}: {domain_state(name)}"]
    qemu_log = QEMU_LOG_DIR / f"{name}.log"
    try:
        parts.append(f"--- {qemu_log} (tail):\n{tail(qemu_log.read_text(errors='replace'), lines)}")
    except OSError as exc:
        parts.append(f"--- {qemu_log}: {exc.strerror}")
    if console is not None:
        try:
            text = console.read_text(errors="replace")
            parts.append(f"--- console {console} (tail):\n{tail(text, lines)}" if text.strip()
                         else f"--- console {console}: empty")
        except OSError as exc:
            parts.append(f"--- console {console}: {exc.strerror}")
    processes = qemu_processes()
    parts.append("--- QEMU processes (pid state wchan cmdline): " + ("\n" + "\n".join(processes)
                                                                     if processes else "none"))
    if processes:
        parts.append("--- QEMU threads (pid/tid name state wchan, CPU ticks over 1 s):\n"
                     + "\n".join(qemu_threads()))
    dmesg = _run(["dmesg"], check=False, timeout=10)
    parts.append(f"--- lab kernel (dmesg tail):\n{tail(dmesg.stdout, 15)}")
    return "\n".join(parts)


def define_domain(xml: str, timeout: float = 60) -> None:
    """virDomainDefineXML on a connection of its own, bounded."""
    import libvirt

    def define() -> None:
        conn = libvirt.open(URI)
        try:
            conn.defineXML(xml)
        finally:
            conn.close()

    bounded(define, timeout, "defining a domain (libvirt.open + defineXML)")


def retry_boot_once(boot: Callable[[], T], what: str, say: Callable[[str], None] = print) -> T:
    """boot(), and once more if it raised NestedBootFailed (the transient kind, see early_stop), saying so
    on `say` and as a NestedBootRetried warning. Anything else boot() raises -- an assertion about the
    feature above all -- goes straight to the caller."""
    try:
        return boot()
    except NestedBootFailed as first:
        message = f"{what}: nested boot failed the transient way, booting once more: {first}"
        say(message)
        warnings.warn(message.splitlines()[0], NestedBootRetried, stacklevel=2)
    try:
        return boot()
    except NestedBootFailed as second:
        raise NestedBootFailed(f"{what}: the second boot failed too: {second}") from None


def boot_and_wait(name: str, start: Callable[[], None], ready: Callable[[], T], console: Path,
                  report: Callable[[], str], marker: str, undo: Callable[[], object] = lambda: None,
                  say: Callable[[str], None] = print, progress: Sequence[str] = ()) -> T:
    """start() a defined domain, then ready() (which closes what it opened when it raises): what ready() returns.

    A nested guest that stops before its /init printed `marker`, or after only its boot `progress` lines
    (early_stop), is undo()ne and booted once more, and `say` tells. Whatever start() raises goes straight to
    the caller (a hook's refusal is the feature's answer); ready()'s OSError or VrnicError otherwise becomes
    LabError with report() (the domain's logs)."""

    def boot() -> T:
        offset = console.stat().st_size if console.exists() else 0  # the log is appended to, boot after boot
        start()
        try:
            return ready()
        except (OSError, VrnicError) as exc:  # ConnectionError and TimeoutError are OSErrors
            if isinstance(exc, ConnectionError):  # QEMU hung up: give libvirt a moment to notice
                with contextlib.suppress(LabError):
                    wait_until(lambda: not domain_running(name), 15, f"{name} stopping")
            reason = early_stop(domain_running(name), read_from(console, offset), marker, progress)
            if reason is not None:
                undo()
                raise NestedBootFailed(f"{name}: {reason}\n{report()}") from exc
            raise LabError(f"{name}: the guest did not say ready: {exc}\n{report()}") from exc

    return retry_boot_once(boot, f"VM {name}", say)


class VmHost:
    """libvirtd + virtlogd inside the lab guest. Use as a context manager, or start()/stop()."""

    def __init__(self, config: VmHostConfig | None = None) -> None:
        self.config = config or VmHostConfig()
        self.timings: dict[str, float] = {}
        self.kvm = False
        self.domain_types: frozenset[str] = frozenset()
        self._mounts: list[Path] = []  # to unmount, in reverse
        self._pids: dict[str, int] = {}

    # -- start --
    def start(self) -> VmHost:
        if os.environ.get("VRNIC_LAB") != "1":
            raise LabError("VmHost only runs inside the lab guest: it mounts over /etc/libvirt and /var/lib/libvirt")
        for tool in ("libvirtd", "virtlogd", "virsh"):
            if shutil.which(tool) is None:
                raise LabError(f"{tool} is not installed (apt install libvirt-daemon-system libvirt-clients)")
        started = time.monotonic()
        try:
            self.kvm = ensure_kvm()
            self.timings["kvm_module_s"] = time.monotonic() - started
            if self.config.require_kvm and not self.kvm:
                raise LabError("no /dev/kvm after modprobe kvm_amd/kvm_intel (is nested virtualization on?)")
            self._prepare_filesystem()
            daemons = time.monotonic()
            for argv in (virtlogd_argv(self.config), libvirtd_argv(self.config)):
                _run(argv)
                name = argv[0]
                self._pids[name] = self._read_pid(name)
            self._wait_capabilities()
            self.timings["libvirtd_ready_s"] = time.monotonic() - daemons
            self.timings["host_ready_s"] = time.monotonic() - started
        except BaseException:
            self.stop()
            raise
        return self

    def _prepare_filesystem(self) -> None:
        c = self.config
        c.state_dir.mkdir(parents=True, exist_ok=True)
        for path in STATE_TMPFS:
            path.mkdir(parents=True, exist_ok=True)  # /run/libvirt: /run is a fresh tmpfs in the lab
            _run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(path)])
            self._mounts.append(path)
        etc = c.state_dir / "etc-libvirt"
        if etc.exists():
            shutil.rmtree(etc)
        shutil.copytree(ETC_LIBVIRT, etc, symlinks=True)
        with (etc / "qemu.conf").open("a") as conf:
            conf.write("\n" + qemu_conf_settings(c))
        with (etc / "libvirtd.conf").open("a") as conf:
            conf.write("\n" + libvirtd_conf_settings(c))
        hooks = etc / "hooks"
        hooks.mkdir(exist_ok=True)
        for name, text in c.hooks.items():
            (hooks / name).write_text(text)
            (hooks / name).chmod(0o755)
        _run(["mount", "--bind", str(etc), str(ETC_LIBVIRT)])
        self._mounts.append(ETC_LIBVIRT)
        c.memory_backing_dir.mkdir(parents=True, exist_ok=True)

    def _read_pid(self, name: str, timeout: float = 10.0) -> int:
        pid_file = self.config.state_dir / f"{name}.pid"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                return int(pid_file.read_text().strip())
            time.sleep(0.05)
        raise LabError(f"{name} wrote no pid file {pid_file}")

    def _wait_capabilities(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout
        last = ""
        while time.monotonic() < deadline:
            result = _run(["virsh", "-c", URI, "capabilities"], check=False,
                          timeout=max(5.0, deadline - time.monotonic()))
            if result.returncode == 0:
                self.domain_types = capabilities_domain_types(result.stdout)
                if "kvm" in self.domain_types or not self.config.require_kvm:
                    return
                last = f"capabilities offer {sorted(self.domain_types)}, no kvm"
            else:
                last = result.stderr.strip()
            if not _pid_alive(self._pids["libvirtd"]):
                raise LabError(f"libvirtd exited during startup: {last}")
            time.sleep(0.1)
        raise LabError(f"libvirtd not ready after {self.config.start_timeout:.0f} s: {last}")

    def restart_libvirtd(self) -> float:
        """Stop libvirtd and start it again (running domains live on; it reconnects to them and runs the
        hook's `reconnect`). Also how a newly installed hook gets noticed. Returns the seconds it took."""
        started = time.monotonic()
        pid = self._pids.pop("libvirtd")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while _pid_alive(pid):
            if time.monotonic() > deadline:
                raise LabError(f"libvirtd ({pid}) did not stop within 15 s")
            time.sleep(0.05)
        (self.config.state_dir / "libvirtd.pid").unlink(missing_ok=True)
        _run(libvirtd_argv(self.config))
        self._pids["libvirtd"] = self._read_pid("libvirtd")
        self._wait_capabilities()
        return time.monotonic() - started

    # -- stop --
    def running_domains(self) -> list[str]:
        result = _run(["virsh", "-c", URI, "list", "--name"], check=False)
        return [line.strip() for line in result.stdout.splitlines() if line.strip()]

    def stop(self) -> list[str]:
        """Destroy leftover domains, stop the daemons, undo the mounts. Returns problems (empty: clean)."""
        problems: list[str] = []
        if "libvirtd" in self._pids and _pid_alive(self._pids["libvirtd"]):
            for name in self.running_domains():
                problems.append(f"domain {name} was still running; destroyed")
                destroyed = _run(["virsh", "-c", URI, "destroy", name], check=False)
                if destroyed.returncode == TIMED_OUT:
                    problems.append(f"`virsh destroy {name}` {destroyed.stderr}\n{domain_report(name)}")
        for name in ("libvirtd", "virtlogd"):
            pid = self._pids.pop(name, None)
            if pid is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(pid):
                problems.append(f"{name} ({pid}) ignored SIGTERM; killed")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for line in [q for q in qemu_processes() if " -name guest=" in q]:  # libvirt's; nobody else ends them
            problems.append(f"QEMU outlived libvirtd; killed: {line}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        while self._mounts:
            path = self._mounts.pop()
            result = _run(["umount", str(path)], check=False)
            if result.returncode != 0:
                problems.append(f"umount {path}: {result.stderr.strip()}")
        return problems

    def __enter__(self) -> VmHost:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def leftover_processes(names: tuple[str, ...] = ("libvirtd", "virtlogd", "qemu-system-x86_64")) -> list[str]:
    """`pid comm` of processes with these names (what must be gone after stop())."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                comm = (proc / "comm").read_text().strip()
                if comm in names or any(n.startswith(comm) and len(comm) == 15 for n in names):
                    found.append(f"{proc.name} {comm}")
    return found


@contextlib.contextmanager
def vm_host(config: VmHostConfig | None = None) -> Iterator[VmHost]:
    host = VmHost(config).start()
    try:
        yield host
    finally:
        host.stop()


def main() -> int:
    host = VmHost()
    host.start()
    print(f"kvm={host.kvm} domain types={sorted(host.domain_types)}")
    problems = host.stop()
    print(json.dumps({k: round(v, 2) for k, v in host.timings.items()}))
    leftovers = leftover_processes()
    for line in problems + [f"leftover process {p}" for p in leftovers]:
        print(line, file=sys.stderr)
    return 1 if problems or leftovers else 0


if __name__ == "__main__":
    raise SystemExit(main())
