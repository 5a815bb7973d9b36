"""SR-IOV desired state in the database (the sriov_vfs table) and SR-IOV events as audit-log rows.

DbVfStateStore implements vrnic.sriov.store.VfStateStore: one row per VF a vRNIC holds, linked to the vRNIC
row (vrnic_serial; the vRNIC's public id and tenant come from the join). Reconcile on daemon start compares
these rows with netlink.

The control plane calls the backend inside its own write transaction (SQLite has one writer, so a second
connection would wait for it forever). It hands that unit of work to the store explicitly
(`store.working_in(...)`): until it has committed or rolled back, the store and the event log write through
it in that thread (the vRNIC row, its VF's desired state and the events commit or roll back together), and
the next unit of work waits for the store. So an allocation only ever sees committed VFs (no two
transactions hand out one VF), and the undo of a failed unit of work still finds the allocation it has to
reset. Other callers (read-only views, tests, tools) run each call in a short transaction of their own
and see what has committed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, cast

from sqlalchemy import Connection, Engine, Row, Table, delete, insert, select, update
from sqlalchemy.exc import SQLAlchemyError

from vrnic.db.tables import Event, Host, SriovVf, Tenant, Vrnic, utcnow
from vrnic.db.unit_of_work import DAEMON_ACTOR, UnitOfWork
from vrnic.errors import NotFound
from vrnic.sriov.vf_types import Allocation, LinkState, VfAddress, VfConfig, VfEvent

log = logging.getLogger(__name__)


SRIOV_VFS = cast(Table, SriovVf.__table__)
_ALLOCATIONS = (select(SRIOV_VFS, Vrnic.public_id, Tenant.name.label("tenant_name"))
                .join(Vrnic, Vrnic.serial == SriovVf.vrnic_serial)
                .join(Tenant, Tenant.id == Vrnic.tenant_id))


class DbVfStateStore:
    """VfStateStore on sriov_vfs for the host named host_name (registered by the API at startup)."""

    def __init__(self, engine: Engine, host_name: str) -> None:
        self.engine = engine
        self.host_name = host_name
        self._reader = engine.execution_options(vrnic_read_only=True)
        self._host_id: int | None = None
        self._one_at_a_time = threading.Lock()  # units of work take turns, from before they begin to the end
        self._uow: UnitOfWork | None = None
        self._owner: int | None = None  # the thread running it: only its calls go through it
        # What that unit of work wrote: if its commit fails, the undo finds the allocation here.
        self._written: dict[str, Allocation] = {}

    @contextmanager
    def working_in(self, begin: Callable[[], AbstractContextManager[UnitOfWork]]) -> Iterator[UnitOfWork]:
        """Take the store, then begin() a unit of work; the store writes through it until it has committed
        or rolled back (its undo actions included). The store is taken first: the same lock order for
        every writer."""
        with self._one_at_a_time:
            try:
                with begin() as uow:
                    self._uow, self._written, self._owner = uow, {}, threading.get_ident()
                    yield uow
            finally:
                self._owner, self._uow, self._written = None, None, {}

    def _mine(self) -> UnitOfWork | None:
        """The unit of work the calling thread runs the store in, if any."""
        uow = self._uow
        return uow if self._owner == threading.get_ident() else None

    @property
    def actor(self) -> str:
        """Who the current writes are for: the unit of work's actor, else the daemon."""
        uow = self._mine()
        return uow.actor if uow is not None else DAEMON_ACTOR

    @contextmanager
    def connection(self, write: bool) -> Iterator[tuple[Connection, bool]]:
        """(a connection, whether it is the unit of work's)."""
        uow = self._mine()
        if uow is not None:
            yield uow.connection, True
            return
        with (self.engine if write else self._reader).begin() as connection:
            yield connection, False

    def _written_here(self) -> dict[str, Allocation]:
        return self._written if self._mine() is not None else {}

    def _host(self, connection: Connection, required: bool) -> int | None:
        if self._host_id is None:
            self._host_id = connection.scalar(select(Host.id).where(Host.name == self.host_name))
            if self._host_id is None and required:
                raise NotFound(f"host {self.host_name} is not registered (the API registers it at startup)")
        return self._host_id

    def list(self) -> list[Allocation]:
        with self.connection(write=False) as (connection, _):
            host = self._host(connection, required=False)
            stored = {} if host is None else {a.vrnic_id: a for a in map(_allocation, connection.execute(
                _ALLOCATIONS.where(SriovVf.host_id == host).order_by(SriovVf.pf, SriovVf.vf_index, SriovVf.id)))}
            for vrnic_id, allocation in self._written_here().items():
                stored.setdefault(vrnic_id, allocation)
        return _ordered(stored.values())

    def get(self, vrnic_id: str) -> Allocation | None:
        with self.connection(write=False) as (connection, _):
            host = self._host(connection, required=False)
            row = None if host is None else connection.execute(
                _ALLOCATIONS.where(SriovVf.host_id == host, Vrnic.public_id == vrnic_id)).first()
            return _allocation(row) if row is not None else self._written_here().get(vrnic_id)

    def put(self, allocation: Allocation) -> None:
        with self.connection(write=True) as (connection, in_unit_of_work):
            host = self._host(connection, required=True)
            serial = connection.scalar(select(Vrnic.serial).where(Vrnic.public_id == allocation.vrnic_id))
            if serial is None:
                raise NotFound(f"no vRNIC {allocation.vrnic_id} in the database to hold {allocation.address}")
            values = _row_values(allocation) | {"host_id": host, "updated_at": utcnow()}
            updated = connection.execute(update(SriovVf).where(SriovVf.vrnic_serial == serial), values)
            if updated.rowcount == 0:
                connection.execute(insert(SriovVf), values | {"vrnic_serial": serial})
            if in_unit_of_work:
                self._written[allocation.vrnic_id] = allocation

    def delete(self, vrnic_id: str) -> None:
        with self.connection(write=True) as (connection, _):
            serial = select(Vrnic.serial).where(Vrnic.public_id == vrnic_id).scalar_subquery()
            connection.execute(delete(SriovVf).where(SriovVf.vrnic_serial == serial))
            self._written_here().pop(vrnic_id, None)


