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


def connected_pair(a: Guest, b: Guest, rc_timeout: int | None = None) -> tuple[QP, QP]:
    """A new QP on each, connected to each other through vrnicd: with the connect verb, or, when rc_timeout is
    given, through INIT, RTR and RTS asking that timeout."""
    qa, qb = a.qp(), b.qp()
    for mine, other, theirs in ((qa, b, qb), (qb, a, qa)):
        if rc_timeout is None:
            mine.connect(other.ctx.gid, theirs.qpn)
        else:
            mine.modify("init", access=15)
            mine.modify("rtr", remote_gid=other.ctx.gid, remote_qpn=theirs.qpn)
            mine.modify("rts", timeout=rc_timeout)
    return qa, qb
