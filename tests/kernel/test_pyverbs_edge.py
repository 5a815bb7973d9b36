"""The pyverbs edge's transitions on rxe: the masks it sends are pyverbs' own, the attribute objects it keeps
for the next call carry nothing of the last one that matters, and the NIC's refusals arrive as DeviceError."""

from __future__ import annotations

import errno

import pytest

from vrnic.backend.pyverbs_edge import TRANSITION_MASKS, PyverbsEdge, describe
from vrnic.backend.rnic_edge import PhysCompletion, PhysRecv, PhysSend, QpCaps, RtrParams, RtsParams
from vrnic.core.specs import roce_v2_ipv4_gid
from vrnic.errors import DeviceError

CAPS = QpCaps(16, 16, 1)
LOCAL_WRITE = 1


def _gid(device: str) -> tuple[int, str]:
    index, gid = roce_v2_ipv4_gid(describe(device))
    return index, gid


def test_each_transition_sends_the_mask_pyverbs_computes_for_it(device_pair: tuple[str, str]) -> None:
    context = PyverbsEdge().open(device_pair[0])
    try:
        pd = context.alloc_pd()
        cq = context.create_cq(16)
        for qp_type in ("rc", "ud"):
            qp, _ = context.create_qp(pd, cq, cq, qp_type, CAPS)
            for state in ("init", "rtr", "rts"):
                assert TRANSITION_MASKS[qp_type, state] == qp._get_comp_mask(state.upper()), (qp_type, state)
            context.destroy(qp)
        context.destroy(cq, pd)
    finally:
        context.close()


def _poll(context: object, cq: object, count: int) -> list[PhysCompletion]:
    import time

    got: list[PhysCompletion] = []
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        got += context.poll_cq(cq, count - len(got))  # type: ignore[attr-defined]
    return got


def test_pairs_connected_one_after_another_through_the_kept_attributes_each_reach_their_own_peer(
        device_pair: tuple[str, str]) -> None:
    """Four RC pairs, each connected with other path settings than the pair before (RNR timer, PSNs): every
    QP reaches RTS, a SEND on each pair arrives at that pair's receiver only, and an RTR on a QP still in RESET
    is refused by the NIC (no INIT slipped in, as pyverbs' to_rtr would) and reported as DeviceError."""
    edge = PyverbsEdge()
    a, b = edge.open(device_pair[0]), edge.open(device_pair[1])
    (ia, ga), (ib, gb) = _gid(device_pair[0]), _gid(device_pair[1])
    try:
        pda, pdb = a.alloc_pd(), b.alloc_pd()
        cqa, cqb = a.create_cq(64), b.create_cq(64)
        buf_a, buf_b = bytearray(4096), bytearray(4096)
        import ctypes

        addr_a = ctypes.addressof(ctypes.c_char.from_buffer(buf_a))
        addr_b = ctypes.addressof(ctypes.c_char.from_buffer(buf_b))
        mra, lkey_a, _ = a.reg_mr(pda, addr_a, 4096, LOCAL_WRITE)
        mrb, lkey_b, _ = b.reg_mr(pdb, addr_b, 4096, LOCAL_WRITE)
        pairs = []
        for n in range(4):
            qa, qpn_a = a.create_qp(pda, cqa, cqa, "rc", CAPS)
            qb, qpn_b = b.create_qp(pdb, cqb, cqb, "rc", CAPS)
            for ctx, qp, index, peer_gid, peer_qpn in ((a, qa, ia, gb, qpn_b), (b, qb, ib, ga, qpn_a)):
                ctx.qp_to_init(qp, "rc", LOCAL_WRITE, 0)
                ctx.qp_to_rtr(qp, "rc", RtrParams(dgid=peer_gid, sgid_index=index, path_mtu=1024, dest_qpn=peer_qpn,
                                                  rq_psn=100 * n, max_dest_rd_atomic=1, min_rnr_timer=12 + n))
                ctx.qp_to_rts(qp, "rc", RtsParams(sq_psn=100 * n, timeout=14, retry_cnt=7, rnr_retry=7,
                                                  max_rd_atomic=1))
                assert ctx.query_qp_state(qp) == "rts"
            pairs.append((qa, qb, qpn_b))
        for n, (qa, qb, qpn_b) in enumerate(pairs):
            b.post_recv(qb, PhysRecv(1000 + n, [(addr_b + 64 * n, 64, lkey_b)]))
            message = f"pair {n}!!".encode()  # 8 bytes
            buf_a[64 * n:64 * n + 8] = message
            a.post_send(qa, PhysSend(wr_id=n, opcode=2, sges=[(addr_a + 64 * n, 8, lkey_a)], signaled=True))
            sent, received = _poll(a, cqa, 1), _poll(b, cqb, 1)
            assert [c.status for c in sent] == [0] and [c.status for c in received] == [0]
            assert received[0].wr_id == 1000 + n and received[0].qp_num == qpn_b
            assert bytes(buf_b[64 * n:64 * n + 8]) == message and received[0].byte_len == 8
        fresh, _ = a.create_qp(pda, cqa, cqa, "rc", CAPS)
        with pytest.raises(DeviceError) as refused:
            a.qp_to_rtr(fresh, "rc", RtrParams(dgid=gb, sgid_index=ia, path_mtu=1024, dest_qpn=1))
        assert refused.value.errno == errno.EINVAL and "modify QP to rtr" in str(refused.value)
        assert a.query_qp_state(fresh) == "reset"
        a.destroy(fresh, *(qa for qa, _, _ in pairs), mra, cqa, pda)
        b.destroy(*(qb for _, qb, _ in pairs), mrb, cqb, pdb)
    finally:
        a.close()
        b.close()


