"""SriovManager orchestration over in-memory stand-ins for the kernel edges: rollback paths the real kernel
cannot be made to take on demand. The real behaviour is proven in tests/kernel/test_sriov_netdevsim.py."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import replace

import pytest

from vrnic.errors import Conflict, DeviceError, InvalidArgument, NotFound, NotSupported
from vrnic.sriov.libvirt_xml import HostdevInterface, PciAddress
from vrnic.sriov.manager import SriovManager
from vrnic.sriov.netlink import VfNetlink
from vrnic.sriov.plan import VfOp
from vrnic.sriov.store import InMemoryVfStateStore
from vrnic.sriov.sysfs import PfSysfs, SriovSysfs, VfSysfs
from vrnic.sriov.vf_types import CLEAN_VF, EventKind, PfKind, VfConfig, VfEvent, VfRequest


class MemorySysfs(SriovSysfs):
    def __init__(self, num_vfs: int = 4, total: int = 4) -> None:
        self.num_vfs, self.total, self.writes = num_vfs, total, []  # type: ignore[var-annotated]

    def pfs(self) -> list[PfSysfs]:
        return [PfSysfs("eth0", PfKind.NETDEVSIM, "netdevsim10", "netdevsim", self.num_vfs, self.total,
                        vfs={i: VfSysfs(i) for i in range(self.num_vfs)})]

    def set_num_vfs(self, name: str, count: int) -> None:
        if self.num_vfs and count:
            raise DeviceError("busy", errno.EBUSY)
        self.writes.append(count)
        self.num_vfs = count


class MemoryNetlink(VfNetlink):
    def __init__(self, sysfs: MemorySysfs) -> None:
        self.sysfs = sysfs
        self.vfs: dict[int, VfConfig] = {i: CLEAN_VF for i in range(8)}  # netdevsim keeps configs of hidden VFs
        self.refuse: str | None = None
        self.applied: list[str] = []

    def read_vfs(self, pf: str) -> dict[int, VfConfig]:
        return {i: c for i, c in self.vfs.items() if i < self.sysfs.num_vfs}

    def apply(self, pf: str, vf: int, ops: Sequence[VfOp]) -> None:
        for op in ops:
            if op.attribute == self.refuse:
                raise DeviceError(f"refused {op}", errno.EINVAL)
            self.vfs[vf] = replace(self.vfs[vf], **op.values())  # type: ignore[arg-type]
            self.applied.append(f"vf{vf} {op}")

    def close(self) -> None:
        pass


@pytest.fixture
def emitted() -> list[VfEvent]:
    """What the parts' manager emitted (its on_event)."""
    return []


@pytest.fixture
def parts(emitted: list[VfEvent]) -> tuple[SriovManager, MemorySysfs, MemoryNetlink]:
    sysfs = MemorySysfs()
    netlink = MemoryNetlink(sysfs)
    manager = SriovManager(sysfs, netlink, InMemoryVfStateStore(), on_event=emitted.append,
                           eswitch_mode=lambda kind, bus: "legacy")
    return manager, sysfs, netlink


def test_allocate_confirms_and_release_resets(parts: tuple[SriovManager, MemorySysfs, MemoryNetlink],
                                              emitted: list[VfEvent]) -> None:
    manager, _, netlink = parts
    a = manager.allocate("v1", "red", "eth0", VfRequest(vlan=100, max_tx_rate=1000, min_tx_rate=100))
    assert netlink.vfs[0] == a.config and a.config.spoofchk and not a.config.trust
    assert manager.discover()[0].vfs[0].config == a.config
    manager.release("v1")
    assert netlink.vfs[0] == CLEAN_VF and manager.allocations() == []
    assert [e.kind for e in emitted] == [EventKind.ALLOCATED, EventKind.RELEASED]


def test_refused_op_rolls_back_everything(parts: tuple[SriovManager, MemorySysfs, MemoryNetlink],
                                          emitted: list[VfEvent]) -> None:
    manager, _, netlink = parts
    netlink.refuse = "rate"  # MAC and VLAN went in before the kernel refused the rates
    with pytest.raises(DeviceError, match="refused rate"):
        manager.allocate("v1", "red", "eth0", VfRequest(vlan=100, max_tx_rate=1000))
    assert netlink.vfs[0] == CLEAN_VF
    assert manager.allocations() == [] and not emitted


