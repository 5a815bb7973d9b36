"""The guest library: pyverbs-shaped objects whose control verbs go to vrnicd.

    with Context.attach(info) as ctx, PD(ctx) as pd, CQ(ctx, 64) as cq:
        mr = MR(pd, 4096, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        qp = QP(pd, cq, cq)
        qp.connect(peer_gid, peer_qpn)
        qp.post_send(SendRequest(1, WrOpcode.SEND, (mr.sge(0, 64),)))
        cq.wait(1)

Buffers come from the context's shared arena (ctx.alloc or MR); posting and
polling touch only shared memory and a doorbell. Inside a VM, Context.attach_vm()
talks over the vRNIC's virtio-serial port and addresses buffers by guest-physical
address. This package imports nothing outside the standard library, so a VM
needs only python3 and the vrnic sources.
"""

from vrnic.core.rings import Access, Completion, RecvRequest, SendRequest, Sge, WcOpcode, WcStatus, WrOpcode
from vrnic.errors import (
    ChannelLost,
    Conflict,
    DeviceError,
    InvalidArgument,
    NotFound,
    NotSupported,
    QuotaExceeded,
    VrnicError,
)
from vrnic.frontend.guest_library import CQ, MR, PD, QP, Buffer, Context

__all__ = ["CQ", "MR", "PD", "QP", "Access", "Buffer", "ChannelLost", "Completion", "Conflict", "Context",
           "DeviceError", "InvalidArgument", "NotFound", "NotSupported", "QuotaExceeded", "RecvRequest", "SendRequest",
           "Sge", "VrnicError", "WcOpcode", "WcStatus", "WrOpcode"]