def test_qps_made_through_the_kept_init_attributes_take_their_own_cqs_type_and_sizes(
        device_pair: tuple[str, str]) -> None:
    """create_qp keeps its last QPInitAttr for the next QP of the same CQs, type and sizes. A QP of other CQs, type
    or sizes gets its own: each QP is what it was asked to be, and one made right after a QP on (cq1, cq1) with
    (cq1, cq2) completes its SEND on cq1 and its receive on cq2."""
    import ctypes

    import pyverbs.enums as e

    edge = PyverbsEdge()
    a, b = edge.open(device_pair[0]), edge.open(device_pair[1])
    (ia, ga), (ib, gb) = _gid(device_pair[0]), _gid(device_pair[1])
    try:
        pda, pdb = a.alloc_pd(), b.alloc_pd()
        cq1, cq2, cqb = a.create_cq(16), a.create_cq(16), b.create_cq(16)
        small = QpCaps(4, 4, 1)
        asked = [(cq1, cq1, "rc", CAPS), (cq1, cq1, "rc", CAPS), (cq2, cq2, "ud", CAPS), (cq2, cq2, "rc", small),
                 (cq1, cq1, "rc", CAPS), (cq1, cq2, "rc", CAPS)]
        made = [a.create_qp(pda, scq, rcq, qp_type, caps) for scq, rcq, qp_type, caps in asked]
        assert len({qpn for _, qpn in made}) == len(asked)
        for (qp, _), (_, _, qp_type, caps) in zip(made, asked, strict=True):
            assert qp.qp_type == (e.IBV_QPT_RC if qp_type == "rc" else e.IBV_QPT_UD)
            cap = qp.query(e.IBV_QP_CAP)[1].cap
            assert caps.max_send_wr <= cap.max_send_wr < (16 if caps is small else 1 << 20)
        mixed, qpn_mixed = made[-1]
        peer, qpn_peer = b.create_qp(pdb, cqb, cqb, "rc", CAPS)
        for ctx, qp, index, peer_gid, peer_qpn in ((a, mixed, ia, gb, qpn_peer), (b, peer, ib, ga, qpn_mixed)):
            ctx.qp_to_init(qp, "rc", LOCAL_WRITE, 0)
            ctx.qp_to_rtr(qp, "rc", RtrParams(dgid=peer_gid, sgid_index=index, path_mtu=1024, dest_qpn=peer_qpn))
            ctx.qp_to_rts(qp, "rc", RtsParams(timeout=14, retry_cnt=7, rnr_retry=7))
        buf_a, buf_b = bytearray(4096), bytearray(4096)
        addr_a = ctypes.addressof(ctypes.c_char.from_buffer(buf_a))
        addr_b = ctypes.addressof(ctypes.c_char.from_buffer(buf_b))
        mra, lkey_a, _ = a.reg_mr(pda, addr_a, 4096, LOCAL_WRITE)
        mrb, lkey_b, _ = b.reg_mr(pdb, addr_b, 4096, LOCAL_WRITE)
        a.post_recv(mixed, PhysRecv(7, [(addr_a, 64, lkey_a)]))
        b.post_recv(peer, PhysRecv(10, [(addr_b + 64, 64, lkey_b)]))
        b.post_send(peer, PhysSend(wr_id=8, opcode=2, sges=[(addr_b, 8, lkey_b)], signaled=True))
        a.post_send(mixed, PhysSend(wr_id=11, opcode=2, sges=[(addr_a + 64, 8, lkey_a)], signaled=True))
        assert [(c.wr_id, c.status) for c in _poll(a, cq2, 1)] == [(7, 0)]  # the receive, on the recv CQ
        assert [(c.wr_id, c.status) for c in _poll(a, cq1, 1)] == [(11, 0)]  # the SEND, on the send CQ
        assert a.poll_cq(cq1, 4) == [] and a.poll_cq(cq2, 4) == []
        a.destroy(*(qp for qp, _ in made), mra, cq1, cq2, pda)
        b.destroy(peer, mrb, cqb, pdb)
    finally:
        a.close()
        b.close()


