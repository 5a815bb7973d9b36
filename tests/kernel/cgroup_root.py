"""The cgroup2 hierarchy the rdma-cgroup kernel tests build their cgroups in (they skip without one)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from vrnic.core.containment import pick_cgroup2_mount, unified_cgroup_path
from vrnic.errors import Conflict


@dataclass(frozen=True)
class Cgroup2Root:
    root: Path  # where cgroup2 is mounted
    own: str  # this process's cgroup, relative to it
    rdma_was_enabled: bool  # whether the root's subtree_control had rdma before the test


def cgroup2_root_with_rdma() -> Cgroup2Root:
    if os.geteuid() != 0:
        pytest.skip("needs root: it creates cgroups and sets rdma.max")
    own = unified_cgroup_path(Path("/proc/self/cgroup").read_text())
    try:
        root = Path(pick_cgroup2_mount(Path("/proc/self/mountinfo").read_text(), "/").directory("/"))
    except Conflict as e:
        pytest.skip(f"no cgroup2 mount: {e}")
    if "rdma" not in (root / "cgroup.controllers").read_text().split():
        pytest.skip("the cgroup2 hierarchy has no rdma controller")
    return Cgroup2Root(root, own, "rdma" in (root / "cgroup.subtree_control").read_text().split())
