"""A guest with the usual objects (PD, CQ, a 64 KiB MR, QPs on demand), for the data-path kernel tests."""

from __future__ import annotations

from vrnic.core.specs import AttachInfo
from vrnic.frontend import CQ, MR, PD, QP, Access, Context

ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


class Guest:
    def __init__(self, info: AttachInfo) -> None:
        self.ctx = Context.attach(info, 1 << 20)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 64)
        self.mr = MR(self.pd, 65536, ALL)
        self.qps: list[QP] = []

    def qp(self) -> QP:
        qp = QP(self.pd, self.cq, self.cq)
        self.qps.append(qp)
        return qp

    def close(self) -> None:
        for obj in (*self.qps, self.mr, self.cq, self.pd, self.ctx):
            obj.close()


def connected_pair(a: Guest, b: Guest) -> tuple[QP, QP]:
    """A new QP on each, connected to each other through vrnicd."""
    qa, qb = a.qp(), b.qp()
    qa.connect(b.ctx.gid, qb.qpn)
    qb.connect(a.ctx.gid, qa.qpn)
    return qa, qb
