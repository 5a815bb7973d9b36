"""The vRNIC lifecycle: allocate, read, release, and the attach state vrnicd observes.

Attach and detach are never what a client says: on every read the state is what the backend observes
now (a guest attached or not), and a change is persisted with an audit event (actor daemon).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from typing import Any, TypeVar, cast

from sqlalchemy import Select, Table, and_, bindparam, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from vrnic.api.auth import Principal
from vrnic.api.converters import vrnic_out
from vrnic.api.inventory import Inventory
from vrnic.api.pagination import PageRequest
from vrnic.api.schemas import Page, VrnicCounters, VrnicCreate, VrnicOut
from vrnic.api.tenants import find_tenant, live_vrnics
from vrnic.api.transactions import Transactions
from vrnic.backend.service import BackendService
from vrnic.core.lifecycle import VrnicAction, VrnicState, check_vrnic_count, next_state, observed_state
from vrnic.core.qos import RateMeter
from vrnic.core.specs import DataEngine, QosPolicy, Quota, VrnicMode, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.db.tables import Tenant, Vrnic, utcnow
from vrnic.db.unit_of_work import DAEMON_ACTOR, UnitOfWork
from vrnic.errors import Conflict, InvalidArgument, NotFound, NotSupported, PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

T = TypeVar("T")
Observed = tuple[T, bool]  # (what a read shows, whether the observed attach state differs from the stored one)
_ATTACHABLE = [VrnicState.ALLOCATED.value, VrnicState.DETACHED.value]


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
_INSERT_VRNIC = insert(_VRNICS).returning(_VRNICS.c.serial)  # built once: compiled once
_PLACE_VRNIC = update(_VRNICS).where(_VRNICS.c.serial == bindparam("b_serial"))
_TENANTS = cast(Table, Tenant.__table__)
_TENANT_BY_ID = select(_TENANTS).where(_TENANTS.c.id == bindparam("b_id"))
_FIND_FOR_UPDATE = (select(_VRNICS, _TENANTS.c.name.label("tenant_name"))
                    .join(_TENANTS, _TENANTS.c.id == _VRNICS.c.tenant_id)
                    .where(_VRNICS.c.public_id == bindparam("b_id")).with_for_update(of=_VRNICS))


class Vrnics:
    def __init__(self, tx: Transactions, backend: BackendService, inventory: Inventory) -> None:
        self.tx = tx
        self.backend = backend
        self.inventory = inventory
        self.meter = RateMeter()

    # -- allocate ---------------------------------------------------------------------------------

    def allocate(self, principal: Principal, body: VrnicCreate,
                 idempotency_key: str | None = None) -> tuple[VrnicOut, bool]:
        """(the vRNIC, replayed): replayed is True when idempotency_key matched an earlier allocation."""
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 255:
            raise InvalidArgument("Idempotency-Key must be 1 to 255 characters")
        # The default engine is left out, so a key recorded before `engine` existed still matches its retry.
        request = body.model_dump(mode="json", exclude={"engine"} if body.engine is DataEngine.RING else None)
        request_hash = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()
        try:
            return self._allocate(principal, body, idempotency_key, request_hash), False
        except Replayed as replay:
            with self.tx.read() as uow:
                row, tenant = uow.session.execute(_WITH_TENANT.where(Vrnic.serial == replay.serial)).tuples().one()
                return self._out(uow.session, row, tenant), True
        except IntegrityError:
            # Same key, allocated concurrently: the other request committed first.
            if idempotency_key is None:
                raise
            with self.tx.read() as uow:
                earlier = self._by_idempotency_key(uow.session, principal, body, idempotency_key, request_hash)
                if earlier is None:
                    raise
                return self._out(uow.session, earlier, earlier.tenant.name), True

    def _allocate(self, principal: Principal, body: VrnicCreate, idempotency_key: str | None,
                  request_hash: str) -> VrnicOut:
        with self.tx.write(principal.actor, sriov=body.mode is VrnicMode.SRIOV) as uow:
            s = uow.session
            if idempotency_key is not None:
                earlier = self._by_idempotency_key(s, principal, body, idempotency_key, request_hash)
                if earlier is not None:
                    raise Replayed(earlier.serial)
            tenant = self._allocating_tenant(s, principal, body)
            if tenant.max_vrnics is not None:
                # PostgreSQL: hold the tenant row so concurrent allocations cannot both pass the count.
                s.execute(select(Tenant.id).where(Tenant.id == tenant.id).with_for_update())
                check_vrnic_count(tenant.max_vrnics, live_vrnics(s, tenant.id))
            quota = body.quota or Quota.model_validate(tenant.default_quota)
            public_id, now = f"vr-{uuid.uuid4().hex}", utcnow()
            values: dict[str, Any] = dict(
                public_id=public_id, tenant_id=tenant.id, mode=body.mode.value, engine=body.engine.value,
                state=VrnicState.ALLOCATED.value,
                host_id=self.inventory.host_id, device_id=None, device_name="", quota=quota.model_dump(),
                qos=body.qos.model_dump(), virtual_gid=public_id, socket_path=None, attach_extra={},
                idempotency_key=idempotency_key, request_hash=request_hash, created_at=now, updated_at=now,
                released_at=None)
            # The hot path in SQLAlchemy Core (the ORM's flushes cost more than the rest of the request):
            # one INSERT (the serial, and a clash on the idempotency key, come from the database) ...
            serial = int(s.execute(_INSERT_VRNIC, values).scalar_one())
            virtual_gid = make_virtual_gid(tenant.vpc_id, serial)
            spec = VrnicSpec(id=public_id, tenant=tenant.name, mode=body.mode, device=body.device, quota=quota,
                             qos=body.qos, vpc_id=tenant.vpc_id, virtual_gid=virtual_gid, engine=body.engine)
            info = self.backend.create_vrnic(spec)
            # the backend holds it: if the database does not end up holding it too, undo
            uow.on_failure(lambda: self._release_backend(public_id))
            # ... the backend call, one UPDATE, the event, one commit.
            device_id = self.inventory.device_id(uow, body.mode, info.device)
            placed = dict(virtual_gid=virtual_gid, device_name=info.device, socket_path=info.socket_path,
                          attach_extra=dict(info.extra), device_id=device_id, updated_at=now)
            s.execute(_PLACE_VRNIC, {**placed, "b_serial": serial})
            uow.record("vrnic.allocate", f"vrnic/{public_id}", tenant.id,
                       {"mode": body.mode.value, "engine": body.engine.value, "device": info.device,
                        "virtual_gid": virtual_gid,
                        **({"idempotency_key": idempotency_key} if idempotency_key else {})})
            # a transient row (never added to the session) so the one converter serves this path too
            out = vrnic_out(Vrnic(serial=serial, **{**values, **placed}), tenant=tenant.name,
                            host=self.inventory.host_name)
        return out.model_copy(update={"attach": out.attach.model_copy(update={"token": info.token})})

    @staticmethod
    def _allocating_tenant(s: Session, principal: Principal, body: VrnicCreate) -> Tenant:
        if principal.is_operator:
            if body.tenant is None:
                raise InvalidArgument("the operator allocates on behalf of a tenant: give `tenant`")
            return find_tenant(s, body.tenant)
        if body.tenant is not None and body.tenant != principal.tenant_name:
            raise PermissionDenied("a tenant allocates only for itself")
        # Core, not session.get: the identity-map machinery costs a fifth of an allocation
        found = s.execute(_TENANT_BY_ID, {"b_id": principal.tenant_id}).mappings().first()
        if found is None:
            raise Unauthenticated("this token's tenant no longer exists")
        return Tenant(**dict(found))  # transient: read only

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

        def convert(found: tuple[Vrnic, str]) -> VrnicOut:
            nonlocal stale
            out = self._out(uow.session, *found, attached=attached)
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

    def _take_in_observation(self, uow: UnitOfWork, row: Vrnic, attached: set[str]) -> bool:
        stored = VrnicState(row.state)
        if row.host_id != self.inventory.host_id:  # another host observes it
            return False
        new = observed_state(stored, row.public_id in attached)
        if new is stored:
            return False
        action = VrnicAction.ATTACH if new is VrnicState.ATTACHED else VrnicAction.DETACH
        row.state = new.value
        uow.record(f"vrnic.{action.value}", f"vrnic/{row.public_id}", row.tenant_id, {"from": stored.value},
                   actor=DAEMON_ACTOR)
        return True

    def _out(self, s: Session, row: Vrnic, tenant: str, *, attached: set[str] | None = None) -> VrnicOut:
        state = VrnicState(row.state)
        if attached is not None and row.host_id == self.inventory.host_id:
            state = observed_state(state, row.public_id in attached)
        return vrnic_out(row, tenant=tenant, host=self.inventory.host_name_of(s, row.host_id), state=state)

    def orphaned(self) -> list[str]:
        """Live vRNICs of this host in the database that the backend does not hold (e.g. after a restart)."""
        held = self.backend.vrnic_ids()
        with self.tx.read() as uow:
            ids = uow.session.scalars(select(Vrnic.public_id).where(
                Vrnic.host_id == self.inventory.host_id, Vrnic.state != VrnicState.RELEASED.value))
            return sorted(set(ids) - held)

    # -- QoS --------------------------------------------------------------------------------------

    def change_qos(self, principal: Principal, vrnic_id: str, policy: QosPolicy) -> VrnicOut:
        """A live vRNIC's QoS, enforced at once by vrnicd (in the transaction: refused means unchanged)."""
        with self.tx.write(principal.actor) as uow:
            row, tenant = find_vrnic(uow.session, principal, vrnic_id, for_update=True)
            if row.state == VrnicState.RELEASED.value:
                raise Conflict(f"vRNIC {vrnic_id} was released", current_state="released")
            if row.host_id != self.inventory.host_id:
                raise Conflict(f"vRNIC {vrnic_id} lives on another host", current_state="elsewhere")
            if row.mode != VrnicMode.PARAVIRTUAL.value:
                raise NotSupported(f"vRNIC {vrnic_id} is an SR-IOV VF: its rates are set when it is allocated "
                                   "(release it and allocate another to change them)")
            before = row.qos
            self.backend.set_qos(vrnic_id, VrnicMode(row.mode), policy)
            row.qos = policy.model_dump()
            uow.record("vrnic.qos", f"vrnic/{vrnic_id}", row.tenant_id, {"from": before, "to": row.qos})
            return self._out(uow.session, row, tenant)

    def counters(self, principal: Principal, vrnic_id: str) -> VrnicCounters:
        with self.tx.read() as uow:
            find_vrnic(uow.session, principal, vrnic_id)
        counted = self.backend.qos_counters().get(vrnic_id) or {}
        now = time.monotonic()
        tx, rx = counted.get("tx_bytes", 0), counted.get("rx_bytes", 0)
        return VrnicCounters(vrnic_id=vrnic_id, shaped=bool(counted), tx_bytes=tx,
                             tx_packets=counted.get("tx_packets", 0), tx_rate_bps=self.meter.read(vrnic_id, tx, now),
                             rx_bytes=rx, rx_packets=counted.get("rx_packets", 0),
                             rx_rate_bps=self.meter.read(f"rx:{vrnic_id}", rx, now))

    # -- release ----------------------------------------------------------------------------------

    def release(self, principal: Principal, vrnic_id: str, *, force: bool = False) -> VrnicOut:
        """Tear down the backend state; the record stays, in state released. An attached vRNIC (as observed
        now) needs force, which only the operator has."""
        if force:
            principal.require_operator()
        refused: Conflict | None = None
        with self.tx.write(principal.actor, sriov=self._may_hold_a_vf(principal, vrnic_id)) as uow:
            # The hot path in SQLAlchemy Core, as allocate: one SELECT ... FOR UPDATE, one UPDATE, the event.
            query = _FIND_FOR_UPDATE if principal.is_operator else _FIND_FOR_UPDATE.where(
                _VRNICS.c.tenant_id == principal.tenant_id)
            found = uow.session.execute(query, {"b_id": vrnic_id}).mappings().first()
            if found is None:  # another tenant's vRNIC looks exactly like one that does not exist
                raise NotFound(f"no vRNIC {vrnic_id}")
            row = Vrnic(**{c.key: found[c.key] for c in _VRNICS.columns})  # transient: never flushed
            stored = row.state
            # what vrnicd observed is a fact: it is recorded even when the release is refused
            self._take_in_observation(uow, row, self.backend.attached_vrnics())
            previous, now = VrnicState(row.state), utcnow()
            try:
                new = next_state(previous, VrnicAction.RELEASE, force=force)
            except Conflict as exc:
                refused = exc
                if row.state != stored:
                    uow.session.execute(_PLACE_VRNIC, {"state": row.state, "updated_at": now, "b_serial": row.serial})
            else:
                self._release_backend(vrnic_id)
                changes = {"state": new.value, "released_at": now, "updated_at": now}
                uow.session.execute(_PLACE_VRNIC, {**changes, "b_serial": row.serial})
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

    def _release_backend(self, vrnic_id: str) -> None:
        try:
            self.backend.release_vrnic(vrnic_id)
        except NotFound:
            # Already gone (the daemon restarted, or an earlier release got this far): nothing to tear down.
            log.warning("vRNIC %s had no backend state left to release", vrnic_id)
