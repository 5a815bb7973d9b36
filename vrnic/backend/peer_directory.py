"""Peers on other hosts: how a vrnicd finds a virtual GID's agent and asks it for QPs and MRs.

The local Registry answers for vRNICs this vrnicd holds. Anything else is asked of a PeerDirectory,
which finds the owning host through a Locator (the shared database, see vrnic.db.locator) and asks
that host's agent (its /agent/v1 routes), which runs the same reachability check on its side.
The backend never touches the database itself: the Locator is handed in by the daemon.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from vrnic.core.peer_wire import (
    CmConnectAnswer,
    CmConnectQuery,
    IdentityWire,
    MrAnswer,
    MrQuery,
    QpAnswer,
    QpQuery,
    ReverseAnswer,
    ReverseQuery,
)
from vrnic.core.peering import Identity, SecurityRule
from vrnic.core.translate import MrWindow
from vrnic.errors import NotFound, Unavailable, VrnicError, error_from_dict

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)
_Answer = TypeVar("_Answer", bound=BaseModel)

LOOKUP_TIMEOUT_S = 5.0  # a peer lookup is one small query to another agent; longer means it is in trouble
CM_MARGIN_S = 2.0  # a connect request waits for the listener: its own timeout plus this


@dataclass(frozen=True)
class AgentRef:
    """A host's agent: its name and the base URL of its API (e.g. http://10.0.2.1:8470)."""

    host: str
    url: str


class Locator(Protocol):
    """What the control plane's store tells a vrnicd about the rest of the cluster."""

    def agent_of(self, virtual_gid: str) -> AgentRef | None:
        """The agent of the host holding the live vRNIC with this virtual GID; None if there is none."""

    def agent_of_phys_gid(self, phys_gid: str) -> AgentRef | None:
        """The agent of the host whose device has this physical GID (a UD sender's source)."""

    def virtual_gid_of_ip(self, asker: Identity, ip: str) -> str | None:
        """The virtual GID of the live vRNIC with virtual IP `ip` in asker's VPC; None if none."""

    def rules(self) -> list[SecurityRule]:
        """Every VPC's security-group rules (callers cache them for a short while)."""

    def audit(self, action: str, asker: Identity, target: Identity | None, detail: dict[str, Any]) -> None:
        """Write one audit event (e.g. "peer.refused") as the daemon."""


@dataclass(frozen=True)
class RemotePeer:
    """A vRNIC another host's vrnicd holds, as its agent described it: enough to program a QP towards it."""

    identity: Identity
    phys_gid: str  # the owner's device GID
    agent: AgentRef

    @property
    def vrnic_id(self) -> str:
        return self.identity.vrnic_id


class PeerDirectory(Protocol):
    """Peers held by other hosts. Each answer was checked by the owner (decide), else it is NotFound."""

    def peer_qp(self, asker: Identity, virtual_gid: str, vqpn: int) -> tuple[RemotePeer, int]:
        """The peer and the physical QPN behind (virtual_gid, vqpn); NotFound if none or unreachable."""

    def peer_mrs(self, asker: Identity, peer: RemotePeer) -> list[MrWindow]:
        """The MR windows the peer publishes now."""

    def virtual_qpn(self, asker: Identity, phys_gid: str, phys_qpn: int) -> int:
        """The virtual QPN of a remote QP seen as a UD source; 0 if unknown or unreachable."""

    def cm_connect(self, asker: Identity, virtual_gid: str, port: int, vqpn: int, private_data: bytes,
                   timeout: float) -> tuple[int, bytes]:
        """Ask the listener on (virtual_gid, port) to connect to asker's QP vqpn: (its vqpn, its private data)."""


