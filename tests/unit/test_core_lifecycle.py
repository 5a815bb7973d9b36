"""The vRNIC state machine (pure)."""

from __future__ import annotations

import itertools

import pytest

from vrnic.core.lifecycle import (
    VrnicAction,
    VrnicState,
    allowed_actions,
    check_vrnic_count,
    holds_backend_state,
    next_state,
    observed_state,
)
from vrnic.errors import Conflict, QuotaExceeded

S, A = VrnicState, VrnicAction

LEGAL = {
    (S.ALLOCATED, A.ATTACH): S.ATTACHED,
    (S.DETACHED, A.ATTACH): S.ATTACHED,
    (S.ATTACHED, A.DETACH): S.DETACHED,
    (S.ALLOCATED, A.RELEASE): S.RELEASED,
    (S.DETACHED, A.RELEASE): S.RELEASED,
    (S.ATTACHED, A.LOSE): S.LOST,  # found at vrnicd's start: the guest's kernel objects died
    (S.LOST, A.ATTACH): S.ATTACHED,
    (S.LOST, A.RELEASE): S.RELEASED,
}


@pytest.mark.parametrize(("state", "action"), list(itertools.product(S, A)))
def test_every_pair_is_either_a_legal_transition_or_a_conflict_naming_the_state(state: S, action: A) -> None:
    if (state, action) in LEGAL:
        assert next_state(state, action) is LEGAL[(state, action)]
        assert action in allowed_actions(state)
    else:
        with pytest.raises(Conflict) as caught:
            next_state(state, action)
        assert caught.value.current_state == state.value
        assert f"state {state.value}" in str(caught.value)
        assert action not in allowed_actions(state)


def test_the_full_lifecycle_with_a_reattach() -> None:
    state = S.ALLOCATED
    for action in (A.ATTACH, A.DETACH, A.ATTACH, A.DETACH, A.RELEASE):
        state = next_state(state, action)
    assert state is S.RELEASED
    assert allowed_actions(state) == frozenset()


def test_releasing_an_attached_vrnic_needs_force_and_says_so() -> None:
    with pytest.raises(Conflict, match="disconnect the guest first"):
        next_state(S.ATTACHED, A.RELEASE)
    assert next_state(S.ATTACHED, A.RELEASE, force=True) is S.RELEASED


def test_force_never_revives_or_widens_anything_else() -> None:
    with pytest.raises(Conflict) as caught:
        next_state(S.RELEASED, A.RELEASE, force=True)
    assert caught.value.current_state == "released"
    with pytest.raises(Conflict):
        next_state(S.ALLOCATED, A.DETACH, force=True)


@pytest.mark.parametrize(("state", "attached", "expected"), [
    (S.ALLOCATED, False, S.ALLOCATED), (S.ALLOCATED, True, S.ATTACHED),
    (S.ATTACHED, True, S.ATTACHED), (S.ATTACHED, False, S.DETACHED),
    (S.DETACHED, False, S.DETACHED), (S.DETACHED, True, S.ATTACHED),
    (S.RELEASED, True, S.RELEASED), (S.RELEASED, False, S.RELEASED),
])
def test_the_observed_attachment_decides_attached_and_detached(state: S, attached: bool, expected: S) -> None:
    assert observed_state(state, attached) is expected
    if expected is not state:  # only legal transitions happen by observation
        action = A.ATTACH if attached else A.DETACH
        assert next_state(state, action) is expected


def test_release_works_from_every_live_state_attached_only_by_force() -> None:
    for state in (S.ALLOCATED, S.DETACHED):
        assert next_state(state, A.RELEASE) is S.RELEASED
    with pytest.raises(Conflict, match="disconnect the guest first"):
        next_state(S.ATTACHED, A.RELEASE)
    assert next_state(S.ATTACHED, A.RELEASE, force=True) is S.RELEASED


def test_only_released_holds_no_backend_state() -> None:
    assert [s for s in S if not holds_backend_state(s)] == [S.RELEASED]


def test_vrnic_count_quota() -> None:
    check_vrnic_count(None, 10_000)
    check_vrnic_count(3, 2)
    with pytest.raises(QuotaExceeded) as caught:
        check_vrnic_count(3, 3)
    assert (caught.value.limit, caught.value.maximum, caught.value.requested) == ("vrnics", 3, 4)
    with pytest.raises(QuotaExceeded):
        check_vrnic_count(0, 0)
