"""Live migration of a VM's vRNIC between two QEMU processes (vrnic.backend.vm_migration), on the in-memory NIC.

The test plays both QEMUs as tests/unit/test_backend_vm_link.py plays one: two RAM
files and two channel sockets. "QEMU's pre-copy" is a copy of the source RAM file
to the destination's before the peer's traffic; the peer's RDMA WRITEs and SENDs
during the migration land in the source RAM only (as the NIC's writes do: QEMU
never sees them), so the destination holds them only if vrnicd's dirty log copied
them. "Resuming on the destination" maps the destination's RAM over the guest's
window in place (MAP_FIXED), so the same frontend objects now see the new RAM,
and its channel now reaches the destination's socket.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.unit.fake_qemu import RamWindow, SocketChannel, Vm, vm_factory
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.fake_edge import FakeEdge
from vrnic.core.migration import DirtyLog, MigrationPhase, advance, coalesce
from vrnic.core.rings import Access, RecvRequest, SendRequest, WcOpcode, WcStatus, WrOpcode
from vrnic.core.specs import AttachInfo
from vrnic.errors import Conflict, InvalidArgument, NotFound
from vrnic.frontend import CQ, MR, PD, QP, Context
from vrnic.frontend.guest_library import QP_POOL

pytestmark = pytest.mark.unit


@pytest.fixture
def make_vm(tmp_path: Path) -> Iterator[Callable[[str], Vm]]:
    yield from vm_factory(tmp_path)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
MAP_FIXED = 0x10


def resume_on(guest: Context, dest: Vm) -> None:
    """The vCPUs now run on the destination: its RAM under the guest's addresses, its port under the channel."""
    arena = guest.arena
    assert isinstance(arena, RamWindow)
    address = ctypes.addressof(ctypes.c_char.from_buffer(arena.view))
    fd = os.open(dest.ram, os.O_RDWR)
    try:
        got = _libc.mmap(address, arena.size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED, fd,
                         arena.gpa)
        assert got == address, os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    assert dest.port is not None
    channel = guest.channel
    assert isinstance(channel, SocketChannel)
    channel.sock = dest.port


def test_dirty_log_coalesces_pages() -> None:
    log = DirtyLog()
    log.mark(4096 * 3 + 10, 5000)  # pages 3 and 4
    log.mark(4096 * 5, 1)
    log.mark(4096 * 9, 0)  # nothing
    log.mark(4096 * 10, 4096)
    assert len(log) == 4
    assert log.ranges() == [(4096 * 3, 3 * 4096), (4096 * 10, 4096)]
    assert coalesce([]) == []


def test_phases_only_move_forward() -> None:
    assert advance(MigrationPhase.PREPARED, MigrationPhase.SWITCHING) is MigrationPhase.SWITCHING
    with pytest.raises(Conflict):
        advance(MigrationPhase.DONE, MigrationPhase.SWITCHING)
    with pytest.raises(Conflict):
        advance(MigrationPhase.ABORTED, MigrationPhase.DONE)


def _connected(driver: VerbsDriver, vm: Vm, vm_info: AttachInfo, peer: Context, qps: int = 2
               ) -> tuple[Context, list[QP], list[QP], MR, MR, CQ, CQ]:
    driver.bind_vm(vm.binding(vm_info.vrnic_id))
    vm.accept()
    guest = vm.guest()
    g_pd, p_pd = PD(guest), PD(peer)
    g_cq, p_cq = CQ(guest, 64), CQ(peer, 64)
    rw = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
    g_mr, p_mr = MR(g_pd, 64 << 10, rw), MR(p_pd, 64 << 10, rw)
    g_qps = [QP(g_pd, g_cq, g_cq, max_send_wr=16, max_recv_wr=16) for _ in range(qps)]
    p_qps = [QP(p_pd, p_cq, p_cq, max_send_wr=16, max_recv_wr=16) for _ in range(qps)]
    for g, p in zip(g_qps, p_qps, strict=True):
        g.connect(peer.gid, p.qpn)
        p.connect(guest.gid, g.qpn)
    return guest, g_qps, p_qps, g_mr, p_mr, g_cq, p_cq


