from __future__ import annotations

import pytest

from vrnic.errors import Conflict, InvalidArgument
from vrnic.sriov.count import plan_count_change
from vrnic.sriov.vf_types import Allocation, VfAddress, VfConfig

HELD = [Allocation("v0", "red", VfAddress("eth0", 0), VfConfig(mac="02:00:00:00:00:01")),
        Allocation("v3", "blue", VfAddress("eth0", 3), VfConfig(mac="02:00:00:00:00:02")),
        Allocation("x", "red", VfAddress("eth1", 0), VfConfig(mac="02:00:00:00:00:03"))]


def test_refused_while_allocated_naming_the_allocations() -> None:
    with pytest.raises(Conflict) as info:
        plan_count_change("eth0", 4, 2, 8, HELD)
    message = str(info.value)
    assert "v0 on vf0 (tenant red)" in message and "v3 on vf3 (tenant blue)" in message
    assert "x on" not in message and "force" in message
    assert info.value.current_state == "allocated"


def test_forced_goes_through_zero_and_splits_survivors() -> None:
    change = plan_count_change("eth0", 4, 2, 8, HELD, force=True)
    assert change.steps == (0, 2)
    assert [a.vrnic_id for a in change.survivors] == ["v0"]
    assert [a.vrnic_id for a in change.vanishing] == ["v3"]
    assert change.reset == (1,)


def test_unallocated_changes_and_bounds() -> None:
    assert plan_count_change("eth0", 0, 4, 4, []).steps == (4,)
    assert plan_count_change("eth0", 4, 0, 4, []).steps == (0,)
    grow = plan_count_change("eth0", 2, 4, 4, [])
    assert grow.steps == (0, 4) and grow.reset == (0, 1, 2, 3)
    assert plan_count_change("eth0", 4, 4, 4, HELD).steps == ()  # nothing to do, not refused
    assert plan_count_change("eth0", 2, 64, None, []).steps == (0, 64)  # unknown limit: the kernel decides
    with pytest.raises(InvalidArgument, match="at most 4 VFs, not 5"):
        plan_count_change("eth0", 4, 5, 4, [], force=True)
    with pytest.raises(InvalidArgument, match="negative"):
        plan_count_change("eth0", 4, -1, 4, [])


def test_vanished_allocations_do_not_block() -> None:
    gone = [Allocation("v", "t", VfAddress("eth0", 3), VfConfig(mac="02:00:00:00:00:01"), vanished=True)]
    assert plan_count_change("eth0", 2, 4, 4, gone).steps == (0, 4)
