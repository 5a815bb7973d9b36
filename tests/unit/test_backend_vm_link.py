"""vrnicd serving a VM over its channel (vrnic.backend.vm_link + VerbsDriver.bind_vm), on the in-memory NIC.

The test plays QEMU: a RAM file laid out like a q35 VM's and a listening Unix
socket for the virtio-serial port. The guest is the real frontend library over
that socket, with an arena that is a window of the RAM file addressed by
guest-physical address (what VmArena gives a guest inside a real VM; the lab's
nested-VM test runs that one).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fake_qemu import RAM, WINDOW, Vm, vm_factory
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.fake_edge import FakeEdge
from vrnic.core.framing import BINARY_VERSION, HEADER, JSON_VERSION, MAGIC, FrameDecoder, encode
from vrnic.core.guest_phys import LEGACY_ROM
from vrnic.core.rings import Access, RecvRequest, SendRequest, WcStatus, WrOpcode
from vrnic.core.specs import AttachInfo, VmBinding, VmVrnic
from vrnic.errors import Conflict, InvalidArgument, NotFound
from vrnic.frontend import CQ, MR, PD, QP, Context

pytestmark = pytest.mark.unit

@pytest.fixture
def make_vm(tmp_path: Path) -> Iterator[Callable[[str], Vm]]:
    yield from vm_factory(tmp_path)


def _bound(driver: VerbsDriver, vm: Vm, info: AttachInfo) -> Context:
    driver.bind_vm(vm.binding(info.vrnic_id))
    vm.accept()
    return vm.guest()


def test_vm_guest_sends_receives_and_is_written_into(driver: VerbsDriver, edge: FakeEdge,
                                                      make_vrnic: Callable[..., AttachInfo],
                                                      make_vm: Callable[[str], Vm]) -> None:
    vm_info, peer_info = make_vrnic(), make_vrnic()
    vm = make_vm("vm1")
    with _bound(driver, vm, vm_info) as guest, Context.attach(peer_info) as peer:
        assert guest.vrnic_id == vm_info.vrnic_id and guest.gid == vm_info.virtual_gid
        assert driver.attached_ids() == {vm_info.vrnic_id, peer_info.vrnic_id}
        g_pd, p_pd = PD(guest), PD(peer)
        g_cq, p_cq = CQ(guest, 16), CQ(peer, 16)
        rw = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
        g_mr, p_mr = MR(g_pd, 4096, rw), MR(p_pd, 4096, rw)
        assert g_mr.addr >= WINDOW[0]  # named by guest-physical address
        g_qp, p_qp = QP(g_pd, g_cq, g_cq), QP(p_pd, p_cq, p_cq)
        g_qp.connect(peer.gid, p_qp.qpn)
        p_qp.connect(guest.gid, g_qp.qpn)
        # VM -> peer: SEND
        p_qp.post_recv(RecvRequest(1, (p_mr.sge(0, 64),)))
        g_mr.write(b"from the VM")
        g_qp.post_send(SendRequest(2, WrOpcode.SEND, (g_mr.sge(0, 11),)))
        assert [c.status for c in g_cq.wait(1)] == [WcStatus.SUCCESS]
        assert p_cq.wait(1)[0].byte_len == 11
        assert p_mr.read(11) == b"from the VM"
        # peer -> VM: an RDMA WRITE that lands in the VM's own RAM, at the MR's guest-physical address
        p_mr.write(b"peer wrote this")
        p_qp.post_send(SendRequest(3, WrOpcode.RDMA_WRITE, (p_mr.sge(0, 15),), remote_addr=g_mr.addr + 100,
                                   rkey=g_mr.rkey))
        assert [c.status for c in p_cq.wait(1)] == [WcStatus.SUCCESS]
        assert vm.read_gpa(g_mr.addr + 100, 15) == b"peer wrote this"
        # VM reads the peer's buffer
        g_qp.post_send(SendRequest(4, WrOpcode.RDMA_READ, (g_mr.sge(200, 15),), remote_addr=p_mr.addr,
                                   rkey=p_mr.rkey))
        assert [c.status for c in g_cq.wait(1)] == [WcStatus.SUCCESS]
        assert g_mr.read(15, 200) == b"peer wrote this"
    assert driver.attached_ids() == set()
    assert not edge.live
    assert driver.vm_bindings() == {"vm1": vm.binding(vm_info.vrnic_id)}
    assert driver.unbind_vm("vm1") == [vm_info.vrnic_id]
    assert driver.unbind_vm("vm1") == []


def test_memory_outside_the_vms_ram_and_foreign_handles_are_refused(driver: VerbsDriver,
                                                                     make_vrnic: Callable[..., AttachInfo],
                                                                     make_vm: Callable[[str], Vm]) -> None:
    vm_info, other_info = make_vrnic(), make_vrnic(tenant="t2")
    vm = make_vm("vm1")
    with _bound(driver, vm, vm_info) as guest, Context.attach(other_info) as other:
        pd = PD(guest)
        for addr, length in ((RAM - 4096, 8192), (RAM, 4096), (LEGACY_ROM[0], 4096), (1 << 40, 4096)):
            with pytest.raises(InvalidArgument, match="outside the guest's memory"):
                guest.call("reg_mr", pd=pd.handle, addr=addr, length=length, access=1)
        with pytest.raises(InvalidArgument, match="outside the guest's memory"):
            guest.call("create_cq", cqe=16, ring=RAM - 64)
        foreign = PD(other)
        with pytest.raises(NotFound):
            guest.call("reg_mr", pd=foreign.handle + 1000, addr=WINDOW[0], length=4096, access=1)
        with pytest.raises(NotFound):
            guest.call("dealloc_pd", pd=foreign.handle + 1000)
        # the VM's RAM below the ROM hole and above it is RAM
        low = guest.call("reg_mr", pd=pd.handle, addr=0x1000, length=4096, access=1)
        high = guest.call("reg_mr", pd=pd.handle, addr=LEGACY_ROM[1], length=4096, access=1)
        assert guest.query_device()["quota_used"]["pinned_bytes"] == 8192
        guest.call("dereg_mr", mr=low["mr"])
        guest.call("dereg_mr", mr=high["mr"])
    driver.unbind_vm("vm1")


def test_a_bound_vrnic_refuses_container_guests_and_other_vms(driver: VerbsDriver,
                                                               make_vrnic: Callable[..., AttachInfo],
                                                               make_vm: Callable[[str], Vm]) -> None:
    info = make_vrnic()
    vm1, vm2 = make_vm("vm1"), make_vm("vm2")
    driver.bind_vm(vm1.binding(info.vrnic_id))
    with pytest.raises(Conflict, match="bound to VM vm1"):
        Context.attach(info)
    with pytest.raises(Conflict, match="bound to VM vm1"):
        driver.bind_vm(vm2.binding(info.vrnic_id))
    assert set(driver.vm_bindings()) == {"vm1"}
    driver.unbind_vm("vm1")
    with Context.attach(info), pytest.raises(Conflict, match="container guest attached"):  # free again
        driver.bind_vm(vm2.binding(info.vrnic_id))
    assert driver.vm_bindings() == {}


def test_bind_is_all_or_nothing_and_rebinding_the_same_is_a_no_op(driver: VerbsDriver, edge: FakeEdge,
                                                                  make_vrnic: Callable[..., AttachInfo],
                                                                  make_vm: Callable[[str], Vm],
                                                                  tmp_path: Path) -> None:
    a, b = make_vrnic(), make_vrnic()
    vm = make_vm("vm1")
    two = VmBinding(domain="vm1", ram_path=str(vm.ram), vrnics=[
        VmVrnic(vrnic_id=a.vrnic_id, channel_socket=str(vm.socket_path)),
        VmVrnic(vrnic_id=b.vrnic_id, channel_socket=str(tmp_path / "nobody-listens.sock"))])
    t0 = time.monotonic()
    with pytest.raises(Exception, match="cannot connect to the VM channel"):
        driver.bind_vm(two)
    assert time.monotonic() - t0 < 10
    stale, _ = vm.listener.accept()  # the link made for the first vRNIC was closed again
    stale.settimeout(5)
    assert stale.recv(1) == b""
    stale.close()
    assert driver.vm_bindings() == {}
    assert all(driver.registry.get(i.vrnic_id).vm_domain is None for i in (a, b))
    for bad, error in ((VmBinding(domain="vm1", ram_path=str(tmp_path / "missing.ram"),
                                  vrnics=[VmVrnic(vrnic_id=a.vrnic_id, channel_socket=str(vm.socket_path))]),
                        NotFound),
                       (vm.binding("no-such-vrnic"), NotFound)):
        with pytest.raises(error):
            driver.bind_vm(bad)
        assert driver.vm_bindings() == {}
    binding = vm.binding(a.vrnic_id)
    driver.bind_vm(binding)
    vm.accept()
    driver.bind_vm(binding)  # libvirtd's `reconnect`: still the same link
    vm.listener.settimeout(0.2)
    with pytest.raises(TimeoutError):
        vm.listener.accept()
    driver.unbind_vm("vm1")
    assert not edge.live


def test_qemu_exit_unbind_and_release_free_every_object(driver: VerbsDriver, edge: FakeEdge,
                                                        make_vrnic: Callable[..., AttachInfo],
                                                        make_vm: Callable[[str], Vm]) -> None:
    def populate(ctx: Context) -> None:
        pd = PD(ctx)
        cq = CQ(ctx, 16)
        MR(pd, 4096, Access.LOCAL_WRITE)
        QP(pd, cq, cq)

    # QEMU exits (virsh destroy): its end of the socket closes
    info = make_vrnic()
    vm = make_vm("vm1")
    guest = _bound(driver, vm, info)
    populate(guest)
    assert edge.live
    assert vm.port is not None
    vm.port.close()
    vm.port = None
    _until(lambda: not edge.live)
    assert driver.attached_ids() == set()
    driver.unbind_vm("vm1")
    guest.closed = True
    guest.arena.close()
    # unbind with a guest in the middle of its work
    guest = _bound(driver, vm, info)
    populate(guest)
    assert driver.unbind_vm("vm1") == [info.vrnic_id]
    assert not edge.live
    guest.closed = True
    guest.arena.close()
    # releasing the vRNIC of a running VM
    vm.port.close()  # type: ignore[union-attr]
    guest = _bound(driver, vm, info)
    populate(guest)
    driver.release_vrnic(info.vrnic_id)
    assert not edge.live and driver.vm_bindings() == {}
    guest.closed = True
    guest.arena.close()


def test_a_new_guest_program_replaces_the_old_session_and_garbage_only_costs_the_session(
        driver: VerbsDriver, edge: FakeEdge, make_vrnic: Callable[..., AttachInfo],
        make_vm: Callable[[str], Vm]) -> None:
    info = make_vrnic()
    vm = make_vm("vm1")
    first = _bound(driver, vm, info)
    PD(first)
    assert edge.live
    # the first program died without detaching; the port's next opener attaches
    second = vm.guest()
    assert not edge.live
    PD(second)
    # a frame vrnicd cannot read: the session ends, the link stays, the next attach works
    assert vm.port is not None
    vm.port.sendall(b"\x00\x01garbage-not-a-frame")
    reply = _read_frame(vm.port)
    assert reply["ok"] is False and reply["error"]["code"] == "protocol_error"
    _until(lambda: not edge.live)
    third = vm.guest()
    assert PD(third).handle >= 1
    # requests before attach are refused
    vm.port.sendall(encode({"id": 7, "op": "detach", "args": {}}))
    assert _read_frame(vm.port)["ok"] is True
    vm.port.sendall(encode({"id": 8, "op": "alloc_pd", "args": {}}))
    assert _read_frame(vm.port)["error"]["message"] == "attach first"
    vm.port.sendall(encode({"id": 9, "op": "attach", "args": {"token": "x"}}))
    assert _read_frame(vm.port)["error"]["code"] == "invalid_argument"
    driver.unbind_vm("vm1")
    for ctx in (first, second, third):
        ctx.closed = True
        ctx.arena.close()


def _read_frame(sock: socket.socket) -> dict[str, object]:
    decoder = FrameDecoder()
    while True:
        got = decoder.feed(sock.recv(65536))
        if got:
            return got[0]


def _until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_vm_guest_is_answered_in_the_version_it_asked_in(driver: VerbsDriver, edge: FakeEdge,
                                                            make_vrnic: Callable[..., AttachInfo],
                                                            make_vm: Callable[[str], Vm]) -> None:
    info = make_vrnic()
    vm = make_vm("vm1")
    driver.bind_vm(vm.binding(info.vrnic_id))
    port = vm.accept()
    decoder = FrameDecoder()

    def read(count: int) -> list[tuple[int, dict[str, Any]]]:
        got: list[tuple[int, dict[str, Any]]] = []
        while len(got) < count:
            got += decoder.feed_frames(port.recv(65536))
        return got

    def ask(*requests: tuple[int, dict[str, object]]) -> list[tuple[int, dict[str, Any]]]:
        port.sendall(b"".join(encode(message, version) for version, message in requests))
        return read(len(requests))

    replies = ask((JSON_VERSION, {"id": 1, "op": "alloc_pd", "args": {}}),
                  (BINARY_VERSION, {"id": 2, "op": "alloc_pd", "args": {}}),
                  (BINARY_VERSION, {"id": 3, "op": "attach", "args": {}}),
                  (JSON_VERSION, {"id": 4, "op": "alloc_pd", "args": {}}),
                  (BINARY_VERSION, {"id": 5, "op": "alloc_pd", "args": {}}))
    assert [(version, reply["id"], reply["ok"]) for version, reply in replies] == [
        (JSON_VERSION, 1, False), (BINARY_VERSION, 2, False), (BINARY_VERSION, 3, True), (JSON_VERSION, 4, True),
        (BINARY_VERSION, 5, True)]
    assert replies[0][1]["error"]["message"] == "attach first"
    # a version 2 frame vrnicd cannot read: the session ends, the link stays, the error comes back in version 2
    port.sendall(HEADER.pack(MAGIC, BINARY_VERSION, 0, 2) + b"\xb1\xdd")
    [(version, reply)] = read(1)
    assert version == BINARY_VERSION and reply["error"]["code"] == "protocol_error"
    assert "a dict key must be a str, not unknown tag 0xdd" in reply["error"]["message"]
    _until(lambda: not edge.live)
    driver.unbind_vm("vm1")
