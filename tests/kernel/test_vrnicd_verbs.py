"""Every mediated verb works end to end through vrnicd on real rxe and moves real data, on both engines:
the shared-ring one (vrnicd posts) and the direct one (the guest drives the NIC's own queues)."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.core.specs import AttachInfo
from vrnic.frontend import (
    CQ,
    MR,
    PD,
    QP,
    Access,
    Conflict,
    Context,
    InvalidArgument,
    RecvRequest,
    SendRequest,
    WcOpcode,
    WcStatus,
    WrOpcode,
)
from vrnic.frontend.guest_library import CQ_POOL, MR_POOL, QP_POOL
from vrnic.frontend.memory import MemfdArena

ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC


@dataclass
class Guest:
    ctx: Context
    pd: PD
    cq: CQ
    mr: MR
    qp: QP


def _guest(info: AttachInfo, qp_type: str = "rc") -> Guest:
    ctx = Context.attach(info, arena_bytes=1 << 20)
    pd = PD(ctx)
    cq = CQ(ctx, 128)
    mr = MR(pd, 65536, ALL)
    qp = QP(pd, cq, cq, qp_type=qp_type, max_send_wr=64, max_recv_wr=64, max_sge=2)
    return Guest(ctx, pd, cq, mr, qp)


def _close(g: Guest) -> None:
    for obj in (g.qp, g.mr, g.cq, g.pd, g.ctx):
        obj.close()


@pytest.fixture
def connected(make_vrnic: Callable[..., AttachInfo], engine: str) -> Iterator[tuple[Guest, Guest]]:
    a, b = _guest(make_vrnic(device="rxe0", engine=engine)), _guest(make_vrnic(device="rxe1", engine=engine))
    assert a.ctx.engine == b.ctx.engine == engine
    a.qp.connect(b.ctx.gid, b.qp.qpn)
    b.qp.connect(a.ctx.gid, a.qp.qpn)
    yield a, b
    _close(a)
    _close(b)


def test_guests_see_only_virtual_identities(connected: tuple[Guest, Guest]) -> None:
    a, b = connected
    assert a.ctx.query_gid().startswith("fd76:726e:")  # virtual GID, not the device's ::ffff:10.77.1.x
    assert a.ctx.query_gid() == a.ctx.gid and a.ctx.gid != b.ctx.gid
    # timeout: the NIC's own value, read back; the guest left rxe's 14 and no QoS shapes this device
    assert a.qp.query() == {"qpn": a.qp.qpn, "state": "rts", "qp_type": "rc", "connected_to": b.ctx.gid,
                            "timeout": 14}
    device = a.ctx.query_device()
    assert device["max_qp"] <= 64 and device["arena_bytes"] == 1 << 20
    assert a.ctx.query_port()["state"] == 4  # IBV_PORT_ACTIVE


def test_send_recv_and_send_with_imm_move_bytes(connected: tuple[Guest, Guest]) -> None:
    a, b = connected
    b.qp.post_recv([RecvRequest(10, (b.mr.sge(0, 256),)), RecvRequest(11, (b.mr.sge(256, 256),))])
    a.mr.write(b"ping" * 16)
    a.mr.write(b"imm!" * 16, 512)
    a.qp.post_send([SendRequest(1, WrOpcode.SEND, (a.mr.sge(0, 64),)),
                    SendRequest(2, WrOpcode.SEND_WITH_IMM, (a.mr.sge(512, 64),), imm=0x01020304)])
    sent = a.cq.wait(2)
    got = b.cq.wait(2)
    assert [(c.wr_id, c.status, c.opcode) for c in sent] == [(1, 0, WcOpcode.SEND), (2, 0, WcOpcode.SEND)]
    assert [(c.wr_id, c.status, c.byte_len, c.qp) for c in got] == [(10, 0, 64, b.qp.qpn), (11, 0, 64, b.qp.qpn)]
    assert got[1].imm == 0x01020304 and got[1].wc_flags & 2  # IBV_WC_WITH_IMM
    assert b.mr.read(64) == b"ping" * 16 and b.mr.read(64, 256) == b"imm!" * 16


def test_rdma_write_and_write_with_imm_land_zero_copy_in_guest_memory(connected: tuple[Guest, Guest]) -> None:
    a, b = connected
    payload = bytes(range(256)) * 16
    a.mr.write(payload)
    a.qp.post_send(SendRequest(1, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 4096),), remote_addr=b.mr.addr + 8192,
                               rkey=b.mr.rkey))
    assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
    # The peer's bytes are in b's own buffer (its memfd arena), with no copy through vrnicd.
    assert b.mr.read(4096, 8192) == payload
    assert bytes(b.ctx.view[b.mr.addr + 8192:b.mr.addr + 8192 + 16]) == payload[:16]
    b.qp.post_recv(RecvRequest(20, (b.mr.sge(0, 0),)))  # pyverbs needs one SGE: a zero-length one
    a.qp.post_send(SendRequest(2, WrOpcode.RDMA_WRITE_WITH_IMM, (a.mr.sge(0, 128),), imm=77,
                               remote_addr=b.mr.addr, rkey=b.mr.rkey))
    assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
    wc = b.cq.wait(1)[0]
    assert (wc.wr_id, wc.status, wc.opcode, wc.imm) == (20, 0, WcOpcode.RECV_RDMA_WITH_IMM, 77)
    assert b.mr.read(128) == payload[:128]


def test_rdma_read_pulls_from_peer_memory(connected: tuple[Guest, Guest]) -> None:
    a, b = connected
    b.mr.write(b"remote-secret!" * 10, 20000)
    a.qp.post_send(SendRequest(3, WrOpcode.RDMA_READ, (a.mr.sge(100, 140),), remote_addr=b.mr.addr + 20000,
                               rkey=b.mr.rkey))
    wc = a.cq.wait(1)[0]
    assert (wc.status, wc.opcode, wc.byte_len) == (0, WcOpcode.RDMA_READ, 140)
    assert a.mr.read(140, 100) == b"remote-secret!" * 10


def test_a_pooled_mr_is_a_registration_of_its_own_whose_key_dies_with_it(connected: tuple[Guest, Guest],
                                                                         engine: str) -> None:
    a, b = connected
    first, handed_out = MR(b.pd, 4096, ALL), MR(b.pd, 4096, ALL)
    if engine == "ring":  # one reg_mrs made the pool; the second MR was a handout
        assert b.ctx.spare_mr_count == (MR_POOL - 1) + (MR_POOL - 2)  # the guest's 64 KiB pool and this one
    a.mr.write(b"pooled!!" b"stale!!!")
    a.qp.post_send(SendRequest(1, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 8),), remote_addr=handed_out.addr,
                               rkey=handed_out.rkey))
    assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
    assert handed_out.read(8) == b"pooled!!"
    addr, rkey = handed_out.addr, handed_out.rkey
    handed_out.close()  # deregistered, not pooled: a peer that kept its key reaches nothing
    a.qp.post_send(SendRequest(2, WrOpcode.RDMA_WRITE, (a.mr.sge(8, 8),), remote_addr=addr, rkey=rkey))
    wc = a.cq.wait(1)[0]
    assert (wc.wr_id, wc.status) == (2, WcStatus.REM_ACCESS_ERR)
    assert bytes(b.ctx.view[addr:addr + 8]) == b"pooled!!"
    first.close()



def test_a_batch_of_qps_is_made_and_connected_in_one_request_each(make_vrnic: Callable[..., AttachInfo],
                                                                  device_pair: tuple[str, str], engine: str) -> None:
    """create_many sends one shape (and, on the shared-ring engine, the rings' addresses); connect_many towards
    one peer sends its GID once. Each of the batch's real QPs then moves its own bytes to its own peer."""
    a, b = _guest(make_vrnic(device=device_pair[0], engine=engine)), _guest(make_vrnic(device=device_pair[1],
                                                                                        engine=engine))
    try:
        before = resource_counts()[device_pair[0]]["qp"]
        qas = QP.create_many(a.pd, a.cq, a.cq, 4)
        qbs = QP.create_many(b.pd, b.cq, b.cq, 4)
        assert resource_counts()[device_pair[0]]["qp"] == before + 4
        QP.connect_many(a.ctx, [(qa, b.ctx.gid, qb.qpn) for qa, qb in zip(qas, qbs, strict=True)])
        QP.connect_many(b.ctx, [(qb, a.ctx.gid, qa.qpn) for qa, qb in zip(qas, qbs, strict=True)])
        for n, qa in enumerate(qas):
            a.mr.write(f"pair {n}!".encode(), 64 * n)
            qa.post_send(SendRequest(n, WrOpcode.RDMA_WRITE, (a.mr.sge(64 * n, 7),), remote_addr=b.mr.addr + 64 * n,
                                     rkey=b.mr.rkey))
            [done] = a.cq.wait(1)
            assert (done.wr_id, done.status, done.qp) == (n, WcStatus.SUCCESS, qa.qpn)
            assert b.mr.read(7, 64 * n) == f"pair {n}!".encode()
        assert [qb.query()["connected_to"] for qb in qbs] == [a.ctx.gid] * 4
        for qp in qas + qbs:
            qp.close()
        assert resource_counts()[device_pair[0]]["qp"] == before
    finally:
        _close(a)
        _close(b)


def _rnr_naks(devices: tuple[str, str]) -> int:
    """RNR NAKs the requesters of these rxe devices received so far."""
    return sum(int(Path(f"/sys/class/infiniband/{d}/ports/1/hw_counters/rcvd_rnr_err").read_text()) for d in devices)


def test_a_send_to_a_local_peer_finds_the_receive_its_guest_posted_first(make_vrnic: Callable[..., AttachInfo],
                                                                        device_pair: tuple[str, str]) -> None:
    """rxe answers a SEND that finds no receive with an RNR NAK and sends it again a timer tick later (4 ms or
    more). Two vRNICs of one vrnicd have two shared-ring engines that race; the sender's engine posts the receives
    of the QP it sends to before the SEND. The receiver's doorbell is never rung here, and rxe counts no RNR NAK."""
    a, b = _guest(make_vrnic(device=device_pair[0])), _guest(make_vrnic(device=device_pair[1]))
    a.qp.connect(b.ctx.gid, b.qp.qpn)
    b.qp.connect(a.ctx.gid, a.qp.qpn)
    before = _rnr_naks(device_pair)
    for number in range(5):
        b.qp.post_recv(RecvRequest(number, (b.mr.sge(0, 64),)), doorbell=False)
        a.mr.write(b"ping %02d" % number)
        a.qp.post_send(SendRequest(number, WrOpcode.SEND, (a.mr.sge(0, 7),)))
        assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
        wc = b.cq.wait(1)[0]
        assert (wc.wr_id, wc.status, wc.byte_len) == (number, WcStatus.SUCCESS, 7)
        assert b.mr.read(7) == b"ping %02d" % number
    assert _rnr_naks(device_pair) == before
    _close(a)
    _close(b)


def test_atomics_compare_swap_and_fetch_add(connected: tuple[Guest, Guest]) -> None:
    a, b = connected
    b.mr.write(struct.pack("<Q", 41), 64)
    a.qp.post_send(SendRequest(4, WrOpcode.ATOMIC_FETCH_AND_ADD, (a.mr.sge(0, 8),), remote_addr=b.mr.addr + 64,
                               rkey=b.mr.rkey, compare_add=1))
    assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
    assert struct.unpack("<Q", a.mr.read(8))[0] == 41  # the old value comes back
    assert struct.unpack("<Q", b.mr.read(8, 64))[0] == 42
    a.qp.post_send(SendRequest(5, WrOpcode.ATOMIC_CMP_AND_SWP, (a.mr.sge(8, 8),), remote_addr=b.mr.addr + 64,
                               rkey=b.mr.rkey, compare_add=42, swap=1000))
    assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
    assert struct.unpack("<Q", b.mr.read(8, 64))[0] == 1000


def test_scatter_gather_and_doorbell_batching(connected: tuple[Guest, Guest]) -> None:
    a, b = connected
    a.mr.write(b"A" * 32, 0)
    a.mr.write(b"B" * 32, 1024)
    b.qp.post_recv([RecvRequest(i, (b.mr.sge(i * 128, 128),)) for i in range(8)], doorbell=False)
    b.ctx.ring_doorbell()
    a.qp.post_send([SendRequest(i, WrOpcode.SEND, (a.mr.sge(0, 32), a.mr.sge(1024, 32))) for i in range(8)])
    assert [c.wr_id for c in a.cq.wait(8)] == list(range(8))
    assert all(c.byte_len == 64 for c in b.cq.wait(8))
    assert all(b.mr.read(64, i * 128) == b"A" * 32 + b"B" * 32 for i in range(8))


def test_ud_send_named_by_virtual_identity(make_vrnic: Callable[..., AttachInfo], device_pair: tuple[str, str]) -> None:
    a, b = _guest(make_vrnic(device=device_pair[0]), "ud"), _guest(make_vrnic(device=device_pair[1]), "ud")
    try:
        for g in (a, b):
            for state in ("init", "rtr", "rts"):
                g.qp.modify(state, qkey=0x1234)
        # UD receives carry a 40-byte GRH; sync: UD has no RNR retry, the receive must be on the NIC first.
        b.qp.post_recv(RecvRequest(1, (b.mr.sge(0, 40 + 64),)), sync=True)
        a.mr.write(b"datagram" * 8)
        vgid = __import__("ipaddress").IPv6Address(b.ctx.gid).packed
        a.qp.post_send(SendRequest(9, WrOpcode.SEND, (a.mr.sge(0, 64),), ud_gid=vgid, ud_qpn=b.qp.qpn,
                                   ud_qkey=0x1234))
        assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
        wc = b.cq.wait(1)[0]
        assert (wc.status, wc.byte_len, wc.src_qp) == (0, 40 + 64, a.qp.qpn)  # the source, virtualized
        assert b.mr.read(64, 40) == b"datagram" * 8
    finally:
        _close(a)
        _close(b)


def test_modify_to_err_flushes_and_reset_allows_reconnect(connected: tuple[Guest, Guest]) -> None:
    a, b = connected
    a.qp.post_recv(RecvRequest(99, (a.mr.sge(0, 64),)))
    a.qp.modify("err")
    wc = a.cq.wait(1)[0]
    assert (wc.wr_id, wc.status) == (99, WcStatus.WR_FLUSH_ERR)
    assert a.qp.query()["state"] == "err"
    a.qp.modify("reset")
    assert a.qp.query()["state"] == "reset"
    a.qp.connect(b.ctx.gid, b.qp.qpn)
    assert a.qp.query()["state"] == "rts"


def test_a_shared_ring_vrnic_keeps_one_device_context_across_its_guests(driver: object,
                                                                         make_vrnic: Callable[..., AttachInfo],
                                                                         device_pair: tuple[str, str]) -> None:
    """Issue 14's pre-setup of the device open: the context is opened at admission, each guest takes it over (no
    new one in `rdma res`), a detach gives it back with nothing of the guest's left in it, and the next guest
    moves data through it as the first did. The direct engine hands its context's fd to the guest: none is kept."""
    dev = device_pair[0]
    before = resource_counts()
    direct = make_vrnic(device=dev, engine="direct")
    assert resource_counts() == before
    info, peer = make_vrnic(device=dev), make_vrnic(device=device_pair[1])
    kept = {**before[dev], "ctx": before[dev]["ctx"] + 1}
    assert resource_counts()[dev] == kept
    b = _guest(peer)
    MemfdArena.close_kept()  # a closed guest's arena, kept for the next attach, is let go before each count
    descriptors = len(os.listdir("/proc/self/fd"))  # vrnicd's and the guests' (all in this process)
    try:
        for n in range(2):
            a = _guest(info)
            assert resource_counts()[dev]["ctx"] == kept["ctx"]  # taken over, not opened
            a.qp.connect(b.ctx.gid, b.qp.qpn)
            b.qp.connect(a.ctx.gid, a.qp.qpn)
            a.mr.write(b"guest %d" % n)
            a.qp.post_send(SendRequest(n, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 7),), remote_addr=b.mr.addr,
                                       rkey=b.mr.rkey))
            [done] = a.cq.wait(1)
            assert (done.wr_id, done.status) == (n, WcStatus.SUCCESS) and b.mr.read(7) == b"guest %d" % n
            _close(a)
            assert resource_counts()[dev] == kept  # nothing of the guest's left, its context kept
            assert MemfdArena.close_kept() == 1  # the guest's arena, kept for its next attach
            assert len(os.listdir("/proc/self/fd")) == descriptors  # nor the completion channels it kept for CQs
            b.qp.modify("reset")
    finally:
        _close(b)
    for made in (info, peer, direct):
        driver.release_vrnic(made.vrnic_id)  # type: ignore[attr-defined]
    assert resource_counts() == before


