"""The vRNIC state machine: allocated -> attached -> detached -> released (and attached -> lost -> attached
when vrnicd restarts under an attached guest), as pure functions.

Attach and detach are what vrnicd observes (a guest connected, or went away), never what a client says;
release is the one action a client asks for. The control plane asks these functions for the next state
before it changes anything, so an illegal request is refused (Conflict, carrying the current state) with
nothing applied.
"""

from __future__ import annotations

from enum import StrEnum

from vrnic.errors import Conflict, QuotaExceeded


class VrnicState(StrEnum):
    ALLOCATED = "allocated"  # backend state exists, no frontend attached yet
    ATTACHED = "attached"  # a guest frontend is using it
    DETACHED = "detached"  # the frontend went away; may attach again
    LOST = "lost"  # vrnicd stopped while a guest was attached: its kernel objects died; the guest re-attaches
    RELEASED = "released"  # backend state torn down; terminal


class VrnicAction(StrEnum):
    ATTACH = "attach"  # observed: a guest frontend connected
    DETACH = "detach"  # observed: the frontend went away
    RELEASE = "release"  # asked for by a client
    LOSE = "lose"  # found at vrnicd's start: the guest's kernel objects died with the previous vrnicd


_TRANSITIONS: dict[tuple[VrnicState, VrnicAction], VrnicState] = {
    (VrnicState.ALLOCATED, VrnicAction.ATTACH): VrnicState.ATTACHED,
    (VrnicState.DETACHED, VrnicAction.ATTACH): VrnicState.ATTACHED,
    (VrnicState.ATTACHED, VrnicAction.DETACH): VrnicState.DETACHED,
    (VrnicState.ALLOCATED, VrnicAction.RELEASE): VrnicState.RELEASED,
    (VrnicState.DETACHED, VrnicAction.RELEASE): VrnicState.RELEASED,
    (VrnicState.ATTACHED, VrnicAction.LOSE): VrnicState.LOST,
    (VrnicState.LOST, VrnicAction.ATTACH): VrnicState.ATTACHED,  # the guest attached again (same token)
    (VrnicState.LOST, VrnicAction.RELEASE): VrnicState.RELEASED,
}

# Why each refused request is refused, so the 409 tells the caller what to do instead.
_HINTS: dict[tuple[VrnicState, VrnicAction], str] = {
    (VrnicState.ATTACHED, VrnicAction.ATTACH): "it is already attached",
    (VrnicState.ATTACHED, VrnicAction.RELEASE): "its guest is attached: disconnect the guest first, or have the "
                                               "operator release with force",
    (VrnicState.ALLOCATED, VrnicAction.DETACH): "it was never attached",
    (VrnicState.DETACHED, VrnicAction.DETACH): "it is already detached",
    (VrnicState.LOST, VrnicAction.DETACH): "its guest's objects are gone already",
}


def allowed_actions(state: VrnicState) -> frozenset[VrnicAction]:
    """The actions that are legal in state (release with force aside)."""
    return frozenset(action for (from_state, action) in _TRANSITIONS if from_state == state)


def next_state(state: VrnicState, action: VrnicAction, *, force: bool = False) -> VrnicState:
    """The state after action; Conflict(current_state=state) if action is illegal in state.

    force only widens release: an operator may release an attached vRNIC (its frontend loses it).
    A released vRNIC stays released: nothing, forced or not, leaves that state.
    """
    if force and action is VrnicAction.RELEASE and state is VrnicState.ATTACHED:
        return VrnicState.RELEASED
    try:
        return _TRANSITIONS[(state, action)]
    except KeyError:
        reason = "it is released" if state is VrnicState.RELEASED else _HINTS.get((state, action), "")
        raise Conflict(f"cannot {action} a vRNIC in state {state}" + (f": {reason}" if reason else ""),
                       current_state=str(state)) from None


def observed_state(state: VrnicState, attached: bool) -> VrnicState:
    """The state once vrnicd's observation (a guest attached or not) is taken in; a released vRNIC and one
    whose observation matches its state stay as they are."""
    if state is VrnicState.RELEASED:
        return state
    if attached:
        return state if state is VrnicState.ATTACHED else next_state(state, VrnicAction.ATTACH)
    return next_state(state, VrnicAction.DETACH) if state is VrnicState.ATTACHED else state  # lost stays lost


def holds_backend_state(state: VrnicState) -> bool:
    """Whether a vRNIC in state still owns real backend state (counts against quotas)."""
    return state is not VrnicState.RELEASED


def check_vrnic_count(limit: int | None, live: int) -> None:
    """QuotaExceeded if a tenant that has live vRNICs may not allocate one more under limit (None: no limit)."""
    if limit is not None and live + 1 > limit:
        raise QuotaExceeded("vrnics", limit, live + 1)
