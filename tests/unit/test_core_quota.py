"""Per-vRNIC quota accounting (vrnic.core.quota)."""

from __future__ import annotations

import threading

import pytest

from vrnic.core.quota import QuotaLedger, Resource
from vrnic.core.specs import Quota
from vrnic.errors import InvalidArgument, QuotaExceeded

SMALL = Quota(max_pds=2, max_cqs=3, max_qps=4, max_mrs=5, max_cqe=64, max_wr=32, max_pinned_bytes=1000)
LIMITS = {Resource.PD: ("max_pds", 2), Resource.CQ: ("max_cqs", 3), Resource.QP: ("max_qps", 4),
          Resource.MR: ("max_mrs", 5), Resource.PINNED_BYTES: ("max_pinned_bytes", 1000)}


def test_a_fresh_ledger_has_used_nothing() -> None:
    assert QuotaLedger(SMALL).used() == {"pd": 0, "cq": 0, "qp": 0, "mr": 0, "pinned_bytes": 0}


@pytest.mark.parametrize("resource", list(Resource))
def test_each_limit_is_reached_then_refused_naming_the_limit(resource: Resource) -> None:
    limit_name, maximum = LIMITS[resource]
    ledger = QuotaLedger(SMALL)
    step = 100 if resource is Resource.PINNED_BYTES else 1
    for _ in range(maximum // step):
        ledger.charge(resource, step)
    assert ledger.used()[str(resource)] == maximum
    with pytest.raises(QuotaExceeded) as info:
        ledger.charge(resource, step)
    assert info.value.limit == limit_name
    assert info.value.maximum == maximum
    assert info.value.requested == maximum + step
    assert limit_name in str(info.value)
    assert ledger.used()[str(resource)] == maximum  # the refused charge changed nothing


def test_a_refused_charge_changes_nothing() -> None:
    ledger = QuotaLedger(SMALL)
    ledger.charge(Resource.PINNED_BYTES, 600)
    ledger.charge(Resource.QP)
    before = ledger.used()
    with pytest.raises(QuotaExceeded):
        ledger.charge(Resource.PINNED_BYTES, 401)
    assert ledger.used() == before
    ledger.charge(Resource.PINNED_BYTES, 400)  # the exact remainder still fits
    assert ledger.used()["pinned_bytes"] == 1000


def test_resources_are_counted_independently() -> None:
    ledger = QuotaLedger(SMALL)
    ledger.charge(Resource.PD, 2)
    ledger.charge(Resource.MR, 5)
    ledger.charge(Resource.CQ)
    assert ledger.used() == {"pd": 2, "cq": 1, "qp": 0, "mr": 5, "pinned_bytes": 0}


def test_a_zero_limit_refuses_the_first_charge() -> None:
    ledger = QuotaLedger(Quota(max_qps=0))
    with pytest.raises(QuotaExceeded) as info:
        ledger.charge(Resource.QP)
    assert (info.value.limit, info.value.maximum, info.value.requested) == ("max_qps", 0, 1)


def test_a_negative_charge_is_refused() -> None:
    ledger = QuotaLedger(SMALL)
    ledger.charge(Resource.MR, 3)
    with pytest.raises(InvalidArgument, match="negative"):
        ledger.charge(Resource.MR, -2)
    assert ledger.used()["mr"] == 3


def test_a_zero_charge_is_a_no_op() -> None:
    ledger = QuotaLedger(SMALL)
    ledger.charge(Resource.PD, 0)
    assert ledger.used()["pd"] == 0


def test_refund_gives_room_back() -> None:
    ledger = QuotaLedger(SMALL)
    ledger.charge(Resource.PD, 2)
    with pytest.raises(QuotaExceeded):
        ledger.charge(Resource.PD)
    ledger.refund(Resource.PD)
    assert ledger.used()["pd"] == 1
    ledger.charge(Resource.PD)
    assert ledger.used()["pd"] == 2
    ledger.refund(Resource.PINNED_BYTES, 0)
    ledger.charge(Resource.PINNED_BYTES, 700)
    ledger.refund(Resource.PINNED_BYTES, 300)
    assert ledger.used()["pinned_bytes"] == 400


def test_refund_never_goes_below_zero() -> None:
    ledger = QuotaLedger(SMALL)
    ledger.charge(Resource.CQ)
    ledger.refund(Resource.CQ, 5)
    assert ledger.used()["cq"] == 0
    ledger.charge(Resource.CQ, 3)  # and the full limit is available again, not more
    with pytest.raises(QuotaExceeded):
        ledger.charge(Resource.CQ)


def test_a_negative_refund_is_refused_instead_of_charging_past_the_limit() -> None:
    ledger = QuotaLedger(SMALL)
    ledger.charge(Resource.PD, 2)
    with pytest.raises(InvalidArgument, match="negative"):
        ledger.refund(Resource.PD, -5)
    assert ledger.used()["pd"] == 2


@pytest.mark.parametrize("cqe", [1, 32, 64])
def test_check_cqe_accepts_1_to_max(cqe: int) -> None:
    QuotaLedger(SMALL).check_cqe(cqe)


def test_check_cqe_refusals() -> None:
    ledger = QuotaLedger(SMALL)
    for bad in (0, -1):
        with pytest.raises(InvalidArgument, match="at least 1 entry"):
            ledger.check_cqe(bad)
    with pytest.raises(QuotaExceeded) as info:
        ledger.check_cqe(65)
    assert (info.value.limit, info.value.maximum, info.value.requested) == ("max_cqe", 64, 65)
    assert ledger.used() == QuotaLedger(SMALL).used()  # a check charges nothing


@pytest.mark.parametrize("depth", [1, 16, 32])
def test_check_wr_accepts_1_to_max(depth: int) -> None:
    QuotaLedger(SMALL).check_wr(depth)


def test_check_wr_refusals() -> None:
    ledger = QuotaLedger(SMALL)
    for bad in (0, -3):
        with pytest.raises(InvalidArgument, match="at least 1 work request"):
            ledger.check_wr(bad)
    with pytest.raises(QuotaExceeded) as info:
        ledger.check_wr(33)
    assert (info.value.limit, info.value.maximum, info.value.requested) == ("max_wr", 32, 33)


def test_concurrent_charges_never_exceed_the_limit() -> None:
    ledger = QuotaLedger(Quota(max_mrs=500))
    refused = []

    def worker() -> None:
        for _ in range(100):
            try:
                ledger.charge(Resource.MR)
            except QuotaExceeded:
                refused.append(1)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.used()["mr"] == 500
    assert len(refused) == 300


def test_charge_up_to_charges_as_many_items_as_every_limit_has_room_for() -> None:
    ledger = QuotaLedger(SMALL)  # 5 MRs, 1000 pinned bytes
    ledger.charge(Resource.MR)
    assert ledger.charge_up_to(10, (Resource.MR, 1), (Resource.PINNED_BYTES, 300)) == 3  # the bytes bind first
    assert ledger.used()["mr"] == 4 and ledger.used()["pinned_bytes"] == 900
    assert ledger.charge_up_to(1, (Resource.MR, 1), (Resource.PINNED_BYTES, 100)) == 1  # and count caps
    assert ledger.used()["mr"] == 5 and ledger.used()["pinned_bytes"] == 1000


def test_charge_up_to_refuses_when_not_one_item_fits_and_charges_nothing() -> None:
    ledger = QuotaLedger(SMALL)
    ledger.charge(Resource.PINNED_BYTES, 900)
    with pytest.raises(QuotaExceeded) as info:
        ledger.charge_up_to(4, (Resource.MR, 1), (Resource.PINNED_BYTES, 200))
    assert (info.value.limit, info.value.requested) == ("max_pinned_bytes", 1100)
    assert ledger.used()["mr"] == 0 and ledger.used()["pinned_bytes"] == 900
    for count, each in ((0, ((Resource.MR, 1),)), (2, ((Resource.MR, -1),))):
        with pytest.raises(InvalidArgument):
            ledger.charge_up_to(count, *each)
    assert ledger.used()["mr"] == 0
