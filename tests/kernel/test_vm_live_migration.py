"""Live migration of a VM whose program is in the middle of RDMA traffic, between two raw QEMU processes in
the lab, with vrnicd moving the vRNIC alongside (issue 11, same host).

The VM runs the migratable image (python3 and vrnic.frontend.peer_program in the initramfs, no 9p)
under nested KVM; vrnicd is the in-process verbs driver on rxe0; the peer is a container guest on rxe1
in its own process (vrnic.lab.migration_peer), so traffic crosses the veth link and the peer can be
killed. The peer streams sequence-numbered 8-byte RDMA WRITEs into the VM's MR, one slot per number, and
every fourth number also as a SEND, which the VM's receive stream records. Proves:
- under traffic: every write the peer saw complete is in the destination's guest RAM (read by the
  program, and through QMP pmemsave on the destination), the SENDs arrived in order with none lost or
  duplicated, the program never restarted (pid, instance, boot id), the vRNIC's kernel objects were
  replaced one for one (nothing of the source is left) and all go at unbind;
- failures: a migration cancelled midway, a destination vrnicd that is not there (the REST API does not
  answer), and the peer killed with -9 during the migration (its QP ends in ERR on the destination, the
  VM's receives flush with an error, the program carries on).

Run: vrnic lab run --topology pair --timeout 900 -e PYTHONPATH=$PWD -- pytest -m kernel -x -s \
     tests/kernel/test_vm_live_migration.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.session import LIVE_SESSIONS
from vrnic.core.specs import AttachInfo
from vrnic.errors import LabError
from vrnic.lab.live_migration import ApiMigration, migrate_vm
from vrnic.lab.migration_rig import (
    WRITE_AT,
    Streaming,
    binding,
    fault_of,
    identity,
    largest_gap_ms,
    retry_on_guest_fault,
    start_vm,
    stream_into_new_vm,
)
from vrnic.lab.qemu_vm import QemuVm
from vrnic.lab.vm_guest import CONTROL_PORT, ControlPort, build_migratable_initramfs, channel_socket
from vrnic.lab.vm_host import ensure_kvm

from .conftest import wait_for_baseline

pytestmark = pytest.mark.kernel
PROJECT = Path(__file__).resolve().parents[2]
MR_BYTES = 1 << 20
DOMAIN = "mig"
URI = "unix:{}/mig.sock"
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def accel() -> Iterator[Literal["kvm", "tcg"]]:
    if os.environ.get("VRNIC_LAB") != "1":
        pytest.skip("needs the lab guest (nested KVM): vrnic lab run --topology pair -- pytest "
                    "tests/kernel/test_vm_live_migration.py")
    for tool in ("qemu-system-x86_64", "cpio", "ldd"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    kvm = ensure_kvm()
    if not kvm:
        print("no /dev/kvm: the VMs run under TCG (slow)")
    yield "kvm" if kvm else "tcg"
    print(f"\nTIMINGS {dict((k, round(v, 2)) for k, v in TIMINGS.items())}")


@pytest.fixture(scope="module")
def image(accel: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_migratable_initramfs(os.uname().release, tmp_path_factory.mktemp("image") / "migratable.cpio.gz",
                                      PROJECT, program_args=("--mr-bytes", str(MR_BYTES)))


@dataclass
class Attempt:
    workdir: Path  # the QEMUs' files, one directory per attempt
    vm_info: AttachInfo
    rig: Streaming
    dest: QemuVm | None = None  # set once started: stopped at the end with the source


@pytest.fixture
def streaming(accel: Literal["kvm", "tcg"], image: Path, driver: Any, make_vrnic: Callable[..., AttachInfo],
              device_pair: tuple[str, str], tmp_path: Path) -> Callable[[int], Attempt]:
    """Attempt n's start: two vRNICs, the source VM booted and bound, the peer streaming into it. A nested guest
    that stopped on its own meanwhile (died unborn, most often) is NestedGuestFault; what was started goes."""

    def start(n: int) -> Attempt:
        workdir = tmp_path / f"attempt{n}"
        workdir.mkdir()
        vm_info, peer_info = make_vrnic(device=device_pair[0]), make_vrnic(device=device_pair[1])
        return Attempt(workdir, vm_info, stream_into_new_vm(
            driver, lambda: driver.unbind_vm(DOMAIN), DOMAIN, lambda: start_vm("src", image, workdir, accel),
            vm_info, peer_info))

    return start


def test_migration_under_traffic_keeps_every_write_and_send(accel: Literal["kvm", "tcg"], image: Path, driver: Any,
                                                            streaming: Callable[[int], Attempt]) -> None:
    def attempt(n: int) -> None:
        with attempt_on(driver, streaming(n)) as run:
            rig, workdir, vm_info = run.rig, run.workdir, run.vm_info
            source, vm, peer = rig.vm, rig.info, rig.peer
            TIMINGS["boot_to_ready_s"] = rig.ready_s
            who = rig.control.call("whoami")
            time.sleep(1.0)  # traffic before
            objects_before = resource_counts()
            dest = run.dest = start_vm("dst", image, workdir, accel, incoming=URI.format(workdir))
            result = migrate_vm(driver, DOMAIN, source, dest, binding(DOMAIN, dest, vm_info.vrnic_id),
                                URI.format(workdir))
            rig.follow(dest)
            switched = result.switchover
            print(f"\nmigration: QEMU total {result.stats.total_ms} ms, downtime {result.stats.downtime_ms} ms; "
                  f"vrnicd prepare {result.prepare_ms:.1f} ms, switchover {switched}")
            source.stop()
            time.sleep(1.0)  # traffic after
            seen = sessions_now()  # shown if the stream turns out to have failed or stalled by now
            try:
                done = peer.ask({"op": "stop"})
            except RuntimeError:  # the peer gave up on a completion: show what every session held, and holds
                print("before stop:", seen)
                print("after:", sessions_now())
                print("destination:", vm_now(dest))
                raise
            if done["errors"]:
                print("before stop:", seen)
                print("destination:", vm_now(dest))
            assert not done["errors"], done["errors"]
            writes, sends = done["writes"], done["sends"]
            assert len(writes) > 50 and writes == list(range(1, len(writes) + 1))
            assert identity(rig.control.call("whoami")) == identity(who)  # the same program, never restarted
            stream = rig.control.call("recv_stream_stop", expect=len(sends), timeout=30)
            assert stream["errors"] == [] and stream["seqs"] == sends, (stream, sends)
            slots = rig.control.call("check_slots", offset=WRITE_AT, count=len(writes) + 1, size=8)["seqs"]
            assert slots[1:] == writes  # every completed write, in the destination's RAM, seen by the program
            saved = workdir / "slots.bin"
            dest.qmp.execute("pmemsave", val=vm["addr"] + WRITE_AT, size=8 * (len(writes) + 1), filename=str(saved))
            raw = saved.read_bytes()
            assert [int.from_bytes(raw[8 * s:8 * s + 8], "little") for s in writes] == writes  # and through QMP
            assert resource_counts() == objects_before  # the source's objects went, the destination's replaced them
            assert switched["peers_repointed"] == 1 and switched["broken_qps"] == 0
            TIMINGS.update(qemu_total_ms=result.stats.total_ms or 0, qemu_downtime_ms=result.stats.downtime_ms or 0,
                           switchover_ms=switched["total_ms"], peer_blackout_ms=largest_gap_ms(done["times"]),
                           writes=len(writes), sends=len(sends))

    retry_on_guest_fault(attempt, "the migration under traffic")


def test_cancelled_migration_and_absent_vrnicd_leave_the_vm_on_the_source(
        accel: Literal["kvm", "tcg"], image: Path, driver: Any, streaming: Callable[[int], Attempt]) -> None:
    def attempt(n: int) -> None:
        with attempt_on(driver, streaming(n)) as run:
            rig, workdir, vm_info = run.rig, run.workdir, run.vm_info
            source, control, peer = rig.vm, rig.control, rig.peer
            who = control.call("whoami")
            objects = resource_counts()
            # no vrnicd answers at the destination's API: nothing starts, the VM never stops
            nobody = httpx.Client(base_url="http://127.0.0.1:9", timeout=2)
            with pytest.raises(httpx.HTTPError):
                migrate_vm(ApiMigration(_Api(nobody)), DOMAIN, source, source,
                           binding(DOMAIN, source, vm_info.vrnic_id), "unix:/nonexistent")
            assert source.qmp.execute("query-status")["running"]
            # cancelled midway (throttled so that it is still copying): vrnicd drops its pre-setup, the source
            # runs on
            dest = start_vm("dst", image, workdir, accel, incoming=URI.format(workdir))
            with pytest.raises(LabError, match="cancelled"):
                migrate_vm(driver, DOMAIN, source, dest, binding(DOMAIN, dest, vm_info.vrnic_id), URI.format(workdir),
                           parameters={"max-bandwidth": 8 << 20}, cancel_after=1.0)
            assert source.qmp.execute("query-status")["running"]
            assert driver.vm_bindings()[DOMAIN].ram_path == str(source.ram_path)
            assert wait_for_baseline(objects) == objects  # the pre-setup is gone, the source's objects are intact
            time.sleep(0.5)
            done = peer.ask({"op": "stop"})
            assert not done["errors"] and len(done["writes"]) > 20
            assert identity(control.call("whoami")) == identity(who)
            stream = control.call("recv_stream_stop", expect=len(done["sends"]), timeout=30)
            assert stream["errors"] == [] and stream["seqs"] == done["sends"]
            slots = control.call("check_slots", offset=WRITE_AT, count=len(done["writes"]) + 1, size=8)["seqs"]
            assert slots[1:] == done["writes"]

    retry_on_guest_fault(attempt, "the cancelled migration")


def test_peer_killed_during_the_migration(accel: Literal["kvm", "tcg"], image: Path, driver: Any,
                                          streaming: Callable[[int], Attempt]) -> None:
    def attempt(n: int) -> None:
        with attempt_on(driver, streaming(n)) as run:
            rig, workdir, vm_info = run.rig, run.workdir, run.vm_info
            source, peer = rig.vm, rig.peer
            who = rig.control.call("whoami")
            dest = run.dest = start_vm("dst", image, workdir, accel, incoming=URI.format(workdir))
            killer = threading.Timer(0.5, lambda: os.kill(peer.proc.pid, signal.SIGKILL))
            killer.start()
            result = migrate_vm(driver, DOMAIN, source, dest, binding(DOMAIN, dest, vm_info.vrnic_id),
                                URI.format(workdir), parameters={"max-bandwidth": 32 << 20})
            rig.follow(dest)
            killer.join()
            source.stop()
            assert result.switchover["broken_qps"] == 1, result.switchover
            assert rig.control.call("whoami")["instance"] == who["instance"]
            stream = rig.control.call("recv_stream_stop", expect=10 ** 6, timeout=5)
            assert any("FLUSH" in e for e in stream["errors"]), stream  # a defined error, not silence

    retry_on_guest_fault(attempt, "the migration with the peer killed")


@contextmanager
def attempt_on(driver: Any, run: Attempt) -> Iterator[Attempt]:
    """One attempt of a test on a streaming VM. A failure while the QEMU the VM runs in (rig.vm: the source
    until rig.follow(dest)) stopped running on its own becomes NestedGuestFault, which retry_on_guest_fault
    runs once more; at the end the peer, the control port, the binding and both QEMUs go."""
    rig = run.rig
    source = rig.vm
    try:
        yield run
    except Exception as exc:
        fault = fault_of(rig.vm, exc)
        if fault is not None:
            raise fault from exc
        raise
    finally:
        rig.close()
        driver.unbind_vm(DOMAIN)
        for qemu in (source, run.dest):
            if qemu is not None:
                qemu.stop()


def sessions_now() -> str:
    """Every live guest session of the in-process vrnicd (engine counters, each QP's held flag, rings and NIC
    state), and rdma res: what a stalled or failed stream needs looked at."""
    states = [json.dumps(session.debug_state(), default=str) for session in list(LIVE_SESSIONS)]
    qps = subprocess.run(["rdma", "res", "show", "qp"], capture_output=True, text=True, check=False).stdout
    return "\n".join([*states, qps])


def vm_now(vm: Any) -> str:
    """Whether the VM runs and its program answers: a stream that stalls after `cont` may be a VM that did not."""
    try:
        status = vm.qmp.execute("query-status")
    except (LabError, OSError) as exc:
        status = f"QMP: {exc}"
    try:
        port = ControlPort(channel_socket(vm.spec, CONTROL_PORT), timeout=5, connect_timeout=5)
        try:
            answer: Any = port.call("whoami")
        finally:
            port.close()
    except Exception as exc:  # a diagnosis reports what it can
        answer = f"control port: {type(exc).__name__}: {exc}"
    return f"{status}; program: {answer}; {vm.exit_report(0.5) or 'QEMU runs'}; console: {vm.console(600)}"


class _Api:
    """ApiMigration's view of an httpx client (vrnic.cli.client.ApiClient has the same request())."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def request(self, method: str, path: str, *, json_body: Any = None) -> Any:
        response = self.client.request(method, f"/api/v1{path}", json=json_body)
        response.raise_for_status()
        return response.json()