def test_bad_input_touches_nothing(parts: tuple[SriovManager, MemorySysfs, MemoryNetlink]) -> None:
    manager, _, netlink = parts
    for call, error in [
        (lambda: manager.allocate("v", "t", "eth0", VfRequest(vlan=4095)), InvalidArgument),
        (lambda: manager.allocate("v", "t", "eth0", VfRequest(max_tx_rate=10, min_tx_rate=100)), InvalidArgument),
        (lambda: manager.allocate("v", "t", "eth0", VfRequest(), vf_index=4), InvalidArgument),
        (lambda: manager.allocate("v", "t", "eth9", VfRequest()), NotFound),
    ]:
        with pytest.raises(error):
            call()
    assert netlink.applied == [] and manager.allocations() == []


def test_count_change_policy(parts: tuple[SriovManager, MemorySysfs, MemoryNetlink]) -> None:
    manager, sysfs, netlink = parts
    manager.allocate("v0", "red", "eth0", VfRequest(vlan=10), vf_index=0)
    manager.allocate("v3", "blue", "eth0", VfRequest(vlan=30), vf_index=3)
    with pytest.raises(Conflict, match="v0 on vf0 .tenant red.*v3 on vf3 .tenant blue"):
        manager.set_num_vfs("eth0", 2)
    assert sysfs.writes == []
    netlink.vfs[0] = CLEAN_VF  # hardware that forgets VF config when VFs go away
    result = manager.set_num_vfs("eth0", 2, force=True)
    assert sysfs.writes == [0, 2]
    assert netlink.vfs[0] == manager.allocation("v0").config
    assert manager.allocation("v3").vanished
    kinds = [(e.kind, e.vrnic_id) for e in result.events]
    assert kinds == [(EventKind.NUM_VFS_CHANGED, None), (EventKind.VANISHED, "v3"), (EventKind.REAPPLIED, "v0")]
    # growing again: vf3 still carries blue's config in this "hardware": it is cleaned, not handed out dirty
    result = manager.set_num_vfs("eth0", 4, force=True)
    assert netlink.vfs[3] == CLEAN_VF and (EventKind.RESET, 3) in [(e.kind, e.vf) for e in result.events]
    manager.release("v3")  # a vanished vRNIC is released without touching the VF that now has its index
    assert [a.vrnic_id for a in manager.allocations()] == ["v0"]


def test_reconcile_restores_drift(parts: tuple[SriovManager, MemorySysfs, MemoryNetlink]) -> None:
    manager, _, netlink = parts
    a = manager.allocate("v1", "red", "eth0", VfRequest(vlan=100))
    netlink.vfs[0] = replace(a.config, vlan=7, trust=True)
    netlink.vfs[2] = VfConfig(mac="02:99:00:00:00:01")  # someone else's
    events = manager.reconcile()
    assert netlink.vfs[0] == a.config
    # VF 2: orphaned settings (say, an allocation whose commit died with the daemon) are reset, audited
    assert [(e.kind, e.vf) for e in events] == [(EventKind.DRIFT_CORRECTED, 0), (EventKind.RESET, 2)]
    assert events[0].detail == {"vlan": "7 -> 100", "trust": "True -> False"}
    assert events[1].detail == {"mac": "02:99:00:00:00:01", "reason": "orphaned: no allocation holds it"}
    assert netlink.vfs[2] == CLEAN_VF
    assert manager.reconcile() == []
    netlink.vfs[2] = VfConfig(mac="02:99:00:00:00:02")
    assert [(e.kind, e.vf) for e in manager.reconcile()] == [(EventKind.RESET, 2)] and netlink.vfs[2] == CLEAN_VF


def test_attach_without_vf_netdev_is_refused_clearly(parts: tuple[SriovManager, MemorySysfs, MemoryNetlink]) -> None:
    manager, _, _ = parts
    manager.allocate("v1", "red", "eth0", VfRequest(vlan=100))
    with pytest.raises(NotSupported, match="has no netdev of its own"):
        manager.attach_container("v1", "ctr")
    with pytest.raises(NotSupported, match="no PCI address"):
        manager.vm_interface("v1")


class PciSysfs(MemorySysfs):
    def pfs(self) -> list[PfSysfs]:
        return [PfSysfs("ens1f0", PfKind.PCI, "0000:3b:00.0", "mlx5_core", self.num_vfs, 8, "mlx5_0",
                        vfs={i: VfSysfs(i, f"0000:3b:00.{i + 2}", f"ens1f0v{i}", f"mlx5_{i + 2}" if i else None)
                             for i in range(self.num_vfs)})]


