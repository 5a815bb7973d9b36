"""A guest process that attaches, connects to a peer and RDMA-WRITEs in a loop until killed."""

import json
import sys

from vrnic.core.specs import AttachInfo
from vrnic.frontend import CQ, MR, PD, QP, Access, Context, SendRequest, WrOpcode

info = AttachInfo(**json.loads(sys.argv[1]))
peer_gid, peer_qpn, peer_addr, peer_rkey = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ctx = Context.attach(info, arena_bytes=1 << 20)
pd = PD(ctx)
cq = CQ(ctx, 64)
mr = MR(pd, 65536, Access.LOCAL_WRITE)
qp = QP(pd, cq, cq)
print(json.dumps({"qpn": qp.qpn}), flush=True)
sys.stdin.readline()  # the peer connects its side, then tells us to go
qp.connect(peer_gid, peer_qpn)
mr.write(b"x" * 65536)
n = 0
while True:
    qp.post_send([SendRequest(n + i, WrOpcode.RDMA_WRITE, (mr.sge(0, 4096),), remote_addr=peer_addr,
                              rkey=peer_rkey) for i in range(8)])
    cq.wait(8, timeout=60)
    n += 8
    if n == 64:
        print("traffic", flush=True)
