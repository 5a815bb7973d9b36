"""Which backend serves a vRNIC: this host's BackendService, or another host's agent over HTTP (RemoteBackend).

The control plane asks by host; a host that is down, or has no agent URL, is Unavailable at once (no
connection attempt), so a dead host costs a request nothing but the answer.
"""

from __future__ import annotations

import threading
from typing import Protocol

from vrnic.api.inventory import HostRef
from vrnic.backend.remote import RemoteBackend
from vrnic.backend.service import BackendService
from vrnic.core.specs import AttachInfo, QosPolicy, VrnicMode, VrnicSpec
from vrnic.errors import Unavailable


class VrnicBackend(Protocol):
    """The part of BackendService that vRNICs of any host need (RemoteBackend has the same)."""

    def create_vrnic(self, spec: VrnicSpec) -> AttachInfo: ...

    def release_vrnic(self, vrnic_id: str) -> None: ...

    def reissue_token(self, vrnic_id: str) -> str: ...

    def attached_vrnics(self) -> set[str]: ...

    def set_qos(self, vrnic_id: str, mode: VrnicMode, policy: QosPolicy) -> None: ...

    def qos_counters(self) -> dict[str, dict[str, int]]: ...


class Backends:
    def __init__(self, local: BackendService, local_host: str, agent_token: str | None) -> None:
        self.local = local
        self.local_host = local_host
        self._token = agent_token
        self._remote: dict[tuple[str, str], RemoteBackend] = {}
        self._lock = threading.Lock()

    def of(self, host: HostRef) -> VrnicBackend:
        if host.name == self.local_host:
            return self.local
        if not host.up:
            raise Unavailable(f"host {host.name} is down (its agent stopped beating)")
        if not host.api_url:
            raise Unavailable(f"host {host.name} has no agent URL (set VRNIC_ADVERTISE_URL there)")
        if self._token is None:
            raise Unavailable("no agent token on this host (set VRNIC_AGENT_TOKEN)")
        key = (host.name, host.api_url)
        with self._lock:
            remote = self._remote.get(key)
            if remote is None:
                remote = self._remote[key] = RemoteBackend(host.name, host.api_url, self._token)
            return remote

    def close(self) -> None:
        with self._lock:
            for remote in self._remote.values():
                remote.close()
            self._remote.clear()
