"""Peers on other hosts: how a vrnicd finds a virtual GID's agent and asks it for QPs and MRs.

The local Registry answers for vRNICs this vrnicd holds. Anything else is asked of a PeerDirectory,
which finds the owning host through a Locator (the shared database, see vrnic.db.locator) and asks
that host's agent (its /agent/v1 routes), which runs the same reachability check on its side.
The backend never touches the database itself: the Locator is handed in by the daemon.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from vrnic.core.peering import Identity, SecurityRule


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

