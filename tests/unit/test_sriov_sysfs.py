"""The sysfs edge on a fabricated tree shaped like a ConnectX PF (PCI) and netdevsim: the PCI layout is
what the lab cannot provide; the netdevsim side is also proven on the real thing in tests/kernel."""

from __future__ import annotations

from pathlib import Path

import pytest

from vrnic.errors import NotFound
from vrnic.sriov.sysfs import SriovSysfs, VfSysfs
from vrnic.sriov.vf_types import PfKind


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _link(path: Path, target: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


@pytest.fixture
def sys_root(tmp_path: Path) -> Path:
    root = tmp_path
    pci = root / "devices/pci0000:00"
    pf = pci / "0000:3b:00.0"
    _write(pf / "sriov_numvfs", "2\n")
    _write(pf / "sriov_totalvfs", "8\n")
    _link(pf / "driver", root / "bus/pci/drivers/mlx5_core")
    _link(pf / "subsystem", root / "bus/pci")
    (pf / "infiniband/mlx5_0").mkdir(parents=True)
    _link(pf / "virtfn0", pci / "0000:3b:00.2")
    _link(pf / "virtfn1", pci / "0000:3b:00.3")  # no VF driver bound: no netdev, no RDMA device
    (pci / "0000:3b:00.2/net/ens1f0v0").mkdir(parents=True)
    (pci / "0000:3b:00.2/infiniband/mlx5_2").mkdir(parents=True)
    for netdev, port in (("ens1f0", "p0"), ("ens1f0_0", "pf0vf0")):  # the PF and a switchdev representor
        _link(root / f"class/net/{netdev}/device", pf)
        _write(root / f"class/net/{netdev}/phys_port_name", port)
    nsim = root / "devices/netdevsim10"
    _write(nsim / "sriov_numvfs", "4\n")
    _link(nsim / "subsystem", root / "bus/netdevsim")
    _link(nsim / "driver", root / "bus/netdevsim/drivers/netdevsim")
    _link(root / "class/net/eth0/device", nsim)
    _write(root / "kernel/debug/netdevsim/netdevsim10/max_vfs", "4\n")
    (root / "class/net/lo").mkdir(parents=True)
    _link(root / "class/net/veth0/device", root / "devices/virtual/x")  # a device without SR-IOV
    return root


def test_finds_pci_and_netdevsim_pfs(sys_root: Path) -> None:
    pfs = SriovSysfs(sys_root).pfs()
    assert [p.name for p in pfs] == ["ens1f0", "eth0"]
    pci, nsim = pfs
    assert (pci.kind, pci.bus_id, pci.driver, pci.num_vfs, pci.total_vfs, pci.rdma_device) == \
        (PfKind.PCI, "0000:3b:00.0", "mlx5_core", 2, 8, "mlx5_0")
    assert pci.vfs == {0: VfSysfs(0, "0000:3b:00.2", "ens1f0v0", "mlx5_2"), 1: VfSysfs(1, "0000:3b:00.3")}
    assert (nsim.kind, nsim.bus_id, nsim.driver, nsim.num_vfs, nsim.total_vfs) == \
        (PfKind.NETDEVSIM, "netdevsim10", "netdevsim", 4, 4)
    assert nsim.vfs == {i: VfSysfs(i) for i in range(4)}


def test_set_num_vfs_and_unknown_pf(sys_root: Path) -> None:
    sysfs = SriovSysfs(sys_root)
    sysfs.set_num_vfs("eth0", 0)
    assert (sys_root / "devices/netdevsim10/sriov_numvfs").read_text() == "0\n"
    with pytest.raises(NotFound, match="no SR-IOV PF 'veth0'"):
        sysfs.pf("veth0")
    with pytest.raises(NotFound):
        sysfs.set_num_vfs("nope", 1)
