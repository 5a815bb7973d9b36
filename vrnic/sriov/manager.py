"""SR-IOV orchestration: discovery, allocation, release, reconciliation, VF count changes and container/VM
attach, over injected edges (sysfs, netlink, devlink, rdma) and a desired-state store.

Every operation validates first and changes the kernel second; a failure half-way rolls back what it
changed, so nothing is half-applied. Desired state is written before the kernel is touched, so a crash in
between leaves something reconcile() repairs rather than a VF nobody knows about.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from vrnic.errors import Conflict, DeviceError, NotFound, NotSupported, VrnicError
from vrnic.sriov import devlink, rdma_netns
from vrnic.sriov.count import CountChange, plan_count_change
from vrnic.sriov.libvirt_xml import HostdevInterface, PciAddress
from vrnic.sriov.netlink import VfNetlink
from vrnic.sriov.plan import differing_fields, plan_ops
from vrnic.sriov.pool import VfPool
from vrnic.sriov.reconcile import plan_reconcile
from vrnic.sriov.store import InMemoryVfStateStore, VfStateStore
from vrnic.sriov.sysfs import PfSysfs, SriovSysfs
from vrnic.sriov.vf_types import (
    CLEAN_VF,
    Allocation,
    EventKind,
    PfInfo,
    PfKind,
    VfAddress,
    VfConfig,
    VfEvent,
    VfInfo,
    VfRequest,
    validate_tenant_config,
)

log = logging.getLogger(__name__)


class RdmaNetns(Protocol):
    def netns_mode(self) -> str: ...

    def move_device(self, device: str, netns: str) -> None: ...

    def return_device(self, device: str, netns: str) -> None: ...


class _RdmaTool:
    netns_mode = staticmethod(rdma_netns.netns_mode)
    move_device = staticmethod(rdma_netns.move_device)
    return_device = staticmethod(rdma_netns.return_device)


@dataclass(frozen=True)
class CountChangeResult:
    change: CountChange
    events: tuple[VfEvent, ...]


@dataclass(frozen=True)
class PfInventory:
    """A PF with its VFs and who holds each (what `GET /sriov/pfs` and `vrnic sriov list` show)."""

    pf: PfInfo
    allocations: dict[int, Allocation]  # VF index -> allocation (vanished ones are listed separately)
    vanished: tuple[Allocation, ...] = ()


@dataclass(frozen=True)
class ContainerAttachment:
    vrnic_id: str
    netns: str
    netdev: str
    rdma_device: str | None  # moved along, or None (see notes)
    notes: tuple[str, ...] = ()


class SriovManager:
    def __init__(self, sysfs: SriovSysfs | None = None, netlink: VfNetlink | None = None,
                 store: VfStateStore | None = None, on_event: Callable[[VfEvent], None] | None = None,
                 eswitch_mode: Callable[[PfKind, str], str | None] | None = None,
                 rdma: RdmaNetns | None = None) -> None:
        self.sysfs = sysfs or SriovSysfs()
        self.netlink = netlink or VfNetlink()
        self.store: VfStateStore = store if store is not None else InMemoryVfStateStore()
        self._on_event = on_event
        self._eswitch_mode = eswitch_mode or devlink.eswitch_mode
        self._rdma: RdmaNetns = rdma or _RdmaTool()
        self._lock = threading.RLock()
        self._reported_dirty: set[VfAddress] = set()  # orphaned VFs that failed to reset: reported once

    def close(self) -> None:
        self.netlink.close()

    # Discovery -----------------------------------------------------------------------------------------

    def discover(self) -> list[PfInfo]:
        """Every SR-IOV PF with its VFs: sysfs for the topology, netlink for the VF settings, devlink for
        the eswitch mode."""
        return [self._describe(pf) for pf in self.sysfs.pfs()]

    def _describe(self, pf: PfSysfs) -> PfInfo:
        observed = self.netlink.read_vfs(pf.name)
        vfs = []
        for index in range(pf.num_vfs):
            vf_sys = pf.vfs.get(index)
            vfs.append(VfInfo(index=index, config=observed.get(index, CLEAN_VF),
                              pci_address=vf_sys.pci_address if vf_sys else None,
                              netdev=vf_sys.netdev if vf_sys else None,
                              rdma_device=vf_sys.rdma_device if vf_sys else None))
        return PfInfo(name=pf.name, kind=pf.kind, bus_id=pf.bus_id, driver=pf.driver, num_vfs=pf.num_vfs,
                      total_vfs=pf.total_vfs, eswitch_mode=self._eswitch_mode(pf.kind, pf.bus_id),
                      rdma_device=pf.rdma_device, vfs=tuple(vfs))

    def inventory(self) -> list[PfInventory]:
        held = self.store.list()
        result = []
        for pf in self.discover():
            mine = [a for a in held if a.address.pf == pf.name]
            result.append(PfInventory(pf, {a.address.index: a for a in mine if not a.vanished},
                                      tuple(a for a in mine if a.vanished)))
        return result

    def _pool(self) -> VfPool:
        return VfPool({pf.name: pf.num_vfs for pf in self.sysfs.pfs()}, self.store.list())

    # Allocation ----------------------------------------------------------------------------------------

    def allocations(self, pf: str | None = None) -> list[Allocation]:
        return [a for a in self.store.list() if pf is None or a.address.pf == pf]

    def attached_ids(self) -> set[str]:
        """The vRNICs whose VF netdev vrnicd moved into a container's netns: the one attachment it sees. A VF
        given to a VM (hostdev) is attached by libvirt, which vrnicd does not observe."""
        return {a.vrnic_id for a in self.store.list() if a.netns is not None and not a.vanished}

    def allocation(self, vrnic_id: str) -> Allocation:
        found = self.store.get(vrnic_id)
        if found is None:
            raise NotFound(f"no SR-IOV vRNIC {vrnic_id}")
        return found

    def allocate(self, vrnic_id: str, tenant: str, pf: str, request: VfRequest,
                 vf_index: int | None = None) -> Allocation:
        """Take a free VF of pf (or vf_index), configure it for the tenant and confirm it through netlink."""
        config = request.config(vrnic_id)
        validate_tenant_config(config)
        with self._lock:
            allocation = self._pool().allocate(vrnic_id, tenant, pf, config, vf_index)
            address = allocation.address
            before = self._observed(address)
            self.store.put(allocation)
            try:
                self._apply_and_confirm(address, config, before)
            except VrnicError:
                self._restore(address, before)
                self.store.delete(vrnic_id)
                raise
            self._emit(VfEvent(EventKind.ALLOCATED, address.pf, address.index, vrnic_id,
                               {"tenant": tenant, "mac": config.mac, "vlan": str(config.vlan),
                                "max_tx_rate": str(config.max_tx_rate), "min_tx_rate": str(config.min_tx_rate)}))
            return allocation

    def release(self, vrnic_id: str) -> None:
        """Reset the VF to the clean state, confirm it, and return it to the pool.

        If the reset fails the allocation stays, so a dirty VF is never handed to the next tenant."""
        with self._lock:
            allocation = self.allocation(vrnic_id)
            address = allocation.address
            if allocation.netns is not None:
                self.detach_container(vrnic_id)
            if not allocation.vanished:
                self._apply_and_confirm(address, CLEAN_VF, self._observed(address))
            self.store.delete(vrnic_id)
            self._emit(VfEvent(EventKind.RELEASED, address.pf, address.index, vrnic_id,
                               {"vanished": "yes"} if allocation.vanished else {}))

    # Reconciliation ------------------------------------------------------------------------------------

    def observe(self) -> dict[VfAddress, VfConfig]:
        observed: dict[VfAddress, VfConfig] = {}
        for pf in self.sysfs.pfs():
            for index, config in self.netlink.read_vfs(pf.name).items():
                if index < pf.num_vfs:
                    observed[VfAddress(pf.name, index)] = config
        return observed

    def reconcile(self) -> list[VfEvent]:
        """Desired (store) minus observed (netlink): re-apply drift, mark vanished VFs, reset the settings of VFs
        no allocation holds (orphaned). Returns the events."""
        events: list[VfEvent] = []
        failed: set[VfAddress] = set()  # orphaned settings that would not reset: reported once, not every pass
        with self._lock:
            plan = plan_reconcile(self.store.list(), self.observe())
            for drift in plan.drifts:
                address = drift.allocation.address
                detail = {name: f"{getattr(drift.observed, name)} -> {getattr(drift.allocation.config, name)}"
                          for name in drift.fields}
                try:
                    self.netlink.apply(address.pf, address.index, drift.ops)
                    self._confirm(address, drift.allocation.config)
                except VrnicError as e:
                    events.append(self._emit(VfEvent(EventKind.RECONCILE_FAILED, address.pf, address.index,
                                                     drift.allocation.vrnic_id, detail | {"error": str(e)})))
                    continue
                events.append(self._emit(VfEvent(EventKind.DRIFT_CORRECTED, address.pf, address.index,
                                                 drift.allocation.vrnic_id, detail)))
            for allocation in plan.vanished:
                events.append(self._mark_vanished(allocation, "the VF no longer exists"))
            observed = self.observe() if plan.unowned_dirty else {}
            for address in plan.unowned_dirty:
                # Tenant settings on a VF nobody holds: an allocation whose commit never happened (the daemon
                # died in between) or a release cut short. Reset, or the next tenant inherits them.
                before = observed[address]
                detail = {name: str(getattr(before, name)) for name in sorted(differing_fields(CLEAN_VF, before))}
                try:
                    self._apply_and_confirm(address, CLEAN_VF, before)
                except VrnicError as e:
                    if address not in self._reported_dirty:
                        events.append(self._emit(VfEvent(EventKind.UNOWNED_DIRTY, address.pf, address.index,
                                                         detail=detail | {"error": str(e)})))
                    failed.add(address)
                    continue
                events.append(self._emit(VfEvent(EventKind.RESET, address.pf, address.index,
                                                 detail=detail | {"reason": "orphaned: no allocation holds it"})))
            self._reported_dirty = failed
        return events

    # VF count ------------------------------------------------------------------------------------------

    def set_num_vfs(self, pf: str, count: int, force: bool = False) -> CountChangeResult:
        """Change sriov_numvfs. Refused while VFs are allocated unless forced; a forced change goes through
        zero, re-applies every surviving VF's configuration, marks vanished ones and cleans new ones."""
        with self._lock:
            current = self.sysfs.pf(pf)
            change = plan_count_change(pf, current.num_vfs, count, current.total_vfs, self.store.list(), force)
            events: list[VfEvent] = []
            if not change.steps:
                return CountChangeResult(change, ())
            try:
                for step in change.steps:
                    self.sysfs.set_num_vfs(pf, step)
            except VrnicError:
                self._restore_count(pf, current.num_vfs)
                raise
            events.append(self._emit(VfEvent(EventKind.NUM_VFS_CHANGED, pf, None, None,
                                             {"from": str(change.current), "to": str(change.requested),
                                              "steps": " -> ".join(str(s) for s in change.steps)})))
            for allocation in change.vanishing:
                events.append(self._mark_vanished(allocation, f"VF count reduced to {count}"))
            for allocation in change.survivors:
                if allocation.netns is not None:  # the VF netdev was re-created in the host namespace
                    self.store.put(replace(allocation, netns=None))
                try:
                    self._apply_and_confirm(allocation.address, allocation.config, None)
                except VrnicError as e:  # the count did change: report and go on with the other VFs
                    events.append(self._emit(VfEvent(EventKind.RECONCILE_FAILED, pf, allocation.address.index,
                                                     allocation.vrnic_id, {"error": str(e)})))
                    continue
                events.append(self._emit(VfEvent(EventKind.REAPPLIED, pf, allocation.address.index,
                                                 allocation.vrnic_id, {"mac": allocation.config.mac,
                                                                       "vlan": str(allocation.config.vlan)})))
            observed = self.netlink.read_vfs(pf)
            for index in change.reset:
                address = VfAddress(pf, index)
                before = observed.get(index)
                if before is not None and before != CLEAN_VF:
                    self._apply_and_confirm(address, CLEAN_VF, before)
                    events.append(self._emit(VfEvent(EventKind.RESET, pf, index)))
            return CountChangeResult(change, tuple(events))

    def _restore_count(self, pf: str, count: int) -> None:
        try:
            if self.sysfs.pf(pf).num_vfs != count:
                self.sysfs.set_num_vfs(pf, 0)
                if count:
                    self.sysfs.set_num_vfs(pf, count)
            for allocation in self.allocations(pf):
                if not allocation.vanished:
                    self._apply_and_confirm(allocation.address, allocation.config, None)
        except VrnicError as e:  # the original error is the one to report
            log.error("restoring %s to %d VFs failed: %s", pf, count, e)

    # Attach --------------------------------------------------------------------------------------------

    def attach_container(self, vrnic_id: str, netns: str, require_rdma: bool = True) -> ContainerAttachment:
        """Move the VF's netdev (and its RDMA device) into a container's named network namespace.

        Checks everything first: a VF without a netdev of its own (netdevsim VFs, or a VF whose driver is
        not bound) cannot be attached; with require_rdma, neither can one without an RDMA device or while
        the RDMA subsystem is in shared netns mode. With require_rdma=False the netdev moves alone and the
        reason is in notes."""
        with self._lock:
            allocation = self.allocation(vrnic_id)
            if allocation.vanished:
                raise Conflict(f"{vrnic_id}: its VF {allocation.address} vanished", current_state="vanished")
            if allocation.netns is not None:
                raise Conflict(f"{vrnic_id} is already in netns {allocation.netns}", current_state="attached")
            vf = self._vf_info(allocation.address)
            if vf.netdev is None:
                raise NotSupported(f"{allocation.address} has no netdev of its own to move into netns {netns} "
                                   "(netdevsim VFs never have one; a PCI VF needs its driver bound)")
            notes: list[str] = []
            rdma_device = vf.rdma_device
            if rdma_device is None:
                notes.append(f"{allocation.address} has no RDMA device: the container gets Ethernet only")
            else:
                mode = self._rdma.netns_mode()
                if mode != "exclusive":
                    notes.append(f"the RDMA subsystem is in {mode} netns mode, so {rdma_device} cannot move "
                                 "into the container (needs `rdma system set netns exclusive`)")
                    rdma_device = None
            if notes and require_rdma:
                raise NotSupported("; ".join(notes))
            self.netlink.move_to_netns(vf.netdev, netns)
            if rdma_device is not None:
                try:
                    self._rdma.move_device(rdma_device, netns)
                except VrnicError:
                    self.netlink.return_from_netns(vf.netdev, netns)
                    raise
            self.store.put(replace(allocation, netns=netns))
            self._emit(VfEvent(EventKind.NETNS_MOVED, allocation.address.pf, allocation.address.index, vrnic_id,
                               {"netns": netns, "netdev": vf.netdev, "rdma_device": rdma_device or ""}))
            return ContainerAttachment(vrnic_id, netns, vf.netdev, rdma_device, tuple(notes))

    def detach_container(self, vrnic_id: str) -> None:
        """Bring the VF netdev (and RDMA device) back from the container's namespace. A namespace that is
        gone already gave them back: the kernel returns physical devices to the init namespace."""
        with self._lock:
            allocation = self.allocation(vrnic_id)
            if allocation.netns is None:
                return
            netns = allocation.netns
            vf = self._vf_info(allocation.address) if not allocation.vanished else None
            if vf is not None:
                try:
                    if vf.rdma_device is not None and self._rdma.netns_mode() == "exclusive":
                        self._rdma.return_device(vf.rdma_device, netns)
                    # sysfs is per network namespace: while the netdev sits in the container, the VF's
                    # PCI device shows none here. Find it in there by its parent, the VF's PCI function.
                    netdev = vf.netdev
                    if netdev is None and vf.pci_address is not None:
                        netdev = self.netlink.link_by_parent_in_netns(vf.pci_address, netns)
                    if netdev is not None:
                        self.netlink.return_from_netns(netdev, netns)
                except NotFound:
                    log.info("netns %s or the netdev in it is gone; the kernel returned it", netns)
            self.store.put(replace(allocation, netns=None))
            self._emit(VfEvent(EventKind.NETNS_RETURNED, allocation.address.pf, allocation.address.index,
                               vrnic_id, {"netns": netns}))

    def vm_interface(self, vrnic_id: str, alias: str | None = None) -> HostdevInterface:
        """The libvirt <interface type='hostdev'> for the vRNIC's VF (NotSupported without a PCI address)."""
        allocation = self.allocation(vrnic_id)
        vf = self._vf_info(allocation.address)
        if vf.pci_address is None:
            raise NotSupported(f"{allocation.address} has no PCI address (netdevsim): it cannot be given to a VM")
        return HostdevInterface(pci=PciAddress.parse(vf.pci_address), mac=allocation.config.mac,
                                vlan=allocation.config.vlan or None, alias=alias)

    # Internals -----------------------------------------------------------------------------------------

    def _vf_info(self, address: VfAddress) -> VfInfo:
        pf = self.sysfs.pf(address.pf)
        vf_sys = pf.vfs.get(address.index)
        if vf_sys is None or address.index >= pf.num_vfs:
            raise NotFound(f"{address} does not exist ({pf.num_vfs} VFs)")
        return VfInfo(index=address.index, config=self._observed(address), pci_address=vf_sys.pci_address,
                      netdev=vf_sys.netdev, rdma_device=vf_sys.rdma_device)

    def _observed(self, address: VfAddress) -> VfConfig:
        observed = self.netlink.read_vfs(address.pf)
        if address.index not in observed:
            raise NotFound(f"{address}: the kernel reports no such VF")
        return observed[address.index]

    def _confirm(self, address: VfAddress, config: VfConfig) -> None:
        observed = self._observed(address)
        wrong = sorted(differing_fields(config, observed))
        if wrong:
            shown = ", ".join(f"{n}={getattr(observed, n)} (wanted {getattr(config, n)})" for n in wrong)
            raise DeviceError(f"{address}: the kernel did not keep the configuration: {shown}")

    def _apply_and_confirm(self, address: VfAddress, config: VfConfig, observed: VfConfig | None) -> None:
        self.netlink.apply(address.pf, address.index, plan_ops(config, observed))
        self._confirm(address, config)

    def _restore(self, address: VfAddress, previous: VfConfig) -> None:
        try:
            self.netlink.apply(address.pf, address.index, plan_ops(previous, None))
        except VrnicError as e:
            log.error("rolling %s back failed: %s", address, e)

    def _mark_vanished(self, allocation: Allocation, reason: str) -> VfEvent:
        self.store.put(replace(allocation, vanished=True, netns=None))
        return self._emit(VfEvent(EventKind.VANISHED, allocation.address.pf, allocation.address.index,
                                  allocation.vrnic_id, {"reason": reason, "tenant": allocation.tenant}))

    def _emit(self, event: VfEvent) -> VfEvent:
        log.info("%s", event)
        if self._on_event is not None:
            self._on_event(event)
        return event

