"""Agent-to-agent routes of a cross-host VM hand-over (vrnic.backend.vm_handover; plan in vrnic.core.handover).

/agent/v1/handover/{domain}: the source's vrnicd drives the destination's (accept, pages, take-over, release,
abort). /agent/v1/moving/{vrnic_id}: it drives every host with peers of a moving vRNIC (track their writes into
it, hold, status, moved, release). The caller is another agent (the agent token); the clients are
vrnic.backend.remote_handover. Handlers are plain functions: FastAPI runs them on worker threads.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response, status
from pydantic import BaseModel, ConfigDict

from vrnic.api.agent import require_agent
from vrnic.api.controlplane import ControlPlane
from vrnic.api.problems import RESPONSES
from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.peer_service import PeerService
from vrnic.core.handover import Arrival, QpCarry, pages_from_wire
from vrnic.core.session_state import SessionSnapshot
from vrnic.core.specs import VmBinding, VrnicSpec
from vrnic.errors import InvalidArgument, NotFound, VrnicError

log = logging.getLogger(__name__)


async def handover_driver(request: Request) -> VerbsDriver:
    cp: ControlPlane = request.app.state.control_plane
    return cp.backend.handover()


async def peer_service(request: Request) -> PeerService:
    cp: ControlPlane = request.app.state.control_plane
    return cp.backend.peers()


Driver = Annotated[VerbsDriver, Depends(handover_driver)]
Peers = Annotated[PeerService, Depends(peer_service)]


class AcceptBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    specs: list[VrnicSpec]
    binding: VmBinding
    snapshots: dict[str, dict[str, Any]]
    device: str | None = None


class PreconnectBody(BaseModel):
    vrnic_id: str
    wires: list[dict[str, Any]]


class ShadowsBody(BaseModel):
    wanted: dict[int, tuple[str, int]]


class PagesBody(BaseModel):
    runs: list[dict[str, Any]]


class TakeOverBody(BaseModel):
    snapshots: dict[str, dict[str, Any]]
    carried: dict[str, list[dict[str, Any]]]
    live_peers: dict[str, list[int]] | None = None  # per vRNIC, its QPs (virtual QPNs) whose peers are held alive


class MovedBody(BaseModel):
    virtual_gid: str
    arrival: dict[str, Any] | None = None  # vrnic.core.handover.Arrival's JSON form


def _snapshots(raw: dict[str, dict[str, Any]]) -> dict[str, SessionSnapshot]:
    try:
        return {k: SessionSnapshot.from_dict(v) for k, v in raw.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"not a session snapshot: {exc}") from None


router = APIRouter(prefix="/agent/v1", tags=["agent"], responses=RESPONSES, dependencies=[Depends(require_agent)],
                   include_in_schema=False)  # host-to-host, not part of the public API (as vrnic.api.agent)


@router.post("/handover/{domain}")
def accept(domain: str, body: AcceptBody, driver: Driver) -> dict[str, Any]:
    return driver.accept_handover(domain, body.specs, body.binding, _snapshots(body.snapshots), body.device)


@router.post("/handover/{domain}/preconnect")
def preconnect(domain: str, body: PreconnectBody, driver: Driver) -> dict[str, int]:
    try:
        return {"preconnected": driver.handover_preconnect(domain, body.vrnic_id, body.wires)}
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"not a pre-connection: {exc}") from None


@router.post("/handover/{domain}/pages")
def pages(domain: str, body: PagesBody, driver: Driver) -> dict[str, int]:
    return {"written": driver.handover_pages(domain, pages_from_wire(body.runs))}


@router.post("/handover/{domain}/take-over")
def take_over(domain: str, body: TakeOverBody, driver: Driver) -> dict[str, Any]:
    carried = {k: [QpCarry.from_dict(c) for c in v] for k, v in body.carried.items()}
    return driver.handover_take_over(domain, _snapshots(body.snapshots), carried, body.live_peers)


@router.post("/handover/{domain}/release", status_code=status.HTTP_204_NO_CONTENT)
def release(domain: str, driver: Driver, request: Request) -> Response:
    driver.handover_release(domain)
    uri: str | None = request.app.state.libvirt_uri
    if uri is not None:
        resume_arrived(uri, domain)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def resume_arrived(uri: str, domain: str) -> None:
    """`virsh migrate --live --suspend` left the domain paused here, the one moment libvirt gives between QEMU's
    last pass and the guest running (no hook runs there): its vRNICs are served here now, so let it run. A domain
    that runs already was resumed by libvirt before the hand-over (migrated without --suspend): said in the log.
    The hand-over is done either way; a failure here leaves the domain paused for the operator."""
    from vrnic.vm.libvirt_edge import connect

    try:
        with connect(uri) as conn:
            resumed = conn.domain(domain).resume_if_paused()
    except NotFound:
        return  # not a libvirt domain (QEMU driven by hand, as in the raw-QEMU lab tests)
    except VrnicError as exc:
        log.error("VM %s: handed over here, but resuming it in libvirt failed: %s", domain, exc)
        return
    if resumed:
        log.info("VM %s: resumed in libvirt after the hand-over", domain)
    else:
        log.warning("VM %s ran before its vRNICs were handed over (virsh migrate without --suspend?): its guest may "
                    "have seen guest memory that the hand-over rewrote", domain)


@router.delete("/handover/{domain}", status_code=status.HTTP_204_NO_CONTENT)
def abort(domain: str, driver: Driver) -> Response:
    driver.handover_abort(domain)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/moving/{vrnic_id}", status_code=status.HTTP_204_NO_CONTENT)
def track(vrnic_id: str, peers: Peers) -> Response:
    peers.track(vrnic_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/moving/{vrnic_id}/shadows")
def shadows(vrnic_id: str, body: ShadowsBody, peers: Peers) -> dict[str, Any]:
    return {"shadows": {str(k): v for k, v in peers.shadows(vrnic_id, body.wanted).items()}}


@router.post("/moving/{vrnic_id}/hold")
def hold(vrnic_id: str, peers: Peers) -> dict[str, Any]:
    return {"qps": [s.to_dict() for s in peers.hold(vrnic_id)]}


@router.get("/moving/{vrnic_id}")
def moving_status(vrnic_id: str, peers: Peers) -> dict[str, Any]:
    statuses, dirty = peers.status(vrnic_id)
    return {"qps": [s.to_dict() for s in statuses], "dirty": [list(r) for r in dirty]}


@router.post("/moving/{vrnic_id}/moved")
def moved(vrnic_id: str, body: MovedBody, peers: Peers) -> dict[str, int]:
    arrival = None if body.arrival is None else Arrival.from_dict(body.arrival)
    return {"repointed": peers.moved(vrnic_id, body.virtual_gid, arrival)}


@router.delete("/moving/{vrnic_id}", status_code=status.HTTP_204_NO_CONTENT)
def release_peers(vrnic_id: str, peers: Peers) -> Response:
    peers.release(vrnic_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
