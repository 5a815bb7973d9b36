"""capped_rate_floor: how slow a capped stream may look over a window in which its requester retransmitted."""

from __future__ import annotations

import pytest

from vrnic.lab.qos_two_hosts import capped_rate_floor


def test_without_retransmissions_the_floor_is_the_cap_less_the_tolerance() -> None:
    assert capped_rate_floor(12, 2.0, 0, 0.268) == pytest.approx(10.8)


def test_each_retransmission_allows_one_rc_timeout_of_stall() -> None:
    # CI: 10.77 Mbit/s under a 12 Mbit/s cap over 2 s with one retransmission (RC timeout 16: 268 ms)
    assert capped_rate_floor(12, 2.0, 1, 0.268) == pytest.approx(10.8 * (2.0 - 0.268) / 2.0)
    assert capped_rate_floor(12, 2.0, 1, 0.268) < 10.77
    assert capped_rate_floor(16, 2.5, 2, 0.268) == pytest.approx(14.4 * (2.5 - 0.536) / 2.5)


def test_stalls_longer_than_the_window_leave_no_floor() -> None:
    assert capped_rate_floor(12, 2.0, 10, 0.268) == 0.0
