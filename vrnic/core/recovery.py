"""Crash recovery as set differences: what the database holds live against what the backend holds after a
vrnicd start, and the attach-token digest that lets a guest keep its token across restarts."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Set
from dataclasses import dataclass

from vrnic.core.lifecycle import VrnicAction, VrnicState, next_state


def token_digest(token: str) -> str:
    """What is kept of an attach token (database, vrnicd's memory): its sha256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(token: str, digest: str) -> bool:
    return hmac.compare_digest(token_digest(token), digest)


@dataclass(frozen=True)
class RecoveryPlan:
    restore: tuple[str, ...]  # live in the database, absent from the backend: re-create (same token)
    lose: tuple[str, ...]  # of those, the ones a guest was attached to: their kernel objects died -> lost
    orphans: tuple[str, ...]  # held by the backend, not live in the database (a commit that never happened)

    @property
    def in_sync(self) -> bool:
        return not (self.restore or self.orphans)


def plan_recovery(stored: Mapping[str, VrnicState], held: Set[str]) -> RecoveryPlan:
    """stored: this host's vRNICs in the database and their states; held: what its backend holds now."""
    live = {vrnic_id for vrnic_id, state in stored.items() if state is not VrnicState.RELEASED}
    restore = sorted(live - held)
    lose = [v for v in restore if stored[v] is VrnicState.ATTACHED
            and next_state(stored[v], VrnicAction.LOSE) is VrnicState.LOST]
    return RecoveryPlan(restore=tuple(restore), lose=tuple(lose), orphans=tuple(sorted(held - live)))
