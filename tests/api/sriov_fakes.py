"""In-memory stand-ins for the SR-IOV kernel edges (sysfs, netlink, devlink) so the API tier can run the real
SriovManager, SriovDriver, database store and routes on the host (no netdevsim here). A PCI PF, so VFs have
PCI addresses (what the VM hostdev XML needs). The kernel behaviour itself is proven in
tests/kernel/test_sriov_api.py and test_sriov_netdevsim.py inside the bench."""

from __future__ import annotations

import errno
import threading
from collections.abc import Sequence
from dataclasses import replace

from sqlalchemy import Engine

from vrnic.backend.drivers.sriov import SriovDriver
from vrnic.db.vf_store import DbVfEventLog, DbVfStateStore
from vrnic.errors import DeviceError
from vrnic.sriov.manager import SriovManager
from vrnic.sriov.netlink import VfNetlink
from vrnic.sriov.plan import VfOp
from vrnic.sriov.sysfs import PfSysfs, SriovSysfs, VfSysfs
from vrnic.sriov.vf_types import CLEAN_VF, PfKind, VfConfig

PF = "ens1f0"


class MemoryKernel(SriovSysfs, VfNetlink):
    """One PCI PF with up to 8 VFs: sriov_numvfs changes only from or to zero, VF settings kept per index."""

    def __init__(self, num_vfs: int = 4, total: int = 8) -> None:
        self.num_vfs, self.total = num_vfs, total
        self.vfs: dict[int, VfConfig] = {i: CLEAN_VF for i in range(total)}
        self.netns: dict[str, str] = {}  # VF netdev -> the namespace it was moved into
        self.lock = threading.Lock()

    # sysfs
    def pfs(self) -> list[PfSysfs]:
        vfs = {i: VfSysfs(i, pci_address=f"0000:03:00.{i + 1}", netdev=f"{PF}v{i}") for i in range(self.num_vfs)}
        return [PfSysfs(PF, PfKind.PCI, "0000:03:00.0", "mlx5_core", self.num_vfs, self.total, vfs=vfs)]

    def set_num_vfs(self, name: str, count: int) -> None:
        if self.num_vfs and count:
            raise DeviceError("busy", errno.EBUSY)
        with self.lock:
            self.num_vfs = count
            if count == 0:  # like a real device, VFs come back clean
                self.vfs = {i: CLEAN_VF for i in range(self.total)}

    # netlink
    def read_vfs(self, pf: str) -> dict[int, VfConfig]:
        with self.lock:
            return {i: c for i, c in self.vfs.items() if i < self.num_vfs}

    def apply(self, pf: str, vf: int, ops: Sequence[VfOp]) -> None:
        with self.lock:
            for op in ops:
                self.vfs[vf] = replace(self.vfs[vf], **op.values())  # type: ignore[arg-type]

    def move_to_netns(self, ifname: str, netns: str) -> None:
        with self.lock:
            self.netns[ifname] = netns

    def return_from_netns(self, ifname: str, netns: str) -> None:
        with self.lock:
            if self.netns.pop(ifname, None) != netns:
                raise DeviceError(f"{ifname} is not in netns {netns}", errno.ENODEV)

    def tamper(self, vf: int, **changes: object) -> None:
        """A change behind vrnic's back."""
        with self.lock:
            self.vfs[vf] = replace(self.vfs[vf], **changes)  # type: ignore[arg-type]

    def close(self) -> None:
        pass


def sriov_driver(engine: Engine, host_name: str, kernel: MemoryKernel) -> SriovDriver:
    """The daemon's wiring (vrnic.daemon.build_sriov_driver) over the in-memory kernel."""
    store = DbVfStateStore(engine, host_name)
    manager = SriovManager(kernel, kernel, store, on_event=DbVfEventLog(store), eswitch_mode=lambda kind, bus: "legacy")
    return SriovDriver(manager=manager, release_on_close=False)
