"""`make demo-qos` scales its link and policies to what the lab's rxe moves (vrnic.lab.qos_demo.Plan)."""

import pytest

from vrnic.lab.qos_demo import FULL_LINK_MBPS, Plan

pytestmark = pytest.mark.unit


def test_a_fast_lab_gets_the_full_link_and_its_policies():
    plan = Plan.for_capacity(300.0)  # a lab whose rxe moves 143 Mbit/s or more unshaped
    assert plan.link_mbps == FULL_LINK_MBPS == 64
    assert (plan.acme_cap, plan.globex_guarantee, plan.globex_cap, plan.acme_raised) == (24, 32, 40, 48)
    assert plan.policies["acme"].rate_cap_mbps == 24
    assert (plan.policies["globex"].guarantee_mbps, plan.policies["globex"].rate_cap_mbps) == (32, 40)
    assert plan.caps == {"acme": 24, "globex": 40}


def test_a_slow_lab_gets_45_percent_of_what_rxe_moved_and_policies_in_the_same_shares():
    plan = Plan.for_capacity(60.0)  # about what rxe moved unshaped on 2026-11-27, when the fixed 64 failed
    assert plan.link_mbps == 27
    assert (plan.acme_cap, plan.globex_guarantee, plan.globex_cap, plan.acme_raised) == (10, 14, 17, 20)
    # the demo's claims still hold in the plan: caps fill the link, the guarantee is under globex's cap
    assert plan.acme_cap + plan.globex_cap <= plan.link_mbps
    assert plan.globex_guarantee <= plan.globex_cap
    assert plan.acme_raised >= 1.3 * plan.acme_cap


@pytest.mark.parametrize("measured", [18.0, 25.0, 44.4, 75.3, 142.3, 1000.0])
def test_every_plan_keeps_its_shares_valid(measured):
    plan = Plan.for_capacity(measured)
    assert 8 <= plan.link_mbps <= 64
    assert 1 <= plan.acme_cap < plan.acme_raised <= plan.link_mbps
    assert plan.globex_guarantee <= plan.globex_cap <= plan.link_mbps


def test_a_starved_lab_is_refused_with_the_measure():
    with pytest.raises(ValueError, match="moved only 17.0 Mbit/s"):
        Plan.for_capacity(17.0)
