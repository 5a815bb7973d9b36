"""SR-IOV mode on real netdevsim VFs inside the lab (`vrnic lab run --netdevsim`).

Every setting is read back independently of vrnic's own parser, through iproute2 (`ip -j -d link show`).
netdevsim VFs have no netdev, PCI function or RDMA device of their own (kernel 6.1), so the netns move is
proven on a netdevsim port netdev, and the refusal for netdevsim VFs is itself tested.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from vrnic.backend.drivers.sriov import SriovDriver
from vrnic.core.specs import QosPolicy, VrnicMode, VrnicSpec
from vrnic.errors import Conflict, DeviceError, InvalidArgument, NotFound, NotSupported, QuotaExceeded, VrnicError
from vrnic.sriov import rdma_netns
from vrnic.sriov.manager import SriovManager
from vrnic.sriov.netlink import VfNetlink
from vrnic.sriov.plan import VfOp
from vrnic.sriov.vf_types import EventKind, LinkState, PfKind, VfRequest

from .sriov_iproute import CLEAN, sh, vf_settings

PF = os.environ.get("VRNIC_LAB_NETDEVSIM_PF", "")
NSIM_DEV = os.environ.get("VRNIC_LAB_NETDEVSIM_DEV", "netdevsim10")
NSIM = Path("/sys/bus/netdevsim/devices") / NSIM_DEV
VF_COUNT = 4

pytestmark = pytest.mark.skipif(not PF or not NSIM.exists(),
                                reason="needs netdevsim: `vrnic lab run --netdevsim -- pytest tests/kernel`")






def numvfs() -> int:
    return int((NSIM / "sriov_numvfs").read_text())


@pytest.fixture
def manager() -> Iterator[SriovManager]:
    manager = SriovManager()
    yield manager
    for allocation in manager.allocations():
        manager.release(allocation.vrnic_id)
    if numvfs() != VF_COUNT:
        manager.set_num_vfs(PF, VF_COUNT, force=True)
    for index in range(VF_COUNT):  # leave every VF clean for the next test
        sh("ip", "link", "set", PF, "vf", str(index), "mac", "00:00:00:00:00:00", "vlan", "0", "max_tx_rate", "0",
           "min_tx_rate", "0", "trust", "off", "spoofchk", "on", "state", "auto")
    manager.close()


def spec(vrnic_id: str, tenant: str, vpc: int, cap: int | None, guarantee: int | None) -> VrnicSpec:
    return VrnicSpec(id=vrnic_id, tenant=tenant, mode=VrnicMode.SRIOV, vpc_id=vpc, virtual_gid="fe80::1",
                     qos=QosPolicy(rate_cap_mbps=cap, guarantee_mbps=guarantee))


def test_discovery_finds_the_netdevsim_pf_and_its_vfs(manager: SriovManager) -> None:
    sh("ip", "link", "set", PF, "vf", "2", "mac", "02:00:00:00:02:02", "vlan", "22", "max_tx_rate", "300")
    pfs = manager.discover()
    assert [p.name for p in pfs] == [PF]
    pf = pfs[0]
    assert (pf.kind, pf.bus_id, pf.driver, pf.num_vfs, pf.eswitch_mode) == \
        (PfKind.NETDEVSIM, NSIM_DEV, "netdevsim", VF_COUNT, "legacy")
    assert [v.index for v in pf.vfs] == [0, 1, 2, 3]
    vf2 = pf.vfs[2]
    assert (vf2.config.mac, vf2.config.vlan, vf2.config.max_tx_rate) == ("02:00:00:00:02:02", 22, 300)
    assert (vf2.pci_address, vf2.netdev, vf2.rdma_device) == (None, None, None)  # netdevsim VFs: none of them


def test_two_tenants_get_their_vlan_and_rates_confirmed_through_netlink(manager: SriovManager) -> None:
    driver = SriovDriver(manager)
    assert [(d.name, d.driver, d.caps["free_vfs"]) for d in driver.devices()] == [(PF, "sriov", VF_COUNT)]
    red = driver.create_vrnic(spec("red-1", "red", 100, 1000, 100), PF)
    blue = driver.create_vrnic(spec("blue-1", "blue", 200, 500, 50), PF)
    assert red.extra["vf_index"] == "0" and blue.extra["vf_index"] == "1"
    assert red.extra["netdevsim_device"] == NSIM_DEV and red.mode is VrnicMode.SRIOV
    vfs = vf_settings(PF)
    assert vfs[0] == {"mac": red.extra["mac"], "vlan": 100, "qos": 0, "max": 1000, "min": 100, "spoofchk": True,
                      "trust": False, "state": "auto"}
    assert vfs[1] == {"mac": blue.extra["mac"], "vlan": 200, "qos": 0, "max": 500, "min": 50, "spoofchk": True,
                      "trust": False, "state": "auto"}
    assert red.extra["mac"] != blue.extra["mac"]
    assert driver.vrnic_ids() == {"red-1", "blue-1"} and driver.load(PF) == 2
    # a given MAC, a VLAN priority and an explicit link state go through the manager
    green = manager.allocate("green-1", "green", PF, VfRequest(vlan=300, qos=5, max_tx_rate=2000, min_tx_rate=0,
                                                                mac="02:47:00:00:00:03", link_state=LinkState.ENABLE))
    assert vf_settings(PF)[green.address.index] == {"mac": "02:47:00:00:00:03", "vlan": 300, "qos": 5, "max": 2000,
                                             "min": 0, "spoofchk": True, "trust": False, "state": "enable"}

    driver.release_vrnic("red-1")
    vfs = vf_settings(PF)
    assert vfs[0] == CLEAN  # nothing of tenant red survives
    assert vfs[1]["vlan"] == 200 and vfs[1]["max"] == 500  # blue untouched
    assert driver.vrnic_ids() == {"blue-1", "green-1"}
    # the released VF is the next one handed out, clean state replaced by the new tenant's
    again = driver.create_vrnic(spec("red-2", "red", 100, None, None), PF)
    assert again.extra["vf_index"] == "0" and vf_settings(PF)[0]["max"] == 0 and vf_settings(PF)[0]["vlan"] == 100
    assert driver.create_vrnic(spec("x", "x", 1, None, None), PF).extra["vf_index"] == "3"
    with pytest.raises(QuotaExceeded, match=f"free VFs on {PF}"):
        driver.create_vrnic(spec("y", "y", 1, None, None), PF)


class RecordingNetlink(VfNetlink):
    """The real netlink edge, remembering what it sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[int, str]] = []

    def apply(self, pf: str, vf: int, ops: Sequence[VfOp]) -> None:
        super().apply(pf, vf, ops)
        self.sent += [(vf, op.attribute) for op in ops]


