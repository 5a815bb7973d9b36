"""Issue 11 the way operators drive it: `virsh migrate --live --suspend` of a libvirt domain whose program is in the
middle of RDMA traffic through its vRNIC, from host a's libvirtd to host b's, and nothing else by hand.

Each host runs libvirtd (TCP, the lab's migration endpoint) with vrnic's hook installed and `vrnic daemon` with
VRNIC_LIBVIRT_URI. What moves the vRNIC is the hook and the agents:
- b's hook at migrate finds where the vRNIC lives (a) and at started asks a's API to prepare the hand-over to b
  (a's dirty logs start, b's vrnicd pre-sets-up the vRNIC over b's RAM file and channels);
- libvirt's Confirm ends a's QEMU while b's waits paused (--suspend); a's hook at stopped makes a's vrnicd hand
  the vRNIC over (hold the peer, drain, copy what the NIC wrote, take-over on b, re-point the peer);
- b's vrnicd resumes the domain once it serves it.

First a migration cancelled midway (`virsh domjobabort` after b's vrnicd pre-set-up the vRNIC): b's hook at
stopped calls the hand-over off, the VM runs on a with its vRNIC and the traffic goes on. Then the real one.
Checked: the domain runs on b and is gone from a; every write the peer saw complete is in b's guest RAM (the
program's own reading and QMP pmemsave through b's libvirt), the SENDs arrived in order, none lost or duplicated,
the program never restarted, the vRNIC's host is b, and `rdma res` on a is back to its baseline. Numbers go to
.lab/two-hosts/virsh-migrate.json.

Run: make test-virsh-migrate-two-hosts
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.config import lab_output_dir
from vrnic.core.specs import AttachInfo
from vrnic.lab.kernel import kernel_image
from vrnic.lab.migration_rig import WRITE_AT, identity, largest_gap_ms, start_stream
from vrnic.lab.two_hosts.libvirt_target import LibvirtTarget, hook_log
from vrnic.lab.two_hosts.rig import OPERATOR_TOKEN, Rig, lab_addrs
from vrnic.lab.vm_guest import CONTROL_PORT, ControlPort
from vrnic.lab.vm_host import domain_report
from vrnic.lab.vm_lab import boot_until_ready
from vrnic.vm.domain_xml import (
    DEFAULT_CHANNEL,
    DirectKernelBoot,
    DomainType,
    SerialConsole,
    VirtioSerialChannel,
    VmDomain,
    VrnicAttachment,
)

from .support import Rigs, eventually, migratable_image, once_moved, release

SHARED = lab_output_dir("two-hosts", "virsh")
SOCKETS = Path("/run/vrnic-virsh/vm")  # the same path on both hosts (b's hook makes it at prepare)
DOMAIN = "vmig"
MR_BYTES = 1 << 20
QBOOT = Path("/usr/share/qemu/qboot.rom")
HOST_UUIDS = {"a": "6a1c0f3e-0a0a-4a0a-8a0a-00000000000a", "b": "6a1c0f3e-0a0a-4a0a-8a0a-00000000000b"}


class RemoteLibvirt:
    """vrnic.lab.two_hosts.libvirt_target on host b, through b's control server."""

    def __init__(self, rig: Rig) -> None:
        self.control = rig.control
        self.id = int(self.control.call("spawn", argv=[sys.executable, "-m", "vrnic.lab.two_hosts.libvirt_target"],
                                        stdin=True)["id"])

    def call(self, op: str, timeout: float = 300.0, **args: Any) -> dict[str, Any]:
        self.control.call("write", id=self.id, text=json.dumps({"op": op, **args}) + "\n")
        answer = self.control.call("readline", id=self.id, timeout=timeout)
        assert answer["line"] is not None, f"libvirt_target on b ended: {answer.get('stderr', '')}"
        result: dict[str, Any] = json.loads(answer["line"])
        assert "error" not in result, (op, result)
        return result

    def close(self) -> None:
        self.call("stop_host")
        self.control.call("write", id=self.id, text=json.dumps({"op": "quit"}) + "\n")
        self.control.call("wait", id=self.id, timeout=60)


@pytest.fixture(scope="module")
def rig(rigs: Rigs) -> Rig:
    """The agents resume a domain that arrives paused (VRNIC_LIBVIRT_URI); a long heartbeat window, as the
    raw-QEMU hand-over test has it (a loaded lab misses beats for seconds)."""
    return rigs.get(agent_env={"VRNIC_HOST_DOWN_AFTER_S": "120", "VRNIC_LIBVIRT_URI": "qemu:///system"})


