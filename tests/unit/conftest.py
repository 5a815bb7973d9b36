"""Host fixtures for the backend: the real paravirtual driver over the in-memory RNIC edge."""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.backend.fake_edge import FakeEdge
from vrnic.backend.guest_memory import REQUIRED_SEALS, GuestMemory
from vrnic.core.specs import AttachInfo, Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid

_serial = itertools.count(1)


@pytest.fixture
def edge() -> FakeEdge:
    return FakeEdge()


@pytest.fixture
def driver(edge: FakeEdge, tmp_path: Path) -> Iterator[VerbsDriver]:
    drv = VerbsDriver(socket_path=tmp_path / "vrnicd.sock", edge=edge)
    yield drv
    drv.close()
    assert not edge.live, "objects left on the fake NIC"
    assert edge.open_contexts == 0, "device contexts left open"


@pytest.fixture
def make_vrnic(driver: VerbsDriver) -> Callable[..., AttachInfo]:
    def make(tenant: str = "t1", vpc: int = 1, device: str = "fake0", **quota: int) -> AttachInfo:
        serial = next(_serial)
        spec = VrnicSpec(id=f"v{serial}", tenant=tenant, vpc_id=vpc, quota=Quota(**quota),
                         virtual_gid=make_virtual_gid(vpc, serial))
        return driver.create_vrnic(spec, device)

    return make


@pytest.fixture
def memory() -> Iterator[GuestMemory]:
    """vrnicd's view of a guest's sealed memfd of 16 pages, none written."""
    fd = os.memfd_create("guest", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, 16 * mmap.PAGESIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    mem = GuestMemory(fd)
    yield mem
    mem.close()