def test_count_change_refused_while_allocated_and_forced_one_reapplies() -> None:
    netlink = RecordingNetlink()
    manager = SriovManager(netlink=netlink)
    try:
        _count_change(manager, netlink)
    finally:
        for allocation in manager.allocations():
            manager.release(allocation.vrnic_id)
        manager.set_num_vfs(PF, VF_COUNT, force=True)
        manager.close()


def _count_change(manager: SriovManager, netlink: RecordingNetlink) -> None:
    kept = manager.allocate("keep", "red", PF, VfRequest(vlan=10, max_tx_rate=800, min_tx_rate=80), vf_index=0)
    lost = manager.allocate("lose", "blue", PF, VfRequest(vlan=30, max_tx_rate=300), vf_index=3)
    with pytest.raises(Conflict) as refused:
        manager.set_num_vfs(PF, 2)
    assert "keep on vf0 (tenant red)" in str(refused.value) and "lose on vf3 (tenant blue)" in str(refused.value)
    assert numvfs() == VF_COUNT and vf_settings(PF)[3]["vlan"] == 30  # nothing changed
    # the kernel itself refuses N -> M without going through zero
    with pytest.raises(OSError):
        (NSIM / "sriov_numvfs").write_text("2")

    netlink.sent.clear()
    result = manager.set_num_vfs(PF, 2, force=True)
    assert result.change.steps == (0, 2) and numvfs() == 2
    # netdevsim keeps VF settings across sriov_numvfs=0 (ConnectX does not), so the re-apply is shown by what
    # reached the kernel: every attribute of the surviving VF, then confirmed by the read-back below
    assert [a for vf, a in netlink.sent if vf == 0] == ["mac", "vlan", "rate", "spoofchk", "trust", "link_state"]
    vfs = vf_settings(PF)
    assert sorted(vfs) == [0, 1]
    assert vfs[0] == {"mac": kept.config.mac, "vlan": 10, "qos": 0, "max": 800, "min": 80, "spoofchk": True,
                      "trust": False, "state": "auto"}
    assert [(e.kind, e.vrnic_id) for e in result.events] == [
        (EventKind.NUM_VFS_CHANGED, None), (EventKind.VANISHED, "lose"), (EventKind.REAPPLIED, "keep")]
    assert manager.allocation("lose").vanished

    # netdevsim keeps a hidden VF's settings: growing back must not hand out blue's old VF 3 dirty
    grown = manager.set_num_vfs(PF, VF_COUNT, force=True)
    assert vf_settings(PF)[3] == CLEAN and vf_settings(PF)[0]["vlan"] == 10
    assert (EventKind.RESET, 3) in [(e.kind, e.vf) for e in grown.events]
    manager.release(lost.vrnic_id)  # the vanished vRNIC goes without touching VF 3
    assert [a.vrnic_id for a in manager.allocations()] == ["keep"]


