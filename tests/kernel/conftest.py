"""Kernel-tier fixtures: a real vrnicd backend (the verbs driver) on the RDMA devices this machine has.

Devices are discovered as rdma-core's own tests do: every device with an ACTIVE port 1 that has a
RoCE v2 IPv4 GID (routable between hosts) is usable. VRNIC_TEST_DEVICES="a b" picks them by hand.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vrnic.backend.rdma_tool import resource_counts
from vrnic.backend.sysfs import rdma_devices
from vrnic.core.specs import AttachInfo, DataEngine, Quota, VrnicSpec, active_roce_v2_gid
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import VrnicError

_serial = itertools.count(1)


def usable_devices() -> list[str]:
    """RDMA devices with an ACTIVE port 1 and a RoCE v2 IPv4 GID, in name order (or VRNIC_TEST_DEVICES)."""
    chosen = os.environ.get("VRNIC_TEST_DEVICES")
    if chosen:
        return chosen.split()
    from vrnic.backend.pyverbs_edge import PyverbsEdge

    edge = PyverbsEdge()
    usable = []
    for name in sorted(rdma_devices()):
        try:
            active_roce_v2_gid(edge.describe(name))  # the driver's own rule
        except VrnicError:
            continue
        usable.append(name)
    return usable


@pytest.fixture(scope="session")
def device_pair() -> tuple[str, str]:
    """Two usable devices: vRNICs on both sides of a real link (the lab's pair topology)."""
    devices = usable_devices()
    if len(devices) < 2:
        pytest.skip(f"needs two RDMA devices with an active RoCE v2 port (the lab's pair topology); "
                    f"usable: {devices or 'none'}, present: {rdma_devices() or 'none'}")
    return devices[0], devices[1]


def wait_for_baseline(baseline: dict[str, dict[str, int]], timeout: float = 10.0) -> dict[str, dict[str, int]]:
    deadline = time.monotonic() + timeout
    while True:
        now = resource_counts()
        if now == baseline or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


@pytest.fixture
def driver(device_pair: tuple[str, str], tmp_path: Path) -> Iterator[object]:
    """An in-process verbs driver; afterwards the kernel must hold exactly what it held before."""
    from vrnic.backend.drivers.paravirtual import VerbsDriver

    baseline = resource_counts()
    # Guests here are threads of the test process, in vrnicd's own cgroup: they cannot be contained
    # (test_direct_confinement.py runs guests in a cgroup of their own).
    drv = VerbsDriver(socket_path=tmp_path / "vrnicd.sock", direct_containment="best-effort")
    yield drv
    drv.close()
    assert wait_for_baseline(baseline) == baseline, "kernel objects leaked"


@pytest.fixture
def make_vrnic(driver: object, device_pair: tuple[str, str]) -> Callable[..., AttachInfo]:
    def make(tenant: str = "t1", device: str | None = None, vpc: int = 1, engine: str = "ring",
             **quota: int) -> AttachInfo:
        """A vRNIC on device (default: the first of the pair), on the ring or the direct engine."""
        serial = next(_serial)
        device = device_pair[0] if device is None else device
        spec = VrnicSpec(id=f"v{serial}", tenant=tenant, vpc_id=vpc, quota=Quota(**quota),
                         virtual_gid=make_virtual_gid(vpc, serial), engine=DataEngine(engine))
        return driver.create_vrnic(spec, device)  # type: ignore[attr-defined, no-any-return]

    return make


@pytest.fixture(params=["ring", "direct"])
def engine(request: pytest.FixtureRequest) -> str:
    """Data-path tests run on both engines."""
    return str(request.param)
