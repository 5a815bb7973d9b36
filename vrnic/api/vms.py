"""vRNICs of VMs: which libvirt domain a vRNIC is attached to, and the libvirt hook's admission and binding.

`vrnic vm attach` records the domain here (after the tenant checks) and edits the
domain's XML itself. The hook (operator token) asks for admission at `prepare`,
binds the running domain at `started`/`reconnect` (vrnicd maps its RAM and
connects its channels) and unbinds it at `stopped`/`release`. What vrnicd serves
is observed from the backend; the database keeps which domain a vRNIC belongs to.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from vrnic.api.auth import Principal
from vrnic.api.converters import vrnic_out
from vrnic.api.inventory import HostRef, Inventory
from vrnic.api.schemas import (
    VmAdmitted,
    VmMigrationAborted,
    VmMigrationPrepared,
    VmMigrationSwitched,
    VmUnbound,
    VrnicOut,
)
from vrnic.api.transactions import Transactions
from vrnic.api.vrnics import find_vrnic
from vrnic.backend.peer_directory import AgentRef
from vrnic.backend.remote_handover import AgentClient, AgentDestination, AgentPeerHost
from vrnic.backend.service import BackendService
from vrnic.core.lifecycle import VrnicState
from vrnic.core.specs import DataEngine, VmBinding, VrnicMode
from vrnic.db.tables import Device, Vrnic
from vrnic.errors import Conflict, InvalidArgument, NotFound, Unavailable, VrnicError

log = logging.getLogger(__name__)

@dataclass
class _Leaving:
    """A VM this host hands to another host: where to, and the agent connections the hand-over uses."""

    host: HostRef
    device: str
    moving: list[str]
    clients: list[AgentClient] = field(default_factory=list)

    def close(self) -> None:
        for client in self.clients:
            client.close()


class Vms:
    def __init__(self, tx: Transactions, backend: BackendService, inventory: Inventory,
                 agent_token: str | None = None) -> None:
        self.tx = tx
        self.backend = backend
        self.inventory = inventory
        self.agent_token = agent_token
        self._leaving: dict[str, _Leaving] = {}
        self._leaving_lock = threading.Lock()

    # -- vrnic vm attach / detach ------------------------------------------------------------------
    def attach(self, principal: Principal, vrnic_id: str, domain: str) -> VrnicOut:
        with self.tx.write(principal.actor) as uow:
            row, tenant = find_vrnic(uow.session, principal, vrnic_id, for_update=True)
            if row.state == VrnicState.RELEASED.value:
                raise Conflict(f"vRNIC {vrnic_id} was released", current_state="released")
            _refuse_direct(row, "give the VM a vRNIC with the ring engine")
            if row.vm_domain not in (None, domain):
                raise Conflict(f"vRNIC {vrnic_id} is attached to VM {row.vm_domain}; detach it there first",
                               current_state="attached")
            if row.vm_domain is None and vrnic_id in self._container_attached():
                raise Conflict(f"vRNIC {vrnic_id} has a container guest attached", current_state="attached")
            if row.vm_domain != domain:
                row.vm_domain = domain
                uow.record("vrnic.vm_attach", f"vrnic/{vrnic_id}", row.tenant_id, {"domain": domain})
            return self._out(uow.session, row, tenant)

    def detach(self, principal: Principal, vrnic_id: str) -> VrnicOut:
        with self.tx.write(principal.actor) as uow:
            row, tenant = find_vrnic(uow.session, principal, vrnic_id, for_update=True)
            domain = row.vm_domain
            if domain is not None:
                bound = self.backend.vm_bindings().get(domain)
                if bound is not None and any(v.vrnic_id == vrnic_id for v in bound.vrnics):
                    self.backend.unbind_vm(domain)  # the running VM loses the vRNIC's service now
                row.vm_domain = None
                uow.record("vrnic.vm_detach", f"vrnic/{vrnic_id}", row.tenant_id, {"domain": domain})
            return self._out(uow.session, row, tenant)

    # -- the libvirt hook (operator) ---------------------------------------------------------------
    def admission(self, principal: Principal, domain: str, vrnic_ids: list[str]) -> VmAdmitted:
        principal.require_operator()
        with self.tx.read() as uow:
            self._admit(uow.session, principal, domain, vrnic_ids)
        return VmAdmitted(domain=domain, vrnic_ids=vrnic_ids)

    def bind(self, principal: Principal, domain: str, binding: VmBinding) -> VmBinding:
        principal.require_operator()
        if binding.domain != domain:
            raise InvalidArgument(f"the binding names domain {binding.domain}, the path {domain}")
        with self.tx.write(principal.actor) as uow:
            rows = self._admit(uow.session, principal, domain, [v.vrnic_id for v in binding.vrnics], for_update=True)
            for row in rows:
                if row.vm_domain is None:
                    row.vm_domain = domain
            self.backend.bind_vm(binding)  # in the transaction: if vrnicd cannot bind, nothing is recorded
            uow.record("vm.bind", f"vm/{domain}", None, {"vrnics": [v.vrnic_id for v in binding.vrnics],
                                                         "ram_path": binding.ram_path})
        return binding

    def unbind(self, principal: Principal, domain: str) -> VmUnbound:
        """The libvirt hook at stopped/release. A VM that has a hand-over prepared stopped because libvirt's
        migration completed (`virsh migrate --live --suspend`: its Confirm step ends the source QEMU while the
        destination waits paused, and no hook runs earlier after QEMU's last pass): hand its vRNICs over now.
        If the hand-over fails, nothing runs the VM any more here: release everything, as for any stop."""
        principal.require_operator()
        with self._leaving_lock:
            leaving = domain in self._leaving
        if leaving:
            try:
                result = self.handover_complete(principal, domain)
                log.info("VM %s stopped here after its migration: vRNICs handed over (%s)", domain, result)
                moved = result.get("vrnics")
                return VmUnbound(domain=domain, unbound=[str(v) for v in moved] if isinstance(moved, list) else [])
            except VrnicError as exc:
                log.error("VM %s stopped with a hand-over prepared, which failed: %s; releasing it here", domain, exc)
                self.handover_abort(principal, domain)
        unbound = self.backend.unbind_vm(domain)
        if unbound:
            with self.tx.write(principal.actor) as uow:
                uow.record("vm.unbind", f"vm/{domain}", None, {"vrnics": unbound})
        return VmUnbound(domain=domain, unbound=unbound)

    # -- live migration between two QEMU processes on this host (operator) ---------------------------
    def migration_prepare(self, principal: Principal, domain: str, target: VmBinding) -> VmMigrationPrepared:
        principal.require_operator()
        with self.tx.write(principal.actor) as uow:
            result = VmMigrationPrepared.model_validate(self.backend.prepare_vm_migration(domain, target))
            uow.record("vm.migration_prepare", f"vm/{domain}", None, {"ram_path": target.ram_path,
                                                                       "moving": result.moving})
        return result

    def migration_complete(self, principal: Principal, domain: str) -> VmMigrationSwitched:
        principal.require_operator()
        with self.tx.write(principal.actor) as uow:
            result = VmMigrationSwitched.model_validate(self.backend.complete_vm_migration(domain))
            uow.record("vm.migration_switchover", f"vm/{domain}", None, result.model_dump())
        return result

    def migration_abort(self, principal: Principal, domain: str) -> VmMigrationAborted:
        principal.require_operator()
        aborted = self.backend.abort_vm_migration(domain)
        if aborted:
            with self.tx.write(principal.actor) as uow:
                uow.record("vm.migration_abort", f"vm/{domain}", None, {})
        return VmMigrationAborted(domain=domain, aborted=aborted)

    # -- live migration to another host (operator; vrnic.backend.vm_handover) -------------------------------
    def handover_prepare(self, principal: Principal, domain: str, host: str, target: VmBinding) -> dict[str, Any]:
        """The VM's destination QEMU runs on `host` (paused, incoming; target: its binding there). That host's
        vrnicd pre-sets-up the vRNICs; this one and every peer host start logging what the NIC writes."""
        principal.require_operator()
        with self.tx.read() as uow:
            dest = self.inventory.find_host(uow.session, host)
        if dest.name == self.inventory.host_name:
            raise InvalidArgument(f"{host} is this host: migrate within it with POST /vms/{domain}/migration")
        if not dest.up or not dest.api_url:
            raise Unavailable(f"host {dest.name} is down or has no agent URL")
        if self.agent_token is None:
            raise Unavailable("no agent token on this host (set VRNIC_AGENT_TOKEN)")
        token = self.agent_token
        with self._leaving_lock:
            if domain in self._leaving:
                raise Conflict(f"VM {domain} is already moving to host {self._leaving[domain].host.name}",
                               current_state="migrating")
            leaving = self._leaving[domain] = _Leaving(dest, "", [])

        def client(agent: AgentRef) -> AgentClient:
            leaving.clients.append(AgentClient(agent, token))
            return leaving.clients[-1]

        try:
            result = self.backend.handover().prepare_vm_handover(
                domain, target, AgentDestination(client(AgentRef(dest.name, dest.api_url))),
                lambda agent: AgentPeerHost(client(agent)))
            moving = result["moving"]
            assert isinstance(moving, list)
            leaving.device, leaving.moving = str(result["device"]), [str(v) for v in moving]
            with self.tx.write(principal.actor) as uow:
                uow.record("vm.handover_prepare", f"vm/{domain}", None, {"host": dest.name, "moving": leaving.moving,
                                                                         "ram_path": target.ram_path})
        except BaseException:
            with self._leaving_lock:
                self._leaving.pop(domain, None)
            leaving.close()
            raise
        return result

    def handover_complete(self, principal: Principal, domain: str) -> dict[str, Any]:
        """QEMU's migration completed, the destination has not run: hand the vRNICs over. The vRNICs' host in the
        database changes before any peer asks where they are. On an error (409) this host still serves the VM."""
        principal.require_operator()
        with self._leaving_lock:
            leaving = self._leaving.get(domain)
        if leaving is None:
            raise Conflict(f"VM {domain} has no hand-over to another host prepared", current_state="bound")

        def record_move() -> None:
            with self.tx.write(principal.actor) as uow:
                device_id = uow.session.scalar(select(Device.id).where(Device.host_id == leaving.host.id,
                                                                       Device.name == leaving.device))
                for vrnic_id in leaving.moving:
                    row = uow.session.scalar(select(Vrnic).where(Vrnic.public_id == vrnic_id).with_for_update())
                    if row is None:
                        continue
                    row.host_id, row.device_id, row.device_name = leaving.host.id, device_id, leaving.device
                    uow.record("vrnic.moved", f"vrnic/{vrnic_id}", row.tenant_id,
                               {"domain": domain, "host": leaving.host.name, "device": leaving.device})

        try:
            result = self.backend.handover().complete_vm_handover(domain, record_move)
        except Conflict:
            with self._leaving_lock:  # called off (the source serves on), or never prepared
                if self.backend.handover().vm_bindings().get(domain) is not None:
                    self._leaving.pop(domain, None)
                    leaving.close()
            raise
        with self._leaving_lock:
            self._leaving.pop(domain, None)
        leaving.close()
        with self.tx.write(principal.actor) as uow:
            uow.record("vm.handover_switchover", f"vm/{domain}", None, {"host": leaving.host.name, **result})
        return result

    def handover_abort(self, principal: Principal, domain: str) -> VmMigrationAborted:
        principal.require_operator()
        with self._leaving_lock:
            leaving = self._leaving.pop(domain, None)
        aborted = self.backend.abort_vm_handover(domain)
        if leaving is not None:
            leaving.close()
        if aborted:
            with self.tx.write(principal.actor) as uow:
                uow.record("vm.handover_abort", f"vm/{domain}", None, {})
        return VmMigrationAborted(domain=domain, aborted=aborted)

    def bindings(self, principal: Principal) -> list[VmBinding]:
        principal.require_operator()
        return [b for _, b in sorted(self.backend.vm_bindings().items())]

    # -- rules -------------------------------------------------------------------------------------
    def _admit(self, s: Session, principal: Principal, domain: str, vrnic_ids: list[str], *,
               for_update: bool = False) -> list[Vrnic]:
        """Every vRNIC exists, is live, paravirtual with the ring engine, and belongs to this domain or to none."""
        if len(set(vrnic_ids)) != len(vrnic_ids):
            raise InvalidArgument(f"a vRNIC is named twice for {domain}")
        if for_update:  # one lock order for every writer (serial), so two bindings cannot deadlock (PostgreSQL)
            s.execute(select(Vrnic.serial).where(Vrnic.public_id.in_(vrnic_ids)).order_by(Vrnic.serial)
                      .with_for_update()).all()
        rows = []
        for vrnic_id in vrnic_ids:
            try:
                row, _ = find_vrnic(s, principal, vrnic_id, for_update=for_update)
            except NotFound:
                raise NotFound(f"vRNIC {vrnic_id} does not exist; refusing to start {domain}") from None
            if row.state == VrnicState.RELEASED.value:
                raise Conflict(f"vRNIC {vrnic_id} was released; refusing to start {domain}", current_state="released")
            if row.host_id != self.inventory.host_id:
                raise Conflict(f"vRNIC {vrnic_id} lives on another host; refusing to start {domain} here",
                               current_state="elsewhere")
            if row.mode != VrnicMode.PARAVIRTUAL.value:
                raise InvalidArgument(f"vRNIC {vrnic_id} is {row.mode}: its VF goes to {domain} as a hostdev "
                                      "interface, not through vrnicd")
            _refuse_direct(row, f"refusing to start {domain}")
            if row.vm_domain not in (None, domain):
                raise Conflict(f"vRNIC {vrnic_id} is attached to VM {row.vm_domain}; refusing to start {domain}",
                               current_state="attached")
            rows.append(row)
        return rows

    def _container_attached(self) -> set[str]:
        in_vms = {v.vrnic_id for b in self.backend.vm_bindings().values() for v in b.vrnics}
        return self.backend.attached_vrnics() - in_vms

    def _out(self, s: Session, row: Vrnic, tenant: str) -> VrnicOut:
        return vrnic_out(row, tenant=tenant, host=self.inventory.host_name_of(s, row.host_id))


def _refuse_direct(row: Vrnic, then: str) -> None:
    """A VM's vRNIC keeps the ring engine: stock QEMU cannot map the NIC's kernel queues into guest memory."""
    if row.engine == DataEngine.DIRECT.value:
        raise InvalidArgument(f"vRNIC {row.public_id} uses the direct engine, which a VM cannot use (stock QEMU "
                              f"cannot map the NIC's queues into guest memory); {then}")
