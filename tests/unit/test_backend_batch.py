"""Batched control verbs (create_qps, connect_qps) and the empty round trip (null_rpc), on the fake edge."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from vrnic.backend.fake_edge import FakeEdge
from vrnic.core.specs import AttachInfo
from vrnic.core.verb_args import MAX_BATCH
from vrnic.errors import Conflict, InvalidArgument, NotFound, QuotaExceeded
from vrnic.frontend import CQ, MR, PD, QP, Access, Context, SendRequest, WcStatus, WrOpcode
from vrnic.frontend.guest_library import PD_POOL

ARENA = 4 << 20
ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


def test_null_rpc_is_an_empty_round_trip_that_checks_its_arguments(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(), ARENA) as ctx:
        assert ctx.null_rpc() is None
        assert ctx.call("null_rpc") == {}
        with pytest.raises(InvalidArgument, match="null_rpc"):
            ctx.call("null_rpc", anything=1)


def test_batched_qps_are_created_and_connected_in_one_request_each_and_carry_data(
        make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(), ARENA) as ca, Context.attach(make_vrnic(device="fake1"), ARENA) as cb:
        pa, pb = PD(ca), PD(cb)
        cqa, cqb = CQ(ca, 64), CQ(cb, 64)
        qas = QP.create_many(pa, cqa, cqa, 8)
        qbs = QP.create_many(pb, cqb, cqb, 8)
        assert len({qp.qpn for qp in qas}) == 8 and len({qp.handle for qp in qbs}) == 8
        assert ca.call("query_device")["quota_used"]["qp"] == 8
        QP.connect_many(ca, [(qa, cb.gid, qb.qpn) for qa, qb in zip(qas, qbs, strict=True)])
        QP.connect_many(cb, [(qb, ca.gid, qa.qpn) for qa, qb in zip(qas, qbs, strict=True)])
        for qa, qb in zip(qas, qbs, strict=True):
            state = qa.query()
            assert {k: state[k] for k in ("qpn", "state", "qp_type", "connected_to")} == {
                "qpn": qa.qpn, "state": "rts", "qp_type": "rc", "connected_to": cb.gid}
            assert qb.query()["connected_to"] == ca.gid
        # Each batched QP moves bytes to its own peer: an RDMA WRITE over the last pair lands in b's buffer.
        src, dst = MR(pa, 4096, ALL), MR(pb, 4096, ALL)
        src.buffer.write(b"batched")
        qas[-1].post_send(SendRequest(1, WrOpcode.RDMA_WRITE, (src.sge(0, 7),), remote_addr=dst.addr, rkey=dst.rkey))
        [done] = cqa.wait(1, timeout=5)
        assert done.status == WcStatus.SUCCESS
        assert dst.buffer.read(7) == b"batched"
        for qp in qas + qbs:
            qp.close()
        assert ca.call("query_device")["quota_used"]["qp"] == 0


def test_create_qps_is_all_or_nothing(make_vrnic: Callable[..., AttachInfo], edge: FakeEdge) -> None:
    with Context.attach(make_vrnic(max_qps=3), ARENA) as ctx:
        pd, cq = PD(ctx), CQ(ctx, 16)
        live = len(edge.live)
        in_use = ctx.allocator.in_use()
        with pytest.raises(QuotaExceeded):
            QP.create_many(pd, cq, cq, 5)
        assert len(edge.live) == live  # the three that fitted were destroyed again
        assert ctx.call("query_device")["quota_used"]["qp"] == 0
        assert ctx.allocator.in_use() == in_use  # and their rings went back to the arena
        assert len(QP.create_many(pd, cq, cq, 3)) == 3


def test_create_qps_checks_every_item_and_caps_the_batch(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(), ARENA) as ctx:
        pd, cq = PD(ctx), CQ(ctx, 16)
        item = {"pd": pd.handle, "send_cq": cq.handle, "recv_cq": cq.handle, "max_send_wr": 4, "max_recv_wr": 4,
                "sq_ring": 0, "rq_ring": 4096}
        with pytest.raises(InvalidArgument, match="create_qps: qps.1.max_sge"):
            ctx.call("create_qps", qps=[item, {**item, "max_sge": 99}])
        with pytest.raises(InvalidArgument, match="create_qps: qps"):
            ctx.call("create_qps", qps=[item] * (MAX_BATCH + 1))
        with pytest.raises(InvalidArgument, match="create_qps: qps"):
            ctx.call("create_qps", qps=[])
        assert ctx.call("query_device")["quota_used"]["qp"] == 0


def test_connect_qps_is_all_or_nothing(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(), ARENA) as ca, Context.attach(make_vrnic(device="fake1"), ARENA) as cb:
        pa, pb = PD(ca), PD(cb)
        cqa, cqb = CQ(ca, 16), CQ(cb, 16)
        qas = QP.create_many(pa, cqa, cqa, 3)
        qbs = QP.create_many(pb, cqb, cqb, 2)
        connections = [(qas[0], cb.gid, qbs[0].qpn), (qas[1], cb.gid, qbs[1].qpn), (qas[2], cb.gid, 0xFFFFFF)]
        with pytest.raises(NotFound):  # the third names no QP of the peer
            QP.connect_many(ca, connections)
        assert [qp.query()["state"] for qp in qas] == ["reset", "reset", "reset"]
        with pytest.raises(InvalidArgument, match="twice"):
            QP.connect_many(ca, [(qas[0], cb.gid, qbs[0].qpn), (qas[0], cb.gid, qbs[1].qpn)])
        QP.connect_many(ca, connections[:2])
        assert [qp.query()["state"] for qp in qas] == ["rts", "rts", "reset"]


def test_pds_are_handed_out_from_a_pool_that_counts_against_the_quota(
        make_vrnic: Callable[..., AttachInfo], edge: FakeEdge) -> None:
    with Context.attach(make_vrnic(), ARENA) as ctx:
        live = len(edge.live)
        first = PD(ctx)
        assert ctx.call("query_device")["quota_used"]["pd"] == PD_POOL  # one alloc_pds filled the pool
        assert len(edge.live) == live + PD_POOL  # real PDs on the NIC, not promises
        others = [PD(ctx) for _ in range(PD_POOL - 1)]
        assert len({pd.handle for pd in [first, *others]}) == PD_POOL
        assert ctx.call("query_device")["quota_used"]["pd"] == PD_POOL  # handouts: no more PDs
        first.close()
        again = PD(ctx)
        assert again.handle == first.handle  # a closed PD went back to the pool
        mr = MR(again, 4096, ALL)  # and works as any PD
        with pytest.raises(Conflict, match="still has 1"):
            again.close()
        mr.close()
        again.close()
    assert len(edge.live) == live  # the pool goes with the context


def test_the_pd_pool_stops_at_the_quota(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(max_pds=2), ARENA) as ctx:
        a, b = PD(ctx), PD(ctx)
        assert ctx.call("query_device")["quota_used"]["pd"] == 2
        with pytest.raises(QuotaExceeded):
            PD(ctx)
        a.close()
        assert PD(ctx).handle == a.handle
        with pytest.raises(InvalidArgument, match="alloc_pds: count"):
            ctx.call("alloc_pds", count=0)
        assert b.handle != a.handle
