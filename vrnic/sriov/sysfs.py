"""The sysfs edge of SR-IOV: find PFs and their VFs, read and write sriov_numvfs.

Both kinds of PF look the same from /sys/class/net/<pf>/device: a PCI function (sriov_totalvfs, virtfnN
links to the VF functions, their netdevs and RDMA devices) or a netdevsim device (sriov_numvfs only; its VF
limit lives in debugfs as max_vfs, and its VFs have no PCI function, netdev or RDMA device).
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from pathlib import Path

from vrnic.errors import DeviceError, InvalidArgument, NotFound
from vrnic.sriov.vf_types import PfKind

SYS = Path("/sys")
# Switchdev representors point at the PF's device too; they are switch ports, not PFs.
_REPRESENTOR_RE = re.compile(r"^(pf\d+vf\d+|pf\d+sf\d+|c\d+pf\d+vf\d+)$")


@dataclass(frozen=True)
class VfSysfs:
    index: int
    pci_address: str | None = None
    netdev: str | None = None
    rdma_device: str | None = None


@dataclass(frozen=True)
class PfSysfs:
    name: str
    kind: PfKind
    bus_id: str
    driver: str
    num_vfs: int
    total_vfs: int | None
    rdma_device: str | None = None
    vfs: dict[int, VfSysfs] = field(default_factory=dict)


class SriovSysfs:
    def __init__(self, root: Path = SYS) -> None:
        self.root = root

    def pfs(self) -> list[PfSysfs]:
        by_device: dict[Path, list[str]] = {}
        net = self.root / "class" / "net"
        for link in sorted(net.iterdir()) if net.exists() else []:
            device = link / "device"
            if (device / "sriov_numvfs").exists():
                by_device.setdefault(device.resolve(), []).append(link.name)
        found = []
        for device, netdevs in by_device.items():
            kind = _kind(device)
            if kind is None:
                continue
            candidates = [n for n in netdevs if not _REPRESENTOR_RE.match(self._port_name(n))] or netdevs
            found.append(self._describe(sorted(candidates)[0], device, kind))
        return sorted(found, key=lambda p: p.name)

    def pf(self, name: str) -> PfSysfs:
        for pf in self.pfs():
            if pf.name == name:
                return pf
        raise NotFound(f"no SR-IOV PF {name!r} (no /sys/class/net/{name}/device/sriov_numvfs)")

    def set_num_vfs(self, name: str, count: int) -> None:
        path = self.root / "class" / "net" / name / "device" / "sriov_numvfs"
        try:
            path.write_text(f"{count}\n")
        except FileNotFoundError:
            raise NotFound(f"no SR-IOV PF {name!r}") from None
        except OSError as e:
            code = e.errno or 0
            reason = {errno.EBUSY: "VFs are enabled (the count only changes from or to zero) or in use",
                      errno.ENOMEM: "more VFs than the device supports",
                      errno.ERANGE: "more VFs than the device supports",
                      errno.EPERM: "not permitted"}.get(code, e.strerror or "error")
            if code in (errno.ERANGE, errno.ENOMEM) and count > 0:
                raise InvalidArgument(f"{name}: cannot enable {count} VFs: {reason}") from None
            raise DeviceError(f"{name}: writing sriov_numvfs={count} failed: {reason}", code) from None

    def _port_name(self, netdev: str) -> str:
        try:
            return (self.root / "class" / "net" / netdev / "phys_port_name").read_text().strip()
        except OSError:  # EOPNOTSUPP for netdevs without port names
            return ""

    def _describe(self, name: str, device: Path, kind: PfKind) -> PfSysfs:
        num_vfs = int(_read(device / "sriov_numvfs") or 0)
        driver_link = device / "driver"
        driver = driver_link.resolve().name if driver_link.exists() else ""
        if kind is PfKind.PCI:
            total = _read(device / "sriov_totalvfs")
            total_vfs = int(total) if total else None
            vfs = {}
            for virtfn in device.glob("virtfn*"):
                index = int(virtfn.name[len("virtfn"):])
                vf_dev = virtfn.resolve()
                vfs[index] = VfSysfs(index=index, pci_address=vf_dev.name, netdev=_first(vf_dev / "net"),
                                     rdma_device=_first(vf_dev / "infiniband"))
            return PfSysfs(name=name, kind=kind, bus_id=device.name, driver=driver, num_vfs=num_vfs,
                           total_vfs=total_vfs, rdma_device=_first(device / "infiniband"), vfs=vfs)
        max_vfs = _read(self.root / "kernel" / "debug" / "netdevsim" / device.name / "max_vfs")
        return PfSysfs(name=name, kind=kind, bus_id=device.name, driver=driver or "netdevsim", num_vfs=num_vfs,
                       total_vfs=int(max_vfs) if max_vfs else None,
                       vfs={i: VfSysfs(index=i) for i in range(num_vfs)})


def _kind(device: Path) -> PfKind | None:
    subsystem = device / "subsystem"
    bus = subsystem.resolve().name if subsystem.exists() else ""
    return {"pci": PfKind.PCI, "netdevsim": PfKind.NETDEVSIM}.get(bus)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _first(directory: Path) -> str | None:
    try:
        names = sorted(p.name for p in directory.iterdir())
    except OSError:
        return None
    return names[0] if names else None
