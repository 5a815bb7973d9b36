from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from vrnic.errors import InvalidArgument
from vrnic.sriov.libvirt_xml import HostdevDevice, HostdevInterface, PciAddress


def canonical(text: str) -> str:
    return ET.canonicalize(text, strip_text=True)


def test_pci_address_parse_and_format() -> None:
    address = PciAddress.parse("0000:3b:10.7")
    assert address == PciAddress(0, 0x3B, 0x10, 7)
    assert str(address) == "0000:3b:10.7"
    assert PciAddress.parse("81:00.1") == PciAddress(0, 0x81, 0, 1)
    for bad in ("0000:3b:10.8", "zz:00.0", "0000:3b:20.0", "eth0"):
        with pytest.raises(InvalidArgument):
            PciAddress.parse(bad)


def test_hostdev_interface_with_mac_and_vlan() -> None:
    xml = HostdevInterface(pci=PciAddress.parse("0000:3b:10.1"), mac="02:AA:00:00:00:01", vlan=42,
                           alias="ua-vrnic-1").to_xml()
    assert canonical(xml) == canonical("""
        <interface type='hostdev' managed='yes'>
          <mac address='02:aa:00:00:00:01'/>
          <source>
            <address type='pci' domain='0x0000' bus='0x3b' slot='0x10' function='0x1'/>
          </source>
          <vlan>
            <tag id='42'/>
          </vlan>
          <alias name='ua-vrnic-1'/>
        </interface>""")


def test_untagged_interface_has_no_vlan_element() -> None:
    xml = HostdevInterface(pci=PciAddress(0, 3, 0, 2), mac="02:00:00:00:00:09", vlan=0, managed=False).to_xml()
    assert canonical(xml) == canonical("""
        <interface type='hostdev' managed='no'>
          <mac address='02:00:00:00:00:09'/>
          <source><address type='pci' domain='0x0000' bus='0x03' slot='0x00' function='0x2'/></source>
        </interface>""")


def test_plain_hostdev() -> None:
    xml = HostdevDevice(pci=PciAddress.parse("0001:af:01.3")).to_xml()
    assert canonical(xml) == canonical("""
        <hostdev mode='subsystem' type='pci' managed='yes'>
          <source><address domain='0x0001' bus='0xaf' slot='0x01' function='0x3'/></source>
        </hostdev>""")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mac": "00:00:00:00:00:00"}, "unicast"),
    ({"mac": "03:00:00:00:00:01"}, "unicast"),
    ({"mac": "02:00:00:00:00:01", "vlan": 4095}, "VLAN 4095"),
    ({"mac": "02:00:00:00:00:01", "alias": "vrnic-1"}, "ua-"),
])
def test_bad_interface_input(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        HostdevInterface(pci=PciAddress(0, 1, 0, 0), **kwargs)  # type: ignore[arg-type]
