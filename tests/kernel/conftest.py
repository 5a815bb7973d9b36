"""Kernel-tier fixtures: a real vrnicd backend (the verbs driver) on the lab's rxe0/rxe1."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.sysfs import rdma_devices
from vrnic.core.specs import AttachInfo, Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid

_serial = itertools.count(1)


@pytest.fixture
def rxe_pair() -> tuple[str, str]:
    devices = rdma_devices()
    if "rxe0" not in devices or "rxe1" not in devices:
        pytest.skip(f"needs rxe0 and rxe1 (the lab's pair topology), have {devices}")
    return "rxe0", "rxe1"


def wait_for_baseline(baseline: dict[str, dict[str, int]], timeout: float = 10.0) -> dict[str, dict[str, int]]:
    deadline = time.monotonic() + timeout
    while True:
        now = resource_counts()
        if now == baseline or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


@pytest.fixture
def driver(rxe_pair: tuple[str, str], tmp_path: Path) -> Iterator[object]:
    """An in-process verbs driver; afterwards the kernel must hold exactly what it held before."""
    from vrnic.backend.drivers.paravirtual import VerbsDriver

    baseline = resource_counts()
    drv = VerbsDriver(socket_path=tmp_path / "vrnicd.sock")
    yield drv
    drv.close()
    assert wait_for_baseline(baseline) == baseline, "kernel objects leaked"


@pytest.fixture
def make_vrnic(driver: object) -> Callable[..., AttachInfo]:
    def make(tenant: str = "t1", device: str = "rxe0", vpc: int = 1, **quota: int) -> AttachInfo:
        serial = next(_serial)
        spec = VrnicSpec(id=f"v{serial}", tenant=tenant, vpc_id=vpc, quota=Quota(**quota),
                         virtual_gid=make_virtual_gid(vpc, serial))
        return driver.create_vrnic(spec, device)  # type: ignore[attr-defined, no-any-return]

    return make