def test_a_new_shared_ring_vrnic_opens_its_device_once(driver: object, make_vrnic: Callable[..., AttachInfo],
                                                        device_pair: tuple[str, str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its description is read through the context it keeps for its first guest (issue 14): one device open, not
    one for the description and one for the context. A direct-engine vRNIC keeps none and opens for the
    description alone."""
    from vrnic.backend import pyverbs_edge

    dev = device_pair[0]
    opened: list[str] = []
    real_open = pyverbs_edge.open_context

    def counted(name: str) -> object:
        opened.append(name)
        return real_open(name)

    monkeypatch.setattr(pyverbs_edge, "open_context", counted)
    before = resource_counts()[dev]["ctx"]
    ring = make_vrnic(device=dev)
    assert opened == [dev]
    assert resource_counts()[dev]["ctx"] == before + 1  # and that one is kept
    direct = make_vrnic(device=dev, engine="direct")
    assert opened == [dev, dev]
    assert resource_counts()[dev]["ctx"] == before + 1
    for made in (ring, direct):
        driver.release_vrnic(made.vrnic_id)  # type: ignore[attr-defined]
    assert resource_counts()[dev]["ctx"] == before


def test_objects_in_use_cannot_be_destroyed_and_teardown_is_complete(make_vrnic: Callable[..., AttachInfo],
                                                                     device_pair: tuple[str, str],
                                                                     engine: str) -> None:
    info = make_vrnic(device=device_pair[0], engine=engine)
    before = resource_counts()  # with the vRNIC: a shared-ring one holds a device context for its guest already
    g = _guest(info)
    during = resource_counts()[device_pair[0]]
    spares = g.ctx.spare_qp_count  # its pool of new QPs (shared-ring engine)
    assert during["qp"] == before[device_pair[0]]["qp"] + 1 + spares
    assert during["mr"] == before[device_pair[0]]["mr"] + 1 + g.ctx.spare_mr_count  # and its pool of MRs
    with pytest.raises(Conflict) as err:
        g.pd.close()
    assert err.value.current_state == "in_use"
    with pytest.raises(Conflict):
        g.cq.close()
    g.pd.closed = False
    _close(g)
    assert resource_counts() == before


def test_close_many_tears_down_in_one_request_each_and_leaves_nothing_on_the_nic(
        make_vrnic: Callable[..., AttachInfo], device_pair: tuple[str, str], engine: str) -> None:
    """destroy_qps and dereg_mrs on rxe: six QPs and six MRs in one request each, a key closed so is dead to a
    peer that kept it, and once the guests close, rdma res counts what it counted before them."""
    infos = make_vrnic(device=device_pair[0], engine=engine), make_vrnic(device=device_pair[1], engine=engine)
    before = resource_counts()
    a, b = _guest(infos[0]), _guest(infos[1])
    try:
        a.qp.connect(b.ctx.gid, b.qp.qpn)
        b.qp.connect(a.ctx.gid, a.qp.qpn)
        qps = QP.create_many(b.pd, b.cq, b.cq, 6)
        mrs = [MR(b.pd, 4096, ALL) for _ in range(6)]
        addr, rkey = mrs[0].addr, mrs[0].rkey
        sent: list[tuple[str, int]] = []
        call = b.ctx.call

        def counting(op: str, **args: object) -> dict[str, object]:
            sent.append((op, len(args.get("qps") or args.get("mrs") or [None])))  # type: ignore[arg-type]
            return call(op, **args)

        b.ctx.call = counting  # type: ignore[method-assign]
        during = resource_counts()[device_pair[1]]
        MR.close_many(mrs)
        QP.close_many(qps)
        assert sent == [("dereg_mrs", 6), ("destroy_qps", 6)]
        after = resource_counts()[device_pair[1]]
        assert (during["qp"] - after["qp"], during["mr"] - after["mr"]) == (6, 6)  # on the NIC, not only in vrnicd
        a.mr.write(b"too late")
        a.qp.post_send(SendRequest(1, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 8),), remote_addr=addr, rkey=rkey))
        wc = a.cq.wait(1)[0]
        assert (wc.wr_id, wc.status) == (1, WcStatus.REM_ACCESS_ERR)
    finally:
        _close(a)
        _close(b)
    assert resource_counts() == before


def test_busy_poll_mode_moves_data_and_can_be_switched_off(make_vrnic: Callable[..., AttachInfo],
                                                           device_pair: tuple[str, str], engine: str) -> None:
    a, b = _guest(make_vrnic(device=device_pair[0], engine=engine)), _guest(make_vrnic(device=device_pair[1],
                                                                                       engine=engine))
    try:
        a.ctx.set_busy_poll(True)
        b.ctx.set_busy_poll(True)
        a.qp.connect(b.ctx.gid, b.qp.qpn)
        b.qp.connect(a.ctx.gid, a.qp.qpn)
        for i in range(20):
            b.qp.post_recv(RecvRequest(i, (b.mr.sge(0, 64),)))
            a.mr.write(i.to_bytes(8, "little"))
            a.qp.post_send(SendRequest(i, WrOpcode.SEND, (a.mr.sge(0, 64),)))
            assert a.cq.wait(1)[0].status == 0
            assert b.cq.wait(1)[0].wr_id == i and b.mr.read(8) == i.to_bytes(8, "little")
        a.ctx.set_busy_poll(False)
        b.qp.post_recv(RecvRequest(99, (b.mr.sge(0, 64),)))
        a.qp.post_send(SendRequest(99, WrOpcode.SEND, (a.mr.sge(0, 64),)))
        assert b.cq.wait(1)[0].wr_id == 99
    finally:
        _close(a)
        _close(b)


def test_direct_engine_keeps_ud_on_the_ring_engine(make_vrnic: Callable[..., AttachInfo],
                                                   device_pair: tuple[str, str]) -> None:
    """rxe takes a UD destination from the WQE, which a direct guest writes: UD is refused there."""
    ctx = Context.attach(make_vrnic(device=device_pair[0], engine="direct"), arena_bytes=1 << 20)
    try:
        with PD(ctx) as pd, CQ(ctx, 16) as cq, pytest.raises(InvalidArgument, match="UD"):
            QP(pd, cq, cq, qp_type="ud")
    finally:
        ctx.close()


def test_direct_guest_gets_a_mapped_nic_queue_and_vrnicd_posts_nothing(
        make_vrnic: Callable[..., AttachInfo], device_pair: tuple[str, str], driver: object) -> None:
    """The guest's WQEs reach the NIC without vrnicd: its session has no engine thread and no rings."""
    a = _guest(make_vrnic(device=device_pair[0], engine="direct"))
    b = _guest(make_vrnic(device=device_pair[1], engine="direct"))
    try:
        a.qp.connect(b.ctx.gid, b.qp.qpn)
        b.qp.connect(a.ctx.gid, a.qp.qpn)
        session = driver.registry.get(a.ctx.vrnic_id).session  # type: ignore[attr-defined]
        assert type(session.engine).__name__ == "DirectEngine"
        assert all(cq.ring is None for _, cq in session.state.cqs.items())
        assert a.qp.direct is not None and a.qp.direct.sq.elem_size >= 208  # rxe_send_wqe and its SGEs
        for i in range(50):
            b.qp.post_recv(RecvRequest(i, (b.mr.sge(0, 64),)))
            a.mr.write(i.to_bytes(8, "little"))
            a.qp.post_send(SendRequest(i, WrOpcode.SEND, (a.mr.sge(0, 64),)))
            assert a.cq.wait(1)[0].status == WcStatus.SUCCESS
            wc = b.cq.wait(1)[0]
            assert (wc.wr_id, wc.qp) == (i, b.qp.qpn) and b.mr.read(8) == i.to_bytes(8, "little")
    finally:
        _close(a)
        _close(b)


def test_qps_are_real_rxe_qps_handed_out_from_a_pool_and_never_twice(make_vrnic: Callable[..., AttachInfo]) -> None:
    """Pre-setup on the shared-ring engine: the first QP of a shape brings QP_POOL real QPs onto rxe, the next
    ones are handouts that connect and carry data as any QP does, and a closed QP is destroyed, so no QP is
    handed out twice. Past the pool, one create_qps fills it again, with twice as many."""
    infos = make_vrnic(device="rxe0"), make_vrnic(device="rxe1")
    before = resource_counts()
    a, b = _guest(infos[0]), _guest(infos[1])
    try:
        assert resource_counts()["rxe0"]["qp"] == before["rxe0"]["qp"] + QP_POOL
        seen = {a.qp.qpn}
        for n in range(QP_POOL + 1):
            a.qp.connect(b.ctx.gid, b.qp.qpn)
            b.qp.connect(a.ctx.gid, a.qp.qpn)
            a.mr.write(n.to_bytes(8, "little"))
            a.qp.post_send(SendRequest(n, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 8),), remote_addr=b.mr.addr,
                                       rkey=b.mr.rkey))
            [done] = a.cq.wait(1)
            assert (done.wr_id, done.status, done.qp) == (n, WcStatus.SUCCESS, a.qp.qpn)
            assert b.mr.read(8) == n.to_bytes(8, "little")
            a.qp.close()
            a.qp = QP(a.pd, a.cq, a.cq, max_send_wr=64, max_recv_wr=64, max_sge=2)
            assert a.qp.qpn not in seen and a.qp.query()["state"] == "reset"
            seen.add(a.qp.qpn)
            b.qp.modify("reset")
        spares = a.ctx.spare_qp_count
        assert spares == 2 * QP_POOL - 2  # the second refill (twice the first), less the QP now held
        assert resource_counts()["rxe0"]["qp"] == before["rxe0"]["qp"] + 1 + spares
    finally:
        _close(a)
        _close(b)
    assert resource_counts() == before  # the pools went with the contexts