def test_reconcile_restores_a_vf_changed_behind_our_back(manager: SriovManager) -> None:
    a = manager.allocate("r1", "red", PF, VfRequest(vlan=100, max_tx_rate=1000, min_tx_rate=100), vf_index=1)
    assert manager.reconcile() == []
    sh("ip", "link", "set", PF, "vf", "1", "mac", "02:66:66:66:66:66", "vlan", "999", "trust", "on", "spoofchk",
       "off", "state", "disable", "max_tx_rate", "5", "min_tx_rate", "0")
    events = manager.reconcile()
    assert [(e.kind, e.vf, e.vrnic_id) for e in events] == [(EventKind.DRIFT_CORRECTED, 1, "r1")]
    assert events[0].detail["vlan"] == "999 -> 100" and set(events[0].detail) == \
        {"mac", "vlan", "trust", "spoofchk", "link_state", "max_tx_rate", "min_tx_rate"}
    assert vf_settings(PF)[1] == {"mac": a.config.mac, "vlan": 100, "qos": 0, "max": 1000, "min": 100, "spoofchk": True,
                           "trust": False, "state": "auto"}
    assert manager.reconcile() == []


def test_bad_input_is_rejected_and_nothing_is_half_applied(manager: SriovManager) -> None:
    manager.allocate("ok", "red", PF, VfRequest(vlan=5), vf_index=0)
    before = vf_settings(PF)
    driver = SriovDriver(manager)
    cases: list[tuple[Any, type[Exception], str]] = [
        (lambda: manager.allocate("b1", "t", PF, VfRequest(vlan=7), vf_index=VF_COUNT), InvalidArgument,
         f"VF index {VF_COUNT} is out of range"),
        (lambda: manager.allocate("b2", "t", PF, VfRequest(vlan=4095)), InvalidArgument, "VLAN 4095"),
        (lambda: driver.create_vrnic(spec("b3", "t", 5000, None, None), PF), InvalidArgument, "vpc_id 5000"),
        (lambda: manager.allocate("b4", "t", PF, VfRequest(vlan=7, max_tx_rate=100, min_tx_rate=200)),
         InvalidArgument, "exceeds max_tx_rate"),
        (lambda: manager.allocate("b5", "t", "nosuchpf0", VfRequest(vlan=7)), NotFound, "no SR-IOV PF 'nosuchpf0'"),
        (lambda: manager.allocate("b6", "t", PF, VfRequest(vlan=7), vf_index=0), Conflict, "allocated to ok"),
        # netdevsim's limit is only in debugfs, so the kernel refuses 99 after the step through zero:
        # vrnic restores the old count and re-applies the allocated VF
        (lambda: manager.set_num_vfs(PF, 99, force=True), VrnicError, "cannot enable 99 VFs"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert vf_settings(PF) == before and numvfs() == VF_COUNT
    assert [a.vrnic_id for a in manager.allocations()] == ["ok"]


def test_vf_netdev_moves_into_a_netns_and_back(manager: SriovManager) -> None:
    manager.allocate("c1", "red", PF, VfRequest(vlan=100))
    # netdevsim VFs have no netdev: attaching one is refused up front, clearly, with nothing moved
    with pytest.raises(NotSupported, match="has no netdev of its own"):
        manager.attach_container("c1", "nowhere")
    assert manager.allocation("c1").netns is None

    # the move itself, proven on a real netdevsim port netdev of the same device
    before = set(os.listdir(NSIM / "net"))
    (NSIM / "new_port").write_text("7")
    port = (set(os.listdir(NSIM / "net")) - before).pop()
    sh("ip", "netns", "add", "vrnic-ctr1")
    netlink = VfNetlink()
    try:
        with pytest.raises(NotFound, match="no network namespace 'nope'"):
            netlink.move_to_netns(port, "nope")
        netlink.move_to_netns(port, "vrnic-ctr1")
        assert port in netlink.links_in_netns("vrnic-ctr1") and port not in netlink.links_in_netns(None)
        assert port in sh("ip", "-n", "vrnic-ctr1", "-o", "link", "show")
        netlink.return_from_netns(port, "vrnic-ctr1")
        assert port in netlink.links_in_netns(None) and port not in netlink.links_in_netns("vrnic-ctr1")
    finally:
        netlink.close()
        sh("ip", "netns", "del", "vrnic-ctr1")
        (NSIM / "del_port").write_text("7")


def test_rdma_device_move_reports_why_it_cannot(manager: SriovManager) -> None:
    assert rdma_netns.netns_mode() == "shared"
    with pytest.raises(NotSupported, match="shared netns mode"):
        rdma_netns.move_device("rxe0", "vrnic-ctr2")
    try:
        rdma_netns.set_netns_mode("exclusive")  # the kernel allows it only while no other netns exists
    except DeviceError as e:
        pytest.skip(f"another test left a network namespace behind, exclusive mode is refused: {e}")
    sh("ip", "netns", "add", "vrnic-ctr2")
    try:
        assert rdma_netns.netns_mode() == "exclusive"
        with pytest.raises(NotSupported, match="Operation not supported"):
            rdma_netns.move_device("rxe0", "vrnic-ctr2")  # rxe cannot change namespace
    finally:
        sh("ip", "netns", "del", "vrnic-ctr2")
        rdma_netns.set_netns_mode("shared")
    assert rdma_netns.netns_mode() == "shared"


def test_backend_service_places_sriov_vrnics_through_the_driver_entry_point() -> None:
    from vrnic.backend.driver import load_driver
    from vrnic.backend.service import BackendService

    driver = load_driver("sriov")
    service = BackendService({VrnicMode.SRIOV: driver})
    try:
        assert [(d.name, d.driver) for d in service.devices()] == [(PF, "sriov")]
        info = service.create_vrnic(spec("svc-1", "red", 77, 400, 40))  # no device given: the backend picks
        assert info.device == PF and vf_settings(PF)[int(info.extra["vf_index"])]["vlan"] == 77
        assert service.vrnic_ids() == {"svc-1"}
        service.release_vrnic("svc-1")
        assert vf_settings(PF)[int(info.extra["vf_index"])] == CLEAN and service.vrnic_ids() == set()
    finally:
        for vrnic_id in driver.vrnic_ids():
            driver.release_vrnic(vrnic_id)
        driver.close()


def test_reconcile_marks_vfs_that_vanished_behind_our_back(manager: SriovManager) -> None:
    kept = manager.allocate("k", "red", PF, VfRequest(vlan=11, max_tx_rate=100), vf_index=0)
    manager.allocate("gone", "blue", PF, VfRequest(vlan=33), vf_index=3)
    (NSIM / "sriov_numvfs").write_text("0")  # an operator bypassing vrnic
    (NSIM / "sriov_numvfs").write_text("2")
    events = manager.reconcile()
    assert [(e.kind, e.vrnic_id) for e in events] == [(EventKind.VANISHED, "gone")]
    assert manager.allocation("gone").vanished and not manager.allocation("k").vanished
    assert vf_settings(PF)[0]["vlan"] == kept.config.vlan
    assert manager.reconcile() == []  # marked once, not on every pass
