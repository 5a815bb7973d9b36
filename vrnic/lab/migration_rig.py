"""The rig for live-migrating a VM with a vRNIC under traffic in the lab: the tests, the bench and the demo share it.

A raw-QEMU VM boots the migratable image (vrnic.lab.vm_guest) and runs the peer program; vrnicd binds it;
a container guest in its own process (vrnic.lab.migration_peer) connects to it and streams
sequence-numbered RDMA WRITEs and SENDs into it. Each migration needs a fresh destination QEMU
(`start_vm(..., incoming=...)`); the VM can go back and forth.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from vrnic.core.specs import AttachInfo, VmBinding, VmVrnic
from vrnic.errors import LabError
from vrnic.lab.qemu_vm import QemuVm
from vrnic.lab.vm_guest import CONTROL_PORT, ControlPort, channel_socket, migratable_vm_spec
from vrnic.vm.domain_xml import DEFAULT_CHANNEL

PROJECT = Path(__file__).resolve().parents[2]
WRITE_AT = 512 << 10  # the peer's slots in the VM's MR (1 MiB): 8 bytes per sequence number
SLOTS = 60000


T = TypeVar("T")


class NestedGuestFault(LabError):
    """A nested guest stopped running under a migration test, and not by a panic: its QEMU ended on its own
    (under -no-reboot a guest reset ends QEMU with status 0), or it runs and its program's control port, which
    vrnicd has no part in, stays silent (a frozen guest). Nested KVM inside the TCG lab, not the feature."""


# A loaded host starves the lab guest's vCPUs (soft lockups of two minutes seen), and its nested guests then reset
# on their own; a clean-clone CI run saw two in a row during one migration test.
GUEST_FAULT_ATTEMPTS = 3


class NestedGuestRetried(UserWarning):
    """A migration test's nested guest stopped running (NestedGuestFault) and the test ran once more."""


def guest_stopped(vm: QemuVm, answer_within: float = 10.0) -> str | None:
    """Why vm, which should be running, is not, when that is the nested guest's own doing; None if it runs and
    its program answers, or if its kernel panicked (a panic may be the feature's doing: a write into the wrong
    guest page)."""
    ended = vm.exit_report(0.5)
    if ended is not None:
        return None if "panic" in ended.lower() else ended
    try:
        port = ControlPort(channel_socket(vm.spec, CONTROL_PORT), timeout=answer_within, connect_timeout=5)
        try:
            port.call("whoami")
        finally:
            port.close()
    except Exception as exc:  # a silent program is the finding, whatever the error
        return (f"QEMU {vm.spec.name} runs ({_status(vm)}) but its program does not answer its control port: "
                f"{type(exc).__name__}: {exc}; {_cpu_state(vm)}")
    return None


def _status(vm: QemuVm) -> str:
    try:
        return str(vm.qmp.execute("query-status").get("status"))
    except (LabError, OSError) as exc:
        return f"QMP: {exc}"


def _cpu_state(vm: QemuVm) -> str:
    """Where the guest's CPU is (RIP, and HLT=1 for a CPU waiting for an interrupt that does not come)."""
    try:
        lines = vm.qmp.hmp("info registers").splitlines()
    except (LabError, OSError) as exc:
        return f"registers: {exc}"
    return "registers: " + " | ".join(line.strip() for line in lines if "RIP=" in line or "HLT=" in line)


def retry_on_guest_fault(attempt: Callable[[int], T], what: str, say: Callable[[str], None] = print,
                         attempts: int = GUEST_FAULT_ATTEMPTS) -> T:
    """attempt(1), and attempt(2), ... up to attempts while it raises NestedGuestFault, saying so on `say` and as a
    NestedGuestRetried warning. Anything else -- an assertion about the feature above all -- goes straight to the
    caller, and so does the last attempt's fault."""
    for n in range(1, attempts):
        try:
            return attempt(n)
        except NestedGuestFault as fault:
            message = f"{what}: the nested guest stopped running, running it once more: {fault}"
            say(message)
            warnings.warn(message.splitlines()[0][:400], NestedGuestRetried, stacklevel=2)
    try:
        return attempt(attempts)
    except NestedGuestFault as last:
        raise NestedGuestFault(f"{what}: the nested guest stopped running in all {attempts} attempts: {last}") \
            from None