@pytest.fixture(scope="module")
def hosts(rig: Rig) -> Iterator[tuple[LibvirtTarget, RemoteLibvirt, bool]]:
    for tool in ("libvirtd", "virtlogd", "virsh", "qemu-system-x86_64", "cpio"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    addrs = lab_addrs()
    local, remote = LibvirtTarget(), RemoteLibvirt(rig)
    try:
        kvm_a = local.do_start_host("a", rig.url("a"), OPERATOR_TOKEN, addrs["a"], HOST_UUIDS["a"])["kvm"]
        kvm_b = remote.call("start_host", host="b", api_url=rig.url("b"), token=OPERATOR_TOKEN,
                            listen_address=addrs["b"], host_uuid=HOST_UUIDS["b"])["kvm"]
        yield local, remote, bool(kvm_a and kvm_b)
    finally:
        problems = local.do_stop_host()["problems"]
        remote.close()
        print(f"libvirt hosts stopped; problems on a: {problems}")


def domain_xml(vrnic_id: str, image: Path, kvm: bool) -> str:
    boot = DirectKernelBoot(kernel=kernel_image(os.uname().release), initrd=image,
                            cmdline="console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off",
                            rom=QBOOT if QBOOT.exists() else None)
    return VmDomain(name=DOMAIN, boot=boot, memory_mib=256, domain_type=DomainType.KVM if kvm else DomainType.QEMU,
                    vrnics=(VrnicAttachment(vrnic_id),),
                    channels=(VirtioSerialChannel(SOCKETS / "vrnic.sock", DEFAULT_CHANNEL),
                              VirtioSerialChannel(SOCKETS / "ctl.sock", CONTROL_PORT)),
                    console=SerialConsole(log=SOCKETS / "console.log")).to_xml()


def hook_ops(host: str) -> list[tuple[str, str]]:
    path = hook_log(host)
    lines = path.read_text().splitlines() if path.exists() else []
    return [(r["op"], r["outcome"]) for r in map(json.loads, lines) if r["domain"] == DOMAIN]


# pytest-timeout counts setup and call together: 244 s of rig and libvirtd setup plus a 512 s call passed 720 on
# a slow hour (native verbs 1.8x slower than usual)
@pytest.mark.timeout(1800)
def test_virsh_migrate_cancelled_then_done_under_rdma_traffic(
        rig: Rig, hosts: tuple[LibvirtTarget, RemoteLibvirt, bool], tmp_path: Path) -> None:
    local, remote, kvm = hosts
    print(f"\nnested VMs under {'kvm' if kvm else 'tcg'}")
    SHARED.mkdir(parents=True, exist_ok=True)
    image = migratable_image(MR_BYTES)
    token = rig.make_tenant("virsh-mover")
    vm_row, peer_row = rig.allocate("a", token), rig.allocate("a", token)
    baseline = resource_counts()
    timings: dict[str, Any] = {"accel": "kvm" if kvm else "tcg"}
    b = lab_addrs()["b"]
    control: ControlPort | None = None
    peer = None
    api = rig.client("a")
    try:
        xml_file = tmp_path / "vmig.xml"
        xml_file.write_text(domain_xml(vm_row["id"], image, kvm))
        SOCKETS.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()

        def create() -> None:
            created = local.do_virsh(["create", str(xml_file)], timeout=300)
            assert created["rc"] == 0, (created, hook_ops("a"))
            assert ("started", "bound") in hook_ops("a"), hook_ops("a")

        console = SOCKETS / "console.log"
        # a loaded lab: a nested VM reached /init after 97 s once; one that dies unborn is created once more
        control, info = boot_until_ready(DOMAIN, create, lambda: ControlPort(SOCKETS / "ctl.sock", timeout=120),
                                         console, lambda: domain_report(DOMAIN, console), ready_timeout=600)
        timings["boot_to_ready_s"] = time.monotonic() - t0
        peer = start_stream(control, info, AttachInfo.model_validate(peer_row["attach"]))
        who = control.call("whoami")
        time.sleep(1.0)  # traffic before
        # 1. a migration cancelled midway (`virsh domjobabort` once b's vrnicd holds the pre-set-up vRNIC): the VM
        # runs on a with its vRNIC as before, and b keeps nothing
        slow = subprocess.Popen(["virsh", "-c", "qemu:///system", "migrate", "--live", "--suspend", "--bandwidth",
                                 "1", DOMAIN, f"qemu+tcp://{b}/system"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            prepared = eventually(lambda: ("started", "handover_prepared") in hook_ops("b"), timeout=300, every=0.5)
            assert prepared, (hook_ops("b"), slow.poll())
            time.sleep(2.0)  # QEMU copying at 1 MiB/s, the dirty logs running
            abort = local.do_virsh(["domjobabort", DOMAIN])
            assert abort["rc"] == 0, abort
            t_abort = time.monotonic()
            _, cancel_err = slow.communicate(timeout=300)
        finally:
            if slow.poll() is None:
                slow.kill()
        assert slow.returncode != 0, "the aborted migration succeeded"
        timings["cancelled"] = cancel_err.strip()[-200:]
        called_off = eventually(lambda: ("stopped", "handover_called_off") in hook_ops("b"), timeout=120)
        assert called_off, hook_ops("b")
        state = eventually(lambda: local.do_virsh(["domstate", DOMAIN])["stdout"].strip() == "running", timeout=60)
        assert state, local.do_virsh(["domstate", "--reason", DOMAIN])
        assert DOMAIN not in remote.call("virsh", args=["list", "--name"])["stdout"].split()
        assert [v["domain"] for v in api.get("/vms").json()["items"]] == [DOMAIN]  # a serves it as before
        with rig.client("b") as api_b:
            assert api_b.get("/vms").json()["items"] == []
        assert api.get(f"/vrnics/{vm_row['id']}").json()["host"] == "a"
        time.sleep(2.0)  # traffic after the cancel, still on a
        # 2. the operator's one command
        t_migrate = time.monotonic()
        migrated = subprocess.run(["virsh", "-c", "qemu:///system", "migrate", "--live", "--suspend", "--verbose",
                                   DOMAIN, f"qemu+tcp://{b}/system"], capture_output=True, text=True, timeout=900,
                                  check=False)
        t_done = time.monotonic()
        timings["virsh_migrate_s"] = t_done - t_migrate
        print(f"virsh migrate: rc {migrated.returncode} in {timings['virsh_migrate_s']:.1f} s\n{migrated.stdout}"
              f"{migrated.stderr}\nhooks on a: {hook_ops('a')}\nhooks on b: {hook_ops('b')}")
        assert migrated.returncode == 0, migrated.stderr
        assert ("migrate", "allowed") in hook_ops("b") and ("started", "handover_prepared") in hook_ops("b")
        assert ("stopped", "unbound") in hook_ops("a"), hook_ops("a")  # a's stop handed the vRNIC over
        running = eventually(lambda: remote.call("virsh", args=["domstate", DOMAIN])["stdout"].strip() == "running",
                             timeout=60, every=0.2)
        assert running, remote.call("virsh", args=["domstate", "--reason", DOMAIN])
        timings["resumed_on_b_after_s"] = time.monotonic() - t_done
        assert DOMAIN not in local.do_virsh(["list", "--name"])["stdout"].split()
        control.close()
        control = None
        time.sleep(1.5)  # traffic after, to the VM on b
        done = peer.ask({"op": "stop"})
        assert not done["errors"], done["errors"]
        writes, sends = done["writes"], done["sends"]
        assert len(writes) > 20 and writes == list(range(1, len(writes) + 1))
        on_b = str(SOCKETS / "ctl.sock")
        assert identity(remote.call("control", socket=on_b, verb="whoami")) == identity(who)  # never restarted
        got = remote.call("control", socket=on_b, verb="recv_stream_stop", args={"expect": len(sends), "timeout": 30})
        assert got["errors"] == [] and got["seqs"] == sends, (got, sends)
        slots = remote.call("control", socket=on_b, verb="check_slots",
                            args={"offset": WRITE_AT, "count": len(writes) + 1, "size": 8})["seqs"]
        assert slots[1:] == writes  # every completed write, in b's guest RAM, as the program reads it
        saved = SHARED / "vmig-slots.bin"
        saved.unlink(missing_ok=True)
        command = json.dumps({"execute": "pmemsave", "arguments": {"val": info["addr"] + WRITE_AT,
                                                                   "size": 8 * (len(writes) + 1),
                                                                   "filename": str(saved)}})
        pmem = remote.call("virsh", args=["qemu-monitor-command", DOMAIN, command])
        assert pmem["rc"] == 0, pmem
        raw = saved.read_bytes()
        assert [int.from_bytes(raw[8 * s:8 * s + 8], "little") for s in writes] == writes  # and through QMP on b
        assert any(t_abort < t < t_migrate for t in done["times"]), "no write completed after the cancel"
        after = [t for t in done["times"] if t > t_done]
        assert after, "no write completed after the migration"
        row = api.get(f"/vrnics/{vm_row['id']}").json()
        assert row["host"] == "b", row
        switch = [e for e in api.get("/events", params={"action": "vm.handover_switchover", "limit": 100})
                  .json()["items"] if e["subject"] == f"vm/{DOMAIN}"]
        assert switch, "no switchover event on a"
        timings.update(peer_blackout_ms=largest_gap_ms(done["times"]), writes=len(writes), sends=len(sends),
                       switchover=switch[-1].get("detail"))
        peer.close()
        peer = None
        left = once_moved(baseline, vm_row)
        # 120 s: on a loaded CI machine this stage ran 1.8x slower than on an idle one, and a leak stays anyway
        back = eventually(lambda: resource_counts() == left, timeout=120)
        assert back, (resource_counts(), left)  # a keeps nothing of the VM
    finally:
        (SHARED.parent / "virsh-migrate.json").write_text(json.dumps(timings, indent=2, default=str))
        print(f"virsh migrate: {json.dumps(timings, default=str)}")
        if control is not None:
            control.close()
        if peer is not None:
            peer.close()
        local.do_virsh(["destroy", DOMAIN])
        remote.call("virsh", args=["destroy", DOMAIN])
        api.close()
        release(rig, vm_row, peer_row)
