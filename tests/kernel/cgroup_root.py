"""The cgroup2 hierarchy the cgroup kernel tests build their cgroups in (they skip without it or its controller)."""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from vrnic.core.containment import pick_cgroup2_mount, unified_cgroup_path
from vrnic.errors import Conflict


@dataclass(frozen=True)
class Cgroup2Root:
    root: Path  # where cgroup2 is mounted
    own: str  # this process's cgroup, relative to it
    was_enabled: bool  # whether the root's subtree_control had the controller before the test


def cgroup2_root_with(controller: str, why: str) -> Cgroup2Root:
    """The hierarchy, if it has controller (else the test skips); why: what the test needs root for."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root: {why}")
    own = unified_cgroup_path(Path("/proc/self/cgroup").read_text())
    try:
        root = Path(pick_cgroup2_mount(Path("/proc/self/mountinfo").read_text(), "/").directory("/"))
    except Conflict as e:
        pytest.skip(f"no cgroup2 mount: {e}")
    if controller not in (root / "cgroup.controllers").read_text().split():
        pytest.skip(f"the cgroup2 hierarchy has no {controller} controller")
    return Cgroup2Root(root, own, controller in (root / "cgroup.subtree_control").read_text().split())


def cgroup2_root_with_rdma() -> Cgroup2Root:
    return cgroup2_root_with("rdma", "it creates cgroups and sets rdma.max")


def rmdir_when_free(d: Path) -> None:
    """Remove a test's cgroup; an exited process may linger in it a moment."""
    for _ in range(100):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            time.sleep(0.05)
    raise AssertionError(f"{d} stays busy: {(d / 'cgroup.procs').read_text()!r}")
