"""The `sriov` RnicDriver: a vRNIC is a whole VF of an SR-IOV PF, hardware-isolated.

Devices are PFs (their netdev names). create_vrnic takes a free VF of the chosen PF and configures it for
the tenant; release_vrnic resets it. The tenant's VPC becomes its VLAN on the wire:

    VLAN = vpc_id, for vpc_id in 0..4094; 0 is the untagged default network (no VPC isolation, as vpc 0
    is in the paravirtual mode). Other vpc ids do not fit an 802.1Q tag and are rejected.

QoS: QosPolicy.rate_cap_mbps -> max_tx_rate, guarantee_mbps -> min_tx_rate (Mbit/s, both VF-level limits).
"""

from __future__ import annotations

from typing import ClassVar

from vrnic.backend.driver import RnicDriver
from vrnic.core.specs import AttachInfo, DeviceInfo, VrnicMode, VrnicSpec
from vrnic.errors import InvalidArgument
from vrnic.sriov.manager import SriovManager
from vrnic.sriov.store import InMemoryVfStateStore
from vrnic.sriov.vf_types import MAX_VLAN, Allocation, PfInfo, PfKind, VfRequest


def vlan_for_vpc(vpc_id: int) -> int:
    if not 0 <= vpc_id <= MAX_VLAN:
        raise InvalidArgument(f"vpc_id {vpc_id} cannot be an SR-IOV tenant VLAN (0..{MAX_VLAN}; 0 = untagged)")
    return vpc_id


def request_for(spec: VrnicSpec) -> VfRequest:
    return VfRequest(vlan=vlan_for_vpc(spec.vpc_id), max_tx_rate=spec.qos.rate_cap_mbps or 0,
                     min_tx_rate=spec.qos.guarantee_mbps or 0)


class SriovDriver(RnicDriver):
    name: ClassVar[str] = "sriov"
    modes: ClassVar[frozenset[VrnicMode]] = frozenset({VrnicMode.SRIOV})

    def __init__(self, manager: SriovManager | None = None, release_on_close: bool | None = None) -> None:
        """release_on_close: reset every VF at close(); by default only when desired state is not persisted
        (the in-memory store), since otherwise a restart would forget VFs still carrying tenants' settings.
        Reconcile passes are the API's (at startup and periodically, inside its units of work)."""
        self.manager = manager or SriovManager()
        if release_on_close is None:
            release_on_close = isinstance(self.manager.store, InMemoryVfStateStore)
        self._release_on_close = release_on_close

    def devices(self) -> list[DeviceInfo]:
        return [self._device(pf) for pf in self.manager.discover()]

    def _device(self, pf: PfInfo) -> DeviceInfo:
        allocated = sum(1 for a in self.manager.allocations(pf.name) if not a.vanished)
        caps = {"num_vfs": pf.num_vfs, "free_vfs": pf.num_vfs - allocated}
        if pf.total_vfs is not None:
            caps["total_vfs"] = pf.total_vfs
        # node_guid identifies RDMA devices; a PF without one is named by its bus id.
        return DeviceInfo(name=pf.name, driver=self.name, node_guid=pf.bus_id, caps=caps)

    def create_vrnic(self, spec: VrnicSpec, device: str) -> AttachInfo:
        allocation = self.manager.allocate(spec.id, spec.tenant, device, request_for(spec))
        return self._attach_info(spec, allocation)

    def _attach_info(self, spec: VrnicSpec, allocation: Allocation) -> AttachInfo:
        pf = self.manager.sysfs.pf(allocation.address.pf)
        vf = pf.vfs.get(allocation.address.index)
        extra = {"vf_index": str(allocation.address.index), "pf": pf.name, "mac": allocation.config.mac,
                 "vlan": str(allocation.config.vlan), "max_tx_rate": str(allocation.config.max_tx_rate),
                 "min_tx_rate": str(allocation.config.min_tx_rate)}
        if pf.kind is PfKind.PCI and vf is not None and vf.pci_address:
            extra["pci_address"] = vf.pci_address
        else:
            extra["netdevsim_device"] = pf.bus_id
        if vf is not None and vf.netdev:
            extra["netdev"] = vf.netdev
        if vf is not None and vf.rdma_device:
            extra["rdma_device"] = vf.rdma_device
        return AttachInfo(vrnic_id=spec.id, mode=VrnicMode.SRIOV, device=pf.name, virtual_gid=spec.virtual_gid,
                          extra=extra)

    def release_vrnic(self, vrnic_id: str) -> None:
        self.manager.release(vrnic_id)

    def vrnic_ids(self) -> set[str]:
        return {a.vrnic_id for a in self.manager.allocations()}

    def attached_ids(self) -> set[str]:
        return self.manager.attached_ids()

    def load(self, device: str) -> int:
        return len(self.manager.allocations(device))

    def close(self) -> None:
        """With a persistent store, shutdown leaves tenants' VFs configured (guests depend on them) and the
        next start reconciles them; with the in-memory store every VF is reset, so nothing leaks."""
        if self._release_on_close:
            super().close()
        self.manager.close()
