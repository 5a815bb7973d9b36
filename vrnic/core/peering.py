"""Who may connect to whom: VPC isolation, security groups and explicit peering (pure logic, no I/O).

A vRNIC reaches another vRNIC of its own VPC by default, and nothing else. A VPC's security group is a
list of rules naming peer tenants (their VPCs): `allow` opens the VPC to them, `deny` closes it, and a deny
always beats an allow. Peering across VPCs is explicit on both ends: each side's rules must allow the
other, so neither tenant can open a path into the other alone. Both agents of a cross-host connection
run this same check (MasQ's connect-time check, at each end).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

ANY_TENANT = "*"


@dataclass(frozen=True)
class Identity:
    """The parts of a vRNIC that decide reachability (and name it in the audit log)."""

    vrnic_id: str
    tenant: str
    vpc_id: int
    virtual_gid: str


class RuleAction(StrEnum):
    ALLOW = "allow"
    DENY = "deny"


@dataclass(frozen=True)
class SecurityRule:
    """A rule of owner_tenant's VPC about peers of peer_tenant's VPC ("*": every other VPC)."""

    owner_tenant: str
    action: RuleAction
    peer_tenant: str

    def names(self, tenant: str) -> bool:
        return self.peer_tenant in (ANY_TENANT, tenant)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str
    cross_vpc: bool = False  # worth an audit line even when allowed: a peering rule was used


SAME_VPC = Decision(True, "same VPC")


def _side(owner: Identity, other: Identity, rules: Iterable[SecurityRule]) -> tuple[bool, str]:
    """Whether owner's VPC lets `other` in, and why."""
    mine = [r for r in rules if r.owner_tenant == owner.tenant and r.names(other.tenant)]
    if any(r.action is RuleAction.DENY for r in mine):
        return False, f"VPC of tenant {owner.tenant} denies tenant {other.tenant}"
    if any(r.action is RuleAction.ALLOW for r in mine):
        return True, f"VPC of tenant {owner.tenant} allows tenant {other.tenant}"
    return False, f"VPC of tenant {owner.tenant} has no rule allowing tenant {other.tenant}"


def decide(asker: Identity, target: Identity, rules: Iterable[SecurityRule]) -> Decision:
    """May asker connect to target? Same tenant and VPC: yes. Otherwise both VPCs' rules must allow it."""
    if asker.tenant == target.tenant and asker.vpc_id == target.vpc_id:
        return SAME_VPC
    rules = list(rules)
    for owner, other in ((target, asker), (asker, target)):
        ok, why = _side(owner, other, rules)
        if not ok:
            return Decision(False, why, cross_vpc=True)
    return Decision(True, f"peering between the VPCs of tenants {asker.tenant} and {target.tenant}", cross_vpc=True)
