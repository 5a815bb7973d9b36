"""The control plane's operations: database state plus the backend, behind the REST routes.

It reaches the backend only through BackendService (the service boundary), so the same code could
drive a remote host agent. Every operation runs in one database transaction and raises only
VrnicErrors; an allocation whose database commit fails releases its backend state again.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar, cast

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Connection, Engine, Row, Select, Table, bindparam, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, joinedload, sessionmaker

from vrnic import __version__
from vrnic.api.auth import OPERATOR, Principal, TokenCache, hash_token, is_operator_token, new_tenant_token
from vrnic.api.schemas import (
    DeviceOut,
    EventOut,
    HostOut,
    NumVfsChange,
    NumVfsChanged,
    Page,
    ReconcileOut,
    SriovEventOut,
    SriovPfOut,
    SriovVfOut,
    TenantCreate,
    TenantCreated,
    TenantOut,
    TenantUpdate,
    TokenIssued,
    TokenOut,
    VfAllocationOut,
    VfSettings,
    VrnicCreate,
    VrnicOut,
)
from vrnic.backend.service import BackendService
from vrnic.core.lifecycle import VrnicAction, VrnicState, check_vrnic_count, next_state
from vrnic.core.specs import AttachInfo, QosPolicy, Quota, VrnicMode, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.db.engine import session_factory
from vrnic.db.tables import ApiToken, Device, Event, Host, Tenant, Vrnic, utcnow
from vrnic.db.vf_store import DAEMON_ACTOR, bound_to
from vrnic.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    NotSupported,
    PermissionDenied,
    Unauthenticated,
    VrnicError,
)
from vrnic.sriov.manager import PfInventory
from vrnic.sriov.vf_types import Allocation, VfConfig, VfEvent, VfInfo

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_PAGE = 500
_LIVE = [s.value for s in VrnicState if s is not VrnicState.RELEASED]


class Replayed(Exception):
    """Internal: an Idempotency-Key matched an earlier allocation."""

    def __init__(self, serial: int) -> None:
        self.serial = serial


class ControlPlane:
    def __init__(self, engine: Engine, backend: BackendService, *, host_name: str,
                 operator_token: str, api_url: str | None = None) -> None:
        self.engine = engine
        self.backend = backend
        self.host_name = host_name
        self.api_url = api_url
        self._operator_token = operator_token
        self._sessions: sessionmaker[Session] = session_factory(engine)
        self._readonly_sessions: sessionmaker[Session] = session_factory(
            engine.execution_options(vrnic_read_only=True))
        self._tokens = TokenCache()
        sqlite = engine.dialect.name == "sqlite"
        self._write_lock: AbstractContextManager[object] = threading.Lock() if sqlite else nullcontext()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="vrnic-db-writer") if sqlite else None
        self._host_id: int | None = None
        self._device_ids: dict[tuple[str, str], int] = {}

    # -- how the API runs operations ---------------------------------------------------------------

    async def write(self, operation: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a state-changing operation off the event loop.

        SQLite takes one writer at a time, so its writes queue (first come, first served) for a single
        writer thread instead of many threads contending for the lock, which kept tail latency long.
        PostgreSQL writes run on the shared thread pool.
        """
        call = functools.partial(operation, *args, **kwargs)
        if self._writer is None:
            return await run_in_threadpool(call)
        return await asyncio.get_running_loop().run_in_executor(self._writer, call)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    # -- sessions ---------------------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[Session]:
        # SQLite has one writer at a time; waiting on a lock in this process wakes up at once, where
        # SQLite's own busy handler sleeps and polls (tens of ms of tail latency under concurrency).
        with self._write_lock, self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._readonly_sessions() as session, session.begin():
            yield session

    # -- startup ----------------------------------------------------------------------------------

    def register_host(self) -> None:
        """Register (or refresh) this host and the devices its drivers see now."""
        with self._write() as s:
            host = s.scalar(select(Host).where(Host.name == self.host_name))
            now = utcnow()
            if host is None:
                host = Host(name=self.host_name, api_url=self.api_url, version=__version__)
                s.add(host)
                s.flush()
                self._event(s, OPERATOR, "host.register", f"host/{self.host_name}", None,
                            {"version": __version__}, actor="daemon")
            host.api_url, host.version, host.last_seen_at = self.api_url, __version__, now
            self._host_id = host.id
        self.sync_devices()

    def sync_devices(self) -> None:
        discovered = self.backend.devices()
        with self._write() as s:
            rows = {(d.driver, d.name): d for d in s.scalars(select(Device).where(Device.host_id == self.host_id))}
            for info in discovered:
                ports = [p.model_dump() for p in info.ports]
                row = rows.pop((info.driver, info.name), None)
                if row is None:
                    row = Device(host_id=self.host_id, name=info.name, driver=info.driver, node_guid=info.node_guid,
                                 ports=ports, caps=dict(info.caps))
                    s.add(row)
                    self._event(s, OPERATOR, "device.discover", f"device/{info.driver}/{info.name}", None,
                                {"node_guid": info.node_guid}, actor="daemon")
                else:
                    row.node_guid, row.ports, row.caps, row.present = info.node_guid, ports, dict(info.caps), True
                    row.discovered_at = utcnow()
            for row in rows.values():
                row.present = False
            s.flush()
            self._device_ids = {(d.driver, d.name): d.id for d in
                                s.scalars(select(Device).where(Device.host_id == self.host_id))}

    @property
    def host_id(self) -> int:
        if self._host_id is None:
            raise RuntimeError("register_host() first")
        return self._host_id

    def orphaned_vrnics(self) -> list[str]:
        """Live vRNICs of this host in the database that the backend does not hold (e.g. after a restart)."""
        held = self.backend.vrnic_ids()
        with self._read() as s:
            ids = s.scalars(select(Vrnic.public_id).where(Vrnic.host_id == self.host_id, Vrnic.state.in_(_LIVE)))
            return sorted(set(ids) - held)

    # -- auth -------------------------------------------------------------------------------------

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
        if is_operator_token(token, self._operator_token):
            return OPERATOR
        digest = hash_token(token)
        cached = self._tokens.get(digest)
        if cached is not None:
            return cached
        with self._read() as s:
            row = s.execute(select(Tenant.id, Tenant.name).join(ApiToken, ApiToken.tenant_id == Tenant.id)
                            .where(ApiToken.token_hash == digest, ApiToken.revoked_at.is_(None))).first()
        if row is None:
            raise Unauthenticated("invalid or revoked token")
        principal = Principal(tenant_id=row.id, tenant_name=row.name)
        self._tokens.put(digest, principal)
        return principal

    @staticmethod
    def require_operator(principal: Principal) -> None:
        if not principal.is_operator:
            raise PermissionDenied("only the operator may do this")

    # -- tenants ----------------------------------------------------------------------------------

    def create_tenant(self, principal: Principal, body: TenantCreate) -> TenantCreated:
        self.require_operator(principal)
        token = new_tenant_token()
        try:
            with self._write() as s:
                if s.scalar(select(Tenant.id).where(Tenant.name == body.name)) is not None:
                    raise Conflict(f"tenant {body.name} already exists", current_state="exists")
                vpc_id = body.vpc_id
                if vpc_id is None:
                    vpc_id = (s.scalar(select(func.max(Tenant.vpc_id))) or 0) + 1
                elif s.scalar(select(Tenant.id).where(Tenant.vpc_id == vpc_id)) is not None:
                    raise Conflict(f"VPC id {vpc_id} belongs to another tenant", current_state="in_use")
                tenant = Tenant(name=body.name, vpc_id=vpc_id, default_quota=body.default_quota.model_dump(),
                                max_vrnics=body.max_vrnics)
                s.add(tenant)
                s.flush()
                s.add(ApiToken(tenant_id=tenant.id, token_hash=hash_token(token), prefix=token[:12]))
                self._event(s, principal, "tenant.create", f"tenant/{tenant.name}", tenant.id,
                            {"vpc_id": vpc_id, "max_vrnics": body.max_vrnics})
                s.flush()
                return TenantCreated(**self._tenant_out(s, tenant).model_dump(), token=token)
        except IntegrityError as exc:  # a concurrent create of the same name or VPC won
            raise Conflict(f"tenant {body.name} or VPC id {body.vpc_id} already exists",
                           current_state="exists") from exc

    def list_tenants(self, principal: Principal, cursor: str | None, limit: int) -> Page[TenantOut]:
        self.require_operator(principal)
        with self._read() as s:
            return self._page(s, select(Tenant), Tenant.id, cursor, limit, lambda t: self._tenant_out(s, t))

    def get_tenant(self, principal: Principal, name: str) -> TenantOut:
        self.require_operator(principal)
        with self._read() as s:
            return self._tenant_out(s, self._tenant(s, name))

    def update_tenant(self, principal: Principal, name: str, body: TenantUpdate) -> TenantOut:
        self.require_operator(principal)
        with self._write() as s:
            tenant = self._tenant(s, name)
            if body.default_quota is not None:
                tenant.default_quota = body.default_quota.model_dump()
            if body.unlimited:
                tenant.max_vrnics = None
            elif body.max_vrnics is not None:
                tenant.max_vrnics = body.max_vrnics
            self._event(s, principal, "tenant.update", f"tenant/{name}", tenant.id,
                        body.model_dump(mode="json", exclude_defaults=True))
            s.flush()
            return self._tenant_out(s, tenant)

    def delete_tenant(self, principal: Principal, name: str) -> None:
        self.require_operator(principal)
        with self._write() as s:
            tenant = self._tenant(s, name)
            live = self._live_count(s, tenant.id)
            if live:
                raise Conflict(f"tenant {name} still has {live} live vRNIC(s); release them first",
                               current_state="has_vrnics")
            for row in s.scalars(select(Vrnic).where(Vrnic.tenant_id == tenant.id)):
                s.delete(row)
            s.flush()
            self._event(s, principal, "tenant.delete", f"tenant/{name}", None, {"vpc_id": tenant.vpc_id})
            s.delete(tenant)
        self._tokens.forget_tenant(tenant.id)

    def issue_token(self, principal: Principal, name: str) -> TokenIssued:
        self.require_operator(principal)
        token = new_tenant_token()
        with self._write() as s:
            tenant = self._tenant(s, name)
            row = ApiToken(tenant_id=tenant.id, token_hash=hash_token(token), prefix=token[:12])
            s.add(row)
            self._event(s, principal, "token.issue", f"tenant/{name}", tenant.id, {"prefix": row.prefix})
            s.flush()
            return TokenIssued(id=row.id, prefix=row.prefix, created_at=row.created_at, token=token)

    def list_tokens(self, principal: Principal, name: str) -> list[TokenOut]:
        self.require_operator(principal)
        with self._read() as s:
            tenant = self._tenant(s, name)
            rows = s.scalars(select(ApiToken).where(ApiToken.tenant_id == tenant.id).order_by(ApiToken.id))
            return [TokenOut(id=r.id, prefix=r.prefix, created_at=r.created_at, revoked_at=r.revoked_at)
                    for r in rows]

    def revoke_token(self, principal: Principal, name: str, token_id: int) -> TokenOut:
        self.require_operator(principal)
        with self._write() as s:
            tenant = self._tenant(s, name)
            row = s.scalar(select(ApiToken).where(ApiToken.id == token_id, ApiToken.tenant_id == tenant.id))
            if row is None:
                raise NotFound(f"tenant {name} has no token {token_id}")
            if row.revoked_at is not None:
                raise Conflict(f"token {token_id} is already revoked", current_state="revoked")
            row.revoked_at = utcnow()
            self._event(s, principal, "token.revoke", f"tenant/{name}", tenant.id, {"prefix": row.prefix})
            out = TokenOut(id=row.id, prefix=row.prefix, created_at=row.created_at, revoked_at=row.revoked_at)
        self._tokens.forget_tenant(tenant.id)
        return out

    # -- vRNICs -----------------------------------------------------------------------------------

    def allocate(self, principal: Principal, body: VrnicCreate,
                 idempotency_key: str | None = None) -> tuple[VrnicOut, bool]:
        """(the vRNIC, replayed): replayed is True when idempotency_key matched an earlier allocation."""
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 255:
            raise InvalidArgument("Idempotency-Key must be 1 to 255 characters")
        request_hash = hashlib.sha256(json.dumps(body.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
        try:
            return self._allocate(principal, body, idempotency_key, request_hash), False
        except Replayed as replay:
            with self._read() as s:
                row = s.get(Vrnic, replay.serial)
                assert row is not None
                return self._vrnic_out(s, row), True
        except IntegrityError:
            # Same key, allocated concurrently: the other request committed first.
            if idempotency_key is None:
                raise
            with self._read() as s:
                row = self._by_idempotency_key(s, principal, body, idempotency_key, request_hash)
                if row is None:
                    raise
                return self._vrnic_out(s, row), True

    def _allocate(self, principal: Principal, body: VrnicCreate, idempotency_key: str | None,
                  request_hash: str) -> VrnicOut:
        # The hot path, in SQLAlchemy Core: one INSERT, the backend call, one UPDATE, the event, one commit.
        info: AttachInfo | None = None
        try:
            with self._write() as s:
                if idempotency_key is not None:
                    earlier = self._by_idempotency_key(s, principal, body, idempotency_key, request_hash)
                    if earlier is not None:
                        raise Replayed(earlier.serial)
                conn = s.connection()
                tenant = self._allocating_tenant(conn, principal, body)
                if tenant.max_vrnics is not None:
                    # PostgreSQL: hold the tenant row so concurrent allocations cannot both pass the count.
                    conn.execute(_LOCK_TENANT, {"b_id": tenant.id})
                    check_vrnic_count(tenant.max_vrnics, self._live_count(s, tenant.id))
                quota = body.quota or Quota.model_validate(tenant.default_quota)
                public_id, now = f"vr-{uuid.uuid4().hex}", utcnow()
                values: dict[str, Any] = dict(
                    public_id=public_id, tenant_id=tenant.id, mode=body.mode.value, state=VrnicState.ALLOCATED.value,
                    host_id=self.host_id, device_id=None, device_name="", quota=quota.model_dump(),
                    qos=body.qos.model_dump(), virtual_gid=public_id, socket_path=None, attach_extra={},
                    idempotency_key=idempotency_key, request_hash=request_hash, created_at=now, updated_at=now,
                    released_at=None)
                # the serial (and a clash on the idempotency key) comes from the database
                inserted = conn.execute(_INSERT_VRNIC, values).inserted_primary_key
                assert inserted is not None
                serial = int(inserted[0])
                virtual_gid = make_virtual_gid(tenant.vpc_id, serial)
                spec = VrnicSpec(id=public_id, tenant=tenant.name, mode=body.mode, device=body.device, quota=quota,
                                 qos=body.qos, vpc_id=tenant.vpc_id, virtual_gid=virtual_gid)
                with bound_to(conn, principal.actor):  # SR-IOV desired state commits with this row
                    info = self.backend.create_vrnic(spec)
                placed = dict(virtual_gid=virtual_gid, device_name=info.device,
                              device_id=self._device_id(s, body.mode, info.device), socket_path=info.socket_path,
                              attach_extra=dict(info.extra), updated_at=now)
                conn.execute(_PLACE_VRNIC, {**placed, "b_serial": serial})
                self._event(s, principal, "vrnic.allocate", f"vrnic/{public_id}", tenant.id,
                            {"mode": body.mode.value, "device": info.device, "virtual_gid": virtual_gid,
                             **({"idempotency_key": idempotency_key} if idempotency_key else {})})
                out = self._vrnic_out(s, _Fields({**values, **placed, "serial": serial}), tenant_name=tenant.name)
        except BaseException:
            if info is not None:  # the backend holds it but the database does not: undo
                self._release_backend(info.vrnic_id)
            raise
        return out.model_copy(update={"attach": out.attach.model_copy(update={"token": info.token})})

    def list_vrnics(self, principal: Principal, cursor: str | None, limit: int, *, state: VrnicState | None = None,
                    tenant: str | None = None) -> Page[VrnicOut]:
        with self._read() as s:
            query = self._visible(select(Vrnic).options(joinedload(Vrnic.tenant)), principal)
            if state is not None:
                query = query.where(Vrnic.state == state.value)
            if tenant is not None:
                query = query.where(Vrnic.tenant_id == self._tenant(s, tenant).id) if principal.is_operator \
                    else query.where(Vrnic.tenant_id == (principal.tenant_id if tenant == principal.tenant_name
                                                         else -1))
            return self._page(s, query, Vrnic.serial, cursor, limit, lambda r: self._vrnic_out(s, r))

    def get_vrnic(self, principal: Principal, vrnic_id: str) -> VrnicOut:
        with self._read() as s:
            return self._vrnic_out(s, self._vrnic(s, principal, vrnic_id))

    def release(self, principal: Principal, vrnic_id: str, *, force: bool = False) -> VrnicOut:
        if force:
            self.require_operator(principal)
        with self._write() as s:
            conn = s.connection()
            if principal.is_operator:
                found = conn.execute(_VRNIC_FOR_UPDATE, {"b_id": vrnic_id})
            else:
                found = conn.execute(_TENANT_VRNIC_FOR_UPDATE, {"b_id": vrnic_id, "b_tenant": principal.tenant_id})
            row = found.mappings().first()
            if row is None:  # another tenant's vRNIC looks exactly like one that does not exist
                raise NotFound(f"no vRNIC {vrnic_id}")
            new = next_state(VrnicState(row["state"]), VrnicAction.RELEASE, force=force)
            with bound_to(conn, principal.actor):
                self._release_backend(vrnic_id)
            now = utcnow()
            changes = {"state": new.value, "released_at": now, "updated_at": now}
            conn.execute(_RELEASE_VRNIC, {**changes, "b_serial": row["serial"]})
            self._event(s, principal, "vrnic.release", f"vrnic/{vrnic_id}", row["tenant_id"],
                        {"from": row["state"], "force": force})
            return self._vrnic_out(s, _Fields({**row, **changes}), tenant_name=row["tenant_name"])

    def transition(self, principal: Principal, vrnic_id: str, action: VrnicAction) -> VrnicOut:
        """attach / detach: record what the frontend did (release goes through release())."""
        if action is VrnicAction.RELEASE:
            raise InvalidArgument("release a vRNIC with DELETE")
        with self._write() as s:
            row = self._vrnic(s, principal, vrnic_id, for_update=True)
            previous = row.state
            row.state = next_state(VrnicState(row.state), action).value
            self._event(s, principal, f"vrnic.{action.value}", f"vrnic/{row.public_id}", row.tenant_id,
                        {"from": previous})
            s.flush()
            return self._vrnic_out(s, row)

    # -- devices, hosts, events -------------------------------------------------------------------

    def list_devices(self, principal: Principal, cursor: str | None, limit: int) -> Page[DeviceOut]:
        self.require_operator(principal)
        with self._read() as s:
            return self._page(s, select(Device), Device.id, cursor, limit, lambda d: self._device_out(s, d))

    def get_device(self, principal: Principal, device_id: int) -> DeviceOut:
        self.require_operator(principal)
        with self._read() as s:
            row = s.get(Device, device_id)
            if row is None:
                raise NotFound(f"no device {device_id}")
            return self._device_out(s, row)

    def list_hosts(self, principal: Principal, cursor: str | None, limit: int) -> Page[HostOut]:
        self.require_operator(principal)
        with self._read() as s:
            return self._page(s, select(Host), Host.id, cursor, limit, _host_out)

    def get_host(self, principal: Principal, name: str) -> HostOut:
        self.require_operator(principal)
        with self._read() as s:
            row = s.scalar(select(Host).where(Host.name == name))
            if row is None:
                raise NotFound(f"no host {name}")
            return _host_out(row)

    def list_events(self, principal: Principal, cursor: str | None, limit: int, *, subject: str | None = None,
                    action: str | None = None) -> Page[EventOut]:
        with self._read() as s:
            query = select(Event)
            if not principal.is_operator:
                query = query.where(Event.tenant_id == principal.tenant_id)
            if subject is not None:
                query = query.where(Event.subject == subject)
            if action is not None:
                query = query.where(Event.action == action)
            names = dict(s.execute(select(Tenant.id, Tenant.name)).tuples().all())
            return self._page(s, query, Event.id, cursor, limit, lambda e: EventOut(
                id=e.id, at=e.at, actor=e.actor, action=e.action, subject=e.subject,
                tenant=names.get(e.tenant_id) if e.tenant_id is not None else None, detail=e.detail))

    # -- SR-IOV: PFs and VFs (operator), a vRNIC's own VF (its tenant) -----------------------------

    def sriov_pfs(self, principal: Principal, cursor: str | None, limit: int) -> Page[SriovPfOut]:
        self.require_operator(principal)
        pfs = [_pf_out(inventory) for inventory in self.backend.sriov_inventory()]
        return _list_page(list(enumerate(pfs)), cursor, limit)

    def sriov_pf(self, principal: Principal, pf: str) -> SriovPfOut:
        self.require_operator(principal)
        return _pf_out(self._inventory(pf))

    def sriov_vfs(self, principal: Principal, pf: str, cursor: str | None, limit: int) -> Page[SriovVfOut]:
        self.require_operator(principal)
        inventory = self._inventory(pf)
        vfs = [(vf.index, _vf_out(pf, vf.index, vf, inventory.allocations.get(vf.index))) for vf in inventory.pf.vfs]
        return _list_page(vfs, cursor, limit)

    def sriov_set_num_vfs(self, principal: Principal, pf: str, body: NumVfsChange) -> NumVfsChanged:
        self.require_operator(principal)
        result = self._sriov_write(principal.actor, self.backend.sriov_set_num_vfs, pf, body.num_vfs, body.force)
        change = result.change
        return NumVfsChanged(pf=pf, previous=change.current, num_vfs=change.requested, steps=list(change.steps),
                             events=[_sriov_event_out(e) for e in result.events])

    def sriov_reconcile(self, principal: Principal | None = None) -> ReconcileOut:
        """One reconcile pass; principal None: the daemon's own (at startup and periodically)."""
        if principal is not None:
            self.require_operator(principal)
        actor = principal.actor if principal is not None else DAEMON_ACTOR
        events = self._sriov_write(actor, self.backend.sriov_reconcile)
        return ReconcileOut(events=[_sriov_event_out(e) for e in events])

    def vrnic_vf(self, principal: Principal, vrnic_id: str) -> SriovVfOut:
        """The VF behind an SR-IOV vRNIC, with its desired and observed settings (its tenant may look)."""
        self._sriov_vrnic(principal, vrnic_id)
        allocation = self.backend.sriov_allocation(vrnic_id)
        address = allocation.address
        if allocation.vanished:
            return _vf_out(address.pf, address.index, None, allocation)
        vf = self._inventory(address.pf).pf.vf(address.index)
        return _vf_out(address.pf, address.index, vf, allocation)

    def vrnic_hostdev_xml(self, principal: Principal, vrnic_id: str, alias: str | None) -> str:
        """libvirt <interface type='hostdev'> for giving the vRNIC's VF to a VM."""
        self._sriov_vrnic(principal, vrnic_id)
        return self.backend.sriov_vm_interface(vrnic_id, alias).to_xml()

    async def reconcile_sriov_periodically(self, interval: float) -> None:
        """The daemon's background reconcile passes, queued like any other write (one writer on SQLite)."""
        while True:
            await asyncio.sleep(interval)
            try:
                result = await self.write(self.sriov_reconcile)
            except VrnicError as exc:
                log.error("SR-IOV reconcile pass failed: %s", exc)
                continue
            except Exception:  # e.g. the database was unavailable: keep the loop, try again next time
                log.exception("SR-IOV reconcile pass failed")
                continue
            if result.events:
                log.info("SR-IOV reconcile: %s", "; ".join(f"{e.kind} {e.pf}/{e.vf}" for e in result.events))

    def _sriov_write(self, actor: str, operation: Callable[..., T], *args: Any) -> T:
        # State changes of the kernel are recorded even when the operation fails half-way (a forced count
        # change that could not re-configure one VF): the database follows the kernel, then the error goes up.
        failure: VrnicError | None = None
        with self._write() as s, bound_to(s.connection(), actor):
            try:
                result = operation(*args)
            except VrnicError as exc:
                failure = exc
        if failure is not None:
            raise failure
        return result

    def _inventory(self, pf: str) -> PfInventory:
        inventories = self.backend.sriov_inventory()
        found = next((i for i in inventories if i.pf.name == pf), None)
        if found is None:
            known = ", ".join(i.pf.name for i in inventories) or "none"
            raise NotFound(f"no SR-IOV PF {pf!r} on this host (known: {known})")
        return found

    def _sriov_vrnic(self, principal: Principal, vrnic_id: str) -> None:
        with self._read() as s:
            row = self._vrnic(s, principal, vrnic_id)
            mode, state = row.mode, row.state
        if mode != VrnicMode.SRIOV.value:
            raise NotSupported(f"vRNIC {vrnic_id} is in {mode} mode: it has no VF")
        if state == VrnicState.RELEASED.value:
            raise Conflict(f"vRNIC {vrnic_id} is released: it holds no VF", current_state=state)

    # -- helpers ----------------------------------------------------------------------------------

    def _release_backend(self, vrnic_id: str) -> None:
        try:
            self.backend.release_vrnic(vrnic_id)
        except NotFound:
            # Already gone (the daemon restarted, or an earlier release got this far): nothing to tear down.
            log.warning("vRNIC %s had no backend state left to release", vrnic_id)

    def _device_id(self, s: Session, mode: VrnicMode, name: str) -> int | None:
        driver = self.backend.driver(mode).name
        known = self._device_ids.get((driver, name))
        if known is not None:
            return known
        # A device that appeared after startup: record it in this transaction (not cached until the next
        # sync, since this transaction may still roll back).
        row = s.scalar(select(Device).where(Device.host_id == self.host_id, Device.driver == driver,
                                            Device.name == name))
        if row is None:
            info = next((d for d in self.backend.devices() if d.driver == driver and d.name == name), None)
            if info is None:
                return None
            row = Device(host_id=self.host_id, name=name, driver=driver, node_guid=info.node_guid,
                         ports=[p.model_dump() for p in info.ports], caps=dict(info.caps))
            s.add(row)
            s.flush()
        return row.id

    @staticmethod
    def _allocating_tenant(conn: Connection, principal: Principal, body: VrnicCreate) -> Row[Any]:
        if principal.is_operator:
            if body.tenant is None:
                raise InvalidArgument("the operator allocates on behalf of a tenant: give `tenant`")
            tenant = conn.execute(_TENANT_BY_NAME, {"b_name": body.tenant}).first()
            if tenant is None:
                raise NotFound(f"no tenant {body.tenant}")
            return tenant
        if body.tenant is not None and body.tenant != principal.tenant_name:
            raise PermissionDenied("a tenant allocates only for itself")
        tenant = conn.execute(_TENANT_BY_ID, {"b_id": principal.tenant_id}).first()
        if tenant is None:
            raise Unauthenticated("this token's tenant no longer exists")
        return tenant

    def _by_idempotency_key(self, s: Session, principal: Principal, body: VrnicCreate, key: str,
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

    def _visible(self, query: Select[tuple[Vrnic]], principal: Principal) -> Select[tuple[Vrnic]]:
        return query if principal.is_operator else query.where(Vrnic.tenant_id == principal.tenant_id)

    def _vrnic(self, s: Session, principal: Principal, vrnic_id: str, *, for_update: bool = False) -> Vrnic:
        query = self._visible(select(Vrnic).where(Vrnic.public_id == vrnic_id), principal)
        row = s.scalar(query.with_for_update() if for_update else query)
        if row is None:  # another tenant's vRNIC looks exactly like one that does not exist
            raise NotFound(f"no vRNIC {vrnic_id}")
        return row

    @staticmethod
    def _tenant(s: Session, name: str) -> Tenant:
        tenant = s.scalar(select(Tenant).where(Tenant.name == name))
        if tenant is None:
            raise NotFound(f"no tenant {name}")
        return tenant

    @staticmethod
    def _live_count(s: Session, tenant_id: int) -> int:
        return s.scalar(select(func.count()).select_from(Vrnic)
                        .where(Vrnic.tenant_id == tenant_id, Vrnic.state.in_(_LIVE))) or 0

    def _tenant_out(self, s: Session, t: Tenant) -> TenantOut:
        return TenantOut(name=t.name, vpc_id=t.vpc_id, default_quota=Quota.model_validate(t.default_quota),
                         max_vrnics=t.max_vrnics, live_vrnics=self._live_count(s, t.id), created_at=t.created_at)

    def _vrnic_out(self, s: Session, r: Vrnic | _Fields, *, tenant_name: str | None = None) -> VrnicOut:
        host = self.host_name if r.host_id == self._host_id else s.scalar(select(Host.name).where(Host.id == r.host_id))
        mode = VrnicMode(r.mode)
        return VrnicOut(
            id=r.public_id, tenant=tenant_name or cast(Vrnic, r).tenant.name, mode=mode, state=VrnicState(r.state),
            host=host or "", device=r.device_name, virtual_gid=r.virtual_gid,
            quota=Quota.model_validate(r.quota), qos=QosPolicy.model_validate(r.qos),
            attach=AttachInfo(vrnic_id=r.public_id, mode=mode, device=r.device_name, virtual_gid=r.virtual_gid,
                              socket_path=r.socket_path, extra=r.attach_extra),
            created_at=r.created_at, updated_at=r.updated_at, released_at=r.released_at)

    def _device_out(self, s: Session, d: Device) -> DeviceOut:
        live = s.scalar(select(func.count()).select_from(Vrnic)
                        .where(Vrnic.device_id == d.id, Vrnic.state.in_(_LIVE))) or 0
        return DeviceOut(id=d.id, host=d.host.name, name=d.name, driver=d.driver, node_guid=d.node_guid,
                         ports=d.ports, caps=d.caps, present=d.present, live_vrnics=live,
                         discovered_at=d.discovered_at)

    @staticmethod
    def _page(s: Session, query: Select[tuple[Any]], key: Any, cursor: str | None, limit: int,
              convert: Callable[[Any], T]) -> Page[T]:
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidArgument(f"limit must be 1..{MAX_PAGE}")
        if cursor is not None:
            if not (cursor.isascii() and cursor.isdigit() and int(cursor) < 1 << 63):
                raise InvalidArgument(f"bad cursor {cursor!r}: pass back a next_cursor")
            query = query.where(key > int(cursor))
        rows = list(s.scalars(query.order_by(key).limit(limit + 1)))
        more = len(rows) > limit
        rows = rows[:limit]
        next_cursor = str(getattr(rows[-1], key.key)) if more else None
        return Page[T](items=[convert(r) for r in rows], next_cursor=next_cursor)

    @staticmethod
    def _event(s: Session, principal: Principal, action: str, subject: str, tenant_id: int | None,
               detail: dict[str, Any], *, actor: str | None = None) -> None:
        s.flush()  # rows this event may refer to go first
        s.connection().execute(_INSERT_EVENT, {"at": utcnow(), "actor": actor or principal.actor, "action": action,
                                               "subject": subject, "tenant_id": tenant_id, "detail": detail})


class _Fields:
    """A vRNIC's column values (from Core) read like the ORM object's attributes."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # for mypy: any column
        raise AttributeError(name)


VRNICS = cast(Table, Vrnic.__table__)
EVENTS = cast(Table, Event.__table__)

# The hot path's statements, built once: values arrive as parameters, so SQLAlchemy compiles each once.
_INSERT_VRNIC = insert(VRNICS)
_INSERT_EVENT = insert(EVENTS)
_PLACE_VRNIC = update(VRNICS).where(VRNICS.c.serial == bindparam("b_serial"))
_RELEASE_VRNIC = update(VRNICS).where(VRNICS.c.serial == bindparam("b_serial"))
_TENANT_COLUMNS = select(Tenant.id, Tenant.name, Tenant.vpc_id, Tenant.max_vrnics, Tenant.default_quota)
_TENANT_BY_NAME = _TENANT_COLUMNS.where(Tenant.name == bindparam("b_name"))
_TENANT_BY_ID = _TENANT_COLUMNS.where(Tenant.id == bindparam("b_id"))
_LOCK_TENANT = select(Tenant.id).where(Tenant.id == bindparam("b_id")).with_for_update()
_VRNIC_FOR_UPDATE = select(VRNICS, Tenant.name.label("tenant_name")) \
    .join(Tenant, Tenant.id == VRNICS.c.tenant_id).where(VRNICS.c.public_id == bindparam("b_id")) \
    .with_for_update(of=VRNICS)
_TENANT_VRNIC_FOR_UPDATE = _VRNIC_FOR_UPDATE.where(VRNICS.c.tenant_id == bindparam("b_tenant"))


def _list_page(items: list[tuple[int, T]], cursor: str | None, limit: int) -> Page[T]:
    """A page of an in-memory list keyed by ascending ints (VF index, PF position), cursors as in _page."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidArgument(f"limit must be 1..{MAX_PAGE}")
    if cursor is not None:
        if not (cursor.isascii() and cursor.isdigit() and int(cursor) < 1 << 63):
            raise InvalidArgument(f"bad cursor {cursor!r}: pass back a next_cursor")
        items = [(key, item) for key, item in items if key > int(cursor)]
    page = items[:limit]
    next_cursor = str(page[-1][0]) if len(items) > limit else None
    return Page[T](items=[item for _, item in page], next_cursor=next_cursor)


def _settings(config: VfConfig) -> VfSettings:
    return VfSettings(mac=config.mac, vlan=config.vlan, qos=config.qos, max_tx_rate=config.max_tx_rate,
                      min_tx_rate=config.min_tx_rate, spoofchk=config.spoofchk, trust=config.trust,
                      link_state=cast(Any, config.link_state.name.lower()))


def _pf_out(inventory: PfInventory) -> SriovPfOut:
    pf = inventory.pf
    return SriovPfOut(name=pf.name, kind=pf.kind.value, bus_id=pf.bus_id, driver=pf.driver, num_vfs=pf.num_vfs,
                      total_vfs=pf.total_vfs, eswitch_mode=pf.eswitch_mode, rdma_device=pf.rdma_device,
                      allocated_vfs=len(inventory.allocations),
                      free_vfs=pf.num_vfs - sum(1 for i in inventory.allocations if i < pf.num_vfs),
                      vanished_vrnics=[a.vrnic_id for a in inventory.vanished])


def _vf_out(pf: str, index: int, vf: VfInfo | None, allocation: Allocation | None) -> SriovVfOut:
    held = None
    if allocation is not None:
        held = VfAllocationOut(vrnic_id=allocation.vrnic_id, tenant=allocation.tenant,
                               desired=_settings(allocation.config),
                               in_sync=vf is not None and vf.config == allocation.config,
                               netns=allocation.netns, vanished=allocation.vanished)
    return SriovVfOut(pf=pf, index=index, pci_address=vf.pci_address if vf else None,
                      netdev=vf.netdev if vf else None, rdma_device=vf.rdma_device if vf else None,
                      settings=_settings(vf.config) if vf else None, allocation=held)


def _sriov_event_out(event: VfEvent) -> SriovEventOut:
    return SriovEventOut(kind=str(event.kind), pf=event.pf, vf=event.vf, vrnic_id=event.vrnic_id,
                         detail=dict(event.detail))


def _host_out(h: Host) -> HostOut:
    return HostOut(name=h.name, api_url=h.api_url, version=h.version, registered_at=h.registered_at,
                   last_seen_at=h.last_seen_at)

