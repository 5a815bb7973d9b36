"""The one backend abstraction for RNICs (os-vif style): an abstract driver, found by entry point.

Drivers: `verbs` (rxe and any generic verbs device, paravirtual mode), `sriov` (VF pool),
and `fake` (in-tree, no hardware: control-plane tests and benchmarks).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from importlib.metadata import EntryPoint, entry_points
from typing import Any, ClassVar

from vrnic.core.specs import AttachInfo, DeviceInfo, QosPolicy, VmBinding, VrnicMode, VrnicSpec
from vrnic.errors import NotFound, NotSupported

ENTRY_POINT_GROUP = "vrnic.drivers"


class RnicDriver(ABC):
    name: ClassVar[str]
    modes: ClassVar[frozenset[VrnicMode]]

    @abstractmethod
    def devices(self) -> list[DeviceInfo]:
        """Physical devices this driver can place vRNICs on."""

    @abstractmethod
    def create_vrnic(self, spec: VrnicSpec, device: str) -> AttachInfo:
        """Create real backend state for spec on device; raise a VrnicError if it cannot."""

    @abstractmethod
    def release_vrnic(self, vrnic_id: str) -> None:
        """Tear down everything of the vRNIC; NotFound if unknown. Must not leak kernel objects."""

    @abstractmethod
    def vrnic_ids(self) -> set[str]:
        """The vRNICs that exist in the backend now (observed state, for reconciliation)."""

    def restore_vrnic(self, spec: VrnicSpec, device: str, token_hash: str) -> None:
        """Hold again a vRNIC the database holds and this backend lost (vrnicd restarted): same spec, same
        device, and the attach token with this digest attaches. Drivers whose state outlives vrnicd (SR-IOV:
        the VF and the database store) never lose one."""
        raise NotSupported(f"the {self.name} driver cannot restore vRNICs")

    def reissue_token(self, vrnic_id: str) -> str:
        """A new attach token for the vRNIC; the old one stops working (NotFound if unknown)."""
        raise NotSupported(f"the {self.name} driver's vRNICs have no attach token")

    def attached_ids(self) -> set[str]:
        """The vRNICs a guest is attached to now, as the backend observes it (none, if it cannot tell)."""
        return set()

    def bind_vm(self, binding: VmBinding) -> None:
        """Serve a running VM's vRNICs: map its RAM, connect its channels. All or nothing; binding the
        same domain again with the same binding is a no-op (libvirtd's `reconnect`)."""
        raise NotSupported(f"the {self.name} driver does not serve VMs over a channel")

    def unbind_vm(self, domain: str) -> list[str]:
        """Stop serving the domain and release every kernel object of its sessions; the vRNIC ids that
        were bound (none if the domain was not bound: stopped and release both call this)."""
        return []

    def vm_bindings(self) -> dict[str, VmBinding]:
        """The VMs served now, by domain name (observed state)."""
        return {}

    def prepare_vm_migration(self, domain: str, target: VmBinding) -> dict[str, object]:
        """A bound VM's destination QEMU runs: get ready to serve it there (see vrnic.backend.vm_migration)."""
        raise NotSupported(f"the {self.name} driver does not migrate VMs")

    def complete_vm_migration(self, domain: str) -> dict[str, object]:
        """QEMU's last pass is done and the destination has not run: switch the VM's vRNICs over."""
        raise NotSupported(f"the {self.name} driver does not migrate VMs")

    def set_qos(self, vrnic_id: str, policy: QosPolicy) -> None:
        """Change a live vRNIC's QoS (enforced at once, or refused with the reason)."""
        raise NotSupported(f"the {self.name} driver cannot change a vRNIC's QoS while it lives")

    def qos_counters(self) -> dict[str, dict[str, int]]:
        """tx_bytes, tx_packets, rx_bytes and rx_packets per vRNIC whose QoS this driver enforces."""
        return {}

    def reconcile_qos(self) -> int:
        """Restore the QoS the kernel lost or changed; how many fixes."""
        return 0

    def abort_vm_migration(self, domain: str) -> bool:
        """Drop a prepared migration; the source keeps serving the VM. False if there was none."""
        return False

    def abort_vm_handover(self, domain: str) -> bool:
        """Drop a prepared hand-over to another host; this host keeps serving the VM. False if there was none."""
        return False

    def load(self, device: str) -> int:
        """How many vRNICs sit on device (for placement)."""
        return 0

    def close(self) -> None:
        """Release everything (daemon shutdown)."""
        for vrnic_id in sorted(self.vrnic_ids()):
            self.release_vrnic(vrnic_id)


@functools.cache
def _driver_entry_points() -> tuple[EntryPoint, ...]:
    # Read once: each read walks every installed distribution's metadata (0.3 s under the lab's TCG).
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


def available_drivers() -> list[str]:
    return sorted(ep.name for ep in _driver_entry_points())


def driver_class(name: str) -> type[RnicDriver]:
    matches = [ep for ep in _driver_entry_points() if ep.name == name]
    if not matches:
        raise NotFound(f"no RNIC driver {name!r} (installed: {', '.join(available_drivers()) or 'none'})")
    found: type[RnicDriver] = matches[0].load()
    return found


def load_driver(name: str, **options: Any) -> RnicDriver:
    return driver_class(name)(**options)


@functools.cache
def drivers_serving(mode: VrnicMode) -> frozenset[str]:
    """The installed drivers (entry point names) that serve mode: what another host's devices of that mode
    are recorded under. A driver whose class cannot be imported here is left out."""
    names = set()
    for ep in _driver_entry_points():
        try:
            if mode in ep.load().modes:
                names.add(ep.name)
        except Exception:  # e.g. a driver's optional dependency missing on this host
            continue
    return frozenset(names)
