"""SR-IOV on real PCI VFs: the lab's emulated igb NIC (`vrnic lab run --sriov-nic`).

netdevsim VFs have no netdev or PCI function; igb VFs have both (igbvf binds them), so here the VF
netdev really moves into a container's network namespace and back, and the VM hostdev XML carries a
real VF PCI address.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import pytest

from vrnic.errors import NotSupported
from vrnic.sriov.manager import SriovManager
from vrnic.sriov.vf_types import VfRequest

from .sriov_iproute import sh

PF = os.environ.get("VRNIC_LAB_SRIOV_PF", "")
NETNS = "vrnic-test-c1"

pytestmark = pytest.mark.skipif(not PF, reason="needs the SR-IOV NIC: `vrnic lab run --sriov-nic -- pytest ...`")


def netdevs(netns: str | None = None) -> set[str]:
    prefix = ["ip", "-n", netns] if netns else ["ip"]
    return {link["ifname"] for link in json.loads(sh(*prefix, "-j", "link", "show"))}


@pytest.fixture
def manager() -> Iterator[SriovManager]:
    device = Path(f"/sys/class/net/{PF}/device")
    if int((device / "sriov_numvfs").read_text()) == 0:
        (device / "sriov_numvfs").write_text("2")
    sh("ip", "netns", "add", NETNS)
    manager = SriovManager()
    yield manager
    for allocation in manager.allocations():
        manager.release(allocation.vrnic_id)
    manager.close()
    sh("ip", "netns", "del", NETNS)


def test_a_real_vf_netdev_moves_into_a_netns_and_back(manager: SriovManager) -> None:
    allocation = manager.allocate("vf-tenant-a", "tenant-a", PF, VfRequest(vlan=100))
    vf = Path(f"/sys/class/net/{PF}/device/virtfn{allocation.address.index}")
    netdev = next((vf / "net").iterdir()).name
    pci = vf.resolve().name  # e.g. 0000:01:10.0
    assert netdev in netdevs() and netdev not in netdevs(NETNS)
    link = json.loads(sh("ip", "-j", "-d", "link", "show", PF))[0]
    settings = next(v for v in link["vfinfo_list"] if v["vf"] == allocation.address.index)
    assert settings["vlan_list"][0]["vlan"] == 100 and settings["address"] == allocation.config.mac

    # igb VFs have no RDMA device: requiring one is refused before anything moves.
    with pytest.raises(NotSupported, match="no RDMA device"):
        manager.attach_container("vf-tenant-a", NETNS)
    assert netdev in netdevs()
    attachment = manager.attach_container("vf-tenant-a", NETNS, require_rdma=False)
    assert attachment.netdev == netdev and attachment.rdma_device is None
    assert netdev in netdevs(NETNS) and netdev not in netdevs()  # really inside the container's netns

    interface = ElementTree.fromstring(manager.vm_interface("vf-tenant-a").to_xml())
    address = interface.find("source/address")
    assert address is not None and address.get("type") == "pci"
    domain, bus, slot_function = pci.split(":")
    slot, function = slot_function.split(".")
    assert {k: int(address.get(k, "-1"), 16) for k in ("domain", "bus", "slot", "function")} == {
        "domain": int(domain, 16), "bus": int(bus, 16), "slot": int(slot, 16), "function": int(function, 16)}
    assert interface.find("vlan/tag").get("id") == "100"  # type: ignore[union-attr]
    assert interface.find("mac").get("address") == allocation.config.mac  # type: ignore[union-attr]

    manager.detach_container("vf-tenant-a")
    assert netdev in netdevs() and netdev not in netdevs(NETNS)
    manager.release("vf-tenant-a")
    link = json.loads(sh("ip", "-j", "-d", "link", "show", PF))[0]
    settings = next(v for v in link["vfinfo_list"] if v["vf"] == allocation.address.index)
    assert settings["address"] == "00:00:00:00:00:00" and not settings.get("vlan_list", [{}])[0].get("vlan")


def test_release_returns_a_vf_still_inside_a_netns(manager: SriovManager) -> None:
    allocation = manager.allocate("vf-tenant-b", "tenant-b", PF, VfRequest(vlan=200))
    netdev = next(Path(f"/sys/class/net/{PF}/device/virtfn{allocation.address.index}/net").iterdir()).name
    manager.attach_container("vf-tenant-b", NETNS, require_rdma=False)
    assert netdev in netdevs(NETNS)
    manager.release("vf-tenant-b")  # no detach first: releasing brings the netdev home
    assert netdev in netdevs() and netdev not in netdevs(NETNS)
