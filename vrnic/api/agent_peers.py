"""Agent-to-agent routes for peering: other hosts' vrnicds ask this one about the vRNICs it holds.

/agent/v1/peers/qp, /peers/mrs and /peers/reverse resolve QPs, MR windows and UD sources; /agent/v1/cm/connect
queues a connection request on a listener here and answers once its guest accepted. The caller is another
agent (Bearer agent token, vrnic.api.agent.require_agent); every answer is checked by this host's own reachability rule
(vrnic.backend.peer_service). Handlers are plain functions: FastAPI runs them on worker threads, so a
connect request waiting for its listener never blocks the event loop.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from vrnic.api.agent import require_agent
from vrnic.api.controlplane import ControlPlane
from vrnic.api.problems import RESPONSES
from vrnic.backend.peer_service import PeerService
from vrnic.core.peer_wire import (
    CmConnectAnswer,
    CmConnectQuery,
    IdentityWire,
    MrAnswer,
    MrQuery,
    MrWindowWire,
    QpAnswer,
    QpQuery,
    ReverseAnswer,
    ReverseQuery,
)


async def peer_service(request: Request) -> PeerService:
    cp: ControlPlane = request.app.state.control_plane
    return cp.backend.peers()


Peers = Annotated[PeerService, Depends(peer_service)]

router = APIRouter(prefix="/agent/v1", tags=["agent"], responses=RESPONSES, dependencies=[Depends(require_agent)],
                   include_in_schema=False)  # host-to-host, not part of the public API (as vrnic.api.agent)


@router.post("/peers/qp", response_model=QpAnswer, summary="The physical QP behind a virtual GID and QPN")
def peer_qp(body: QpQuery, peers: Peers) -> QpAnswer:
    target, phys_gid, phys_qpn = peers.qp(body.asker.identity(), body.virtual_gid, body.vqpn)
    return QpAnswer(target=IdentityWire.of(target), phys_gid=phys_gid, phys_qpn=phys_qpn)


@router.post("/peers/mrs", response_model=MrAnswer, summary="The MR windows a vRNIC publishes")
def peer_mrs(body: MrQuery, peers: Peers) -> MrAnswer:
    return MrAnswer(windows=[MrWindowWire.of(w) for w in peers.mrs(body.asker.identity(), body.virtual_gid)])


@router.post("/peers/reverse", response_model=ReverseAnswer, summary="The virtual QPN of a physical UD source")
def peer_reverse(body: ReverseQuery, peers: Peers) -> ReverseAnswer:
    return ReverseAnswer(vqpn=peers.reverse(body.asker.identity(), body.phys_gid, body.phys_qpn))


@router.post("/cm/connect", response_model=CmConnectAnswer,
             summary="A connection request for a listener here; answers when its guest accepts")
def cm_connect(body: CmConnectQuery, peers: Peers) -> CmConnectAnswer:
    vqpn, private_data = peers.cm_connect(body.asker.identity(), body.virtual_gid, body.port, body.vqpn,
                                          bytes.fromhex(body.private_data), body.timeout_ms / 1000)
    return CmConnectAnswer(vqpn=vqpn, private_data=private_data.hex())
