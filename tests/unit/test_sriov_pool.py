from __future__ import annotations

import pytest

from vrnic.errors import Conflict, InvalidArgument, NotFound, QuotaExceeded
from vrnic.sriov.pool import VfPool
from vrnic.sriov.vf_types import Allocation, VfAddress, VfConfig


def cfg(mac: str, vlan: int = 10) -> VfConfig:
    return VfConfig(mac=mac, vlan=vlan)


def test_allocates_lowest_free_vf_and_releases_it() -> None:
    pool = VfPool({"eth0": 3})
    a = pool.allocate("v1", "t1", "eth0", cfg("02:00:00:00:00:01"))
    b = pool.allocate("v2", "t2", "eth0", cfg("02:00:00:00:00:02"))
    assert (a.address, b.address) == (VfAddress("eth0", 0), VfAddress("eth0", 1))
    assert pool.free("eth0") == [2]
    assert pool.release("v1") == a
    assert pool.free("eth0") == [0, 2]
    assert pool.allocate("v3", "t1", "eth0", cfg("02:00:00:00:00:03")).address.index == 0


def test_chosen_index_taken_out_of_range_and_unknown_pf() -> None:
    pool = VfPool({"eth0": 2, "eth1": 0})
    pool.allocate("v1", "t1", "eth0", cfg("02:00:00:00:00:01"), index=1)
    with pytest.raises(Conflict, match="allocated to v1 .tenant t1"):
        pool.allocate("v2", "t2", "eth0", cfg("02:00:00:00:00:02"), index=1)
    with pytest.raises(InvalidArgument, match="VF index 2 is out of range for eth0 .2 VFs: 0..1"):
        pool.allocate("v2", "t2", "eth0", cfg("02:00:00:00:00:02"), index=2)
    with pytest.raises(InvalidArgument, match="eth1 has no VFs"):
        pool.allocate("v2", "t2", "eth1", cfg("02:00:00:00:00:02"), index=0)
    with pytest.raises(NotFound, match="no SR-IOV PF 'eth9' .known: eth0, eth1"):
        pool.allocate("v2", "t2", "eth9", cfg("02:00:00:00:00:02"))
    assert [a.vrnic_id for a in pool.allocations()] == ["v1"]


def test_exhausted_pool_duplicate_id_and_duplicate_mac() -> None:
    pool = VfPool({"eth0": 1, "eth1": 1})
    pool.allocate("v1", "t1", "eth0", cfg("02:00:00:00:00:01"))
    with pytest.raises(QuotaExceeded) as info:
        pool.allocate("v2", "t1", "eth0", cfg("02:00:00:00:00:02"))
    assert (info.value.limit, info.value.maximum) == ("free VFs on eth0", 1)
    with pytest.raises(Conflict, match="already holds eth0/vf0"):
        pool.allocate("v1", "t1", "eth1", cfg("02:00:00:00:00:03"))
    with pytest.raises(Conflict, match="MAC 02:00:00:00:00:01 is already used by v1"):
        pool.allocate("v3", "t1", "eth0", cfg("02:00:00:00:00:01"), index=0)
    # the same MAC on another PF (another embedded switch) is fine
    assert pool.allocate("v3", "t1", "eth1", cfg("02:00:00:00:00:01")).address == VfAddress("eth1", 0)


def test_vanished_allocations_hold_no_vf() -> None:
    gone = Allocation("v1", "t1", VfAddress("eth0", 0), cfg("02:00:00:00:00:01"), vanished=True)
    pool = VfPool({"eth0": 1}, [gone])
    assert pool.free("eth0") == [0]
    assert pool.holder(VfAddress("eth0", 0)) is None
    assert pool.allocate("v2", "t2", "eth0", cfg("02:00:00:00:00:01")).address.index == 0
    with pytest.raises(NotFound):
        pool.release("nope")
