"""Two guests' RC QPs connected to each other, each with its PD, CQ and a 4 KiB MR (unit tests on the fake edge)."""

from __future__ import annotations

from typing import NamedTuple

from vrnic.frontend import CQ, MR, PD, QP, Context


class ConnectedPair(NamedTuple):
    qa: QP
    qb: QP
    cqa: CQ
    cqb: CQ
    mra: MR
    mrb: MR


def connected_pair(ca: Context, cb: Context) -> ConnectedPair:
    pa, pb = PD(ca), PD(cb)
    cqa, cqb = CQ(ca, 16), CQ(cb, 16)
    mra, mrb = MR(pa, 4096), MR(pb, 4096)
    qa, qb = QP(pa, cqa, cqa), QP(pb, cqb, cqb)
    qa.connect(cb.gid, qb.qpn)
    qb.connect(ca.gid, qa.qpn)
    return ConnectedPair(qa, qb, cqa, cqb, mra, mrb)
