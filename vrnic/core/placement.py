"""Where a new vRNIC goes: the least loaded device among the up hosts (pure logic, no I/O).

Load is the share of a device's cap its live vRNICs take (a device without a cap counts as empty, then by its
live count); ties go by host name, then device name, so every API server picks the same. The cap itself is
enforced where the choice is committed (the device row locked, then counted): this only chooses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vrnic.errors import Conflict, NotSupported


@dataclass(frozen=True)
class Candidate:
    host: str
    device: str
    live: int
    max_vrnics: int | None  # None: no cap

    @property
    def full(self) -> bool:
        return self.max_vrnics is not None and self.live >= self.max_vrnics

    def key(self) -> tuple[float, int, str, str]:
        share = self.live / self.max_vrnics if self.max_vrnics else 0.0 if self.max_vrnics is None else 1.0
        return share, self.live, self.host, self.device


def choose(candidates: Iterable[Candidate], *, mode: str) -> Candidate:
    """The device to place on; NotSupported when there is none, Conflict when every one is full."""
    found = list(candidates)
    if not found:
        raise NotSupported(f"no device available for mode {mode} on any host that is up")
    free = [c for c in found if not c.full]
    if not free:
        names = ", ".join(f"{c.host}/{c.device}" for c in sorted(found, key=Candidate.key))
        raise Conflict(f"device full: every device for mode {mode} is at its cap ({names})", current_state="full")
    return min(free, key=Candidate.key)
