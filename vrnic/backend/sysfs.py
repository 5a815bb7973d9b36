"""Thin reads of /sys/class/infiniband (the RDMA device view that pyverbs does not give)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from vrnic.errors import NotFound

IB_SYSFS = Path("/sys/class/infiniband")


def rdma_devices(root: Path = IB_SYSFS) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def gid_table(device: str, port: int = 1, root: Path = IB_SYSFS) -> list[tuple[int, str, str]]:
    """Populated GID entries as (index, gid, type), e.g. (1, '::ffff:10.77.1.1', 'RoCE v2')."""
    base = root / device / "ports" / str(port)
    if not base.exists():
        raise NotFound(f"no RDMA device {device} port {port}")
    entries = []
    for path in sorted((base / "gids").iterdir(), key=lambda p: int(p.name)):
        raw = path.read_text().strip()
        if int(raw.replace(":", ""), 16) == 0:
            continue
        try:
            kind = (base / "gid_attrs" / "types" / path.name).read_text().strip()
        except OSError:  # the kernel answers EINVAL for entries without attributes
            continue
        address = ipaddress.IPv6Address(raw)
        shown = f"::ffff:{address.ipv4_mapped}" if address.ipv4_mapped else str(address)
        entries.append((int(path.name), shown, kind))
    return entries


def roce_v2_ipv4_gid_index(device: str, port: int = 1, root: Path = IB_SYSFS) -> int:
    """The index of the RoCE v2 IPv4-mapped GID: the one routable between hosts."""
    for index, gid, kind in gid_table(device, port, root):
        address = ipaddress.IPv6Address(gid)
        if kind == "RoCE v2" and address.ipv4_mapped is not None:
            return index
    raise NotFound(f"{device} port {port} has no RoCE v2 IPv4 GID (is an address set on its netdev?)")
