"""The vRNIC state machine: allocated -> attached -> detached -> released, as pure functions.

The control plane asks these functions for the next state before it changes anything,
so an illegal request is refused (Conflict, carrying the current state) with nothing applied.
"""

from __future__ import annotations

from enum import StrEnum

from vrnic.errors import Conflict, QuotaExceeded


class VrnicState(StrEnum):
    ALLOCATED = "allocated"  # backend state exists, no frontend attached yet
    ATTACHED = "attached"  # a guest frontend is using it
    DETACHED = "detached"  # the frontend went away; may attach again
    RELEASED = "released"  # backend state torn down; terminal


class VrnicAction(StrEnum):
    ATTACH = "attach"
    DETACH = "detach"
    RELEASE = "release"


_TRANSITIONS: dict[tuple[VrnicState, VrnicAction], VrnicState] = {
    (VrnicState.ALLOCATED, VrnicAction.ATTACH): VrnicState.ATTACHED,
    (VrnicState.DETACHED, VrnicAction.ATTACH): VrnicState.ATTACHED,
    (VrnicState.ATTACHED, VrnicAction.DETACH): VrnicState.DETACHED,
    (VrnicState.ALLOCATED, VrnicAction.RELEASE): VrnicState.RELEASED,
    (VrnicState.DETACHED, VrnicAction.RELEASE): VrnicState.RELEASED,
}

# Why each refused request is refused, so the 409 tells the caller what to do instead.
_HINTS: dict[tuple[VrnicState, VrnicAction], str] = {
    (VrnicState.ATTACHED, VrnicAction.ATTACH): "it is already attached",
    (VrnicState.ATTACHED, VrnicAction.RELEASE): "it is attached: detach it first, or release with force",
    (VrnicState.ALLOCATED, VrnicAction.DETACH): "it was never attached",
    (VrnicState.DETACHED, VrnicAction.DETACH): "it is already detached",
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


def holds_backend_state(state: VrnicState) -> bool:
    """Whether a vRNIC in state still owns real backend state (counts against quotas)."""
    return state is not VrnicState.RELEASED


def check_vrnic_count(limit: int | None, live: int) -> None:
    """QuotaExceeded if a tenant that has live vRNICs may not allocate one more under limit (None: no limit)."""
    if limit is not None and live + 1 > limit:
        raise QuotaExceeded("vrnics", limit, live + 1)
