"""Every isolation rule of vrnicd, on the host: the real driver, channel, session and engine over the fake RNIC edge.

Guests are the real frontend library attached through the real Unix socket. The
fake edge records every work request that reached the "NIC", so a rule that
refuses something is proven by what did not get there, not only by the
completion the guest saw. The kernel tier repeats the important ones on rxe.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable

import pytest

from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.fake_edge import FakeContext, FakeEdge
from vrnic.core.specs import AttachInfo
from vrnic.errors import DeviceError
from vrnic.frontend import (
    CQ,
    MR,
    PD,
    QP,
    Access,
    Context,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
    RecvRequest,
    SendRequest,
    WcStatus,
    WrOpcode,
)

ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
ARENA = 1 << 20


class Guest:
    """One attached guest with a PD, a CQ, an MR and an RC QP."""

    def __init__(self, ctx: Context, access: int = ALL, qp_type: str = "rc") -> None:
        self.ctx = ctx
        self.pd = PD(ctx)
        self.cq = CQ(ctx, 32)
        self.mr = MR(self.pd, 4096, access)
        self.qp = QP(self.pd, self.cq, self.cq, qp_type=qp_type)


def packed(gid: str) -> bytes:
    return ipaddress.IPv6Address(gid).packed


def posted_by(edge: FakeEdge) -> list[int]:
    return [wr.wr_id for _, wr in edge.posted]


def connected(a: Guest, b: Guest) -> None:
    a.qp.connect(b.ctx.gid, b.qp.qpn)
    b.qp.connect(a.ctx.gid, a.qp.qpn)


# ----- handles --------------------------------------------------------------------------------------------

def test_another_guests_handles_name_nothing(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(tenant="alice"), ARENA) as alice, \
            Context.attach(make_vrnic(tenant="mallory"), ARENA) as mallory:
        a = Guest(alice)
        for op, args in [("dealloc_pd", {"pd": a.pd.handle}), ("destroy_cq", {"cq": a.cq.handle}),
                         ("dereg_mr", {"mr": a.mr.handle}), ("destroy_qp", {"qp": a.qp.handle}),
                         ("query_qp", {"qp": a.qp.handle})]:
            with pytest.raises(NotFound):
                mallory.call(op, **args)
        with pytest.raises(NotFound):  # a foreign PD cannot anchor a new MR either
            mallory.call("reg_mr", pd=a.pd.handle, addr=0, length=4096, access=1)
        assert alice.call("query_qp", qp=a.qp.handle)["qpn"] == a.qp.qpn  # Alice's objects are untouched


# ----- tenant and VPC -------------------------------------------------------------------------------------

def test_a_qp_of_another_tenant_cannot_be_connected_to(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(tenant="alice"), ARENA) as alice, \
            Context.attach(make_vrnic(tenant="mallory", device="fake1"), ARENA) as mallory:
        a, m = Guest(alice), Guest(mallory)
        with pytest.raises(NotFound, match="no reachable vRNIC"):
            m.qp.connect(alice.gid, a.qp.qpn)


def test_a_qp_in_another_vpc_cannot_be_connected_to(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(tenant="alice", vpc=1), ARENA) as vpc1, \
            Context.attach(make_vrnic(tenant="alice", vpc=2, device="fake1"), ARENA) as vpc2:
        a, o = Guest(vpc1), Guest(vpc2)
        with pytest.raises(NotFound, match="no reachable vRNIC"):
            o.qp.connect(vpc1.gid, a.qp.qpn)


def test_same_tenant_and_vpc_connect_and_move_bytes(make_vrnic: Callable[..., AttachInfo], edge: FakeEdge) -> None:
    with Context.attach(make_vrnic(), ARENA) as ca, Context.attach(make_vrnic(device="fake1"), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        connected(a, b)
        b.qp.post_recv(RecvRequest(7, (b.mr.sge(0, 64),)))
        a.mr.write(b"through the fake NIC")
        a.qp.post_send(SendRequest(1, WrOpcode.SEND, (a.mr.sge(0, 20),)))
        assert [c.status for c in a.cq.wait(1)] == [WcStatus.SUCCESS]
        (recv,) = b.cq.wait(1)
        assert (recv.wr_id, recv.status, recv.byte_len, recv.qp) == (7, WcStatus.SUCCESS, 20, b.qp.qpn)
        assert b.mr.read(20) == b"through the fake NIC"
        assert posted_by(edge) == [1]


def test_unknown_virtual_qpn_on_a_reachable_peer(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(), ARENA) as ca, Context.attach(make_vrnic(device="fake1"), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        with pytest.raises(NotFound, match=f"no QP {b.qp.qpn ^ 1}"):
            a.qp.connect(cb.gid, b.qp.qpn ^ 1)


def test_ud_sends_to_another_tenant_never_reach_the_nic(make_vrnic: Callable[..., AttachInfo],
                                                        edge: FakeEdge) -> None:
    with Context.attach(make_vrnic(tenant="alice"), ARENA) as alice, \
            Context.attach(make_vrnic(tenant="mallory", device="fake1"), ARENA) as mallory:
        a, m = Guest(alice, qp_type="ud"), Guest(mallory, qp_type="ud")
        for g in (a, m):
            for state in ("init", "rtr", "rts"):
                g.qp.modify(state)
        m.qp.post_recv(RecvRequest(9, (m.mr.sge(0, 256),)))
        a.qp.post_send(SendRequest(3, WrOpcode.SEND, (a.mr.sge(0, 8),), ud_gid=packed(mallory.gid), ud_qpn=m.qp.qpn,
                                   ud_qkey=0x11111111))
        (wc,) = a.cq.wait(1)
        assert (wc.wr_id, wc.status) == (3, WcStatus.LOC_QP_OP_ERR)
        assert posted_by(edge) == []
        assert m.cq.poll() == []


def test_ud_source_is_shown_as_the_senders_virtual_qpn(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(), ARENA) as ca, Context.attach(make_vrnic(device="fake1"), ARENA) as cb:
        a, b = Guest(ca, qp_type="ud"), Guest(cb, qp_type="ud")
        for g in (a, b):
            for state in ("init", "rtr", "rts"):
                g.qp.modify(state)
        b.qp.post_recv(RecvRequest(9, (b.mr.sge(0, 256),)), sync=True)
        a.qp.post_send(SendRequest(3, WrOpcode.SEND, (a.mr.sge(0, 8),), ud_gid=packed(cb.gid), ud_qpn=b.qp.qpn,
                                   ud_qkey=0x11111111))
        (wc,) = b.cq.wait(1)
        assert (wc.status, wc.src_qp, wc.qp) == (WcStatus.SUCCESS, a.qp.qpn, b.qp.qpn)


# ----- keys -----------------------------------------------------------------------------------------------

def test_an_lkey_of_another_vrnic_is_refused_before_the_nic(make_vrnic: Callable[..., AttachInfo],
                                                            edge: FakeEdge) -> None:
    with Context.attach(make_vrnic(), ARENA) as ca, Context.attach(make_vrnic(device="fake1"), ARENA) as cb:
        a, b = Guest(ca), Guest(cb)
        connected(a, b)
        stolen = type(a.mr.sge())(a.mr.addr, 8, b.mr.lkey)  # Bob's key, Alice's offsets
        a.qp.post_send(SendRequest(4, WrOpcode.SEND, (stolen,)))
        (wc,) = a.cq.wait(1)
        assert (wc.wr_id, wc.status) == (4, WcStatus.LOC_PROT_ERR)
        assert posted_by(edge) == []


def test_an_rkey_of_a_vrnic_other_than_the_peer_is_refused(make_vrnic: Callable[..., AttachInfo],
                                                           edge: FakeEdge) -> None:
    with Context.attach(make_vrnic(), ARENA) as ca, Context.attach(make_vrnic(device="fake1"), ARENA) as cb, \
            Context.attach(make_vrnic(), ARENA) as cc:
        a, b, carol = Guest(ca), Guest(cb), Guest(cc)
        connected(a, b)
        carol.mr.write(b"carol's secret")
        a.qp.post_send(SendRequest(5, WrOpcode.RDMA_READ, (a.mr.sge(0, 14),), remote_addr=carol.mr.addr,
                                   rkey=carol.mr.rkey))
        (wc,) = a.cq.wait(1)
        assert (wc.wr_id, wc.status) == (5, WcStatus.REM_ACCESS_ERR)
        assert posted_by(edge) == []
        assert a.mr.read(14) != b"carol's secret"


def test_remote_access_the_peer_did_not_grant_is_refused(make_vrnic: Callable[..., AttachInfo],
                                                         edge: FakeEdge) -> None:
    with Context.attach(make_vrnic(), ARENA) as ca, Context.attach(make_vrnic(device="fake1"), ARENA) as cb:
        a, b = Guest(ca), Guest(cb, access=Access.LOCAL_WRITE | Access.REMOTE_READ)
        connected(a, b)
        a.qp.post_send(SendRequest(6, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 8),), remote_addr=b.mr.addr,
                                   rkey=b.mr.rkey))
        a.qp.post_send(SendRequest(7, WrOpcode.RDMA_READ, (a.mr.sge(0, 8),), remote_addr=b.mr.addr + 4096 - 4,
                                   rkey=b.mr.rkey))  # runs past the end of the MR
        assert [(c.wr_id, c.status) for c in a.cq.wait(2)] == [(6, WcStatus.REM_ACCESS_ERR),
                                                               (7, WcStatus.REM_ACCESS_ERR)]
        assert posted_by(edge) == []
        a.qp.post_send(SendRequest(8, WrOpcode.RDMA_READ, (a.mr.sge(0, 8),), remote_addr=b.mr.addr, rkey=b.mr.rkey))
        assert [(c.wr_id, c.status) for c in a.cq.wait(1)] == [(8, WcStatus.SUCCESS)]
        (qpn, wr), = edge.posted
        assert wr.rkey != b.mr.rkey, "the NIC must get the physical rkey, never the guest's virtual one"


def test_a_released_peers_memory_is_out_of_reach(make_vrnic: Callable[..., AttachInfo], driver: VerbsDriver,
                                                 edge: FakeEdge) -> None:
    info_b = make_vrnic(device="fake1")
    with Context.attach(make_vrnic(), ARENA) as ca:
        cb = Context.attach(info_b, ARENA)
        a, b = Guest(ca), Guest(cb)
        connected(a, b)
        driver.release_vrnic(info_b.vrnic_id)
        a.qp.post_send(SendRequest(9, WrOpcode.RDMA_WRITE, (a.mr.sge(0, 8),), remote_addr=b.mr.addr,
                                   rkey=b.mr.rkey))
        (wc,) = a.cq.wait(1)
        assert (wc.wr_id, wc.status) == (9, WcStatus.REM_ACCESS_ERR)
        assert posted_by(edge) == []
        cb.close()  # vrnicd dropped it already: closing is still clean


# ----- quotas and memory ----------------------------------------------------------------------------------

def test_object_quotas(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(max_mrs=1, max_qps=1, max_cqs=1, max_pds=1), ARENA) as ctx:
        g = Guest(ctx)
        for make in (lambda: PD(ctx), lambda: CQ(ctx, 4), lambda: MR(g.pd, 4096), lambda: QP(g.pd, g.cq, g.cq)):
            with pytest.raises(QuotaExceeded):
                make()
        assert ctx.call("query_device")["quota_used"] == {"pd": 1, "cq": 1, "qp": 1, "mr": 1, "pinned_bytes": 4096}


def test_pinned_bytes_quota(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(max_pinned_bytes=8192), ARENA) as ctx:
        pd = PD(ctx)
        MR(pd, 8192)
        with pytest.raises(QuotaExceeded) as caught:
            MR(pd, 4096)
        assert (caught.value.limit, caught.value.maximum, caught.value.requested) == ("max_pinned_bytes", 8192, 12288)


def test_queue_depth_quotas(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(max_cqe=16, max_wr=8), ARENA) as ctx:
        pd, cq = PD(ctx), CQ(ctx, 16)
        with pytest.raises(QuotaExceeded):
            CQ(ctx, 17)
        with pytest.raises(QuotaExceeded):
            QP(pd, cq, cq, max_send_wr=9, max_recv_wr=8)


def test_a_failed_verb_refunds_its_quota(make_vrnic: Callable[..., AttachInfo],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise DeviceError("reg MR: Cannot allocate memory", 12)

    with Context.attach(make_vrnic(max_mrs=1), ARENA) as ctx:
        pd = PD(ctx)
        monkeypatch.setattr(FakeContext, "reg_mr", refuse)
        with pytest.raises(DeviceError):
            MR(pd, 4096)
        monkeypatch.undo()
        assert ctx.call("query_device")["quota_used"]["mr"] == 0
        MR(pd, 4096)  # the one MR the quota allows is still available


def test_memory_outside_the_guests_arena_is_refused(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(), ARENA) as ctx:
        pd = PD(ctx)
        for addr, length in ((ARENA - 4096, 8192), (-1, 4096), (ARENA, 1)):
            with pytest.raises(InvalidArgument):
                ctx.call("reg_mr", pd=pd.handle, addr=addr, length=length, access=1)
        with pytest.raises(InvalidArgument):
            ctx.call("create_cq", cqe=16, ring=ARENA - 64)


# ----- failure and teardown -------------------------------------------------------------------------------

def test_an_engine_failure_reaches_the_guest_at_once(make_vrnic: Callable[..., AttachInfo], edge: FakeEdge,
                                                     driver: VerbsDriver, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    info = make_vrnic()
    with Context.attach(info, ARENA) as ctx:
        g = Guest(ctx)

        def broken(*_: object) -> list[object]:
            raise RuntimeError("engine bug")

        monkeypatch.setattr(FakeContext, "poll_cq", broken)
        started = time.monotonic()
        with pytest.raises(DeviceError, match="data path for this vRNIC failed"):
            g.cq.wait(1, timeout=10)
        assert time.monotonic() - started < 5
        deadline = time.monotonic() + 5
        while info.vrnic_id in driver.attached_ids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert info.vrnic_id not in driver.attached_ids(), "the session must end with its engine"
        assert not edge.live
    assert "data-path engine of vRNIC" in caplog.text


def test_detach_and_reattach_leave_nothing_behind(make_vrnic: Callable[..., AttachInfo], edge: FakeEdge,
                                                  driver: VerbsDriver) -> None:
    info = make_vrnic()
    for _ in range(2):
        with Context.attach(info, ARENA) as ctx:
            Guest(ctx)
            assert driver.attached_ids() == {info.vrnic_id}
            assert edge.live
        assert driver.attached_ids() == set()
        assert not edge.live