def fault_of(vm: QemuVm, exc: Exception) -> NestedGuestFault | None:
    """The NestedGuestFault to raise for exc if vm stopped running on its own (guest_stopped), else None."""
    stopped = guest_stopped(vm)
    if stopped is None:
        return None
    return NestedGuestFault(f"{stopped} (the test then failed: {type(exc).__name__}: {exc})"[:4000])


class Binder(Protocol):
    def bind_vm(self, binding: VmBinding) -> None: ...


class PeerProcess:
    """vrnic.lab.migration_peer in its own process (so that it can be killed)."""

    def __init__(self, info: AttachInfo, qps: int = 1) -> None:
        env = dict(os.environ, PYTHONPATH=str(PROJECT))
        self.proc = subprocess.Popen([sys.executable, "-m", "vrnic.lab.migration_peer"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.info = self.ask({"attach": info.model_dump(mode="json"), "qps": qps})

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        self.tell(message)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer process exited ({self.proc.wait(10)})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def tell(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):  # stdin's unflushed rest, to a process that is gone
                    pipe.close()


def start_vm(name: str, image: Path, workdir: Path, accel: Literal["kvm", "tcg"], incoming: str | None = None,
             memory_mib: int = 256) -> QemuVm:
    return QemuVm(migratable_vm_spec(name, workdir, image, accel=accel, incoming=incoming,
                                     memory_mib=memory_mib)).start()


def vm_report(vm: QemuVm) -> str:
    """What to know when a VM's program misbehaves: its console and QEMU log."""
    return f"console:\n{vm.console()}\nqemu:\n{vm.log_tail()}"


def binding(domain: str, vm: QemuVm, vrnic_id: str) -> VmBinding:
    return VmBinding(domain=domain, ram_path=str(vm.ram_path), machine="q35",
                     vrnics=[VmVrnic(vrnic_id=vrnic_id, channel_socket=str(channel_socket(vm.spec, DEFAULT_CHANNEL)))])


@dataclass
class Streaming:
    """A bound VM whose program streams receives, and the peer writing into it."""

    vm: QemuVm
    control: ControlPort
    info: dict[str, Any]  # the program's ready line: gid, qpn, addr, rkey, extra_qpns, ...
    peer: PeerProcess
    ready_s: float

    def follow(self, vm: QemuVm) -> None:
        """The VM now runs in this QEMU: talk to its control port."""
        self.control.close()
        self.vm = vm
        self.control = ControlPort(channel_socket(vm.spec, CONTROL_PORT), report=lambda: vm_report(vm))

    def close(self) -> None:
        self.peer.close()
        self.control.close()


def stream_into_vm(vrnicd: Binder, domain: str, vm: QemuVm, vm_info: AttachInfo, peer_info: AttachInfo,
                   send_every: int = 4, ready_timeout: float = 180.0) -> Streaming:
    """Bind the VM, wait for its program, connect it to a peer process (all of the VM's QPs, one peer QP each),
    start the VM's receive stream and the peer's writes."""
    t0 = time.monotonic()
    vrnicd.bind_vm(binding(domain, vm, vm_info.vrnic_id))
    control = ControlPort(channel_socket(vm.spec, CONTROL_PORT))
    try:
        info = control.ready(ready_timeout)
    except Exception as exc:
        control.close()
        raise RuntimeError(f"{exc}; {vm_report(vm)}") from exc
    control.report = lambda: vm_report(vm)  # a silent VM program's error carries them too, from here on
    ready_s = time.monotonic() - t0
    peer = start_stream(control, info, peer_info, send_every)
    return Streaming(vm, control, info, peer, ready_s)


def stream_into_new_vm(vrnicd: Binder, unbind: Callable[[], object], domain: str, start: Callable[[], QemuVm],
                       vm_info: AttachInfo, peer_info: AttachInfo, ready_timeout: float = 180.0) -> Streaming:
    """start() a VM, then stream_into_vm. If that fails, the VM is unbound and stopped, and the error is
    NestedGuestFault when the VM had stopped on its own (a nested guest that died unborn, most often)."""
    vm = start()
    try:
        return stream_into_vm(vrnicd, domain, vm, vm_info, peer_info, ready_timeout=ready_timeout)
    except Exception as exc:
        fault = fault_of(vm, exc)
        unbind()
        vm.stop()
        if fault is not None:
            raise fault from exc
        raise


def boot_and_stream(vrnicd: Binder, unbind: Callable[[], object], domain: str, start: Callable[[Path], QemuVm],
                    workdir: Path, vm_info: AttachInfo, peer_info: AttachInfo, ready_timeout: float = 180.0,
                    say: Callable[[str], None] = print) -> Streaming:
    """stream_into_new_vm on a VM that start(dir) boots in a fresh workdir/boot<n>; a nested guest that stopped
    on its own meanwhile is booted once more (retry_on_guest_fault), and `say` tells."""

    def attempt(n: int) -> Streaming:
        boot_dir = workdir / f"boot{n}"
        boot_dir.mkdir()
        return stream_into_new_vm(vrnicd, unbind, domain, lambda: start(boot_dir), vm_info, peer_info,
                                  ready_timeout)

    return retry_on_guest_fault(attempt, f"VM {domain}'s boot", say)


def start_stream(control: ControlPort, info: dict[str, Any], peer_info: AttachInfo,
                 send_every: int = 4) -> PeerProcess:
    """The VM's program is ready (info: its ready line): connect it to a peer process and start the VM's receive
    stream and the peer's writes. On an error the peer and the control port are closed."""
    qpns = [info["qpn"], *info.get("extra_qpns", [])]
    peer = PeerProcess(peer_info, qps=len(qpns))
    try:
        control.call("connect", gid=peer.info["gid"], qpn=peer.info["qpns"][0], addr=peer.info["addr"],
                     rkey=peer.info["rkey"])
        if len(qpns) > 1:
            control.call("connect_extra", gid=peer.info["gid"], qpns=peer.info["qpns"][1:])
        peer.ask({"gid": info["gid"], "qpns": qpns, "addr": info["addr"], "rkey": info["rkey"],
                  "write_at": WRITE_AT, "slots": SLOTS, "send_every": send_every})
        control.call("recv_stream_start", slots=16)
        peer.tell({"op": "go"})
    except BaseException:
        peer.close()
        control.close()
        raise
    return peer


def stream_problems(done: dict[str, Any], received: dict[str, Any], slots: list[int]) -> list[str]:
    """What the VM got wrong, given the peer's stop report (done), the VM program's receive stream
    (recv_stream_stop) and its write slots (check_slots, from slot 0): every write the peer saw complete must be
    in the VM's RAM and every SEND received once, in order. Empty if nothing."""
    found: list[str] = []
    writes, sends = done["writes"], done["sends"]
    if done["errors"]:
        found.append(f"the peer's traffic failed: {done['errors']}")
    if writes != list(range(1, len(writes) + 1)):
        found.append("the peer's completed writes are not 1..n")
    if received["errors"] or received["seqs"] != sends:
        found.append(f"SENDs: sent {len(sends)}, received {len(received['seqs'])}, errors {received['errors'][:3]}")
    missing = [s for s in writes if s >= len(slots) or slots[s] != s]
    if missing:
        found.append(f"{len(missing)} completed writes are not in the VM's RAM as its program reads it: "
                     f"{missing[:10]}")
    return found


def identity(whoami: dict[str, Any]) -> tuple[Any, ...]:
    """What must not change across a migration: the same process of the same boot."""
    return whoami["pid"], whoami["instance"], whoami["boot_id"]


def largest_gap_ms(times: list[float], start: float | None = None, end: float | None = None) -> float:
    """The longest time between two consecutive completions (within [start, end] when given)."""
    chosen = [t for t in times if (start is None or t >= start) and (end is None or t <= end)]
    if start is not None:
        before = [t for t in times if t < start]
        chosen = before[-1:] + chosen
    if end is not None:
        after = [t for t in times if t > end]
        chosen = chosen + after[:1]
    return max((b - a for a, b in zip(chosen, chosen[1:], strict=False)), default=0.0) * 1000
