"""The backend service boundary: what the control plane (API, CLI through the API) asks of vrnicd.

The API only talks to this class; another host's BackendService is reached through that host's agent
(vrnic.api.agent serves it, vrnic.backend.remote.RemoteBackend calls it with the same method names).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from vrnic.backend.driver import RnicDriver
from vrnic.core.specs import AttachInfo, DeviceInfo, QosPolicy, VmBinding, VrnicMode, VrnicSpec
from vrnic.errors import Conflict, InvalidArgument, NotFound, NotSupported

if TYPE_CHECKING:
    from vrnic.backend.drivers.paravirtual import VerbsDriver
    from vrnic.backend.peer_service import PeerService
    from vrnic.sriov.libvirt_xml import HostdevInterface
    from vrnic.sriov.manager import ContainerAttachment, CountChangeResult, PfInventory, SriovManager
    from vrnic.sriov.vf_types import Allocation, VfEvent


class BackendService:
    def __init__(self, drivers: Mapping[VrnicMode, RnicDriver]) -> None:
        self._drivers = dict(drivers)
        self._placement: dict[str, VrnicMode] = {}
        self._lock = threading.Lock()

    def driver(self, mode: VrnicMode) -> RnicDriver:
        try:
            return self._drivers[mode]
        except KeyError:
            raise NotSupported(f"mode {mode} is not enabled on this host") from None

    def has_mode(self, mode: VrnicMode) -> bool:
        return mode in self._drivers

    def devices(self) -> list[DeviceInfo]:
        seen: dict[str, DeviceInfo] = {}
        for driver in self._drivers.values():
            for device in driver.devices():
                seen.setdefault(f"{device.driver}/{device.name}", device)
        return list(seen.values())

    def create_vrnic(self, spec: VrnicSpec) -> AttachInfo:
        driver = self.driver(spec.mode)
        names = [d.name for d in driver.devices()]
        if spec.device is not None and spec.device not in names:
            raise InvalidArgument(f"device {spec.device!r} is not available for mode {spec.mode} "
                                  f"(available: {', '.join(names) or 'none'})")
        if not names:
            raise NotSupported(f"no device available for mode {spec.mode}")
        device = spec.device or min(names, key=lambda n: (driver.load(n), n))
        with self._placed(spec):
            return driver.create_vrnic(spec, device)

    def release_vrnic(self, vrnic_id: str) -> None:
        self._drivers[self._mode_of(vrnic_id)].release_vrnic(vrnic_id)
        with self._lock:
            self._placement.pop(vrnic_id, None)

    def restore_vrnic(self, spec: VrnicSpec, device: str, token_hash: str) -> None:
        """Hold again a vRNIC that an earlier vrnicd held (crash recovery), on the device it was on."""
        with self._placed(spec):
            self.driver(spec.mode).restore_vrnic(spec, device, token_hash)

    def reissue_token(self, vrnic_id: str) -> str:
        """A new attach token for a vRNIC of this host; the old one stops working."""
        return self._drivers[self._mode_of(vrnic_id)].reissue_token(vrnic_id)

    @contextmanager
    def _placed(self, spec: VrnicSpec) -> Iterator[None]:
        """Reserve the id for its mode while the driver creates it; drop the reservation if that fails.

        One id lives in one mode: a second create in another mode would overwrite the placement and leave the
        first vRNIC unreachable by release_vrnic."""
        with self._lock:
            if spec.id in self._placement:
                raise Conflict(f"vRNIC {spec.id} already exists in the backend (mode {self._placement[spec.id]})")
            self._placement[spec.id] = spec.mode
        try:
            yield
        except BaseException:
            with self._lock:
                self._placement.pop(spec.id, None)
            raise

    def _mode_of(self, vrnic_id: str) -> VrnicMode:
        with self._lock:
            mode = self._placement.get(vrnic_id)
        if mode is None:
            # Not placed by this instance (e.g. SR-IOV allocations that outlived a daemon restart):
            # the driver that holds it still answers for it.
            mode = next((m for m, d in self._drivers.items() if vrnic_id in d.vrnic_ids()), None)
        if mode is None:
            raise NotFound(f"no vRNIC {vrnic_id} in the backend")
        return mode

    def vrnic_ids(self) -> set[str]:
        return {i for d in self._drivers.values() for i in d.vrnic_ids()}

    def attached_vrnics(self) -> set[str]:
        """The vRNICs a guest is attached to now, as the drivers observe it."""
        return {i for d in self._drivers.values() for i in d.attached_ids()}

    # -- VMs: the libvirt hook binds a running domain's paravirtual vRNICs ---------------------------

    def bind_vm(self, binding: VmBinding) -> None:
        self.driver(VrnicMode.PARAVIRTUAL).bind_vm(binding)

    def unbind_vm(self, domain: str) -> list[str]:
        return [i for d in self._drivers.values() for i in d.unbind_vm(domain)]

    def vm_bindings(self) -> dict[str, VmBinding]:
        return {name: b for d in self._drivers.values() for name, b in d.vm_bindings().items()}

    def prepare_vm_migration(self, domain: str, target: VmBinding) -> dict[str, object]:
        return self.driver(VrnicMode.PARAVIRTUAL).prepare_vm_migration(domain, target)

    def complete_vm_migration(self, domain: str) -> dict[str, object]:
        return self.driver(VrnicMode.PARAVIRTUAL).complete_vm_migration(domain)

    def peers(self) -> PeerService:
        """What other hosts' agents may ask about this host's paravirtual vRNICs (vrnic.api.agent_peers)."""
        from vrnic.backend.peer_service import PeerService

        service = getattr(self.driver(VrnicMode.PARAVIRTUAL), "peers", None)
        if not isinstance(service, PeerService):
            raise NotSupported("the paravirtual driver of this host does not serve peers to other hosts")
        return service

    def handover(self) -> VerbsDriver:
        """The driver that hands VMs' vRNICs to and from other hosts (vrnic.backend.vm_handover)."""
        from vrnic.backend.drivers.paravirtual import VerbsDriver

        driver = self.driver(VrnicMode.PARAVIRTUAL)
        if not isinstance(driver, VerbsDriver):
            raise NotSupported("the paravirtual driver of this host does not hand VMs over to other hosts")
        return driver

    def set_qos(self, vrnic_id: str, mode: VrnicMode, policy: QosPolicy) -> None:
        self.driver(mode).set_qos(vrnic_id, policy)

    def qos_counters(self) -> dict[str, dict[str, int]]:
        return {i: c for d in self._drivers.values() for i, c in d.qos_counters().items()}

    def reconcile_qos(self) -> int:
        return sum(d.reconcile_qos() for d in self._drivers.values())

    def abort_vm_migration(self, domain: str) -> bool:
        return any(d.abort_vm_migration(domain) for d in self._drivers.values())

    def abort_vm_handover(self, domain: str) -> bool:
        return any(d.abort_vm_handover(domain) for d in self._drivers.values())

    def close(self) -> None:
        for driver in self._drivers.values():
            driver.close()
        with self._lock:
            self._placement.clear()

    # -- SR-IOV: PFs, VF counts, reconciliation, VM devices (the sriov driver's manager) --------------

    def _sriov(self) -> SriovManager:
        from vrnic.sriov.manager import SriovManager

        manager = getattr(self.driver(VrnicMode.SRIOV), "manager", None)
        if not isinstance(manager, SriovManager):
            raise NotSupported("the SR-IOV driver of this host does not manage PFs and VFs")
        return manager

    def sriov_inventory(self) -> list[PfInventory]:
        return self._sriov().inventory()

    def sriov_set_num_vfs(self, pf: str, count: int, force: bool = False) -> CountChangeResult:
        return self._sriov().set_num_vfs(pf, count, force)

    def sriov_reconcile(self) -> list[VfEvent]:
        return self._sriov().reconcile()

    def sriov_allocation(self, vrnic_id: str) -> Allocation:
        return self._sriov().allocation(vrnic_id)

    def sriov_vm_interface(self, vrnic_id: str, alias: str | None = None) -> HostdevInterface:
        return self._sriov().vm_interface(vrnic_id, alias)

    def sriov_attach_container(self, vrnic_id: str, netns: str, require_rdma: bool = True) -> ContainerAttachment:
        return self._sriov().attach_container(vrnic_id, netns, require_rdma)

    def sriov_detach_container(self, vrnic_id: str) -> None:
        self._sriov().detach_container(vrnic_id)