def _my_mrs(device: str) -> dict[int, int]:
    """This process's MRs on device in `rdma res`: lkey -> length."""
    import json
    import os
    import subprocess

    shown = subprocess.run(["rdma", "-j", "-d", "res", "show", "mr", "dev", device], capture_output=True, text=True,
                           check=True).stdout
    return {_key(mr["lkey"]): int(mr["mrlen"]) for mr in json.loads(shown or "[]")
            if mr.get("pid") == os.getpid() and "lkey" in mr}


def _key(shown: object) -> int:
    return int(shown, 16) if isinstance(shown, str) else int(str(shown))  # iproute2 writes keys in hex


def test_an_mr_made_by_a_legacy_write_is_the_kernels_and_goes_exactly_once(device_pair: tuple[str, str]) -> None:
    """reg_mr writes REG_MR on pyverbs' own command fd: the MR is in the context's PD (rdma res), it goes on the
    first destroy and a second is nothing (its handle may be the next MR's), one left at close goes before its
    PD, and the kernel's refusal arrives as DeviceError with its errno."""
    import ctypes
    import mmap

    device = device_pair[0]
    area = mmap.mmap(-1, 3 * 4096)
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    context = PyverbsEdge().open(device)
    try:
        pd = context.alloc_pd()
        before = _my_mrs(device)
        first, lkey, rkey = context.reg_mr(pd, base, 4096, 7)  # LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ
        second, lkey2, _ = context.reg_mr(pd, base + 4096, 8192, 1)
        assert lkey == rkey and len({lkey, lkey2}) == 2
        assert _my_mrs(device) == {**before, lkey: 4096, lkey2: 8192}
        context.destroy(first)
        context.destroy(first)  # nothing: the MR went with the first
        assert _my_mrs(device) == {**before, lkey2: 8192} and context.reusable()
        with pytest.raises(DeviceError) as refused:
            context.reg_mr(pd, 4096, 4096, 1)  # nothing mapped at page 1
        assert refused.value.errno == errno.EFAULT and "reg MR" in str(refused.value)
    finally:
        context.close()  # the second MR first, then its PD with the context
    assert _my_mrs(device) == before
