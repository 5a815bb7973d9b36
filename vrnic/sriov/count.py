"""VF count changes: the policy and the steps. Pure.

SR-IOV devices (ConnectX and the kernel's PCI core alike, and netdevsim) only change sriov_numvfs from or
to zero, so N -> M with both non-zero goes N -> 0 -> M and takes every VF away for a moment.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vrnic.errors import Conflict, InvalidArgument
from vrnic.sriov.vf_types import Allocation


@dataclass(frozen=True)
class CountChange:
    pf: str
    current: int
    requested: int
    steps: tuple[int, ...]  # values written to sriov_numvfs, in order; () means nothing to do
    survivors: tuple[Allocation, ...]  # allocated VFs that exist again afterwards: re-apply their config
    vanishing: tuple[Allocation, ...]  # allocated VFs beyond the new count: their vRNICs lose the VF
    reset: tuple[int, ...]  # VF indexes that exist afterwards and are nobody's: reset to the clean state


def plan_count_change(pf: str, current: int, requested: int, total: int | None,
                      allocations: Iterable[Allocation], force: bool = False) -> CountChange:
    if requested < 0:
        raise InvalidArgument(f"VF count cannot be negative ({requested})")
    if total is not None and requested > total:
        raise InvalidArgument(f"{pf} supports at most {total} VFs, not {requested}")
    held = sorted((a for a in allocations if a.address.pf == pf and not a.vanished),
                  key=lambda a: a.address.index)
    if requested == current:
        return CountChange(pf, current, requested, (), tuple(held), (), ())
    if held and not force:
        names = ", ".join(f"{a.vrnic_id} on vf{a.address.index} (tenant {a.tenant})" for a in held)
        raise Conflict(f"{pf}: changing the VF count from {current} to {requested} goes through zero and would "
                       f"take VFs away from {len(held)} allocated vRNIC(s): {names}; release them or force it",
                       current_state="allocated")
    if current == 0 or requested == 0:
        steps: tuple[int, ...] = (requested,)
    else:
        steps = (0, requested)
    survivors = tuple(a for a in held if a.address.index < requested)
    vanishing = tuple(a for a in held if a.address.index >= requested)
    kept = {a.address.index for a in survivors}
    reset = tuple(i for i in range(requested) if i not in kept)
    return CountChange(pf, current, requested, steps, survivors, vanishing, reset)
