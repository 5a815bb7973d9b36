"""Test tiers: the directory a test lives in is its marker.

unit: pure logic; api: real database; kernel: real RDMA/netlink (inside the
lab); libvirt: a real libvirtd with QEMU on the host; two_hosts: the lab's
two-hosts topology (tests/two_hosts/conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TIERS = ("unit", "api", "kernel", "libvirt", "two_hosts")


def _have_rdma() -> bool:
    path = Path("/sys/class/infiniband")
    return path.exists() and any(path.iterdir())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    no_rdma = pytest.mark.skip(reason="needs an RDMA device: runs inside the lab "
                                      "(`vrnic lab run -- pytest -m kernel`, as `make test` does)")
    for item in items:
        tier = item.path.relative_to(root).parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "kernel" and not _have_rdma():
            item.add_marker(no_rdma)


@pytest.fixture
def in_lab() -> bool:
    return os.environ.get("VRNIC_LAB") == "1"