def _prepare(driver: VerbsDriver, source: Vm, dest: Vm, vm_info: AttachInfo) -> dict[str, object]:
    """QEMU's pre-copy (the source RAM as it is now), then vrnicd's prepare to the destination of domain vm1."""
    shutil.copyfile(source.ram, dest.ram)
    prepared = driver.prepare_vm_migration("vm1", dest.binding(vm_info.vrnic_id).model_copy(update={"domain": "vm1"}))
    dest.accept()
    return prepared


def test_a_vm_migrates_under_traffic_and_keeps_every_write(driver: VerbsDriver, edge: FakeEdge,
                                                           make_vrnic: Callable[..., AttachInfo],
                                                           make_vm: Callable[[str], Vm]) -> None:
    vm_info, peer_info = make_vrnic(), make_vrnic()
    source, dest = make_vm("vm1"), make_vm("vm1-incoming")
    with Context.attach(peer_info) as peer:
        guest, g_qps, p_qps, g_mr, p_mr, g_cq, p_cq = _connected(driver, source, vm_info, peer)
        handles_before = [(q.handle, q.qpn) for q in g_qps]
        # receives posted by the guest before the migration: the peer's SENDs during it land there
        g_qps[0].post_recv([RecvRequest(100 + i, (g_mr.sge(i * 1024, 1024),)) for i in range(4)])
        # QEMU's pre-copy: the destination gets the source's RAM as it is now
        prepared = _prepare(driver, source, dest, vm_info)
        assert prepared["moving"] == [vm_info.vrnic_id]
        assert prepared["presetup_mrs"] == 1 + guest.spare_mr_count  # the guest's MR and its pool's spares
        # during the migration: sequence-numbered RDMA WRITEs into the VM, and SENDs it receives
        for seq in range(1, 9):
            p_mr.write(struct.pack("<Q", seq), seq * 8)
            p_qps[1].post_send(SendRequest(seq, WrOpcode.RDMA_WRITE, (p_mr.sge(seq * 8, 8),),
                                           remote_addr=g_mr.addr + 8192 + seq * 8, rkey=g_mr.rkey))
        for seq in range(1, 3):
            p_mr.write(struct.pack("<Q", 1000 + seq), 4096 + seq * 8)
            p_qps[0].post_send(SendRequest(50 + seq, WrOpcode.SEND, (p_mr.sge(4096 + seq * 8, 8),)))
        assert [c.status for c in p_cq.wait(10)] == [WcStatus.SUCCESS] * 10
        # the writes are in the source RAM, not in the destination's (QEMU did not see them)
        assert source.read_gpa(g_mr.addr + 8192 + 8, 8) == struct.pack("<Q", 1)
        assert dest.read_gpa(g_mr.addr + 8192 + 8, 8) == bytes(8)
        report = driver.complete_vm_migration("vm1")
        spares = guest.spare_qp_count  # the guest's pool of new QPs moves too
        assert spares == QP_POOL - 2
        assert report["qps"] == 2 + spares and report["peers_repointed"] == 2
        assert report["mrs_presetup"] == 1 + guest.spare_mr_count
        assert report["preconnected"] == 2  # connected at prepare: the switchover modified no QP
        assert report["dirty_pages"] >= 2 and report["recvs_reposted"] == 2  # the two unused receives
        assert dest.read_gpa(g_mr.addr + 8192 + 8, 64) == b"".join(struct.pack("<Q", s) for s in range(1, 9))
        resume_on(guest, dest)
        # the guest's program carries on, unchanged: same handles and QPNs, its completions, its data
        assert [(q.handle, q.qpn) for q in g_qps] == handles_before
        done = g_cq.wait(2)
        assert [(c.wr_id, c.status, c.opcode) for c in done] == [(100, WcStatus.SUCCESS, WcOpcode.RECV),
                                                                 (101, WcStatus.SUCCESS, WcOpcode.RECV)]
        assert [struct.unpack("<Q", g_mr.read(8, i * 1024))[0] for i in range(2)] == [1001, 1002]
        assert [struct.unpack("<Q", g_mr.read(8, 8192 + s * 8))[0] for s in range(1, 9)] == list(range(1, 9))
        # traffic after the migration, both ways, on the re-pointed QPs (the reposted receives take it)
        for seq in (3, 4):
            p_mr.write(struct.pack("<Q", 1000 + seq), 4096 + seq * 8)
            p_qps[0].post_send(SendRequest(60 + seq, WrOpcode.SEND, (p_mr.sge(4096 + seq * 8, 8),)))
        assert [c.status for c in p_cq.wait(2)] == [WcStatus.SUCCESS] * 2
        assert [c.wr_id for c in g_cq.wait(2)] == [102, 103]
        assert [struct.unpack("<Q", g_mr.read(8, i * 1024))[0] for i in (2, 3)] == [1003, 1004]
        g_mr.write(b"from the migrated VM", 30000)
        p_qps[1].post_recv(RecvRequest(7, (p_mr.sge(20000, 64),)))
        g_qps[1].post_send(SendRequest(8, WrOpcode.SEND, (g_mr.sge(30000, 20),)))
        assert [c.status for c in g_cq.wait(1)] == [WcStatus.SUCCESS]
        assert p_cq.wait(1)[0].byte_len == 20 and p_mr.read(20, 20000) == b"from the migrated VM"
        assert driver.vm_bindings()["vm1"].ram_path == str(dest.ram)
        guest.close()
    assert driver.unbind_vm("vm1") == [vm_info.vrnic_id]
    assert not edge.live