def test_cqs_are_real_rxe_cqs_handed_out_from_a_pool_and_come_back_empty(
        make_vrnic: Callable[..., AttachInfo]) -> None:
    """Pre-setup on the shared-ring engine: the first CQ of a size brings CQ_POOL real CQs onto rxe, a closed one
    goes back to the pool, and what a destroyed QP left never shows up in the CQ's next life."""
    infos = make_vrnic(device="rxe0"), make_vrnic(device="rxe1")
    before = resource_counts()
    a, b = _guest(infos[0]), _guest(infos[1])
    try:
        assert resource_counts()["rxe0"]["cq"] == before["rxe0"]["cq"] + CQ_POOL
        for _ in range(2):
            a.qp.connect(b.ctx.gid, b.qp.qpn)
            b.qp.connect(a.ctx.gid, a.qp.qpn)
            # completions nobody polls: the WRs reach rxe as destroy_qp drains them (no doorbell)
            a.qp.post_send([SendRequest(i, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 64),), remote_addr=b.mr.addr,
                                        rkey=b.mr.rkey) for i in range(32)], doorbell=False)
            handle = a.cq.handle
            a.qp.close()
            a.cq.close()
            a.cq = CQ(a.ctx, 128)
            assert a.cq.handle == handle
            time.sleep(0.5)  # anything still on its way would have arrived
            assert a.cq.poll(128) == []
            a.qp = QP(a.pd, a.cq, a.cq, max_send_wr=64, max_recv_wr=64, max_sge=2)
            b.qp.modify("reset")
        a.qp.connect(b.ctx.gid, b.qp.qpn)
        b.qp.connect(a.ctx.gid, a.qp.qpn)
        a.mr.write(b"pooled")
        a.qp.post_send(SendRequest(7, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 6),), remote_addr=b.mr.addr, rkey=b.mr.rkey))
        [done] = a.cq.wait(1)
        assert (done.wr_id, done.status, done.qp) == (7, WcStatus.SUCCESS, a.qp.qpn)
        assert b.mr.read(6) == b"pooled"
        assert resource_counts()["rxe0"]["cq"] == before["rxe0"]["cq"] + CQ_POOL  # handouts, not new CQs
    finally:
        _close(a)
        _close(b)
    assert resource_counts() == before  # the pools went with the contexts
