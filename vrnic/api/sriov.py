"""SR-IOV views and operations: PFs and VFs (operator), a vRNIC's own VF (its tenant), reconcile passes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Engine

from vrnic.api.auth import Principal
from vrnic.api.converters import pf_out, sriov_event_out, vf_out
from vrnic.api.pagination import PageRequest
from vrnic.api.schemas import (
    ContainerAttach,
    ContainerAttached,
    NumVfsChange,
    NumVfsChanged,
    Page,
    ReconcileOut,
    SriovPfOut,
    SriovVfOut,
)
from vrnic.api.transactions import Transactions
from vrnic.api.vrnics import find_vrnic
from vrnic.backend.service import BackendService
from vrnic.core.lifecycle import VrnicState
from vrnic.core.specs import VrnicMode
from vrnic.db.unit_of_work import DAEMON_ACTOR
from vrnic.db.vf_store import DbVfStateStore
from vrnic.errors import Conflict, NotFound, NotSupported, VrnicError
from vrnic.sriov.manager import PfInventory

log = logging.getLogger(__name__)
T = TypeVar("T")


def database_vf_store(backend: BackendService, engine: Engine) -> DbVfStateStore | None:
    """The SR-IOV driver's desired-state store if it keeps it in the API's database (then its writes must
    join the API's units of work), else None."""
    if not backend.has_mode(VrnicMode.SRIOV):
        return None
    store = getattr(getattr(backend.driver(VrnicMode.SRIOV), "manager", None), "store", None)
    if isinstance(store, DbVfStateStore) and store.engine.url == engine.url:
        return store
    return None


class Sriov:
    def __init__(self, tx: Transactions, backend: BackendService) -> None:
        self.tx = tx
        self.backend = backend

    def list_pfs(self, principal: Principal, cursor: str | None, limit: int) -> Page[SriovPfOut]:
        """SR-IOV capable PFs of this host, keyed by their position."""
        principal.require_operator()
        request = PageRequest.parse(cursor, limit)
        return request.page(enumerate(self.backend.sriov_inventory()), lambda item: item[0],
                            lambda item: pf_out(item[1]))

    def get_pf(self, principal: Principal, pf: str) -> SriovPfOut:
        principal.require_operator()
        return pf_out(self._inventory(pf))

    def list_vfs(self, principal: Principal, pf: str, cursor: str | None, limit: int) -> Page[SriovVfOut]:
        """A PF's VFs, keyed by their index."""
        principal.require_operator()
        request = PageRequest.parse(cursor, limit)
        inventory = self._inventory(pf)
        return request.page(inventory.pf.vfs, lambda vf: vf.index,
                            lambda vf: vf_out(pf, vf.index, vf, inventory.allocations.get(vf.index)))

    def set_num_vfs(self, principal: Principal, pf: str, body: NumVfsChange) -> NumVfsChanged:
        principal.require_operator()
        result = self._write(principal.actor, lambda: self.backend.sriov_set_num_vfs(pf, body.num_vfs, body.force))
        change = result.change
        return NumVfsChanged(pf=pf, previous=change.current, num_vfs=change.requested, steps=list(change.steps),
                             events=[sriov_event_out(e) for e in result.events])

    def reconcile(self, principal: Principal) -> ReconcileOut:
        principal.require_operator()
        return self._reconcile(principal.actor)

    def reconcile_as_daemon(self) -> ReconcileOut:
        """The daemon's own pass (at startup and periodically)."""
        return self._reconcile(DAEMON_ACTOR)

    def _reconcile(self, actor: str) -> ReconcileOut:
        events = self._write(actor, self.backend.sriov_reconcile)
        return ReconcileOut(events=[sriov_event_out(e) for e in events])

    def vrnic_vf(self, principal: Principal, vrnic_id: str) -> SriovVfOut:
        """The VF behind an SR-IOV vRNIC, with its desired and observed settings (its tenant may look)."""
        self._check_holds_a_vf(principal, vrnic_id)
        allocation = self.backend.sriov_allocation(vrnic_id)
        address = allocation.address
        vf = None if allocation.vanished else self._inventory(address.pf).pf.vf(address.index)
        return vf_out(address.pf, address.index, vf, allocation)

    def attach_container(self, principal: Principal, vrnic_id: str, body: ContainerAttach) -> ContainerAttached:
        """Operator (the container runtime): move the vRNIC's VF netdev, and its RDMA device, into a named
        network namespace. vrnicd then observes the vRNIC attached; the move is an audit event."""
        principal.require_operator()
        self._check_holds_a_vf(principal, vrnic_id)
        moved = self._write(principal.actor, lambda: self.backend.sriov_attach_container(vrnic_id, body.netns,
                                                                                          body.require_rdma))
        return ContainerAttached(vrnic_id=moved.vrnic_id, netns=moved.netns, netdev=moved.netdev,
                                 rdma_device=moved.rdma_device, notes=list(moved.notes))

    def detach_container(self, principal: Principal, vrnic_id: str) -> SriovVfOut:
        """Operator: bring the VF back from the container's namespace (a no-op when it is in none)."""
        principal.require_operator()
        self._check_holds_a_vf(principal, vrnic_id)
        self._write(principal.actor, lambda: self.backend.sriov_detach_container(vrnic_id))
        return self.vrnic_vf(principal, vrnic_id)

    def vrnic_hostdev_xml(self, principal: Principal, vrnic_id: str, alias: str | None) -> str:
        """libvirt <interface type='hostdev'> for giving the vRNIC's VF to a VM."""
        self._check_holds_a_vf(principal, vrnic_id)
        return self.backend.sriov_vm_interface(vrnic_id, alias).to_xml()

    async def reconcile_periodically(self, interval: float) -> None:
        """The daemon's background reconcile passes, queued like any other write (one writer on SQLite)."""
        while True:
            await asyncio.sleep(interval)
            try:
                result = await self.tx.run_write(self.reconcile_as_daemon)
            except VrnicError as exc:
                log.error("SR-IOV reconcile pass failed: %s", exc)
                continue
            except Exception:  # e.g. the database was unavailable: keep the loop, try again next time
                log.exception("SR-IOV reconcile pass failed")
                continue
            if result.events:
                log.info("SR-IOV reconcile: %s", "; ".join(f"{e.kind} {e.pf}/{e.vf}" for e in result.events))

    def _write(self, actor: str, operation: Callable[[], T]) -> T:
        # State changes of the kernel are recorded even when the operation fails half-way (a forced count
        # change that could not re-configure one VF): the database follows the kernel, then the error goes up.
        failure: VrnicError | None = None
        with self.tx.write(actor, sriov=True):
            try:
                result = operation()
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

    def _check_holds_a_vf(self, principal: Principal, vrnic_id: str) -> None:
        with self.tx.read() as uow:
            row, _ = find_vrnic(uow.session, principal, vrnic_id)
            mode, state = row.mode, row.state
        if mode != VrnicMode.SRIOV.value:
            raise NotSupported(f"vRNIC {vrnic_id} is in {mode} mode: it has no VF")
        if state == VrnicState.RELEASED.value:
            raise Conflict(f"vRNIC {vrnic_id} is released: it holds no VF", current_state=state)
