"""SR-IOV desired state in the database (the sriov_vfs table) and SR-IOV events as audit-log rows.

DbVfStateStore implements vrnic.sriov.store.VfStateStore: one row per VF a vRNIC holds, linked to the vRNIC
row (vrnic_serial; the vRNIC's public id and tenant come from the join). Reconcile on daemon start compares
these rows with netlink.

The control plane calls the backend inside its own write transaction (SQLite has one writer, so a second
connection would wait for it forever). Within `bound_to(connection, actor)` the store and the event log
write through that connection instead: the vRNIC row, its VF's desired state and the events commit or roll
back together. Outside it (tests, tools) each call runs in a short transaction of its own.
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Connection, Engine, Row, Table, delete, insert, select, update
from sqlalchemy.exc import SQLAlchemyError

from vrnic.db.tables import Event, Host, SriovVf, Tenant, Vrnic, utcnow
from vrnic.errors import NotFound
from vrnic.sriov.vf_types import Allocation, LinkState, VfAddress, VfConfig, VfEvent

log = logging.getLogger(__name__)

DAEMON_ACTOR = "daemon"


@dataclass(frozen=True)
class _Binding:
    connection: Connection
    actor: str


_binding: ContextVar[_Binding | None] = ContextVar("vrnic_sriov_db_binding", default=None)


@contextmanager
def bound_to(connection: Connection, actor: str) -> Iterator[None]:
    """SR-IOV state and events written in this block (this thread) go through connection's transaction;
    events are attributed to actor ("operator", "tenant:<name>", "daemon")."""
    token = _binding.set(_Binding(connection, actor))
    try:
        yield
    finally:
        _binding.reset(token)


def _bound(engine: Engine) -> _Binding | None:
    binding = _binding.get()
    if binding is not None and binding.connection.engine.url == engine.url:
        return binding
    return None


class _Database:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._reader = engine.execution_options(vrnic_read_only=True)

    @contextmanager
    def connection(self, write: bool) -> Iterator[Connection]:
        binding = _bound(self._engine)
        if binding is not None:
            yield binding.connection
            return
        with (self._engine if write else self._reader).begin() as connection:
            yield connection


SRIOV_VFS = cast(Table, SriovVf.__table__)
_ALLOCATIONS = (select(SRIOV_VFS, Vrnic.public_id, Tenant.name.label("tenant_name"))
                .join(Vrnic, Vrnic.serial == SriovVf.vrnic_serial)
                .join(Tenant, Tenant.id == Vrnic.tenant_id))


class DbVfStateStore(_Database):
    """VfStateStore on sriov_vfs for the host named host_name (registered by the API at startup).

    Allocations written inside a caller's transaction stay visible to this process until a committed read
    shows them (or they are deleted): other transactions must not hand out that VF meanwhile (PostgreSQL runs
    allocations concurrently), and if the caller's transaction rolls back after the VF was configured, the
    release that undoes it must still find the allocation to reset the VF.
    """

    def __init__(self, engine: Engine, host_name: str) -> None:
        super().__init__(engine)
        self.host_name = host_name
        self._host_id: int | None = None
        self._unsettled: dict[str, Allocation] = {}
        self._lock = threading.Lock()

    def _host(self, connection: Connection, required: bool) -> int | None:
        if self._host_id is None:
            self._host_id = connection.scalar(select(Host.id).where(Host.name == self.host_name))
            if self._host_id is None and required:
                raise NotFound(f"host {self.host_name} is not registered (the API registers it at startup)")
        return self._host_id

    def list(self) -> list[Allocation]:
        with self.connection(write=False) as connection:
            host = self._host(connection, required=False)
            stored = [] if host is None else [_allocation(row) for row in connection.execute(
                _ALLOCATIONS.where(SriovVf.host_id == host).order_by(SriovVf.pf, SriovVf.vf_index, SriovVf.id))]
        return self._with_unsettled({a.vrnic_id: a for a in stored}, committed=_bound(self._engine) is None)

    def get(self, vrnic_id: str) -> Allocation | None:
        with self.connection(write=False) as connection:
            host = self._host(connection, required=False)
            row = None if host is None else connection.execute(
                _ALLOCATIONS.where(SriovVf.host_id == host, Vrnic.public_id == vrnic_id)).first()
        found = {vrnic_id: _allocation(row)} if row is not None else {}
        return next(iter(self._with_unsettled(found, _bound(self._engine) is None, only=vrnic_id)), None)

    def _with_unsettled(self, stored: dict[str, Allocation], committed: bool, only: str | None = None
                        ) -> builtins.list[Allocation]:
        with self._lock:
            if committed:  # what a committed read shows has settled
                for vrnic_id in stored:
                    self._unsettled.pop(vrnic_id, None)
            for vrnic_id, allocation in self._unsettled.items():
                if vrnic_id not in stored and (only is None or vrnic_id == only):
                    stored[vrnic_id] = allocation
        return sorted(stored.values(), key=lambda a: (a.address.pf, a.address.index, a.vanished))

    def put(self, allocation: Allocation) -> None:
        with self.connection(write=True) as connection:
            host = self._host(connection, required=True)
            serial = connection.scalar(select(Vrnic.serial).where(Vrnic.public_id == allocation.vrnic_id))
            if serial is None:
                raise NotFound(f"no vRNIC {allocation.vrnic_id} in the database to hold {allocation.address}")
            values = _row_values(allocation) | {"host_id": host, "updated_at": utcnow()}
            updated = connection.execute(update(SriovVf).where(SriovVf.vrnic_serial == serial), values)
            if updated.rowcount == 0:
                connection.execute(insert(SriovVf), values | {"vrnic_serial": serial})
        with self._lock:
            if _bound(self._engine) is not None:
                self._unsettled[allocation.vrnic_id] = allocation
            else:
                self._unsettled.pop(allocation.vrnic_id, None)

    def delete(self, vrnic_id: str) -> None:
        with self.connection(write=True) as connection:
            serial = select(Vrnic.serial).where(Vrnic.public_id == vrnic_id).scalar_subquery()
            connection.execute(delete(SriovVf).where(SriovVf.vrnic_serial == serial))
        with self._lock:
            self._unsettled.pop(vrnic_id, None)


class DbVfEventLog(_Database):
    """The SriovManager's on_event: each VfEvent becomes an Event row (action = the kind, subject
    vf/<pf>/<index> or pf/<pf>), visible to the vRNIC's tenant when it concerns one. Never raises: a failed
    audit write is logged, and the VF operation that caused it goes on."""

    def __call__(self, event: VfEvent) -> None:
        binding = _bound(self._engine)
        actor = binding.actor if binding is not None else DAEMON_ACTOR
        subject = f"vf/{event.pf}/{event.vf}" if event.vf is not None else f"pf/{event.pf}"
        detail: dict[str, Any] = dict(event.detail)
        if event.vrnic_id is not None:
            detail["vrnic_id"] = event.vrnic_id
        try:
            with self.connection(write=True) as connection, _savepoint(connection, binding is not None):
                tenant_id = connection.scalar(select(Vrnic.tenant_id).where(Vrnic.public_id == event.vrnic_id)) \
                    if event.vrnic_id is not None else None
                connection.execute(insert(Event), {"at": utcnow(), "actor": actor, "action": str(event.kind)[:40],
                                                   "subject": subject[:80], "tenant_id": tenant_id, "detail": detail})
        except SQLAlchemyError as exc:
            log.error("could not record SR-IOV event %s: %s", event, exc)


@contextmanager
def _savepoint(connection: Connection, nested: bool) -> Iterator[None]:
    # Inside someone else's transaction a failed insert must not abort it (PostgreSQL would refuse every
    # later statement): a savepoint confines the failure to the event.
    if not nested:
        yield
        return
    with connection.begin_nested():
        yield


def _row_values(allocation: Allocation) -> dict[str, Any]:
    config = allocation.config
    return {"pf": allocation.address.pf, "vf_index": allocation.address.index, "mac": config.mac,
            "vlan": config.vlan, "qos": config.qos, "max_tx_rate_mbps": config.max_tx_rate,
            "min_tx_rate_mbps": config.min_tx_rate, "trust": config.trust, "spoofchk": config.spoofchk,
            "link_state": config.link_state.name.lower(), "netns": allocation.netns,
            "vanished": allocation.vanished}


def _allocation(row: Row[Any]) -> Allocation:
    vf = row._mapping
    default = VfConfig()

    def value(column: str, fallback: Any) -> Any:
        return vf[column] if vf[column] is not None else fallback

    config = VfConfig(
        mac=value("mac", default.mac), vlan=value("vlan", default.vlan), qos=value("qos", default.qos),
        max_tx_rate=value("max_tx_rate_mbps", default.max_tx_rate),
        min_tx_rate=value("min_tx_rate_mbps", default.min_tx_rate),
        spoofchk=bool(value("spoofchk", default.spoofchk)), trust=bool(value("trust", default.trust)),
        link_state=LinkState[vf["link_state"].upper()] if vf["link_state"] else default.link_state)
    return Allocation(vrnic_id=vf["public_id"], tenant=vf["tenant_name"], address=VfAddress(vf["pf"], vf["vf_index"]),
                      config=config, netns=vf["netns"], vanished=bool(vf["vanished"]))
