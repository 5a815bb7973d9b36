"""Placement by load (vrnic.core.placement.choose)."""

from __future__ import annotations

import pytest

from vrnic.core.placement import Candidate, choose
from vrnic.errors import Conflict, NotSupported


def test_the_least_loaded_share_of_its_cap_wins() -> None:
    picked = choose([Candidate("a", "d0", 3, 4), Candidate("b", "d0", 5, 10), Candidate("b", "d1", 9, 10)],
                    mode="paravirtual")
    assert (picked.host, picked.device) == ("b", "d0")  # 50% beats 75% and 90%


def test_ties_go_by_host_then_device_name() -> None:
    picked = choose([Candidate("b", "d0", 1, 4), Candidate("a", "d1", 1, 4), Candidate("a", "d0", 1, 4)],
                    mode="paravirtual")
    assert (picked.host, picked.device) == ("a", "d0")


def test_uncapped_devices_go_by_their_live_count() -> None:
    picked = choose([Candidate("a", "d0", 7, None), Candidate("b", "d0", 2, None)], mode="paravirtual")
    assert picked.host == "b"


def test_full_devices_are_skipped_and_all_full_is_a_conflict() -> None:
    picked = choose([Candidate("a", "d0", 4, 4), Candidate("b", "d0", 9, 10)], mode="paravirtual")
    assert picked.host == "b"
    full = r"device full: every device for mode paravirtual is at its cap \(b/d0, a/d0\)"
    with pytest.raises(Conflict, match=full) as raised:
        choose([Candidate("a", "d0", 4, 4), Candidate("b", "d0", 0, 0)], mode="paravirtual")
    assert raised.value.current_state == "full"


def test_no_device_at_all_is_not_supported() -> None:
    with pytest.raises(NotSupported, match="no device available for mode sriov"):
        choose([], mode="sriov")
