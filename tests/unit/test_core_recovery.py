"""Crash recovery as set differences, and the lost state of the vRNIC state machine."""

from __future__ import annotations

import pytest

from vrnic.core.lifecycle import VrnicAction, VrnicState, next_state, observed_state
from vrnic.core.recovery import plan_recovery, token_digest, token_matches
from vrnic.errors import Conflict

S = VrnicState


def test_live_vrnics_the_backend_lost_are_restored_and_the_attached_ones_lost() -> None:
    stored = {"a": S.ALLOCATED, "b": S.ATTACHED, "c": S.DETACHED, "d": S.RELEASED, "e": S.LOST, "f": S.ATTACHED}
    plan = plan_recovery(stored, held={"f", "x"})
    assert plan.restore == ("a", "b", "c", "e")  # every live one the backend does not hold, lost ones too
    assert plan.lose == ("b",)  # only an attached guest had kernel objects to lose
    assert plan.orphans == ("x",)  # held, but not live in the database (its commit never happened)
    assert not plan.in_sync


def test_nothing_to_do_when_database_and_backend_agree() -> None:
    plan = plan_recovery({"a": S.ATTACHED, "d": S.RELEASED}, held={"a"})
    assert plan.in_sync and plan.restore == plan.lose == plan.orphans == ()
    assert plan_recovery({"d": S.RELEASED}, held={"d"}).orphans == ("d",)  # released, yet held: tear down


def test_lost_is_left_by_attaching_again_or_by_release_only() -> None:
    assert next_state(S.ATTACHED, VrnicAction.LOSE) is S.LOST
    assert next_state(S.LOST, VrnicAction.ATTACH) is S.ATTACHED
    assert next_state(S.LOST, VrnicAction.RELEASE) is S.RELEASED
    with pytest.raises(Conflict) as refused:
        next_state(S.LOST, VrnicAction.DETACH)
    assert refused.value.to_dict()["current_state"] == "lost"
    for state in (S.ALLOCATED, S.DETACHED, S.LOST, S.RELEASED):
        with pytest.raises(Conflict):
            next_state(state, VrnicAction.LOSE)
    assert observed_state(S.LOST, attached=False) is S.LOST
    assert observed_state(S.LOST, attached=True) is S.ATTACHED


def test_the_token_digest_is_what_is_kept() -> None:
    digest = token_digest("secret-token")
    assert len(digest) == 64 and "secret-token" not in digest
    assert token_matches("secret-token", digest) and not token_matches("other", digest)
    assert not token_matches("secret-token", "")  # no digest kept: no token attaches
