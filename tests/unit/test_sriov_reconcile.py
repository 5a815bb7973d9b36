from __future__ import annotations

from vrnic.sriov.reconcile import plan_reconcile
from vrnic.sriov.vf_types import CLEAN_VF, Allocation, LinkState, VfAddress, VfConfig

A = VfConfig(mac="02:00:00:00:00:0a", vlan=100, max_tx_rate=1000, min_tx_rate=100, link_state=LinkState.ENABLE)
B = VfConfig(mac="02:00:00:00:00:0b", vlan=200, max_tx_rate=500)


def alloc(vrnic_id: str, index: int, config: VfConfig, pf: str = "eth0", vanished: bool = False) -> Allocation:
    return Allocation(vrnic_id, "t", VfAddress(pf, index), config, vanished=vanished)


def test_in_sync_is_empty() -> None:
    observed = {VfAddress("eth0", 0): A, VfAddress("eth0", 1): B, VfAddress("eth0", 2): CLEAN_VF}
    plan = plan_reconcile([alloc("a", 0, A), alloc("b", 1, B)], observed)
    assert plan.in_sync and not plan.unowned_dirty


def test_drift_is_the_set_difference_and_yields_ops() -> None:
    tampered = VfConfig(mac=A.mac, vlan=999, max_tx_rate=1000, min_tx_rate=100, link_state=LinkState.DISABLE,
                        spoofchk=False)
    observed = {VfAddress("eth0", 0): tampered, VfAddress("eth0", 1): B}
    plan = plan_reconcile([alloc("a", 0, A), alloc("b", 1, B)], observed)
    assert len(plan.drifts) == 1
    drift = plan.drifts[0]
    assert drift.allocation.vrnic_id == "a"
    assert drift.fields == ("link_state", "spoofchk", "vlan")
    assert [op.attribute for op in drift.ops] == ["vlan", "spoofchk", "link_state"]
    assert drift.ops[0].netlink_vf(0) == {"vf": 0, "vlan": {"vlan": 100, "qos": 0}}


def test_vanished_and_unowned_dirty() -> None:
    observed = {VfAddress("eth0", 0): A, VfAddress("eth0", 1): VfConfig(mac="02:de:ad:00:00:01", vlan=7),
                VfAddress("eth0", 2): VfConfig(spoofchk=False)}  # a driver default, not tenant state
    plan = plan_reconcile([alloc("a", 0, A), alloc("gone", 5, B), alloc("old", 3, B, vanished=True),
                           alloc("otherpf", 0, B, pf="eth9")], observed)
    assert [a.vrnic_id for a in plan.vanished] == ["gone", "otherpf"]
    assert not plan.drifts
    assert plan.unowned_dirty == (VfAddress("eth0", 1),)
    assert not plan.in_sync