def test_an_aborted_migration_leaves_the_source_serving(driver: VerbsDriver, edge: FakeEdge,
                                                        make_vrnic: Callable[..., AttachInfo],
                                                        make_vm: Callable[[str], Vm]) -> None:
    vm_info, peer_info = make_vrnic(), make_vrnic()
    source, dest = make_vm("vm1"), make_vm("vm1-incoming")
    with Context.attach(peer_info) as peer:
        guest, g_qps, p_qps, g_mr, p_mr, g_cq, p_cq = _connected(driver, source, vm_info, peer, qps=1)
        live = len(edge.live)
        shutil.copyfile(source.ram, dest.ram)
        with pytest.raises(NotFound):
            driver.prepare_vm_migration("nope", dest.binding(vm_info.vrnic_id))
        with pytest.raises(InvalidArgument, match="RAM file is the source's"):
            driver.prepare_vm_migration("vm1", source.binding(vm_info.vrnic_id))
        driver.prepare_vm_migration("vm1", dest.binding(vm_info.vrnic_id).model_copy(update={"domain": "vm1"}))
        dest.accept()
        assert len(edge.live) > live  # the pre-setup
        with pytest.raises(Conflict, match="already migrating"):
            driver.prepare_vm_migration("vm1", dest.binding(vm_info.vrnic_id).model_copy(update={"domain": "vm1"}))
        assert driver.abort_vm_migration("vm1") is True
        assert driver.abort_vm_migration("vm1") is False
        assert len(edge.live) == live  # the pre-setup is gone, the source's objects stay
        p_qps[0].post_recv(RecvRequest(1, (p_mr.sge(0, 64),)))
        g_mr.write(b"still on the source")
        g_qps[0].post_send(SendRequest(2, WrOpcode.SEND, (g_mr.sge(0, 19),)))
        assert [c.status for c in g_cq.wait(1)] == [WcStatus.SUCCESS]
        assert p_cq.wait(1)[0].byte_len == 19 and p_mr.read(19) == b"still on the source"
        with pytest.raises(Conflict, match="no migration prepared"):
            driver.complete_vm_migration("vm1")
        guest.close()
    driver.unbind_vm("vm1")
    assert not edge.live


