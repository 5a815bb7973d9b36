"""Another host's backend, through its agent's /agent/v1 routes (vrnic.api.agent): the subset of
BackendService the control plane uses for vRNICs placed elsewhere.

Errors come back as the VrnicError the agent raised (its problem+json, rebuilt); an agent that cannot be
reached is Unavailable (503), never a hang: connecting gives up after a few seconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vrnic.core.specs import AttachInfo, QosPolicy, VrnicMode, VrnicSpec
from vrnic.errors import Unavailable, VrnicError, error_from_dict

if TYPE_CHECKING:
    import httpx

AGENT_PREFIX = "/agent/v1"
_TIMEOUT_S, _CONNECT_TIMEOUT_S = 30.0, 3.0


class RemoteBackend:
    def __init__(self, host: str, url: str, token: str, *, transport: httpx.BaseTransport | None = None) -> None:
        self.host = host
        self.url = url.rstrip("/")
        # httpx is imported here, not with the module: the API imports this module, and a daemon that never
        # reaches another host should not pay httpx's import (with its CLI's rich) at every start
        import httpx

        self._http = httpx.Client(base_url=self.url + AGENT_PREFIX, transport=transport,
                                  timeout=httpx.Timeout(_TIMEOUT_S, connect=_CONNECT_TIMEOUT_S),
                                  headers={"Authorization": f"Bearer {token}"})

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        import httpx  # loaded by __init__ already

        try:
            response = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise Unavailable(f"the agent of host {self.host} ({self.url}) is unreachable: {exc}") from exc
        if response.status_code >= 400:
            raise _error(response, self.host)
        return response.json() if response.content else None

    def create_vrnic(self, spec: VrnicSpec) -> AttachInfo:
        return AttachInfo.model_validate(self._call("POST", "/vrnics", spec.model_dump(mode="json")))

    def release_vrnic(self, vrnic_id: str) -> None:
        self._call("DELETE", f"/vrnics/{vrnic_id}")

    def reissue_token(self, vrnic_id: str) -> str:
        return str(self._call("POST", f"/vrnics/{vrnic_id}/token")["token"])

    def vrnic_ids(self) -> set[str]:
        return set(self._call("GET", "/vrnics")["vrnic_ids"])

    def attached_vrnics(self) -> set[str]:
        return set(self._call("GET", "/attached")["vrnic_ids"])

    def set_qos(self, vrnic_id: str, mode: VrnicMode, policy: QosPolicy) -> None:
        self._call("PUT", f"/vrnics/{vrnic_id}/qos", {"mode": mode.value, "qos": policy.model_dump(mode="json")})

    def qos_counters(self) -> dict[str, dict[str, int]]:
        counted: dict[str, dict[str, int]] = self._call("GET", "/counters")
        return counted

    def close(self) -> None:
        self._http.close()


def _error(response: httpx.Response, host: str) -> VrnicError:
    try:
        problem = response.json()
    except ValueError:
        problem = None
    if not isinstance(problem, dict) or "code" not in problem:
        # not the agent answering (a proxy, another service on that port)
        return Unavailable(f"the agent of host {host} answered {response.status_code}: {response.text[:200]}")
    if problem["code"] in ("unauthenticated", "permission_denied"):
        return Unavailable(f"the agent of host {host} refused this host's agent token (VRNIC_AGENT_TOKEN must be "
                           "the same on every host)")
    return error_from_dict({**problem, "message": f"host {host}: {problem.get('detail', 'request failed')}"})
