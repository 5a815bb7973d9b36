"""An in-memory Locator (what vrnic.db.locator.DbLocator answers from the database), for peering tests.

Tests fill it as the control plane would: which agent holds which virtual GID and device GID, the virtual
IPs, the security-group rules; it records what the registries audit.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vrnic.backend.peer_directory import AgentRef
from vrnic.core.peering import Identity, RuleAction, SecurityRule


@dataclass(frozen=True)
class Audited:
    action: str
    asker: Identity
    target: Identity | None
    detail: dict[str, Any]


@dataclass
class MemoryLocator:
    agents: dict[str, AgentRef] = field(default_factory=dict)  # virtual GID -> agent
    phys_agents: dict[str, AgentRef] = field(default_factory=dict)  # device GID -> agent
    ips: dict[tuple[int, str], str] = field(default_factory=dict)  # (VPC, IP) -> virtual GID
    security_rules: list[SecurityRule] = field(default_factory=list)
    events: list[Audited] = field(default_factory=list)
    rule_reads: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def place(self, agent: AgentRef, virtual_gid: str, phys_gid: str, vpc_id: int, ip: str | None = None) -> None:
        self.agents[virtual_gid] = agent
        self.phys_agents[phys_gid] = agent
        if ip is not None:
            self.ips[(vpc_id, ip)] = virtual_gid

    def allow(self, owner: str, peer: str) -> None:
        self.security_rules.append(SecurityRule(owner, RuleAction.ALLOW, peer))

    def agent_of(self, virtual_gid: str) -> AgentRef | None:
        return self.agents.get(virtual_gid)

    def agent_of_phys_gid(self, phys_gid: str) -> AgentRef | None:
        return self.phys_agents.get(phys_gid)

    def virtual_gid_of_ip(self, asker: Identity, ip: str) -> str | None:
        return self.ips.get((asker.vpc_id, ip))

    def rules(self) -> list[SecurityRule]:
        self.rule_reads += 1
        return list(self.security_rules)

    def audit(self, action: str, asker: Identity, target: Identity | None, detail: dict[str, Any]) -> None:
        with self.lock:
            self.events.append(Audited(action, asker, target, detail))

    def actions(self) -> list[tuple[str, str, str | None]]:
        with self.lock:
            return [(e.action, e.asker.vrnic_id, e.target.vrnic_id if e.target else None) for e in self.events]
