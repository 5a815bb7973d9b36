"""Native pyverbs RC endpoints: the lab smoke workload and the baseline benchmarks compare against.

This deliberately talks to pyverbs directly, with no vrnic mediation in between.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

from vrnic.backend.pyverbs_edge import describe
from vrnic.core.specs import roce_v2_ipv4_gid
from vrnic.errors import DeviceError

ACCESS = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
          | e.IBV_ACCESS_REMOTE_ATOMIC)
PORT = 1


@dataclass(frozen=True)
class EndpointInfo:
    """What a peer needs to connect to an RC QP and access its buffer."""

    gid: str
    qpn: int
    rkey: int
    addr: int
    length: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def connect_rc(qp: QP, remote_gid: str, remote_qpn: int, sgid_index: int, *, timeout: int = 14,
               retry_cnt: int = 7, flow_label: int = 0) -> None:
    """RESET -> INIT -> RTR -> RTS for an RC QP towards one remote QP.

    timeout is the ack timeout exponent (4.096 us << timeout); flow_label also picks rxe's UDP source port.
    """
    attr = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=PORT)
    attr.qp_access_flags = ACCESS
    attr.pkey_index = 0
    qp.to_init(attr)
    route = GlobalRoute(dgid=GID(remote_gid), sgid_index=sgid_index, hop_limit=64, flow_label=flow_label)
    attr = QPAttr(port_num=PORT)
    attr.ah_attr = AHAttr(gr=route, is_global=1, port_num=PORT)
    attr.path_mtu = e.IBV_MTU_1024
    attr.dest_qp_num = remote_qpn
    attr.rq_psn = 0
    attr.max_dest_rd_atomic = 4
    attr.min_rnr_timer = 12
    qp.to_rtr(attr)
    attr.sq_psn = 0
    attr.timeout = timeout
    attr.retry_cnt = retry_cnt
    attr.rnr_retry = 7
    attr.max_rd_atomic = 4
    qp.to_rts(attr)


class RcEndpoint:
    """One device context with a PD, a CQ, a registered buffer and an RC QP."""

    def __init__(self, device: str, size: int = 4096, depth: int = 64) -> None:
        self.device = device
        self.gid_index, _ = roce_v2_ipv4_gid(describe(device))
        self.ctx = Context(name=device)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, depth * 2)
        self.mr = MR(self.pd, size, ACCESS)
        cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.gid = str(self.ctx.query_gid(PORT, self.gid_index))

    def info(self) -> EndpointInfo:
        return EndpointInfo(gid=self.gid, qpn=self.qp.qp_num, rkey=self.mr.rkey, addr=self.mr.buf,
                            length=self.mr.length)

    def connect(self, remote: EndpointInfo, **path: int) -> None:
        """path: connect_rc's timeout, retry_cnt and flow_label."""
        connect_rc(self.qp, remote.gid, remote.qpn, self.gid_index, **path)

    def _sge(self, length: int, offset: int = 0) -> SGE:
        return SGE(self.mr.buf + offset, length, self.mr.lkey)

    def post_rdma(self, opcode: int, remote: EndpointInfo, length: int, offset: int = 0,
                  remote_offset: int = 0) -> None:
        wr = SendWR(opcode=opcode, num_sge=1, sg=[self._sge(length, offset)], send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(remote.rkey, remote.addr + remote_offset)
        self.qp.post_send(wr)

    def post_send(self, length: int, offset: int = 0) -> None:
        self.qp.post_send(SendWR(opcode=e.IBV_WR_SEND, num_sge=1, sg=[self._sge(length, offset)],
                                 send_flags=e.IBV_SEND_SIGNALED))

    def post_recv(self, length: int, offset: int = 0) -> None:
        self.qp.post_recv(RecvWR(num_sge=1, sg=[self._sge(length, offset)]))

    def poll(self, count: int = 1, timeout: float = 5.0) -> list[Any]:
        """Busy-poll until count completions arrived; a failed completion raises DeviceError."""
        done: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(done) < count:
            npolled, wcs = self.cq.poll(num_entries=count - len(done))
            for wc in wcs[:npolled]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise DeviceError(f"{self.device}: work completion failed with status {wc.status}")
                done.append(wc)
            if npolled == 0 and time.monotonic() > deadline:
                raise DeviceError(f"{self.device}: no completion within {timeout} s")
        return done

    def close(self) -> None:
        # Children before parents: QP, MR, CQ, PD, then the context.
        for resource in (self.qp, self.mr, self.cq, self.pd, self.ctx):
            resource.close()

    def __enter__(self) -> RcEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
