"""The Locator a vrnicd uses to find the rest of the cluster (vrnic.backend.peer_directory), read from the
control plane's database: which host's agent holds a virtual GID, a physical GID or a virtual IP, the
security-group rules, and the audit log for what the agents decide.

Only hosts that are up are named: a vRNIC of a host that is down is as unreachable as one that is gone.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from sqlalchemy import Engine, select

from vrnic.backend.peer_directory import AgentRef
from vrnic.core.peering import Identity, RuleAction, SecurityRule
from vrnic.core.vaddr import parse_virtual_gid
from vrnic.db.tables import Device, Host, Tenant, Vrnic, vrnic_is_live
from vrnic.db.tables import SecurityRule as RuleRow
from vrnic.db.unit_of_work import DAEMON_ACTOR, Database
from vrnic.errors import InvalidArgument

_UP = "up"


def _canonical_gid(gid: str) -> str | None:
    try:
        return str(ipaddress.IPv6Address(gid))
    except ValueError:
        return None


class DbLocator:
    def __init__(self, engine: Engine) -> None:
        self.db = Database(engine)

    def agent_of(self, virtual_gid: str) -> AgentRef | None:
        try:
            _, serial = parse_virtual_gid(virtual_gid)
        except InvalidArgument:
            return None
        with self.db.read() as uow:
            row = uow.session.execute(
                select(Vrnic.virtual_gid, Host.name, Host.api_url, Host.state).join(Host, Host.id == Vrnic.host_id)
                .where(Vrnic.serial == serial, vrnic_is_live(Vrnic.state))).first()
        if row is None or _canonical_gid(row.virtual_gid) != _canonical_gid(virtual_gid):
            return None
        return AgentRef(row.name, row.api_url) if row.state == _UP and row.api_url else None

    def agent_of_phys_gid(self, phys_gid: str) -> AgentRef | None:
        wanted = _canonical_gid(phys_gid)
        if wanted is None:
            return None
        with self.db.read() as uow:
            rows = uow.session.execute(
                select(Device.ports, Host.name, Host.api_url).join(Host, Host.id == Device.host_id)
                .where(Device.present, Host.state == _UP, Host.api_url.is_not(None))).all()
        for ports, host, url in rows:
            for port in ports or []:
                if any(_canonical_gid(str(entry.get("gid", ""))) == wanted for entry in port.get("gids", [])):
                    return AgentRef(host, url)
        return None

    def virtual_gid_of_ip(self, asker: Identity, ip: str) -> str | None:
        try:
            address = str(ipaddress.IPv4Address(ip))
        except ValueError:
            return None
        with self.db.read() as uow:
            found: str | None = uow.session.scalar(
                select(Vrnic.virtual_gid).join(Tenant, Tenant.id == Vrnic.tenant_id)
                .where(Tenant.name == asker.tenant, Tenant.vpc_id == asker.vpc_id, Vrnic.virtual_ip == address,
                       vrnic_is_live(Vrnic.state)))
        return found

    def rules(self) -> list[SecurityRule]:
        with self.db.read() as uow:
            rows = uow.session.execute(select(Tenant.name, RuleRow.action, RuleRow.peer_tenant)
                                       .join(Tenant, Tenant.id == RuleRow.tenant_id).order_by(RuleRow.id)).all()
        return [SecurityRule(owner, RuleAction(action), peer) for owner, action, peer in rows]

    def audit(self, action: str, asker: Identity, target: Identity | None, detail: dict[str, Any]) -> None:
        """One event as the daemon, about the asking vRNIC (in its tenant's log); the target is in the detail."""
        with self.db.write(DAEMON_ACTOR) as uow:
            tenant_id = uow.session.scalar(select(Tenant.id).where(Tenant.name == asker.tenant))
            described: dict[str, Any] = {"asker": _identity(asker), **detail}
            if target is not None:
                described["target"] = _identity(target)
            uow.record(action, f"vrnic/{asker.vrnic_id}", tenant_id, described)


def _identity(who: Identity) -> dict[str, Any]:
    return {"vrnic_id": who.vrnic_id, "tenant": who.tenant, "vpc_id": who.vpc_id, "virtual_gid": who.virtual_gid}
