"""Reconciliation, Neutron style: desired facts minus observed facts is what to correct. Pure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vrnic.sriov.plan import VfOp, plan_ops
from vrnic.sriov.vf_types import CLEAN_VF, Allocation, VfAddress, VfConfig


@dataclass(frozen=True)
class Drift:
    allocation: Allocation
    observed: VfConfig
    fields: tuple[str, ...]  # the fields that differ, sorted
    ops: tuple[VfOp, ...]  # what restores the desired state


@dataclass(frozen=True)
class ReconcilePlan:
    drifts: tuple[Drift, ...] = ()
    vanished: tuple[Allocation, ...] = ()  # desired VFs the kernel no longer has
    unowned_dirty: tuple[VfAddress, ...] = ()  # VFs nobody owns that are not clean: reset (orphaned settings)

    @property
    def in_sync(self) -> bool:
        return not (self.drifts or self.vanished)


def plan_reconcile(allocations: Iterable[Allocation], observed: Mapping[VfAddress, VfConfig]) -> ReconcilePlan:
    desired = {a.address: a for a in allocations if not a.vanished}
    desired_facts = {(addr, f, v) for addr, a in desired.items() for f, v in a.config.facts()}
    observed_facts = {(addr, f, v) for addr, c in observed.items() for f, v in c.facts()}
    vanished_addresses = set(desired) - set(observed)
    missing: dict[VfAddress, set[str]] = defaultdict(set)
    for addr, name, _ in desired_facts - observed_facts:
        if addr not in vanished_addresses:
            missing[addr].add(name)
    drifts = tuple(
        Drift(allocation=desired[addr], observed=observed[addr], fields=tuple(sorted(names)),
              ops=tuple(plan_ops(desired[addr].config, observed[addr])))
        for addr, names in sorted(missing.items(), key=lambda item: (item[0].pf, item[0].index))
    )
    vanished = tuple(desired[a] for a in sorted(vanished_addresses, key=lambda a: (a.pf, a.index)))
    # Only the tenant-identifying fields count as dirty: drivers differ in their defaults for spoofchk.
    unowned = tuple(sorted(
        (addr for addr, c in observed.items() if addr not in desired and _carries_tenant_state(c)),
        key=lambda a: (a.pf, a.index)))
    return ReconcilePlan(drifts=drifts, vanished=vanished, unowned_dirty=unowned)


def _carries_tenant_state(config: VfConfig) -> bool:
    clean = CLEAN_VF
    return (config.mac, config.vlan, config.qos, config.max_tx_rate, config.min_tx_rate, config.trust) != \
        (clean.mac, clean.vlan, clean.qos, clean.max_tx_rate, clean.min_tx_rate, clean.trust)