class DbVfEventLog:
    """The SriovManager's on_event: each VfEvent becomes an Event row (action = the kind, subject
    vf/<pf>/<index> or pf/<pf>), visible to the vRNIC's tenant when it concerns one, written through the
    store's unit of work when it has one. Never raises: a failed audit write is logged, and the VF operation
    that caused it goes on."""

    def __init__(self, store: DbVfStateStore) -> None:
        self.store = store

    def __call__(self, event: VfEvent) -> None:
        subject = f"vf/{event.pf}/{event.vf}" if event.vf is not None else f"pf/{event.pf}"
        detail: dict[str, Any] = dict(event.detail)
        if event.vrnic_id is not None:
            detail["vrnic_id"] = event.vrnic_id
        try:
            with self.store.connection(write=True) as (connection, nested), _savepoint(connection, nested):
                tenant_id = connection.scalar(select(Vrnic.tenant_id).where(Vrnic.public_id == event.vrnic_id)) \
                    if event.vrnic_id is not None else None
                connection.execute(insert(Event), {"at": utcnow(), "actor": self.store.actor,
                                                   "action": str(event.kind)[:40], "subject": subject[:80],
                                                   "tenant_id": tenant_id, "detail": detail})
        except SQLAlchemyError as exc:
            log.error("could not record SR-IOV event %s: %s", event, exc)


def _ordered(allocations: Iterable[Allocation]) -> list[Allocation]:
    return sorted(allocations, key=lambda a: (a.address.pf, a.address.index, a.vanished))


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
