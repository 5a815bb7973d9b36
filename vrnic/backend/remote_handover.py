"""The destination's vrnicd and the peer hosts' vrnicds of a cross-host hand-over, through their agents'
/agent/v1/handover and /agent/v1/moving routes (vrnic.api.agent_handover), with the agent token.

The source's side (vrnic.backend.vm_handover) sees HandoverDestination and PeerHost; these speak HTTP with
the JSON forms of vrnic.core.handover. An agent that cannot be reached is Unavailable; its problem+json comes
back as the VrnicError it raised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vrnic.backend.peer_directory import AgentRef, agent_problem
from vrnic.core.handover import Arrival, PeerQpStatus, QpCarry, pages_to_wire
from vrnic.core.session_state import SessionSnapshot
from vrnic.core.specs import VmBinding, VrnicSpec
from vrnic.errors import Unavailable

if TYPE_CHECKING:
    import httpx

# A take-over connects every QP and registers what changed since the pre-setup: seconds on a loaded host.
HANDOVER_TIMEOUT_S, HANDOVER_CONNECT_TIMEOUT_S = 60.0, 3.0


class AgentClient:
    def __init__(self, agent: AgentRef, token: str, transport: httpx.BaseTransport | None = None) -> None:
        import httpx  # when a hand-over needs it, not at the daemon's start (see vrnic.backend.remote)

        self.agent = agent
        self._http = httpx.Client(base_url=agent.url.rstrip("/") + "/agent/v1",
                                  timeout=httpx.Timeout(HANDOVER_TIMEOUT_S, connect=HANDOVER_CONNECT_TIMEOUT_S),
                                  transport=transport, headers={"Authorization": f"Bearer {token}"})

    def call(self, method: str, path: str, body: Any = None) -> Any:
        import httpx  # loaded by __init__ already

        try:
            reply = self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise Unavailable(f"the agent of host {self.agent.host} ({self.agent.url}) cannot be reached: "
                              f"{exc}") from exc
        if reply.status_code >= 400:
            raise agent_problem(self.agent, reply)
        return reply.json() if reply.content else None

    def close(self) -> None:
        self._http.close()


class AgentDestination:
    """HandoverDestination: the destination host's vrnicd."""

    def __init__(self, client: AgentClient, device: str | None = None) -> None:
        self.client = client
        self.device = device

    def accept(self, domain: str, specs: list[VrnicSpec], binding: VmBinding,
               snapshots: dict[str, SessionSnapshot]) -> dict[str, Any]:
        answer: dict[str, Any] = self.client.call("POST", f"/handover/{domain}", {
            "specs": [s.model_dump(mode="json") for s in specs], "binding": binding.model_dump(mode="json"),
            "snapshots": {k: v.to_dict() for k, v in snapshots.items()}, "device": self.device})
        return answer

    def preconnect(self, domain: str, vrnic_id: str, wires: list[dict[str, Any]]) -> int:
        return int(self.client.call("POST", f"/handover/{domain}/preconnect",
                                    {"vrnic_id": vrnic_id, "wires": wires})["preconnected"])

    def pages(self, domain: str, runs: list[tuple[int, bytes]]) -> None:
        self.client.call("POST", f"/handover/{domain}/pages", {"runs": pages_to_wire(runs)})

    def take_over(self, domain: str, snapshots: dict[str, SessionSnapshot], carried: dict[str, list[QpCarry]],
                  live_peers: dict[str, list[int]]) -> dict[str, Any]:
        answer: dict[str, Any] = self.client.call("POST", f"/handover/{domain}/take-over", {
            "snapshots": {k: v.to_dict() for k, v in snapshots.items()},
            "carried": {k: [c.to_dict() for c in v] for k, v in carried.items()}, "live_peers": live_peers})
        answer["agent"] = {"host": self.client.agent.host, "url": self.client.agent.url}  # whom peers re-point to
        return answer

    def release(self, domain: str) -> None:
        self.client.call("POST", f"/handover/{domain}/release")

    def abort(self, domain: str) -> None:
        self.client.call("DELETE", f"/handover/{domain}")


class AgentPeerHost:
    """PeerHost: a host with peers of the moving vRNIC (its PeerService)."""

    def __init__(self, client: AgentClient) -> None:
        self.client = client

    def track(self, vrnic_id: str) -> None:
        self.client.call("POST", f"/moving/{vrnic_id}")

    def shadows(self, vrnic_id: str, wanted: dict[int, tuple[str, int]]) -> dict[int, dict[str, Any]]:
        answer = self.client.call("POST", f"/moving/{vrnic_id}/shadows",
                                  {"wanted": {str(k): list(v) for k, v in wanted.items()}})
        return {int(k): v for k, v in answer["shadows"].items()}

    def hold(self, vrnic_id: str) -> list[PeerQpStatus]:
        answer = self.client.call("POST", f"/moving/{vrnic_id}/hold")
        return [PeerQpStatus.from_dict(s) for s in answer["qps"]]

    def status(self, vrnic_id: str) -> tuple[list[PeerQpStatus], list[tuple[int, int]]]:
        answer = self.client.call("GET", f"/moving/{vrnic_id}")
        return ([PeerQpStatus.from_dict(s) for s in answer["qps"]],
                [(int(a), int(n)) for a, n in answer["dirty"]])

    def moved(self, vrnic_id: str, virtual_gid: str, arrival: Arrival | None = None) -> int:
        body = {"virtual_gid": virtual_gid, "arrival": None if arrival is None else arrival.to_dict()}
        return int(self.client.call("POST", f"/moving/{vrnic_id}/moved", body)["repointed"])

    def release(self, vrnic_id: str) -> None:
        self.client.call("DELETE", f"/moving/{vrnic_id}")