class AgentDirectory:
    """A PeerDirectory over HTTP: each owner agent's /agent/v1 routes, with the agent token."""

    def __init__(self, locator: Locator, agent_token: str, timeout: float = LOOKUP_TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.locator = locator
        self.timeout = timeout
        self._agent_token, self._transport = agent_token, transport

    @functools.cached_property
    def _client(self) -> httpx.Client:
        # Made at the first lookup, not at the daemon's start: a client loads the CA bundle (0.5 s under TCG),
        # and a single-host daemon never asks another agent. httpx itself is imported here for the same reason.
        import httpx

        return httpx.Client(headers={"Authorization": f"Bearer {self._agent_token}"}, timeout=self.timeout,
                            transport=self._transport)

    def close(self) -> None:
        if "_client" in self.__dict__:
            self._client.close()

    def _agent(self, virtual_gid: str) -> AgentRef:
        agent = self.locator.agent_of(virtual_gid)
        if agent is None:
            raise NotFound(f"no reachable vRNIC with virtual GID {virtual_gid}")
        return agent

    def _post(self, agent: AgentRef, path: str, body: BaseModel, answer: type[_Answer],
              timeout: float | None = None) -> _Answer:
        import httpx  # loaded by _client already

        url = agent.url.rstrip("/") + path
        try:
            reply = self._client.post(url, content=body.model_dump_json(),
                                      headers={"Content-Type": "application/json"},
                                      timeout=timeout if timeout is not None else self.timeout)
        except httpx.HTTPError as exc:
            raise Unavailable(f"the agent of host {agent.host} ({agent.url}) cannot be reached: {exc}") from exc
        if reply.status_code == 200:
            try:
                return answer.model_validate_json(reply.content)
            except ValidationError as exc:
                raise Unavailable(f"the agent of host {agent.host} sent an unreadable answer to {path}") from exc
        raise agent_problem(agent, reply)

    def peer_qp(self, asker: Identity, virtual_gid: str, vqpn: int) -> tuple[RemotePeer, int]:
        agent = self._agent(virtual_gid)
        found = self._post(agent, "/agent/v1/peers/qp",
                           QpQuery(asker=IdentityWire.of(asker), virtual_gid=virtual_gid, vqpn=vqpn), QpAnswer)
        if found.target.virtual_gid != virtual_gid:
            raise Unavailable(f"the agent of host {agent.host} answered for {found.target.virtual_gid}, "
                              f"not {virtual_gid}")
        return RemotePeer(found.target.identity(), found.phys_gid, agent), found.phys_qpn

    def peer_mrs(self, asker: Identity, peer: RemotePeer) -> list[MrWindow]:
        found = self._post(peer.agent, "/agent/v1/peers/mrs",
                           MrQuery(asker=IdentityWire.of(asker), virtual_gid=peer.identity.virtual_gid), MrAnswer)
        return [w.window() for w in found.windows]

    def virtual_qpn(self, asker: Identity, phys_gid: str, phys_qpn: int) -> int:
        agent = self.locator.agent_of_phys_gid(phys_gid)
        if agent is None:
            return 0
        found = self._post(agent, "/agent/v1/peers/reverse",
                           ReverseQuery(asker=IdentityWire.of(asker), phys_gid=phys_gid, phys_qpn=phys_qpn),
                           ReverseAnswer)
        return found.vqpn

    def cm_connect(self, asker: Identity, virtual_gid: str, port: int, vqpn: int, private_data: bytes,
                   timeout: float) -> tuple[int, bytes]:
        agent = self._agent(virtual_gid)
        query = CmConnectQuery(asker=IdentityWire.of(asker), virtual_gid=virtual_gid, port=port, vqpn=vqpn,
                               private_data=private_data.hex(), timeout_ms=max(1, round(timeout * 1000)))
        found = self._post(agent, "/agent/v1/cm/connect", query, CmConnectAnswer, timeout=timeout + CM_MARGIN_S)
        return found.vqpn, bytes.fromhex(found.private_data)


def agent_problem(agent: AgentRef, reply: httpx.Response) -> VrnicError:
    """The owner agent's problem+json as the VrnicError it was there (401/403: our token, a setup fault)."""
    if reply.status_code in (401, 403):
        return Unavailable(f"the agent of host {agent.host} refused this agent's token ({reply.status_code})")
    try:
        body = reply.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("code"), str):
        return Unavailable(f"the agent of host {agent.host} answered {reply.status_code}")
    if reply.status_code >= 500:
        log.warning("agent of host %s: %s %s", agent.host, reply.status_code, body.get("detail"))
    return error_from_dict({**body, "message": str(body.get("detail", ""))})