def test_a_send_waiting_for_a_receive_goes_again_after_the_switchover(driver: VerbsDriver, edge: FakeEdge,
                                                                      make_vrnic: Callable[..., AttachInfo],
                                                                      make_vm: Callable[[str], Vm]) -> None:
    """The VM cannot post receives while it is stopped, so a peer's SEND can wait for one through the whole
    switchover (RNR on a real NIC): it was never taken, so it goes again on the new connection."""
    vm_info, peer_info = make_vrnic(), make_vrnic()
    source, dest = make_vm("vm1"), make_vm("vm1-incoming")
    with Context.attach(peer_info) as peer:
        guest, g_qps, p_qps, g_mr, p_mr, g_cq, p_cq = _connected(driver, source, vm_info, peer, qps=1)
        g_qps[0].post_recv(RecvRequest(1, (g_mr.sge(0, 64),)))
        _prepare(driver, source, dest, vm_info)
        for n in (1, 2):
            p_mr.write(f"send {n}".encode(), n * 64)
            p_qps[0].post_send(SendRequest(n, WrOpcode.SEND, (p_mr.sge(n * 64, 6),)))
        assert [c.wr_id for c in p_cq.wait(1)] == [1]  # the second waits for a receive
        peer.call("sync")  # and is on the NIC by now, not still in the peer's ring
        report = driver.complete_vm_migration("vm1")
        assert report["sends_carried"] == 1 and report["drain_ms"] < 4000, report
        resume_on(guest, dest)
        assert [c.wr_id for c in g_cq.wait(1)] == [1] and g_mr.read(6) == b"send 1"
        g_qps[0].post_recv(RecvRequest(2, (g_mr.sge(128, 64),)))
        assert [(c.wr_id, c.status) for c in p_cq.wait(1)] == [(2, WcStatus.SUCCESS)]
        assert [(c.wr_id, c.byte_len) for c in g_cq.wait(1)] == [(2, 6)] and g_mr.read(6, 128) == b"send 2"
        guest.close()
    driver.unbind_vm("vm1")
    assert not edge.live


def test_a_pair_changed_after_prepare_is_connected_the_slow_way(driver: VerbsDriver, edge: FakeEdge,
                                                               make_vrnic: Callable[..., AttachInfo],
                                                               make_vm: Callable[[str], Vm]) -> None:
    vm_info, peer_info = make_vrnic(), make_vrnic()
    source, dest = make_vm("vm1"), make_vm("vm1-incoming")
    with Context.attach(peer_info) as peer:
        guest, g_qps, p_qps, g_mr, p_mr, g_cq, p_cq = _connected(driver, source, vm_info, peer)
        _prepare(driver, source, dest, vm_info)
        live = len(edge.live)
        guest.call("modify_qp", qp=g_qps[1].handle, state="err")  # after prepare: its pre-set-up pair is stale
        report = driver.complete_vm_migration("vm1")
        assert report["preconnected"] == 1 and report["peers_repointed"] == 2, report
        assert len(edge.live) < live  # the stale shadow and the source's objects went
        resume_on(guest, dest)
        assert guest.call("query_qp", qp=g_qps[1].handle)["state"] == "err"
        # the pre-connected pair works
        p_qps[0].post_recv(RecvRequest(1, (p_mr.sge(0, 64),)))
        g_mr.write(b"pair 0")
        g_qps[0].post_send(SendRequest(2, WrOpcode.SEND, (g_mr.sge(0, 6),)))
        assert [c.status for c in g_cq.wait(1)] == [WcStatus.SUCCESS]
        assert p_cq.wait(1)[0].byte_len == 6 and p_mr.read(6) == b"pair 0"
        guest.close()
    driver.unbind_vm("vm1")
    assert not edge.live
