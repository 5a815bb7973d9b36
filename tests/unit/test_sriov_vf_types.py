from __future__ import annotations

import pytest

from vrnic.backend.drivers.sriov import request_for, vlan_for_vpc
from vrnic.core.specs import QosPolicy, VrnicMode, VrnicSpec
from vrnic.errors import InvalidArgument
from vrnic.sriov.plan import plan_ops
from vrnic.sriov.vf_types import (
    CLEAN_VF,
    LinkState,
    VfConfig,
    VfRequest,
    generated_mac,
    normalize_mac,
    validate_tenant_config,
)


def test_generated_mac_is_stable_local_unicast() -> None:
    mac = generated_mac("vrnic-1")
    assert mac == generated_mac("vrnic-1") != generated_mac("vrnic-2")
    first = int(mac[:2], 16)
    assert first & 0b10 and not first & 1
    assert VfRequest(vlan=5).config("vrnic-1").mac == mac
    assert VfRequest(mac="02-AA-BB-CC-DD-EE").config("x").mac == "02:aa:bb:cc:dd:ee"


@pytest.mark.parametrize(("config", "message"), [
    (VfConfig(mac="02:00:00:00:00:01", vlan=4095), "VLAN 4095 is out of range"),
    (VfConfig(mac="02:00:00:00:00:01", vlan=-1), "VLAN -1 is out of range"),
    (VfConfig(mac="02:00:00:00:00:01", vlan=10, qos=8), "qos. 8 is out of range"),
    (VfConfig(mac="02:00:00:00:00:01", qos=3), "needs a VLAN"),
    (VfConfig(mac="02:00:00:00:00:01", max_tx_rate=100, min_tx_rate=200), "min_tx_rate 200 .* exceeds"),
    (VfConfig(mac="02:00:00:00:00:01", max_tx_rate=-5), "cannot be negative"),
    (VfConfig(mac="00:00:00:00:00:00"), "needs a MAC"),
    (VfConfig(mac="01:00:5e:00:00:01"), "multicast"),
    (VfConfig(mac="02:00:00:00:01"), "is not of the form"),
])
def test_bad_tenant_config_is_rejected(config: VfConfig, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        validate_tenant_config(config)


def test_guarantee_without_cap_is_allowed() -> None:
    validate_tenant_config(VfConfig(mac="02:00:00:00:00:01", min_tx_rate=100))


def test_plan_ops_only_what_differs_in_fixed_order() -> None:
    desired = VfConfig(mac="02:00:00:00:00:01", vlan=100, qos=3, max_tx_rate=1000, min_tx_rate=100,
                       link_state=LinkState.ENABLE)
    full = plan_ops(desired)
    assert [op.attribute for op in full] == ["mac", "vlan", "rate", "spoofchk", "trust", "link_state"]
    assert [op.netlink_vf(2) for op in full] == [
        {"vf": 2, "mac": "02:00:00:00:00:01"},
        {"vf": 2, "vlan": {"vlan": 100, "qos": 3}},
        {"vf": 2, "rate": {"max_tx_rate": 1000, "min_tx_rate": 100}},
        {"vf": 2, "spoofchk": 1},
        {"vf": 2, "trust": 0},
        {"vf": 2, "link_state": 1},
    ]
    drifted = VfConfig(mac="02:00:00:00:00:01", vlan=7, qos=3, max_tx_rate=1000, min_tx_rate=100,
                       trust=True, link_state=LinkState.ENABLE)
    assert [str(op) for op in plan_ops(desired, drifted)] == ["vlan vlan=100 qos=3", "trust trust=False"]
    assert plan_ops(desired, desired) == []
    assert [op.netlink_vf(0) for op in plan_ops(CLEAN_VF, desired)] == [
        {"vf": 0, "mac": "00:00:00:00:00:00"}, {"vf": 0, "vlan": {"vlan": 0, "qos": 0}},
        {"vf": 0, "rate": {"max_tx_rate": 0, "min_tx_rate": 0}}, {"vf": 0, "link_state": 0}]


def test_vpc_to_vlan_mapping_and_qos() -> None:
    assert [vlan_for_vpc(v) for v in (0, 1, 4094)] == [0, 1, 4094]
    for bad in (4095, 70000, -1):
        with pytest.raises(InvalidArgument, match=f"vpc_id {bad} cannot be an SR-IOV tenant VLAN"):
            vlan_for_vpc(bad)
    spec = VrnicSpec(id="v", tenant="t", mode=VrnicMode.SRIOV, vpc_id=42, virtual_gid="fe80::1",
                     qos=QosPolicy(rate_cap_mbps=500, guarantee_mbps=50))
    assert request_for(spec) == VfRequest(vlan=42, max_tx_rate=500, min_tx_rate=50)


def test_normalize_mac() -> None:
    assert normalize_mac(" 02:AB:cd:00:00:01 ") == "02:ab:cd:00:00:01"
