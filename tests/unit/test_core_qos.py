"""QoS planning (vrnic.core.qos) and the parts of the HTB shaper that are pure (vrnic.backend.qos_shaper)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vrnic.backend.qos_shaper import decode_u32_keys
from vrnic.core.qos import (
    FIRST_MINOR,
    RC_TIMEOUT_MARGIN,
    RC_TIMEOUT_UNIT_S,
    Filter,
    HtbClass,
    Shaped,
    TimedSenders,
    admit,
    drain_kbit,
    drain_rates,
    drift,
    jain_index,
    key_of,
    next_minor,
    plan_classes,
    queue_wait_s,
    rc_timeout,
    rc_timeout_floor,
    rc_timeout_outlasts,
    rx_qpn_of,
    rx_u32_keys,
    u32_keys,
)
from vrnic.core.specs import QosPolicy
from vrnic.errors import Conflict, InvalidArgument

pytestmark = pytest.mark.unit


def test_guarantees_get_their_rate_and_the_rest_is_shared_by_weight() -> None:
    shaped = [Shaped("a", QosPolicy(guarantee_mbps=40, rate_cap_mbps=60), 0x10),
              Shaped("b", QosPolicy(weight=1), 0x11),
              Shaped("c", QosPolicy(weight=3, rate_cap_mbps=50), 0x12)]
    plan = plan_classes(200, shaped)
    assert plan["a"] == HtbClass(0x10, 40_000, 60_000)
    assert plan["b"] == HtbClass(0x11, 40_000, 200_000)  # a quarter of the 160 Mbit/s no guarantee holds
    assert plan["c"] == HtbClass(0x12, 50_000, 50_000)  # three quarters, but never above its cap
    assert plan["a"].classid == 0x76720010


def test_admission_refuses_oversubscribed_guarantees_with_the_numbers() -> None:
    admit(100, [QosPolicy(guarantee_mbps=60)], QosPolicy(guarantee_mbps=40))
    with pytest.raises(Conflict, match=r"sum to 110 Mbit/s \(60 given \+ 50 asked\) on a 100 Mbit/s link"):
        admit(100, [QosPolicy(guarantee_mbps=60)], QosPolicy(guarantee_mbps=50))
    with pytest.raises(InvalidArgument, match="cap of 500 Mbit/s exceeds the link's 100"):
        admit(100, [], QosPolicy(rate_cap_mbps=500))
    with pytest.raises(Conflict, match="needs the link's speed"):
        admit(None, [], QosPolicy(guarantee_mbps=5))
    admit(None, [], QosPolicy(rate_cap_mbps=5))  # a cap needs no link speed
    with pytest.raises(ValueError, match="exceeds the cap"):
        QosPolicy(rate_cap_mbps=10, guarantee_mbps=20)


def test_minors_are_reused_and_bounded() -> None:
    assert next_minor([]) == FIRST_MINOR
    assert next_minor([FIRST_MINOR, FIRST_MINOR + 2]) == FIRST_MINOR + 1


def test_drift_is_a_set_difference() -> None:
    want = {0x10: HtbClass(0x10, 1000, 2000), 0x11: HtbClass(0x11, 500, 2000)}
    have = {0x10: HtbClass(0x10, 1000, 2000), 0x11: HtbClass(0x11, 900, 2000), 0x12: HtbClass(0x12, 1, 1)}
    found = drift(want, have, {Filter((0xC001, 5), 0x10), Filter((0xC002, None), 0x11)},
                  {Filter((0xC001, 5), 0x10), Filter((7, 9), 0x12)})
    assert found.add_classes == () and found.change_classes == (HtbClass(0x11, 500, 2000),)
    assert found.remove_classes == (0x12,)
    assert found.add_filters == (Filter((0xC002, None), 0x11),) and found.remove_filters == (Filter((7, 9), 0x12),)
    assert drift(want, dict(want), set(), set()).empty
    # the kernel rounds rates: within 1 % is the same
    assert drift({1: HtbClass(1, 40_000, 60_000)}, {1: HtbClass(1, 39_999, 60_001)}, (), ()).empty
    # a class whose queue is not ours (HTB's own leaf: 0), or shortened, is a change: it gets its queue back
    for leaf in (0, 1000):
        assert drift(want, {**want, 0x10: HtbClass(0x10, 1000, 2000, leaf)}, (), ()).change_classes == (want[0x10],)
    assert want[0x10].leaf_packets == 65 * 1024 and want[0x10].leaf_handle == 0x8010 << 16


def test_u32_keys_and_their_decoding_round_trip() -> None:
    assert u32_keys((0xC0DE, None)) == ["0x00110000/0x00ff0000+8", "0xc0de12b7/0xffffffff+20"]  # to port 4791
    assert u32_keys((0xC0DE, 0x1B0A)) == ["0x00110000/0x00ff0000+8", "0xc0de12b7/0xffffffff+20",
                                          "0x00001b0a/0x00ffffff+32"]
    # pyroute2 0.9.7 reads the key array 4 bytes early, and re-cuts the words it was given so that each mask
    # starts with a non-zero byte (both seen on a real kernel, for the filter of (0xC124, 0x12))
    as_read = [{"key_mask": 0, "key_val": 0xFF000000, "key_off": 17, "key_offmask": 9},
               {"key_mask": 0, "key_val": 0xFFFFFFFF, "key_off": -1223547711, "key_offmask": 20},
               {"key_mask": 0, "key_val": 0xFFFFFF00, "key_off": 1179648, "key_offmask": 33}]
    keys = decode_u32_keys(as_read)
    assert keys == [(0xFF000000, 0x11000000, 9), (0xFFFFFFFF, 0xC12412B7, 20), (0xFFFFFF00, 0x00001200, 33)]
    assert key_of(keys) == (0xC124, 0x12)
    # the words as written, and as a fixed pyroute2 would return them
    written = [(0x00FF0000, 0x00110000, 8), (0xFFFFFFFF, 0xC0DE12B7, 20)]
    assert key_of(written) == (0xC0DE, None) and key_of([*written, (0x00FFFFFF, 0x1B0A, 32)]) == (0xC0DE, 0x1B0A)
    assert decode_u32_keys([{"key_mask": m, "key_val": v, "key_off": o, "key_offmask": 0}
                            for m, v, o in written]) == written
    assert key_of([(0x00FF0000, 0x00110000, 8), (0xFFFFFFFF, 0x12345678, 20)]) is None  # not RoCEv2: not ours
    assert key_of([(0x00FF0000, 0x00060000, 8), (0xFFFFFFFF, 0xC0DE12B7, 20)]) is None  # TCP


def _words(keys: list[str]) -> list[tuple[int, int, int]]:
    out = []
    for key in keys:
        value, _, rest = key.partition("/")
        mask, _, offset = rest.partition("+")
        out.append((int(mask, 16), int(value, 16), int(offset)))
    return out


def test_receive_counting_keys_round_trip_and_are_told_apart_from_send_filters() -> None:
    assert rx_u32_keys(0x1B0A) == ["0x00110000/0x00ff0000+8", "0x000012b7/0x0000ffff+20",  # to port 4791
                                   "0x00001b0a/0x00ffffff+32"]  # for local QP 0x1b0a
    assert rx_qpn_of(_words(rx_u32_keys(0x1B0A))) == 0x1B0A
    # pyroute2 re-cuts words so that a mask starts with a non-zero byte: the same bytes, other words
    assert rx_qpn_of([(0xFF000000, 0x11000000, 9), (0xFFFF0000, 0x12B70000, 22), (0xFFFFFF00, 0x001B0A00, 33)]) \
        == 0x1B0A
    send = _words(u32_keys((0xC0DE, 0x1B0A)))
    assert rx_qpn_of(send) is None and key_of(_words(rx_u32_keys(0x1B0A))) is None  # neither reads as the other
    assert rx_qpn_of(_words(rx_u32_keys(7))[:2]) is None  # no QPN: not ours
    assert rx_qpn_of([(0x00FF0000, 0x00060000, 8), *_words(rx_u32_keys(7))[1:]]) is None  # TCP


def test_jain_index() -> None:
    assert jain_index([10, 10, 10]) == pytest.approx(1.0)
    assert jain_index([30, 0, 0]) == pytest.approx(1 / 3)
    assert jain_index([]) == 0.0


def test_queue_wait_is_every_qps_packets_in_flight_at_the_class_rate() -> None:
    # 65 packets of 1024 + 94 bytes at 12 Mbit/s: 48 ms, under the guest's 67 ms (timeout 14), but not by 4x
    assert queue_wait_s(1024, 1, 12_000) == pytest.approx(65 * 1118 * 8 / 12e6)
    assert queue_wait_s(1024, 3, 12_000) == pytest.approx(3 * queue_wait_s(1024, 1, 12_000))
    assert queue_wait_s(4096, 1, 12_000) > queue_wait_s(1024, 1, 12_000)


@pytest.mark.parametrize(("mtu", "qps", "kbit"), [(1024, 1, 12_000), (1024, 1, 2_000), (1024, 3, 5_333),
                                                  (4096, 8, 1_000), (1024, 1, 100_000_000), (256, 1, 8)])
def test_the_rc_timeout_floor_is_the_smallest_exponent_above_margin_times_the_wait(mtu: int, qps: int,
                                                                                   kbit: int) -> None:
    floor = rc_timeout_floor(mtu, qps, kbit)
    needed = RC_TIMEOUT_MARGIN * queue_wait_s(mtu, qps, kbit)
    assert RC_TIMEOUT_UNIT_S * 2 ** floor >= needed
    assert floor == 0 or RC_TIMEOUT_UNIT_S * 2 ** (floor - 1) < needed


@settings(max_examples=500, deadline=None)
@given(st.sampled_from((256, 512, 1024, 2048, 4096)), st.integers(1, 100_000), st.integers(1, 400_000_000),
       st.floats(0.0, 16.0))
def test_the_rc_timeout_floor_from_the_logarithm_is_the_one_counting_up_finds(mtu: int, qps: int, kbit: int,
                                                                             margin: float) -> None:
    wait = margin * queue_wait_s(mtu, qps, kbit)
    counted = 0
    while counted < 31 and RC_TIMEOUT_UNIT_S * (1 << counted) < wait:
        counted += 1
    assert rc_timeout_floor(mtu, qps, kbit, margin) == counted


def test_rc_timeout_floor_values_and_bounds() -> None:
    assert rc_timeout_floor(1024, 1, 12_000) == 16  # 4 x 48 ms = 0.19 s -> 2^16 x 4.096 us = 0.27 s
    assert rc_timeout_floor(1024, 1, 16_000) == 16
    assert rc_timeout_floor(1024, 1, 4_000) == 18  # 4 x 145 ms = 0.58 s -> 1.07 s
    assert rc_timeout_floor(1024, 1, 100_000_000) == 3  # a 100 Gbit/s class: the guest's 14 stays
    assert rc_timeout_floor(1024, 1_000_000, 8) == 31  # 2.4 hours at most


def test_the_guests_timeout_is_only_ever_raised() -> None:
    assert rc_timeout(14, 17) == 17
    assert rc_timeout(20, 17) == 20
    assert rc_timeout(0, 17) == 0  # none at all: never retransmits on a timeout


def test_drain_rate_counts_every_vrnic_on_the_device_as_shaped() -> None:
    # nobody asks anything: an equal share of the link each (QoS on would give each a class so)
    assert drain_kbit(16, {"x": QosPolicy(), "y": QosPolicy(), "z": QosPolicy(), "w": QosPolicy()}, "x") == 4000
    # the vRNIC itself need not be listed yet (a default policy)
    assert drain_kbit(16, {"y": QosPolicy()}, "x") == 8000
    # a guarantee is the guarantee; the others share what it leaves by weight; a cap bounds the rate
    policies = {"x": QosPolicy(guarantee_mbps=10), "y": QosPolicy(weight=2), "z": QosPolicy()}
    assert drain_kbit(16, policies, "x") == 10_000
    assert drain_kbit(16, policies, "y") == 4000 and drain_kbit(16, policies, "z") == 2000
    assert drain_kbit(24, {"x": QosPolicy(rate_cap_mbps=12)}, "x") == 12_000

    # every vRNIC's rate from one plan is what each asks alone
    assert drain_rates(16, policies) == {i: drain_kbit(16, policies, i) for i in policies}


MTUS = (256, 512, 1024, 2048, 4096)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 31), st.sampled_from(MTUS)), max_size=40),
       st.integers(1, 50_000_000))
def test_one_more_sender_outlasts_a_timeout_exactly_when_a_walk_over_every_sender_finds_one(
        senders: list[tuple[int, int]], drain: int) -> None:
    """TimedSenders keeps the count and one QP, the one whose timeout per wire byte is least, so that a batch of
    connects checks each join in O(1); it must answer as the walk over every connected QP does."""
    timed = TimedSenders()
    for timeout, mtu in senders:
        timed.add(timeout, mtu)
    walk = any(not rc_timeout_outlasts(timeout, queue_wait_s(mtu, len(senders) + 1, drain))
               for timeout, mtu in senders)
    assert timed.count == len(senders)
    assert timed.outlasted_by_one_more(drain) == walk
