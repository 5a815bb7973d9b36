"""A real VM with a vRNIC: nested KVM under a real libvirtd in the lab, vrnicd's verbs driver on rxe.

The VM runs vrnic.frontend.peer_program with the lab's python3 over 9p; its
partner is a container guest on the lab host. vrnicd binds the running domain
here directly (the libvirt hook's part is tests/kernel/test_vm_hook_flow.py).
Proves: SEND both ways, RDMA WRITE both ways (the peer's landing in the VM's own
buffer, seen at its guest-physical address in the RAM file), RDMA READ both
ways, refusals for memory outside the VM's RAM and for other identities, and
that `virsh destroy` in the middle of traffic leaves no kernel object.

Run: vrnic lab run -e PYTHONPATH=$PWD -- pytest -m kernel tests/kernel/test_vm_datapath.py
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.core.specs import AttachInfo, VmBinding, VmVrnic
from vrnic.lab.vm_guest import ControlPort, HostPeer, peer_domain
from vrnic.lab.vm_host import URI, VmHost, VmHostConfig, domain_report, leftover_processes, ram_file
from vrnic.lab.vm_lab import boot_until_ready
from vrnic.vm.domain_xml import DomainType

from .conftest import wait_for_baseline

pytestmark = pytest.mark.kernel
PROJECT = Path(__file__).resolve().parents[2]
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def host() -> Iterator[VmHost]:
    if os.environ.get("VRNIC_LAB") != "1":
        pytest.skip("needs the lab guest (nested KVM, libvirtd): vrnic lab run -- pytest tests/kernel/"
                    "test_vm_datapath.py")
    pytest.importorskip("libvirt", reason="libvirt-python is not installed (make setup)")
    for tool in ("libvirtd", "virtlogd", "cpio"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    vm_host = VmHost(VmHostConfig())
    vm_host.start()
    yield vm_host
    problems = vm_host.stop()
    print(f"\nTIMINGS {dict((k, round(v, 2)) for k, v in TIMINGS.items())}")
    assert not problems, problems
    assert not leftover_processes(), leftover_processes()


def _define_vm(host: VmHost, tmp_path: Path, name: str, vrnic_id: str) -> tuple[Any, Any]:
    import libvirt

    domain_type = DomainType.KVM if "kvm" in host.domain_types else DomainType.QEMU
    if domain_type is DomainType.QEMU:
        print("no /dev/kvm: the VM runs under TCG (slow)")
    spec = peer_domain(name, tmp_path, PROJECT, vrnic_id, domain_type)
    conn = libvirt.open(URI)
    return conn, conn.defineXML(spec.to_xml())


def test_vm_rdma_both_ways_refusals_and_destroy_mid_traffic(host: VmHost, driver: Any,
                                                             make_vrnic: Callable[..., AttachInfo],
                                                             device_pair: tuple[str, str], tmp_path: Path) -> None:
    vm_info = make_vrnic(device=device_pair[0])
    peer_info = make_vrnic(device=device_pair[1])
    foreign = make_vrnic(tenant="other", device=device_pair[1])
    baseline = resource_counts()
    name = "vrnic-dp-1"
    conn, domain = _define_vm(host, tmp_path, name, vm_info.vrnic_id)
    console = tmp_path / "console.log"
    ram_paths: list[Path] = []
    peer = foreign_peer = control = None

    def start() -> None:
        t0 = time.monotonic()
        domain.create()
        TIMINGS["domain_create_s"] = time.monotonic() - t0

    def bind_and_connect() -> ControlPort:
        # a guest that died meanwhile fails the bind too: that is classified with the rest of the wait
        ram_paths.append(ram_file(host.config, domain.ID(), name))
        t0 = time.monotonic()
        driver.bind_vm(VmBinding(domain=name, ram_path=str(ram_paths[-1]), machine="q35", vrnics=[
            VmVrnic(vrnic_id=vm_info.vrnic_id, channel_socket=str(tmp_path / "org.vrnic.0.sock"))]))
        TIMINGS["bind_ms"] = (time.monotonic() - t0) * 1000
        return ControlPort(tmp_path / "ctl.sock")

    report = partial(domain_report, name, console)
    try:
        t0 = time.monotonic()
        # a nested guest that died unborn is unbound and booted once more
        control, vm = boot_until_ready(name, start, bind_and_connect, console, report, ready_timeout=180,
                                       undo=lambda: driver.unbind_vm(name))
        control.report = report  # from here on a silent VM program's error carries them (boot_and_wait's did)
        ram_path = ram_paths[-1]
        TIMINGS["create_to_ready_s"] = time.monotonic() - t0
        print(f"\nVM program ready: {vm}")
        assert vm["gid"] == vm_info.virtual_gid
        assert driver.attached_ids() == {vm_info.vrnic_id}
        peer = HostPeer(peer_info)
        control.call("connect", **peer.info())
        peer.connect(vm)
        # SEND: VM -> host
        hello = b"hello from inside the VM " + secrets.token_bytes(8)
        peer.post_recv()
        control.call("send", data=hello.hex())
        got = peer.cq.wait(1, timeout=30)[0]
        assert got.byte_len == len(hello) and peer.mr.read(len(hello)) == hello
        # SEND: host -> VM
        back = b"hello VM, from the host " + secrets.token_bytes(8)
        control.call("post_recv", count=1)
        peer.send(back)
        assert control.call("wait_recv", count=1)["received"] == [back.hex()]
        # RDMA WRITE host -> the VM's own buffer: the VM sees it, and it sits at the MR's GPA in the RAM file
        into = b"WRITTEN INTO THE VM " + secrets.token_bytes(16)
        at = 100_000
        peer.write_into_vm(into, vm_offset=at)
        assert control.call("peek", offset=at, length=len(into))["data"] == into.hex()
        with ram_path.open("rb") as ram:
            ram.seek(vm["addr"] + at)
            assert ram.read(len(into)) == into
        # RDMA WRITE VM -> host, RDMA READ both ways
        out = b"the VM wrote this " + secrets.token_bytes(8)
        control.call("write", data=out.hex(), remote_offset=32768)
        assert peer.mr.read(len(out), 32768) == out
        assert bytes.fromhex(control.call("read", length=len(out), remote_offset=32768)["data"]) == out
        assert peer.read_from_vm(len(into), vm_offset=at) == into
        # refusals: memory outside the VM's RAM, handles and peers that are not the VM's
        foreign_peer = HostPeer(foreign)
        codes = control.call("refusals", foreign_gid=foreign.virtual_gid, foreign_qpn=foreign_peer.qp.qpn)["codes"]
        assert codes == {"mr_beyond_ram": "invalid_argument", "mr_in_rom_hole": "invalid_argument",
                         "foreign_pd": "not_found", "foreign_qp": "not_found", "foreign_peer": "not_found"}, codes
        foreign_peer.close()
        foreign_peer = None
        # numbers for the record (the bench measures them properly)
        echo = threading.Thread(target=peer.echo, args=(200,), daemon=True)
        echo.start()
        ping = control.call("ping", iterations=200)
        echo.join(timeout=30)
        TIMINGS["vm_send_round_trip_us"] = ping["round_trip_us"]
        # virsh destroy in the middle of traffic: RDMA WRITEs stream from the VM into the host peer
        peer.mr.write(bytes(4096), 0)
        control.call("flood", size=4096)  # the VM's send area still holds `out` (the READ put it there)
        deadline = time.monotonic() + 10
        while peer.mr.read(len(out), 0) != out and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peer.mr.read(len(out), 0) == out, "the VM's writes are not arriving"
        time.sleep(0.5)
        t1 = time.monotonic()
        domain.destroy()
        TIMINGS["destroy_s"] = time.monotonic() - t1
        deadline = time.monotonic() + 15
        while driver.attached_ids() != {peer_info.vrnic_id} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert driver.attached_ids() == {peer_info.vrnic_id}, "the VM's session outlived QEMU"
        assert driver.unbind_vm(name) == [vm_info.vrnic_id]
        peer.close()
        peer = None
        assert wait_for_baseline(baseline) == baseline, "kernel objects left after virsh destroy"
    finally:
        for p in (peer, foreign_peer):
            if p is not None:
                p.close()
        if control is not None:
            control.close()
        driver.unbind_vm(name)
        if domain.isActive():
            domain.destroy()
        domain.undefine()
        conn.close()
