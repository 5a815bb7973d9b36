"""The verbs driver's QoS rules where no mechanism exists (the in-memory NIC has none): a policy that limits
anything is refused, never accepted and ignored; one that asks nothing is fine. Enforcement itself is proven
on rxe in the lab (tests/kernel/test_qos_rxe.py) and on real netlink (tests/kernel/test_qos_shaper.py)."""

from __future__ import annotations

import pytest

from vrnic.backend.drivers.paravirtual import VerbsDriver
from vrnic.core.qos import RateMeter
from vrnic.core.specs import QosPolicy, Quota, VrnicSpec
from vrnic.core.vaddr import make_virtual_gid
from vrnic.errors import NotFound, NotSupported

pytestmark = pytest.mark.unit


def _spec(n: int, qos: QosPolicy) -> VrnicSpec:
    return VrnicSpec(id=f"q{n}", tenant="t1", vpc_id=1, quota=Quota(), virtual_gid=make_virtual_gid(1, 700 + n),
                     qos=qos)


def test_a_limiting_policy_on_a_device_without_a_mechanism_is_refused(driver: VerbsDriver) -> None:
    for n, policy in enumerate((QosPolicy(rate_cap_mbps=10), QosPolicy(guarantee_mbps=5), QosPolicy(weight=2))):
        with pytest.raises(NotSupported, match="no QoS mechanism"):
            driver.create_vrnic(_spec(n, policy), "fake0")
    assert driver.vrnic_ids() == set()  # nothing half-made
    driver.create_vrnic(_spec(9, QosPolicy()), "fake0")  # asks nothing: nothing to enforce
    with pytest.raises(NotSupported, match="no QoS mechanism"):
        driver.set_qos("q9", QosPolicy(rate_cap_mbps=10))
    driver.set_qos("q9", QosPolicy())
    with pytest.raises(NotFound):
        driver.set_qos("nope", QosPolicy())
    assert driver.qos_counters() == {} and driver.reconcile_qos() == 0
    driver.release_vrnic("q9")


def test_rate_meter() -> None:
    meter = RateMeter()
    assert meter.read("a", 1000, 10.0) == 0.0  # first reading
    assert meter.read("a", 3000, 12.0) == 8000.0  # 2000 bytes in 2 s
    assert meter.read("a", 100, 13.0) == 0.0  # the counter went back (a new class): no rate
    assert meter.read("b", 5, 13.0) == 0.0
