"""Typed libvirt device XML for handing a VF to a VM (Nova config-object style: objects in, XML out, no I/O).

`HostdevInterface` is `<interface type='hostdev'>`: libvirt itself sets the VF's MAC and VLAN on the PF when
the VM starts, so the guest sees a NIC with the tenant's identity. `HostdevDevice` is the plain
`<hostdev>` passthrough (no network identity; for RDMA-only use or VFs libvirt must not configure).
libvirt has no tx-rate element for hostdev interfaces: the rates stay set through netlink by vrnic.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from vrnic.errors import InvalidArgument
from vrnic.sriov.vf_types import MAX_VLAN, ZERO_MAC, normalize_mac

_PCI_RE = re.compile(r"^(?:([0-9a-fA-F]{4}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


@dataclass(frozen=True)
class PciAddress:
    domain: int
    bus: int
    slot: int
    function: int

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        match = _PCI_RE.match(text.strip())
        if not match:
            raise InvalidArgument(f"{text!r} is not a PCI address like 0000:03:00.1")
        domain, bus, slot, function = match.groups()
        address = cls(int(domain or "0", 16), int(bus, 16), int(slot, 16), int(function))
        if address.slot > 0x1F:
            raise InvalidArgument(f"PCI slot {address.slot:#x} in {text!r} is out of range (0..0x1f)")
        return address

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"

    def attributes(self, with_type: bool) -> dict[str, str]:
        attrs = {"type": "pci"} if with_type else {}
        return attrs | {"domain": f"0x{self.domain:04x}", "bus": f"0x{self.bus:02x}",
                        "slot": f"0x{self.slot:02x}", "function": f"0x{self.function:x}"}


@dataclass(frozen=True)
class HostdevInterface:
    """<interface type='hostdev' managed='yes'> with the VF's MAC and the tenant VLAN."""

    pci: PciAddress
    mac: str
    vlan: int | None = None  # None or 0: untagged
    managed: bool = True  # libvirt detaches the VF from its host driver and binds vfio-pci
    alias: str | None = None  # "ua-..." user alias, so the device can be found again for detach

    def __post_init__(self) -> None:
        mac = normalize_mac(self.mac)
        if mac == ZERO_MAC or int(mac[:2], 16) & 1:
            raise InvalidArgument(f"a VM interface needs a unicast MAC, not {self.mac}")
        if self.vlan is not None and not 0 <= self.vlan <= MAX_VLAN:
            raise InvalidArgument(f"VLAN {self.vlan} is out of range (0..{MAX_VLAN})")
        if self.alias is not None and not re.match(r"^ua-[A-Za-z0-9_-]+$", self.alias):
            raise InvalidArgument(f"libvirt user aliases start with 'ua-' and use [A-Za-z0-9_-]: {self.alias!r}")

    def to_element(self) -> ET.Element:
        root = ET.Element("interface", {"type": "hostdev", "managed": "yes" if self.managed else "no"})
        ET.SubElement(root, "mac", {"address": normalize_mac(self.mac)})
        source = ET.SubElement(root, "source")
        ET.SubElement(source, "address", self.pci.attributes(with_type=True))
        if self.vlan:
            vlan = ET.SubElement(root, "vlan")
            ET.SubElement(vlan, "tag", {"id": str(self.vlan)})
        if self.alias:
            ET.SubElement(root, "alias", {"name": self.alias})
        return root

    def to_xml(self) -> str:
        return _to_xml(self.to_element())


@dataclass(frozen=True)
class HostdevDevice:
    """<hostdev mode='subsystem' type='pci'>: the VF passed through as a bare PCI function."""

    pci: PciAddress
    managed: bool = True
    alias: str | None = None

    def to_element(self) -> ET.Element:
        root = ET.Element("hostdev", {"mode": "subsystem", "type": "pci", "managed": "yes" if self.managed else "no"})
        source = ET.SubElement(root, "source")
        ET.SubElement(source, "address", self.pci.attributes(with_type=False))
        if self.alias:
            ET.SubElement(root, "alias", {"name": self.alias})
        return root

    def to_xml(self) -> str:
        return _to_xml(self.to_element())


def _to_xml(element: ET.Element) -> str:
    ET.indent(element, space="  ")
    return ET.tostring(element, encoding="unicode")
