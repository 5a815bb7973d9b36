"""Thin reads of /sys/class/infiniband (the RDMA device view that pyverbs does not give)."""

from __future__ import annotations

from pathlib import Path

IB_SYSFS = Path("/sys/class/infiniband")


def rdma_devices(root: Path = IB_SYSFS) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []
