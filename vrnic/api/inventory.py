"""Inventory: this host, the devices its drivers see, and the audit log (hosts, devices, events)."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from vrnic import __version__
from vrnic.api.auth import Principal
from vrnic.api.converters import device_out, event_out, host_out
from vrnic.api.pagination import PageRequest
from vrnic.api.schemas import DeviceOut, EventOut, HostOut, Page
from vrnic.backend.service import BackendService
from vrnic.core.lifecycle import VrnicState
from vrnic.core.specs import VrnicMode
from vrnic.db.tables import Device, Event, Host, Tenant, Vrnic, utcnow
from vrnic.db.unit_of_work import DAEMON_ACTOR, Database, UnitOfWork
from vrnic.errors import NotFound

LIVE_STATES = [s.value for s in VrnicState if s is not VrnicState.RELEASED]


class Inventory:
    def __init__(self, db: Database, backend: BackendService, *, host_name: str, api_url: str | None) -> None:
        self.db = db
        self.backend = backend
        self.host_name = host_name
        self.api_url = api_url
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
            self._host_id = host.id
        self.sync_devices()

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
                                 ports=ports, caps=dict(info.caps)))
                    uow.record("device.discover", f"device/{info.driver}/{info.name}", None,
                               {"node_guid": info.node_guid})
                else:
                    row.node_guid, row.ports, row.caps, row.present = info.node_guid, ports, dict(info.caps), True
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
                         ports=[p.model_dump() for p in info.ports], caps=dict(info.caps))
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
                        .where(Vrnic.device_id == device.id, Vrnic.state.in_(LIVE_STATES))) or 0
        return device_out(device, host=self.host_name_of(s, device.host_id), live_vrnics=live)
