"""Tenants and their bearer tokens, and who a token belongs to (operator only, authentication aside)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from vrnic.api.auth import OPERATOR, Principal, TokenCache, hash_token, is_operator_token, new_tenant_token
from vrnic.api.converters import tenant_out, token_out
from vrnic.api.pagination import PageRequest
from vrnic.api.schemas import Page, TenantCreate, TenantCreated, TenantOut, TenantUpdate, TokenIssued, TokenOut
from vrnic.db.tables import ApiToken, Tenant, Vrnic, utcnow, vrnic_is_live
from vrnic.db.unit_of_work import Database
from vrnic.errors import Conflict, NotFound, Unauthenticated


def find_tenant(s: Session, name: str) -> Tenant:
    tenant = s.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise NotFound(f"no tenant {name}")
    return tenant


def live_vrnics(s: Session, tenant_id: int) -> int:
    return s.scalar(select(func.count()).select_from(Vrnic)
                    .where(Vrnic.tenant_id == tenant_id, vrnic_is_live(Vrnic.state))) or 0


class Tenants:
    def __init__(self, db: Database, operator_token: str) -> None:
        self.db = db
        self._operator_token = operator_token
        self._tokens = TokenCache()

    # -- authentication ---------------------------------------------------------------------------

    def cached_principal(self, token: str | None) -> Principal | None:
        """The caller if it is known without a database read (operator, recently seen tenant token)."""
        if not token:
            return None
        if is_operator_token(token, self._operator_token):
            return OPERATOR
        return self._tokens.get(hash_token(token))

    def authenticate(self, token: str | None) -> Principal:
        if not token:
            raise Unauthenticated("missing bearer token (Authorization: Bearer <token>)")
        known = self.cached_principal(token)
        if known is not None:
            return known
        digest = hash_token(token)
        with self.db.read() as uow:
            row = uow.session.execute(select(Tenant.id, Tenant.name).join(ApiToken, ApiToken.tenant_id == Tenant.id)
                                      .where(ApiToken.token_hash == digest, ApiToken.revoked_at.is_(None))).first()
        if row is None:
            raise Unauthenticated("invalid or revoked token")
        principal = Principal.tenant(row.id, row.name)
        self._tokens.put(digest, principal)
        return principal

    # -- tenants ----------------------------------------------------------------------------------

    def create_tenant(self, principal: Principal, body: TenantCreate) -> TenantCreated:
        principal.require_operator()
        token = new_tenant_token()
        try:
            with self.db.write(principal.actor) as uow:
                s = uow.session
                if s.scalar(select(Tenant.id).where(Tenant.name == body.name)) is not None:
                    raise Conflict(f"tenant {body.name} already exists", current_state="exists")
                vpc_id = body.vpc_id
                if vpc_id is None:
                    vpc_id = (s.scalar(select(func.max(Tenant.vpc_id))) or 0) + 1
                elif s.scalar(select(Tenant.id).where(Tenant.vpc_id == vpc_id)) is not None:
                    raise Conflict(f"VPC id {vpc_id} belongs to another tenant", current_state="in_use")
                tenant = Tenant(name=body.name, vpc_id=vpc_id, default_quota=body.default_quota.model_dump(),
                                max_vrnics=body.max_vrnics, vpc_cidr=body.vpc_cidr)
                s.add(tenant)
                s.flush()
                s.add(ApiToken(tenant_id=tenant.id, token_hash=hash_token(token), prefix=token[:12]))
                uow.record("tenant.create", f"tenant/{tenant.name}", tenant.id,
                           {"vpc_id": vpc_id, "max_vrnics": body.max_vrnics})
                return TenantCreated(**tenant_out(tenant, 0).model_dump(), token=token)
        except IntegrityError as exc:  # a concurrent create of the same name or VPC won
            raise Conflict(f"tenant {body.name} or VPC id {body.vpc_id} already exists",
                           current_state="exists") from exc

    def list_tenants(self, principal: Principal, cursor: str | None, limit: int) -> Page[TenantOut]:
        principal.require_operator()
        request = PageRequest.parse(cursor, limit)
        with self.db.read() as uow:
            s = uow.session
            rows = s.scalars(request.window(select(Tenant), Tenant.id))
            return request.page(rows, lambda t: t.id, lambda t: tenant_out(t, live_vrnics(s, t.id)))

    def get_tenant(self, principal: Principal, name: str) -> TenantOut:
        principal.require_operator()
        with self.db.read() as uow:
            tenant = find_tenant(uow.session, name)
            return tenant_out(tenant, live_vrnics(uow.session, tenant.id))

    def update_tenant(self, principal: Principal, name: str, body: TenantUpdate) -> TenantOut:
        principal.require_operator()
        with self.db.write(principal.actor) as uow:
            tenant = find_tenant(uow.session, name)
            if body.default_quota is not None:
                tenant.default_quota = body.default_quota.model_dump()
            if body.unlimited:
                tenant.max_vrnics = None
            elif body.max_vrnics is not None:
                tenant.max_vrnics = body.max_vrnics
            uow.record("tenant.update", f"tenant/{name}", tenant.id,
                       body.model_dump(mode="json", exclude_defaults=True))
            return tenant_out(tenant, live_vrnics(uow.session, tenant.id))

    def delete_tenant(self, principal: Principal, name: str) -> None:
        """Delete a tenant with no live vRNICs (its released vRNICs and tokens go with it)."""
        principal.require_operator()
        with self.db.write(principal.actor) as uow:
            s = uow.session
            tenant = find_tenant(s, name)
            live = live_vrnics(s, tenant.id)
            if live:
                raise Conflict(f"tenant {name} still has {live} live vRNIC(s); release them first",
                               current_state="has_vrnics")
            for row in s.scalars(select(Vrnic).where(Vrnic.tenant_id == tenant.id)):
                s.delete(row)
            s.flush()
            uow.record("tenant.delete", f"tenant/{name}", None, {"vpc_id": tenant.vpc_id})
            s.delete(tenant)
        self._tokens.forget_tenant(tenant.id)

    # -- tokens -----------------------------------------------------------------------------------

    def issue_token(self, principal: Principal, name: str) -> TokenIssued:
        principal.require_operator()
        token = new_tenant_token()
        with self.db.write(principal.actor) as uow:
            tenant = find_tenant(uow.session, name)
            row = ApiToken(tenant_id=tenant.id, token_hash=hash_token(token), prefix=token[:12])
            uow.session.add(row)
            uow.record("token.issue", f"tenant/{name}", tenant.id, {"prefix": row.prefix})
            return TokenIssued(**token_out(row).model_dump(), token=token)

    def list_tokens(self, principal: Principal, name: str) -> list[TokenOut]:
        principal.require_operator()
        with self.db.read() as uow:
            tenant = find_tenant(uow.session, name)
            rows = uow.session.scalars(select(ApiToken).where(ApiToken.tenant_id == tenant.id).order_by(ApiToken.id))
            return [token_out(r) for r in rows]

    def revoke_token(self, principal: Principal, name: str, token_id: int) -> TokenOut:
        principal.require_operator()
        with self.db.write(principal.actor) as uow:
            tenant = find_tenant(uow.session, name)
            row = uow.session.scalar(select(ApiToken).where(ApiToken.id == token_id, ApiToken.tenant_id == tenant.id))
            if row is None:
                raise NotFound(f"tenant {name} has no token {token_id}")
            if row.revoked_at is not None:
                raise Conflict(f"token {token_id} is already revoked", current_state="revoked")
            row.revoked_at = utcnow()
            uow.record("token.revoke", f"tenant/{name}", tenant.id, {"prefix": row.prefix})
            out = token_out(row)
        self._tokens.forget_tenant(tenant.id)
        return out
