"""The vRNIC lifecycle: allocate, read, release, and the attach state vrnicd observes.

Attach and detach are never what a client says: on every read the state is what the backend observes
now (a guest attached or not), and a change is persisted with an audit event (actor daemon).

Multi-host: allocate places on the least loaded device of the up hosts (or the `host` asked for); a device's
cap holds across API servers because its row is locked, then its live vRNICs counted, in the allocating
transaction. A vRNIC of another host is created, released and shaped through that host's agent; one of a
host that is down is shown unreachable and is never reallocated.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, fields
from typing import Any, TypeVar, cast

from sqlalchemy import Connection, Select, Table, and_, bindparam, false, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from vrnic.api.auth import Principal
from vrnic.api.backends import Backends, VrnicBackend
from vrnic.api.converters import VrnicRecord, vrnic_out
from vrnic.api.inventory import UP, HostRef, Inventory
from vrnic.api.pagination import PageRequest
from vrnic.api.schemas import Page, VrnicCounters, VrnicCreate, VrnicOut
from vrnic.api.tenants import find_tenant, live_vrnics
from vrnic.api.transactions import Transactions
from vrnic.backend.driver import drivers_serving
from vrnic.backend.service import BackendService
from vrnic.core.lifecycle import VrnicAction, VrnicState, check_vrnic_count, next_state, observed_state
from vrnic.core.placement import Candidate, choose
from vrnic.core.qos import RateMeter
from vrnic.core.recovery import RecoveryPlan, plan_recovery, token_digest
from vrnic.core.specs import DataEngine, QosPolicy, Quota, VrnicMode, VrnicSpec
from vrnic.core.vaddr import check_virtual_ip, first_free_virtual_ip, make_virtual_gid, next_virtual_ip
from vrnic.db.prepared import Prepared
from vrnic.db.tables import Device, Host, Tenant, Vrnic, utcnow, vrnic_is_live
from vrnic.db.unit_of_work import DAEMON_ACTOR, UnitOfWork
from vrnic.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    NotSupported,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    VrnicError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
Observed = tuple[T, bool]  # (what a read shows, whether the observed attach state differs from the stored one)
_ATTACHABLE = [VrnicState.ALLOCATED.value, VrnicState.DETACHED.value, VrnicState.LOST.value]


_RECORD_FIELDS = frozenset(f.name for f in fields(VrnicRecord))
_IP_RETRIES = 8  # concurrent allocations of one tenant may pick the same next address: the loser picks again


@dataclass(frozen=True)
class Placement:
    host: HostRef
    device: str | None  # None: the host's backend picks (this host, no caps anywhere: today's fast path)
    device_id: int | None


class Replayed(Exception):
    """Internal: an Idempotency-Key matched an earlier allocation."""

    def __init__(self, serial: int) -> None:
        self.serial = serial


def visible(query: Select[tuple[Vrnic, str]], principal: Principal) -> Select[tuple[Vrnic, str]]:
    """query limited to what principal may see (a tenant: its own vRNICs)."""
    return query if principal.is_operator else query.where(Vrnic.tenant_id == principal.tenant_id)


def find_vrnic(s: Session, principal: Principal, vrnic_id: str, *, for_update: bool = False) -> tuple[Vrnic, str]:
    """(the vRNIC, its tenant's name); another tenant's vRNIC looks exactly like one that does not exist."""
    query = visible(_WITH_TENANT.where(Vrnic.public_id == vrnic_id), principal)
    found = s.execute(query.with_for_update(of=Vrnic) if for_update else query).tuples().first()
    if found is None:
        raise NotFound(f"no vRNIC {vrnic_id}")
    return found


_WITH_TENANT = select(Vrnic, Tenant.name).join(Tenant, Tenant.id == Vrnic.tenant_id)
_VRNICS = cast(Table, Vrnic.__table__)
# The allocation's statements run Prepared, on the DBAPI cursor: Connection.execute cost 5x SQLite's own work
_INSERT_VRNIC = Prepared(insert(_VRNICS).returning(_VRNICS.c.serial))
_PLACE_VRNIC = Prepared(update(_VRNICS).where(_VRNICS.c.serial == bindparam("b_serial")))
_TENANTS = cast(Table, Tenant.__table__)
_TENANT_BY_ID = Prepared(select(_TENANTS).where(_TENANTS.c.id == bindparam("b_id")))
_FIND_FOR_UPDATE = (select(_VRNICS, _TENANTS.c.name.label("tenant_name"))
                    .join(_TENANTS, _TENANTS.c.id == _VRNICS.c.tenant_id)
                    .where(_VRNICS.c.public_id == bindparam("b_id")).with_for_update(of=_VRNICS))
_FIND_TENANTS_FOR_UPDATE = _FIND_FOR_UPDATE.where(_VRNICS.c.tenant_id == bindparam("b_tenant"))  # built once too
_LIVE = vrnic_is_live(_VRNICS.c.state)
_LIVE_ORM = vrnic_is_live(Vrnic.state)
_DEVICES = cast(Table, Device.__table__)
_HOSTS = cast(Table, Host.__table__)
# Core columns, not ORM attributes: an ORM-enabled select goes through the ORM's loading machinery
_CANDIDATES = (select(_DEVICES.c.id, _DEVICES.c.name, _DEVICES.c.max_vrnics, _DEVICES.c.driver,
                      _HOSTS.c.id.label("host_id"), _HOSTS.c.name.label("host_name"), _HOSTS.c.api_url,
                      _HOSTS.c.state)
               .join(_HOSTS, _HOSTS.c.id == _DEVICES.c.host_id).where(_DEVICES.c.present, _HOSTS.c.state == UP))
_LIVE_ON_DEVICE = select(func.count()).select_from(_VRNICS).where(_VRNICS.c.device_id == bindparam("b_device"),
                                                                  _LIVE)
_NEWEST_IP = Prepared(select(_VRNICS.c.virtual_ip).where(_VRNICS.c.tenant_id == bindparam("b_tenant"), _LIVE,
                                                          _VRNICS.c.virtual_ip.is_not(None))
                      .order_by(_VRNICS.c.serial.desc()).limit(1))
_IP_HOLDER = select(_VRNICS.c.public_id).where(_VRNICS.c.tenant_id == bindparam("b_tenant"), _LIVE,
                                               _VRNICS.c.virtual_ip == bindparam("b_ip"))


@functools.cache
def _candidates_for(mode: VrnicMode) -> Select[Any]:
    """The present devices of up hosts that serve mode; built once per mode, so its cache key is computed once
    (SQLAlchemy memoizes it on the statement object: rebuilding it per request cost a fifth of an allocation)."""
    # one `driver = ?` per name, not IN (...): an IN list is expanded again at every execution
    return _CANDIDATES.where(or_(false(), *(_DEVICES.c.driver == name for name in sorted(drivers_serving(mode)))))


@functools.cache
def _prepared_candidates(mode: VrnicMode) -> Prepared:
    return Prepared(_candidates_for(mode))


@dataclass(frozen=True, slots=True)
class TenantFacts:
    """What an allocation reads of its tenant (a plain record: an ORM instance costs more than the query)."""

    id: int
    name: str
    vpc_id: int
    vpc_cidr: str
    max_vrnics: int | None
    default_quota: dict[str, Any]

    @classmethod
    def of(cls, row: Any) -> TenantFacts:
        return cls(row.id, row.name, row.vpc_id, row.vpc_cidr, row.max_vrnics, row.default_quota)


def _request_hash(body: VrnicCreate) -> str:
    """What an Idempotency-Key's retry must carry again (kept only with a key: hashing costs every request)."""
    # The default engine is left out, so a key recorded before `engine` existed still matches its retry.
    request = body.model_dump(mode="json", exclude={"engine"} if body.engine is DataEngine.RING else None)
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()


class Vrnics:
    def __init__(self, tx: Transactions, backend: BackendService, inventory: Inventory,
                 backends: Backends | None = None) -> None:
        self.tx = tx
        self.backend = backend
        self.inventory = inventory
        self.backends = backends or Backends(backend, inventory.host_name, None)
        self.meter = RateMeter()

    # -- allocate ---------------------------------------------------------------------------------

    def allocate(self, principal: Principal, body: VrnicCreate,
                 idempotency_key: str | None = None) -> tuple[VrnicOut, bool]:
        """(the vRNIC, replayed): replayed is True when idempotency_key matched an earlier allocation."""
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 255:
            raise InvalidArgument("Idempotency-Key must be 1 to 255 characters")
        request_hash = None if idempotency_key is None else _request_hash(body)
        try:
            return self._allocate_retrying(principal, body, idempotency_key, request_hash), False
        except Replayed as replay:
            with self.tx.read() as uow:
                row, tenant = uow.session.execute(_WITH_TENANT.where(Vrnic.serial == replay.serial)).tuples().one()
                return self._out(uow.session, row, tenant), True
        except IntegrityError:
            # Same key, allocated concurrently: the other request committed first.
            if idempotency_key is None or request_hash is None:
                raise
            with self.tx.read() as uow:
                earlier = self._by_idempotency_key(uow.session, principal, body, idempotency_key, request_hash)
                if earlier is None:
                    raise
                return self._out(uow.session, earlier, earlier.tenant.name), True

    def _allocate_retrying(self, principal: Principal, body: VrnicCreate, idempotency_key: str | None,
                           request_hash: str | None) -> VrnicOut:
        for attempt in range(_IP_RETRIES):
            try:
                return self._allocate(principal, body, idempotency_key, request_hash, check_next_ip=attempt > 0)
            except IntegrityError as exc:
                if "virtual_ip" not in str(exc.orig):
                    raise
                if body.virtual_ip is not None:
                    raise Conflict(f"virtual IP {body.virtual_ip} is taken in this VPC", current_state="taken") \
                        from exc
                log.info("virtual IP clash (a concurrent allocation, or the next address still held; attempt %d): "
                         "picking again", attempt + 1)
        raise Conflict("could not pick a free virtual IP under contention; retry", current_state="contended")

    def _allocate(self, principal: Principal, body: VrnicCreate, idempotency_key: str | None,
                  request_hash: str | None, *, check_next_ip: bool) -> VrnicOut:
        with self.tx.write(principal.actor, sriov=body.mode is VrnicMode.SRIOV) as uow:
            c = uow.connection  # the session only where the ORM is needed: making one costs (issue 14)
            if idempotency_key is not None and request_hash is not None:
                earlier = self._by_idempotency_key(uow.session, principal, body, idempotency_key, request_hash)
                if earlier is not None:
                    raise Replayed(earlier.serial)
            tenant = self._allocating_tenant(uow, principal, body)
            if tenant.max_vrnics is not None:
                # PostgreSQL: hold the tenant row so concurrent allocations cannot both pass the count.
                uow.session.execute(select(Tenant.id).where(Tenant.id == tenant.id).with_for_update())
                check_vrnic_count(tenant.max_vrnics, live_vrnics(uow.session, tenant.id))
            quota = body.quota or Quota.model_validate(tenant.default_quota)
            place = self._place(uow, body)
            virtual_ip = self._virtual_ip(c, tenant, body.virtual_ip, check_next=check_next_ip)
            public_id, now = f"vr-{uuid.uuid4().hex}", utcnow()
            values: dict[str, Any] = dict(
                public_id=public_id, tenant_id=tenant.id, mode=body.mode.value, engine=body.engine.value,
                state=VrnicState.ALLOCATED.value,
                host_id=place.host.id, device_id=place.device_id, device_name="", quota=quota.model_dump(),
                qos=body.qos.model_dump(), virtual_gid=public_id, virtual_ip=virtual_ip, socket_path=None,
                attach_extra={}, attach_token_hash=None, idempotency_key=idempotency_key, request_hash=request_hash,
                created_at=now, updated_at=now, released_at=None)
            # The hot path in Core statements run Prepared (the ORM's flushes cost more than the rest of the
            # request): one INSERT (the serial, and a clash on the idempotency key, come from the database) ...
            serial = int(_INSERT_VRNIC.scalar(c, values))
            virtual_gid = make_virtual_gid(tenant.vpc_id, serial)
            spec = VrnicSpec(id=public_id, tenant=tenant.name, mode=body.mode, device=place.device or body.device,
                             quota=quota, qos=body.qos, vpc_id=tenant.vpc_id, virtual_gid=virtual_gid,
                             virtual_ip=virtual_ip, engine=body.engine)
            backend = self.backends.of(place.host)
            info = backend.create_vrnic(spec)
            # the backend holds it: if the database does not end up holding it too, undo
            uow.on_failure(lambda: self._release_backend(public_id, backend))
            # ... the backend call, one UPDATE, the event, one commit.
            device_id = place.device_id if place.device_id is not None else \
                self.inventory.device_id(uow, body.mode, info.device)
            placed = dict(virtual_gid=virtual_gid, device_name=info.device, socket_path=info.socket_path,
                          attach_extra=dict(info.extra), device_id=device_id, updated_at=now,
                          attach_token_hash=token_digest(info.token) if info.token else None)
            _PLACE_VRNIC.execute(c, {**placed, "b_serial": serial})
            uow.record("vrnic.allocate", f"vrnic/{public_id}", tenant.id,
                       {"mode": body.mode.value, "engine": body.engine.value, "device": info.device,
                        "virtual_gid": virtual_gid, "virtual_ip": virtual_ip,
                        **({"host": place.host.name} if place.host.id != self.inventory.host_id else {}),
                        **({"idempotency_key": idempotency_key} if idempotency_key else {})})
            # a plain record of the row as written (an ORM instance costs more), so the one converter serves here too
            out = vrnic_out(VrnicRecord(**{k: v for k, v in {**values, **placed}.items() if k in _RECORD_FIELDS}),
                            tenant=tenant.name, host=place.host.name, attach_token=info.token)
        return out

    def _place(self, uow: UnitOfWork, body: VrnicCreate) -> Placement:
        """The host and device of a new vRNIC. Capped devices are locked (PostgreSQL: FOR UPDATE) and counted
        here, so the row inserted next is seen by every other allocation that waits for that lock."""
        local = HostRef(self.inventory.host_id, self.inventory.host_name, self.inventory.api_url, UP)
        query = every = _candidates_for(body.mode)
        if body.mode is VrnicMode.SRIOV:  # VFs are this host's own (its desired state joins this transaction)
            query = query.where(_HOSTS.c.id == local.id)
        if body.host is not None and body.host != local.name:
            wanted = self.inventory.find_host(uow.session, body.host)
            if not wanted.up:
                raise Unavailable(f"host {body.host} is down: vRNICs are not placed there")
            query = query.where(_HOSTS.c.id == wanted.id)
        elif body.host is not None:
            query = query.where(_HOSTS.c.id == local.id)
        if body.device is not None:
            query = query.where(_DEVICES.c.name == body.device)
        # the usual request narrows nothing: its query runs Prepared; a narrowed one is built per request
        rows = (_prepared_candidates(body.mode).rows(uow.connection) if query is every
                else uow.connection.execute(query).all())
        if all(r.host_id == local.id and r.max_vrnics is None for r in rows):
            # This host only and nothing capped: its backend picks (by its own load), as on a single host.
            if body.host is not None and body.host != local.name:
                raise NotSupported(f"host {body.host} has no device for mode {body.mode}"
                                   + (f" named {body.device}" if body.device else ""))
            return Placement(local, None, None)
        live = dict(uow.session.execute(select(_VRNICS.c.device_id, func.count()).where(
            _VRNICS.c.device_id.in_([r.id for r in rows]), _LIVE).group_by(_VRNICS.c.device_id)).tuples().all())
        by_key = {(r.host_name, r.name): r for r in rows}
        best = choose((Candidate(r.host_name, r.name, live.get(r.id, 0), r.max_vrnics) for r in rows),
                      mode=body.mode.value)
        chosen = by_key[best.host, best.device]
        host = HostRef(chosen.host_id, chosen.host_name, chosen.api_url, chosen.state)
        if chosen.max_vrnics is not None:
            uow.session.execute(select(Device.id).where(Device.id == chosen.id).with_for_update())
            count = uow.session.execute(_LIVE_ON_DEVICE, {"b_device": chosen.id}).scalar_one()
            if count >= chosen.max_vrnics:
                raise Conflict(f"device full: {chosen.host_name}/{chosen.name} holds {count} live vRNIC(s), "
                               f"its cap is {chosen.max_vrnics}", current_state="full")
        return Placement(host, chosen.name, chosen.id)

    @staticmethod
    def _virtual_ip(c: Connection, tenant: TenantFacts, wanted: str | None, *, check_next: bool) -> str:
        """The new vRNIC's address in the tenant's VPC: the one asked for (free, a host address of the VPC), else
        the one after the newest live vRNIC's, else the lowest free one.

        check_next False: the one after the newest is taken without asking whether it is free. The unique index on
        live addresses refuses it if it is not (the VPC wrapped around, or an address asked for explicitly), and
        the allocation is tried again with check_next True: one query fewer on the common path."""
        if wanted is not None:
            ip = check_virtual_ip(tenant.vpc_cidr, wanted)
            holder = c.execute(_IP_HOLDER, {"b_tenant": tenant.id, "b_ip": ip}).scalar()
            if holder is not None:
                raise Conflict(f"virtual IP {ip} is taken in this VPC (by {holder})", current_state="taken")
            return ip
        newest = _NEWEST_IP.scalar(c, {"b_tenant": tenant.id})
        candidate = next_virtual_ip(tenant.vpc_cidr, newest)
        if candidate is not None and (not check_next or c.execute(
                _IP_HOLDER, {"b_tenant": tenant.id, "b_ip": candidate}).first() is None):
            return candidate
        taken = {ip for ip in c.scalars(select(_VRNICS.c.virtual_ip).where(
            _VRNICS.c.tenant_id == tenant.id, _LIVE)) if ip is not None}
        return first_free_virtual_ip(tenant.vpc_cidr, taken)

    @staticmethod
    def _allocating_tenant(uow: UnitOfWork, principal: Principal, body: VrnicCreate) -> TenantFacts:
        if principal.is_operator:
            if body.tenant is None:
                raise InvalidArgument("the operator allocates on behalf of a tenant: give `tenant`")
            return TenantFacts.of(find_tenant(uow.session, body.tenant))
        if body.tenant is not None and body.tenant != principal.tenant_name:
            raise PermissionDenied("a tenant allocates only for itself")
        # Core, not session.get: the identity-map machinery costs a fifth of an allocation
        found = _TENANT_BY_ID.first(uow.connection, {"b_id": principal.tenant_id})
        if found is None:
            raise Unauthenticated("this token's tenant no longer exists")
        return TenantFacts.of(found)

    @staticmethod
    def _by_idempotency_key(s: Session, principal: Principal, body: VrnicCreate, key: str,
                            request_hash: str) -> Vrnic | None:
        tenant_id = principal.tenant_id
        if tenant_id is None:
            tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == body.tenant)) if body.tenant else None
        if tenant_id is None:
            return None
        row = s.scalar(select(Vrnic).where(Vrnic.tenant_id == tenant_id, Vrnic.idempotency_key == key))
        if row is not None and row.request_hash != request_hash:
            raise Conflict(f"Idempotency-Key {key!r} was used for a different request (vRNIC {row.public_id})",
                           current_state=row.state)
        return row

    # -- read: with the observed attach state -----------------------------------------------------

    def list_vrnics(self, principal: Principal, cursor: str | None, limit: int, *, state: VrnicState | None = None,
                    tenant: str | None = None) -> Observed[Page[VrnicOut]]:
        request = PageRequest.parse(cursor, limit)
        attached = self.backend.attached_vrnics()
        stale = False
        hosts: dict[int, HostRef] = {}

        def convert(found: tuple[Vrnic, str]) -> VrnicOut:
            nonlocal stale
            out = self._out(uow.session, *found, attached=attached, hosts=hosts)
            stale = stale or out.state.value != found[0].state
            return out

        with self.tx.read() as uow:
            query = visible(_WITH_TENANT, principal)
            if tenant is not None:
                if principal.is_operator:
                    find_tenant(uow.session, tenant)  # an unknown tenant is a 404 for the operator
                query = query.where(Tenant.name == tenant)
            # the state filter sees the stored state (the route persists a changed observation, then asks again)
            if state is not None:
                query = query.where(Vrnic.state == state.value)
            rows = uow.session.execute(request.window(query, Vrnic.serial)).tuples()
            page = request.page(rows, lambda found: found[0].serial, convert)
        return page, stale

    def get_vrnic(self, principal: Principal, vrnic_id: str) -> Observed[VrnicOut]:
        attached = self.backend.attached_vrnics()
        with self.tx.read() as uow:
            row, tenant = find_vrnic(uow.session, principal, vrnic_id)
            out = self._out(uow.session, row, tenant, attached=attached)
            return out, out.state.value != row.state

    def record_observed(self) -> int:
        """Persist the attach state vrnicd observes now for this host's vRNICs, each change with an event.
        Returns how many changed."""
        attached = self.backend.attached_vrnics()
        with self.tx.write(DAEMON_ACTOR) as uow:
            differing = select(Vrnic).where(Vrnic.host_id == self.inventory.host_id, or_(
                and_(Vrnic.state == VrnicState.ATTACHED.value, Vrnic.public_id.not_in(attached)),
                and_(Vrnic.state.in_(_ATTACHABLE), Vrnic.public_id.in_(attached))))
            # one lock order for every writer (PostgreSQL), so two of these cannot deadlock
            differing = differing.order_by(Vrnic.serial).with_for_update()
            rows = list(uow.session.scalars(differing))
            return sum(self._take_in_observation(uow, row, attached) for row in rows)

    def _take_in_observation(self, uow: UnitOfWork, row: Vrnic, attached: set[str],
                             observer: int | None = None) -> bool:
        """attached: what the backend of host `observer` (default: this one) observes now."""
        stored = VrnicState(row.state)
        if row.host_id != (observer if observer is not None else self.inventory.host_id):
            return False  # another host observes it
        new = observed_state(stored, row.public_id in attached)
        if new is stored:
            return False
        action = VrnicAction.ATTACH if new is VrnicState.ATTACHED else VrnicAction.DETACH
        row.state = new.value
        uow.record(f"vrnic.{action.value}", f"vrnic/{row.public_id}", row.tenant_id, {"from": stored.value},
                   actor=DAEMON_ACTOR)
        return True

    def _out(self, s: Session, row: Vrnic, tenant: str, *, attached: set[str] | None = None,
             hosts: dict[int, HostRef] | None = None, attach_token: str | None = None) -> VrnicOut:
        state = VrnicState(row.state)
        if row.host_id == self.inventory.host_id:  # this host answers: it is up
            if attached is not None:
                state = observed_state(state, row.public_id in attached)
            return vrnic_out(row, tenant=tenant, host=self.inventory.host_name, state=state, attach_token=attach_token)
        host = (hosts or {}).get(row.host_id) or self.inventory.host_ref(s, row.host_id)
        if hosts is not None:
            hosts[row.host_id] = host
        return vrnic_out(row, tenant=tenant, host=host.name, state=state, reachable=host.up, attach_token=attach_token)

    def _backend_of(self, s: Session, host_id: int) -> VrnicBackend:
        if host_id == self.inventory.host_id:
            return self.backend
        return self.backends.of(self.inventory.host_ref(s, host_id))

    def recover(self) -> RecoveryPlan:
        """At start: this host's live vRNICs in the database against what the backend holds (set differences,
        vrnic.core.recovery). A paravirtual vRNIC the backend lost (the previous vrnicd died or stopped) is held
        again with the same attach token; one a guest was attached to is marked lost (its kernel objects died
        with the old process; the guest attaches again and rebuilds). What the backend holds that the database
        does not (an allocation whose commit never happened) is released. Each change is audited."""
        held = self.backend.vrnic_ids()
        with self.tx.write(DAEMON_ACTOR) as uow:
            s = uow.session
            rows = {row.public_id: (row, tenant, vpc_id) for row, tenant, vpc_id in s.execute(
                select(Vrnic, Tenant.name, Tenant.vpc_id).join(Tenant, Tenant.id == Vrnic.tenant_id)
                .where(Vrnic.host_id == self.inventory.host_id, _LIVE_ORM).order_by(Vrnic.serial)
                .with_for_update(of=Vrnic)).tuples()}
            plan = plan_recovery({vid: VrnicState(row.state) for vid, (row, _, _) in rows.items()}, held)
            for vrnic_id in plan.restore:
                row, tenant, vpc_id = rows[vrnic_id]
                if vrnic_id in plan.lose:
                    row.state, row.updated_at = VrnicState.LOST.value, utcnow()
                    uow.record("vrnic.lost", f"vrnic/{vrnic_id}", row.tenant_id,
                               {"from": VrnicState.ATTACHED.value, "reason": "vrnicd restarted: the guest's kernel "
                                "objects died with the previous process; it attaches again with its token"},
                               actor=DAEMON_ACTOR)
                if row.mode != VrnicMode.PARAVIRTUAL.value:
                    log.error("SR-IOV vRNIC %s has no VF allocation on this host any more", vrnic_id)
                    continue
                spec = VrnicSpec(id=vrnic_id, tenant=tenant, mode=VrnicMode.PARAVIRTUAL, device=row.device_name,
                                 quota=Quota.model_validate(row.quota), qos=QosPolicy.model_validate(row.qos),
                                 vpc_id=vpc_id, virtual_gid=row.virtual_gid, virtual_ip=row.virtual_ip,
                                 engine=DataEngine(row.engine))
                try:
                    # no digest kept (allocated before 0006): no token attaches; a re-issued one will
                    self.backend.restore_vrnic(spec, row.device_name, row.attach_token_hash or "")
                except VrnicError as exc:
                    log.error("could not hold vRNIC %s again on %s: %s", vrnic_id, row.device_name, exc)
                    uow.record("vrnic.restore_failed", f"vrnic/{vrnic_id}", row.tenant_id, {"error": str(exc)},
                               actor=DAEMON_ACTOR)
            for vrnic_id in plan.orphans:
                self._release_backend(vrnic_id, self.backend)
                uow.record("vrnic.orphan_released", f"vrnic/{vrnic_id}", None, {}, actor=DAEMON_ACTOR)
        if not plan.in_sync:
            log.info("recovery: %d vRNIC(s) held again (%d lost), %d orphan(s) released", len(plan.restore),
                     len(plan.lose), len(plan.orphans))
        return plan

    def orphaned(self) -> list[str]:
        """Live vRNICs of this host in the database that the backend does not hold (e.g. after a restart)."""
        held = self.backend.vrnic_ids()
        with self.tx.read() as uow:
            ids = uow.session.scalars(select(Vrnic.public_id).where(
                Vrnic.host_id == self.inventory.host_id, _LIVE_ORM))
            return sorted(set(ids) - held)

    # -- QoS --------------------------------------------------------------------------------------

    def change_qos(self, principal: Principal, vrnic_id: str, policy: QosPolicy) -> VrnicOut:
        """A live vRNIC's QoS, enforced at once by vrnicd (in the transaction: refused means unchanged)."""
        with self.tx.write(principal.actor) as uow:
            row, tenant = find_vrnic(uow.session, principal, vrnic_id, for_update=True)
            if row.state == VrnicState.RELEASED.value:
                raise Conflict(f"vRNIC {vrnic_id} was released", current_state="released")
            if row.mode != VrnicMode.PARAVIRTUAL.value:
                raise NotSupported(f"vRNIC {vrnic_id} is an SR-IOV VF: its rates are set when it is allocated "
                                   "(release it and allocate another to change them)")
            before = row.qos
            self._backend_of(uow.session, row.host_id).set_qos(vrnic_id, VrnicMode(row.mode), policy)
            row.qos = policy.model_dump()
            uow.record("vrnic.qos", f"vrnic/{vrnic_id}", row.tenant_id, {"from": before, "to": row.qos})
            return self._out(uow.session, row, tenant)

    def counters(self, principal: Principal, vrnic_id: str) -> VrnicCounters:
        with self.tx.read() as uow:
            row, _ = find_vrnic(uow.session, principal, vrnic_id)
            backend = self._backend_of(uow.session, row.host_id)
        counted = backend.qos_counters().get(vrnic_id) or {}
        now = time.monotonic()
        tx, rx = counted.get("tx_bytes", 0), counted.get("rx_bytes", 0)
        return VrnicCounters(vrnic_id=vrnic_id, shaped=bool(counted), tx_bytes=tx,
                             tx_packets=counted.get("tx_packets", 0), tx_rate_bps=self.meter.read(vrnic_id, tx, now),
                             rx_bytes=rx, rx_packets=counted.get("rx_packets", 0),
                             rx_rate_bps=self.meter.read(f"rx:{vrnic_id}", rx, now))

    # -- attach token -----------------------------------------------------------------------------

    def reissue_token(self, principal: Principal, vrnic_id: str) -> VrnicOut:
        """A new attach token (in this response only); the old one stops working at once. For a client whose
        allocation response was lost (an Idempotency-Key replay does not show the token again)."""
        with self.tx.write(principal.actor) as uow:
            row, tenant = find_vrnic(uow.session, principal, vrnic_id, for_update=True)
            if row.state == VrnicState.RELEASED.value:
                raise Conflict(f"vRNIC {vrnic_id} was released", current_state="released")
            if row.mode != VrnicMode.PARAVIRTUAL.value:
                raise NotSupported(f"vRNIC {vrnic_id} is an SR-IOV VF: it has no attach token")
            token = self._backend_of(uow.session, row.host_id).reissue_token(vrnic_id)
            row.attach_token_hash, row.updated_at = token_digest(token), utcnow()
            uow.record("vrnic.token_reissue", f"vrnic/{vrnic_id}", row.tenant_id, {})
            return self._out(uow.session, row, tenant, attach_token=token)

    # -- release ----------------------------------------------------------------------------------

    def release(self, principal: Principal, vrnic_id: str, *, force: bool = False) -> VrnicOut:
        """Tear down the backend state; the record stays, in state released. An attached vRNIC (as observed
        now) needs force, which only the operator has."""
        if force:
            principal.require_operator()
        refused: Conflict | None = None
        with self.tx.write(principal.actor, sriov=self._may_hold_a_vf(principal, vrnic_id)) as uow:
            # The hot path in SQLAlchemy Core, as allocate: one SELECT ... FOR UPDATE, one UPDATE, the event.
            query = _FIND_FOR_UPDATE if principal.is_operator else _FIND_TENANTS_FOR_UPDATE
            found = uow.connection.execute(query, {"b_id": vrnic_id, "b_tenant": principal.tenant_id}
                                           ).mappings().first()
            if found is None:  # another tenant's vRNIC looks exactly like one that does not exist
                raise NotFound(f"no vRNIC {vrnic_id}")
            row = Vrnic(**{c.key: found[c.key] for c in _VRNICS.columns})  # transient: never flushed
            stored = row.state
            # A released one needs no backend (even on a host that is down: that is a 409, not a 503).
            backend = self._backend_of(uow.session, row.host_id) if stored != VrnicState.RELEASED.value \
                else self.backend
            # what vrnicd observed is a fact: it is recorded even when the release is refused
            self._take_in_observation(uow, row, backend.attached_vrnics(), row.host_id)
            previous, now = VrnicState(row.state), utcnow()
            try:
                new = next_state(previous, VrnicAction.RELEASE, force=force)
            except Conflict as exc:
                refused = exc
                if row.state != stored:
                    _PLACE_VRNIC.execute(uow.connection, {"state": row.state, "updated_at": now,
                                                          "b_serial": row.serial})
            else:
                self._release_backend(vrnic_id, backend)
                changes = {"state": new.value, "released_at": now, "updated_at": now}
                _PLACE_VRNIC.execute(uow.connection, {**changes, "b_serial": row.serial})
                for column, value in changes.items():
                    setattr(row, column, value)
                uow.record("vrnic.release", f"vrnic/{vrnic_id}", row.tenant_id,
                           {"from": previous.value, "force": force})
                out = self._out(uow.session, row, found["tenant_name"])
        if refused is not None:
            raise refused
        return out

    def _may_hold_a_vf(self, principal: Principal, vrnic_id: str) -> bool:
        # Decided before the write begins (the SR-IOV store is taken first); a vRNIC's mode never changes.
        if self.tx.vf_store is None:
            return False
        with self.tx.read() as uow:
            mode = uow.session.scalar(visible(_WITH_TENANT, principal).with_only_columns(Vrnic.mode)
                                      .where(Vrnic.public_id == vrnic_id))
        return mode == VrnicMode.SRIOV.value

    def _release_backend(self, vrnic_id: str, backend: VrnicBackend) -> None:
        try:
            backend.release_vrnic(vrnic_id)
        except NotFound:
            # Already gone (the daemon restarted, or an earlier release got this far): nothing to tear down.
            log.warning("vRNIC %s had no backend state left to release", vrnic_id)
