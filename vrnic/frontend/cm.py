"""Connecting by virtual IP, rdma_cm style: resolve an address, listen on a port, connect with private data.

Two guests that know only each other's virtual IP (the address their vRNIC has in its VPC) connect like
this, on the same host or on two hosts (vrnicd carries the request to the other host's agent):

    # the passive side                               # the active side
    with cm.Listener(ctx, 7471) as listener:          qp.modify("init"); qp.post_recv(...)
        qp.modify("init"); qp.post_recv(...)          done = cm.connect(ctx, qp, "10.0.0.5", 7471, b"hello")
        request = listener.get_request(timeout=10)    done.private_data      # what the listener answered
        listener.accept(request, qp, b"welcome")

accept() connects the listener's QP (INIT, RTR, RTS) to the requesting QP before it answers; connect()
returns once its own QP is connected too. Both QPs are RC QPs of the caller in RESET or INIT; receives
posted in INIT beforehand (as rdma_cm's QPs start in INIT) are there when the first message arrives. The
connector's QP reaches RTS a moment after the listener's: RC's retransmission covers a send in between.
Private data is capped as rdma_cm caps it on RC: 56 bytes with a request, 196 with an accept. A request
to a port nobody listens on, or that the listener rejects, fails with Conflict (current_state "rejected");
one nobody answers in time with Conflict ("timeout"); an IP or GID the caller may not reach is NotFound,
exactly as one that does not exist. Standard library only, like the rest of the frontend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vrnic.errors import InvalidArgument

if TYPE_CHECKING:
    from vrnic.frontend.guest_library import QP, Context

CONNECT_PRIVATE_DATA = 56  # bytes, as rdma_connect on RC
ACCEPT_PRIVATE_DATA = 196  # bytes, as rdma_accept on RC
WAIT_SLICE_S = 1.0  # a get_request waits in vrnicd at most this long per call, so other calls of ours interleave


@dataclass(frozen=True)
class ConnectRequest:
    """A connection request queued on a listener: who asks (virtual GID) and what it sent."""

    id: int
    port: int
    remote_gid: str
    private_data: bytes


@dataclass(frozen=True)
class Connected:
    """An established connection: the peer QP (virtual GID and QPN) and the private data the other side sent."""

    remote_gid: str
    remote_qpn: int
    private_data: bytes


def resolve(ctx: Context, ip: str) -> str:
    """The virtual GID of the vRNIC with virtual IP `ip` in this vRNIC's VPC (rdma_resolve_addr).

    NotFound if the VPC has no such address."""
    return str(ctx.call("resolve_ip", ip=ip)["gid"])


def _checked(data: bytes, limit: int, what: str) -> str:
    if len(data) > limit:
        raise InvalidArgument(f"{what} carries at most {limit} bytes of private data, not {len(data)}")
    return bytes(data).hex()


class Listener:
    """Listens for connection requests on `port` of this vRNIC (rdma_listen); one listener per port.

    The listener ends with close() or when the context detaches; requests still queued are rejected."""

    def __init__(self, ctx: Context, port: int) -> None:
        self.ctx = ctx
        self.port = port
        ctx.call("cm_listen", port=port)
        self.closed = False

    def get_request(self, timeout: float | None = None) -> ConnectRequest | None:
        """The next connection request (rdma_get_cm_event for CONNECT_REQUEST); None after `timeout` seconds
        (None: wait as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
            reply = self.ctx.call("cm_get_request", port=self.port, timeout_ms=int(left * 1000))
            request: dict[str, Any] | None = reply.get("request")
            if request is not None:
                return ConnectRequest(int(request["id"]), int(request["port"]), str(request["remote_gid"]),
                                      bytes.fromhex(request["private_data"]))
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def accept(self, request: ConnectRequest, qp: QP, private_data: bytes = b"") -> Connected:
        """Connect qp to the requesting QP and answer with private_data (rdma_accept).

        Conflict ("timeout") if the requester stopped waiting; the QP is connected then all the same."""
        reply = self.ctx.call("cm_accept", request=request.id, qp=qp.handle,
                              private_data=_checked(private_data, ACCEPT_PRIVATE_DATA, "an accept"))
        return Connected(str(reply["remote_gid"]), int(reply["remote_qpn"]), request.private_data)

    def reject(self, request: ConnectRequest) -> None:
        """Refuse the request (rdma_reject): the requester's connect fails with Conflict ("rejected")."""
        self.ctx.call("cm_reject", request=request.id)

    def close(self) -> None:
        if not self.closed and not self.ctx.closed:
            self.ctx.call("cm_unlisten", port=self.port)
        self.closed = True

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(ctx: Context, qp: QP, ip: str, port: int, private_data: bytes = b"", timeout: float = 5.0) -> Connected:
    """Connect qp to whatever listens on (virtual IP, port), sending private_data (rdma_resolve_addr,
    rdma_connect and the wait for ESTABLISHED in one call). Waits up to `timeout` seconds for the listener's
    guest to accept; returns the listener's QP and private data."""
    reply = ctx.call("cm_connect", qp=qp.handle, ip=ip, port=port, timeout_ms=max(1, int(timeout * 1000)),
                     private_data=_checked(private_data, CONNECT_PRIVATE_DATA, "a connect request"))
    return Connected(str(reply["remote_gid"]), int(reply["remote_qpn"]), bytes.fromhex(reply["private_data"]))
