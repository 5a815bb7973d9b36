"""iproute2's `rdma` tool: the only interface to `rdma link` and resource tracking (no pyroute2 support)."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from vrnic.errors import DeviceError, NotSupported

RESOURCE_KINDS = ("pd", "cq", "qp", "mr", "ctx", "srq", "cm_id")


def _rdma(*args: str) -> Any:
    if shutil.which("rdma") is None:
        raise NotSupported("iproute2's rdma tool is not installed")
    result = subprocess.run(["rdma", "-j", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise DeviceError(f"rdma {' '.join(args)}: {result.stderr.strip()}")
    return json.loads(result.stdout or "[]")


def parse_resource_counts(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    return {r["ifname"]: {k: int(r.get(k, 0)) for k in RESOURCE_KINDS} for r in records}


def resource_counts() -> dict[str, dict[str, int]]:
    """Kernel object counts per RDMA device, as `rdma res show` reports them."""
    return parse_resource_counts(_rdma("res", "show"))