class MovingNetlink(MemoryNetlink):
    def __init__(self, sysfs: MemorySysfs) -> None:
        super().__init__(sysfs)
        self.where: dict[str, str | None] = {}

    def move_to_netns(self, ifname: str, netns: str) -> None:
        self.where[ifname] = netns

    def return_from_netns(self, ifname: str, netns: str) -> None:
        assert self.where[ifname] == netns
        self.where[ifname] = None


class FakeRdma:
    def __init__(self, mode: str) -> None:
        self.mode, self.where = mode, {}  # type: ignore[var-annotated]

    def netns_mode(self) -> str:
        return self.mode

    def move_device(self, device: str, netns: str) -> None:
        self.where[device] = netns

    def return_device(self, device: str, netns: str) -> None:
        self.where[device] = None


def test_pci_vf_container_attach_and_vm_xml() -> None:
    sysfs = PciSysfs()
    netlink = MovingNetlink(sysfs)
    rdma = FakeRdma("shared")
    manager = SriovManager(sysfs, netlink, eswitch_mode=lambda kind, bus: "switchdev", rdma=rdma)
    manager.allocate("v0", "red", "ens1f0", VfRequest(vlan=42), vf_index=0)  # VF 0 has no RDMA device
    manager.allocate("v1", "red", "ens1f0", VfRequest(vlan=42), vf_index=1)
    interface = manager.vm_interface("v1", alias="ua-v1")
    assert interface == HostdevInterface(pci=PciAddress(0, 0x3B, 0, 3), mac=manager.allocation("v1").config.mac,
                                         vlan=42, alias="ua-v1")

    with pytest.raises(NotSupported, match="ens1f0/vf0 has no RDMA device"):
        manager.attach_container("v0", "ctr")
    with pytest.raises(NotSupported, match="shared netns mode"):
        manager.attach_container("v1", "ctr")
    assert netlink.where == {} and manager.allocation("v1").netns is None  # refused before moving anything

    ethernet_only = manager.attach_container("v0", "ctr", require_rdma=False)
    assert ethernet_only.rdma_device is None and "Ethernet only" in ethernet_only.notes[0]
    rdma.mode = "exclusive"
    attached = manager.attach_container("v1", "ctr")
    assert (attached.netdev, attached.rdma_device) == ("ens1f0v1", "mlx5_3")
    assert netlink.where["ens1f0v1"] == "ctr" and rdma.where["mlx5_3"] == "ctr"
    with pytest.raises(Conflict, match="already in netns ctr"):
        manager.attach_container("v1", "other")
    # what vrnicd observes as attached: the VFs it moved into a container (a VM's hostdev it cannot see)
    assert manager.attached_ids() == {"v0", "v1"}
    manager.detach_container("v0")
    assert manager.attached_ids() == {"v1"}
    manager.release("v1")  # release brings both back before resetting the VF
    assert netlink.where["ens1f0v1"] is None and rdma.where["mlx5_3"] is None
    assert netlink.vfs[1] == CLEAN_VF
    assert manager.attached_ids() == set()


def test_inventory_and_driver_close_resets_with_in_memory_store(
        parts: tuple[SriovManager, MemorySysfs, MemoryNetlink]) -> None:
    from vrnic.backend.drivers.sriov import SriovDriver

    manager, _, netlink = parts
    driver = SriovDriver(manager)
    manager.allocate("v1", "red", "eth0", VfRequest(vlan=100), vf_index=2)
    [inventory] = manager.inventory()
    assert inventory.pf.eswitch_mode == "legacy" and set(inventory.allocations) == {2}
    assert inventory.pf.vfs[2].config == inventory.allocations[2].config
    assert [(d.name, d.caps) for d in driver.devices()] == [("eth0", {"num_vfs": 4, "free_vfs": 3, "total_vfs": 4})]
    driver.close()  # nothing persisted the allocation, so nothing may stay configured
    assert netlink.vfs[2] == CLEAN_VF and manager.allocations() == []


def test_driver_keeps_vfs_on_close_with_a_persistent_store(
        parts: tuple[SriovManager, MemorySysfs, MemoryNetlink]) -> None:
    from vrnic.backend.drivers.sriov import SriovDriver

    manager, _, netlink = parts
    driver = SriovDriver(manager, release_on_close=False)
    a = manager.allocate("v1", "red", "eth0", VfRequest(vlan=100))
    driver.close()
    assert netlink.vfs[0] == a.config
