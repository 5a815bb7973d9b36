"""The agent routes (/agent/v1): what other hosts' API servers ask of this host's backend.

Authenticated by the agent token every host shares (require_agent), not by tenants' tokens: the caller is
a control plane that already checked the tenant. Thin: each route is one BackendService call, and its
errors go back as problem+json, which vrnic.backend.remote rebuilds into the same VrnicError.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict

from vrnic.api.problems import RESPONSES
from vrnic.backend.remote import AGENT_PREFIX
from vrnic.backend.service import BackendService
from vrnic.core.specs import AttachInfo, QosPolicy, VrnicMode, VrnicSpec
from vrnic.errors import Unauthenticated

agent_bearer = HTTPBearer(auto_error=False, scheme_name="AgentToken", description="the agents' shared token")


async def require_agent(request: Request,
                        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(agent_bearer)]) -> None:
    """Only another agent (or this host's own API) may call: the Bearer token is the agent token."""
    expected: str = request.app.state.agent_token
    given = credentials.credentials if credentials else ""
    if not given or not secrets.compare_digest(given.encode(), expected.encode()):
        raise Unauthenticated("the agent routes need the agent token (VRNIC_AGENT_TOKEN)")


async def local_backend(request: Request) -> BackendService:
    backend: BackendService = request.app.state.control_plane.backend
    return backend


Backend = Annotated[BackendService, Depends(local_backend)]


class VrnicIds(BaseModel):
    vrnic_ids: list[str]


class QosChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: VrnicMode
    qos: QosPolicy


# Not in the public OpenAPI document: an internal, host-to-host interface.
router = APIRouter(prefix=AGENT_PREFIX, tags=["agent"], dependencies=[Depends(require_agent)], responses=RESPONSES,
                   include_in_schema=False)


@router.post("/vrnics", status_code=status.HTTP_201_CREATED)
def create_vrnic(spec: VrnicSpec, backend: Backend) -> AttachInfo:
    return backend.create_vrnic(spec)


@router.delete("/vrnics/{vrnic_id}", status_code=status.HTTP_204_NO_CONTENT)
def release_vrnic(vrnic_id: str, backend: Backend) -> Response:
    backend.release_vrnic(vrnic_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/vrnics/{vrnic_id}/token")
def reissue_token(vrnic_id: str, backend: Backend) -> dict[str, str]:
    return {"token": backend.reissue_token(vrnic_id)}


@router.get("/vrnics")
def vrnic_ids(backend: Backend) -> VrnicIds:
    return VrnicIds(vrnic_ids=sorted(backend.vrnic_ids()))


@router.get("/attached")
def attached(backend: Backend) -> VrnicIds:
    return VrnicIds(vrnic_ids=sorted(backend.attached_vrnics()))


@router.put("/vrnics/{vrnic_id}/qos", status_code=status.HTTP_204_NO_CONTENT)
def set_qos(vrnic_id: str, body: QosChange, backend: Backend) -> Response:
    backend.set_qos(vrnic_id, body.mode, body.qos)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/counters")
def counters(backend: Backend) -> dict[str, dict[str, int]]:
    return backend.qos_counters()
