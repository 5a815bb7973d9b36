"""Security groups: each tenant's VPC has rules allowing or denying peers of other tenants' VPCs.

A tenant manages its own VPC's rules, the operator anyone's; every change is in the audit log. The agents
read them (vrnic.db.locator) and decide at connect time with vrnic.core.peering.decide.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from vrnic.api.auth import Principal
from vrnic.api.converters import security_rule_out
from vrnic.api.pagination import PageRequest
from vrnic.api.schemas import Page, SecurityRuleCreate, SecurityRuleOut
from vrnic.api.tenants import find_tenant
from vrnic.db.tables import SecurityRule, Tenant
from vrnic.db.unit_of_work import Database
from vrnic.errors import Conflict, InvalidArgument, NotFound, PermissionDenied


class SecurityRules:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, principal: Principal, body: SecurityRuleCreate) -> SecurityRuleOut:
        try:
            with self.db.write(principal.actor) as uow:
                s = uow.session
                if principal.is_operator:
                    if body.tenant is None:
                        raise InvalidArgument("the operator adds a rule to a tenant's VPC: give `tenant`")
                    tenant = find_tenant(s, body.tenant)
                else:
                    if body.tenant is not None and body.tenant != principal.tenant_name:
                        raise PermissionDenied("a tenant manages only its own VPC's rules")
                    tenant = find_tenant(s, str(principal.tenant_name))
                if body.peer_tenant == tenant.name:
                    raise InvalidArgument("a VPC always reaches itself: a rule names another tenant, or *")
                existing = s.scalar(select(SecurityRule.id).where(
                    SecurityRule.tenant_id == tenant.id, SecurityRule.action == body.action.value,
                    SecurityRule.peer_tenant == body.peer_tenant))
                if existing is not None:
                    raise Conflict(f"tenant {tenant.name} already has rule {existing}: {body.action} "
                                   f"{body.peer_tenant}", current_state="exists")
                rule = SecurityRule(tenant_id=tenant.id, action=body.action.value, peer_tenant=body.peer_tenant)
                s.add(rule)
                s.flush()
                uow.record("security_rule.create", f"security-rule/{rule.id}", tenant.id,
                           {"action": rule.action, "peer_tenant": rule.peer_tenant})
                return security_rule_out(rule, tenant=tenant.name)
        except IntegrityError as exc:  # the same rule, added concurrently
            raise Conflict(f"that rule already exists: {body.action} {body.peer_tenant}",
                           current_state="exists") from exc

    def list(self, principal: Principal, cursor: str | None, limit: int, *,
             tenant: str | None = None) -> Page[SecurityRuleOut]:
        """The rules a caller may see (a tenant: its own VPC's), oldest first."""
        request = PageRequest.parse(cursor, limit)
        query = select(SecurityRule, Tenant.name).join(Tenant, Tenant.id == SecurityRule.tenant_id)
        with self.db.read() as uow:
            if not principal.is_operator:
                query = query.where(SecurityRule.tenant_id == principal.tenant_id)
            if tenant is not None:
                if principal.is_operator:
                    find_tenant(uow.session, tenant)
                query = query.where(Tenant.name == tenant)
            rows = uow.session.execute(request.window(query, SecurityRule.id)).tuples()
            return request.page(rows, lambda found: found[0].id,
                                lambda found: security_rule_out(found[0], tenant=found[1]))

    def delete(self, principal: Principal, rule_id: int) -> None:
        with self.db.write(principal.actor) as uow:
            query = select(SecurityRule).where(SecurityRule.id == rule_id)
            if not principal.is_operator:  # another tenant's rule looks like one that does not exist
                query = query.where(SecurityRule.tenant_id == principal.tenant_id)
            rule = uow.session.scalar(query.with_for_update())
            if rule is None:
                raise NotFound(f"no security rule {rule_id}")
            uow.record("security_rule.delete", f"security-rule/{rule.id}", rule.tenant_id,
                       {"action": rule.action, "peer_tenant": rule.peer_tenant})
            uow.session.delete(rule)
