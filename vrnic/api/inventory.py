"""Inventory: this host, the devices its drivers see, the hosts' liveness, and the audit log (hosts, devices,
events).

Liveness: every agent beats (its hosts.last_seen_at) and sweeps: an up host silent for longer than the window
is marked down (event host.down), and a down host that beats again is up (host.up). Several agents sweeping
at once write each change once: the row is locked and its state checked again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from vrnic import __version__
from vrnic.api.auth import Principal
from vrnic.api.converters import device_out, event_out, host_out
from vrnic.api.pagination import PageRequest
from vrnic.api.schemas import DeviceOut, EventOut, HostOut, Page
from vrnic.backend.service import BackendService
from vrnic.core.specs import VrnicMode
from vrnic.db.tables import Device, Event, Host, Tenant, Vrnic, utcnow, vrnic_is_live
from vrnic.db.unit_of_work import DAEMON_ACTOR, Database, UnitOfWork
from vrnic.errors import NotFound

UP, DOWN = "up", "down"


@dataclass(frozen=True)
class HostRef:
    id: int
    name: str
    api_url: str | None
    state: str

    @property
    def up(self) -> bool:
        return self.state == UP


class Inventory:
    def __init__(self, db: Database, backend: BackendService, *, host_name: str, api_url: str | None,
                 device_max_vrnics: int | None = None, down_after_s: float = 6.0) -> None:
        self.db = db
        self.backend = backend
        self.host_name = host_name
        self.api_url = api_url
        self.device_max_vrnics = device_max_vrnics
        self.down_after = timedelta(seconds=down_after_s)
        self._host_id: int | None = None
        self._device_ids: dict[tuple[str, str], int] = {}

    @property
    def host_id(self) -> int:
        if self._host_id is None:
            raise RuntimeError("register_host() first")
        return self._host_id

    def register_host(self) -> None:
        """Register (or refresh) this host and the devices its drivers see now."""
        with self.db.write(DAEMON_ACTOR) as uow:
            s = uow.session
            host = s.scalar(select(Host).where(Host.name == self.host_name))
            if host is None:
                host = Host(name=self.host_name, api_url=self.api_url, version=__version__)
                s.add(host)
                s.flush()
                uow.record("host.register", f"host/{self.host_name}", None, {"version": __version__})
            host.api_url, host.version, host.last_seen_at = self.api_url, __version__, utcnow()
            self._mark_up(uow, host)
            self._host_id = host.id
        self.sync_devices()

    def heartbeat(self, now: datetime | None = None) -> None:
        """This host is alive: its last_seen_at, and up again if the others had marked it down."""
        with self.db.write(DAEMON_ACTOR) as uow:
            # NO KEY UPDATE (PostgreSQL), not FOR UPDATE: a transaction that inserts a vRNIC on this host holds a KEY
            # SHARE lock on the host's row (the foreign key) through its backend call, seconds on a slow agent; FOR
            # UPDATE would wait for it, the beat would stop, and the other hosts would mark this one down
            host = uow.session.scalar(select(Host).where(Host.id == self.host_id).with_for_update(key_share=True))
            if host is None:  # someone deleted the row: register again
                raise NotFound(f"host {self.host_name} is not registered")
            host.last_seen_at = now or utcnow()
            self._mark_up(uow, host)

    @staticmethod
    def _mark_up(uow: UnitOfWork, host: Host) -> None:
        if host.state == DOWN:
            uow.record("host.up", f"host/{host.name}", None, {"last_seen_at": host.last_seen_at.isoformat()})
        host.state = UP

    def sweep(self, now: datetime | None = None) -> list[str]:
        """Mark down the other hosts that have not beaten within the window (as of now); their names."""
        now = now or utcnow()
        cutoff = now - self.down_after
        stale = (select(Host).where(Host.state == UP, Host.last_seen_at < cutoff, Host.id != self.host_id)
                 .order_by(Host.id).with_for_update(key_share=True))  # NO KEY UPDATE, as in heartbeat
        with self.db.write(DAEMON_ACTOR) as uow:
            marked = []
            for host in uow.session.scalars(stale):
                host.state = DOWN
                uow.record("host.down", f"host/{host.name}", None,
                           {"last_seen_at": host.last_seen_at.isoformat(), "silent_s": (now - host.last_seen_at)
                            .total_seconds(), "by": self.host_name})
                marked.append(host.name)
            return marked

    def host_ref(self, s: Session, host_id: int) -> HostRef:
        row = s.execute(select(Host.id, Host.name, Host.api_url, Host.state).where(Host.id == host_id)).one()
        return HostRef(row.id, row.name, row.api_url, row.state)

    def find_host(self, s: Session, name: str) -> HostRef:
        row = s.execute(select(Host.id, Host.name, Host.api_url, Host.state).where(Host.name == name)).first()
        if row is None:
            raise NotFound(f"no host {name}")
        return HostRef(row.id, row.name, row.api_url, row.state)

    def sync_devices(self) -> None:
        discovered = self.backend.devices()
        with self.db.write(DAEMON_ACTOR) as uow:
            s = uow.session
            rows = {(d.driver, d.name): d for d in s.scalars(select(Device).where(Device.host_id == self.host_id))}
            for info in discovered:
                ports = [p.model_dump() for p in info.ports]
                row = rows.pop((info.driver, info.name), None)
                if row is None:
                    s.add(Device(host_id=self.host_id, name=info.name, driver=info.driver, node_guid=info.node_guid,
                                 ports=ports, caps=dict(info.caps), max_vrnics=self.device_max_vrnics))
                    uow.record("device.discover", f"device/{info.driver}/{info.name}", None,
                               {"node_guid": info.node_guid})
                else:
                    row.node_guid, row.ports, row.caps, row.present = info.node_guid, ports, dict(info.caps), True
                    row.max_vrnics = self.device_max_vrnics
                    row.discovered_at = utcnow()
            for row in rows.values():
                row.present = False
            s.flush()
            self._device_ids = {(d.driver, d.name): d.id for d in
                                s.scalars(select(Device).where(Device.host_id == self.host_id))}

    def device_id(self, uow: UnitOfWork, mode: VrnicMode, name: str) -> int | None:
        """The id of the device a vRNIC was placed on."""
        driver = self.backend.driver(mode).name
        known = self._device_ids.get((driver, name))
        if known is not None:
            return known
        # A device that appeared after startup: record it in this transaction (not cached until the next
        # sync, since this transaction may still roll back).
        s = uow.session
        row = s.scalar(select(Device).where(Device.host_id == self.host_id, Device.driver == driver,
                                            Device.name == name))
        if row is None:
            info = next((d for d in self.backend.devices() if d.driver == driver and d.name == name), None)
            if info is None:
                return None
            row = Device(host_id=self.host_id, name=name, driver=driver, node_guid=info.node_guid,
                         ports=[p.model_dump() for p in info.ports], caps=dict(info.caps),
                         max_vrnics=self.device_max_vrnics)
            s.add(row)
            s.flush()
        return row.id

    def host_name_of(self, s: Session, host_id: int) -> str:
        if host_id == self._host_id:
            return self.host_name
        return s.scalar(select(Host.name).where(Host.id == host_id)) or ""

    # -- the API's views --------------------------------------------------------------------------

    def list_devices(self, principal: Principal, cursor: str | None, limit: int) -> Page[DeviceOut]:
        principal.require_operator()
        request = PageRequest.parse(cursor, limit)
        with self.db.read() as uow:
            rows = uow.session.scalars(request.window(select(Device), Device.id))
            return request.page(rows, lambda d: d.id, lambda d: self._device_out(uow.session, d))

    def get_device(self, principal: Principal, device_id: int) -> DeviceOut:
        principal.require_operator()
        with self.db.read() as uow:
            row = uow.session.get(Device, device_id)
            if row is None:
                raise NotFound(f"no device {device_id}")
            return self._device_out(uow.session, row)

    def list_hosts(self, principal: Principal, cursor: str | None, limit: int) -> Page[HostOut]:
        principal.require_operator()
        request = PageRequest.parse(cursor, limit)
        with self.db.read() as uow:
            return request.page(uow.session.scalars(request.window(select(Host), Host.id)), lambda h: h.id, host_out)

    def get_host(self, principal: Principal, name: str) -> HostOut:
        principal.require_operator()
        with self.db.read() as uow:
            row = uow.session.scalar(select(Host).where(Host.name == name))
            if row is None:
                raise NotFound(f"no host {name}")
            return host_out(row)

    def list_events(self, principal: Principal, cursor: str | None, limit: int, *, subject: str | None = None,
                    action: str | None = None) -> Page[EventOut]:
        """The audit log, oldest first; a tenant sees only events about itself."""
        request = PageRequest.parse(cursor, limit)
        query = select(Event)
        if not principal.is_operator:
            query = query.where(Event.tenant_id == principal.tenant_id)
        if subject is not None:
            query = query.where(Event.subject == subject)
        if action is not None:
            query = query.where(Event.action == action)
        with self.db.read() as uow:
            names = dict(uow.session.execute(select(Tenant.id, Tenant.name)).tuples().all())
            rows = uow.session.scalars(request.window(query, Event.id))
            return request.page(rows, lambda e: e.id, lambda e: event_out(
                e, tenant=names.get(e.tenant_id) if e.tenant_id is not None else None))

    def _device_out(self, s: Session, device: Device) -> DeviceOut:
        live = s.scalar(select(func.count()).select_from(Vrnic)
                        .where(Vrnic.device_id == device.id, vrnic_is_live(Vrnic.state))) or 0
        return device_out(device, host=self.host_name_of(s, device.host_id), live_vrnics=live)
