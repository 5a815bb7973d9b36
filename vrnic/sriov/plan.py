"""Desired VF configuration -> the netlink operations that reach it. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vrnic.sriov.vf_types import VfConfig

# One op per IFLA_VF_* attribute. vlan+qos and the two rates each travel together in one attribute,
# so the kernel checks min <= max on the pair it is given, never against a stale half.
OP_FIELDS: dict[str, tuple[str, ...]] = {
    "mac": ("mac",),
    "vlan": ("vlan", "qos"),
    "rate": ("max_tx_rate", "min_tx_rate"),
    "spoofchk": ("spoofchk",),
    "trust": ("trust",),
    "link_state": ("link_state",),
}


@dataclass(frozen=True)
class VfOp:
    attribute: str  # a key of OP_FIELDS
    config: VfConfig  # the desired configuration the op takes its values from

    def values(self) -> dict[str, object]:
        return {name: getattr(self.config, name) for name in OP_FIELDS[self.attribute]}

    def netlink_vf(self, index: int) -> dict[str, Any]:
        """The `vf=` argument of pyroute2's IPRoute.link('set', ...), a fresh dict (pyroute2 consumes it)."""
        c = self.config
        spec: dict[str, Any] = {"vf": index}
        if self.attribute == "mac":
            spec["mac"] = c.mac
        elif self.attribute == "vlan":
            spec["vlan"] = {"vlan": c.vlan, "qos": c.qos}
        elif self.attribute == "rate":
            spec["rate"] = {"max_tx_rate": c.max_tx_rate, "min_tx_rate": c.min_tx_rate}
        elif self.attribute == "spoofchk":
            spec["spoofchk"] = int(c.spoofchk)
        elif self.attribute == "trust":
            spec["trust"] = int(c.trust)
        elif self.attribute == "link_state":
            spec["link_state"] = int(c.link_state)
        else:  # pragma: no cover - OP_FIELDS is closed
            raise ValueError(self.attribute)
        return spec

    def __str__(self) -> str:
        return f"{self.attribute} " + " ".join(f"{k}={v}" for k, v in self.values().items())


def differing_fields(desired: VfConfig, observed: VfConfig) -> set[str]:
    return {name for name, _ in desired.facts() - observed.facts()}


def plan_ops(desired: VfConfig, observed: VfConfig | None = None) -> list[VfOp]:
    """The ops that turn observed into desired (all of them when observed is unknown), in a fixed order:
    identity (MAC, VLAN) and limits first, link state last, so a VF only comes up fully configured."""
    changed = set(VfConfig.field_names()) if observed is None else differing_fields(desired, observed)
    return [VfOp(attribute, desired) for attribute, names in OP_FIELDS.items() if changed & set(names)]
