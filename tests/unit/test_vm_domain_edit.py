"""vrnic.vm.domain_edit: what `vrnic vm attach` adds to a domain, and detach takes away again."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vrnic.errors import Conflict, InvalidArgument
from vrnic.sriov.libvirt_xml import HostdevInterface, PciAddress
from vrnic.vm.domain_edit import (
    attach_hostdev,
    attach_vrnic,
    detach_vrnic,
    domain_facts,
    hostdev_alias,
    note_added_controllers,
    vrnics_in,
)

SOCKET = Path("/run/vrnic/vm/vm1/org.vrnic.0.sock")

PLAIN = """<domain type='kvm'>
  <name>vm1</name>
  <uuid>757fef6f-c10c-4ed2-b625-46ea44233d94</uuid>
  <memory unit='KiB'>262144</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc-q35-7.2'>hvm</type></os>
  <devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices>
</domain>"""

# already shared file memory, another tool's metadata, another channel
BUSY = """<domain type='kvm'>
  <name>vm1</name>
  <metadata><other:thing xmlns:other="https://example.org/other"><other:x a="1"/></other:thing></metadata>
  <memory unit='KiB'>262144</memory>
  <memoryBacking><source type='file'/><access mode='shared'/></memoryBacking>
  <devices>
    <channel type='unix'>
      <source mode='bind' path='/run/ga.sock'/><target type='virtio' name='org.qemu.guest_agent.0'/>
    </channel>
  </devices>
</domain>"""


def canon(text: str) -> str:
    return ET.canonicalize(text, strip_text=True)


@pytest.mark.parametrize("original", [PLAIN, BUSY], ids=["plain", "busy"])
def test_attach_then_detach_gives_the_domain_back(original: str) -> None:
    attached = attach_vrnic(original, "vr-1", SOCKET)
    root = ET.fromstring(attached)
    assert root.find("memoryBacking/source[@type='file']") is not None
    assert root.find("memoryBacking/access[@mode='shared']") is not None
    channel = root.find("devices/channel/target[@name='org.vrnic.0']/..")
    assert channel is not None and channel.find("source").get("path") == str(SOCKET)  # type: ignore[union-attr]
    assert [(v.vrnic_id, v.mode, v.channel) for v in vrnics_in(attached)] == [("vr-1", "paravirtual", "org.vrnic.0")]
    restored, removed = detach_vrnic(attached)
    assert removed == ["vr-1"]
    assert canon(restored) == canon(original)


def test_only_what_attach_added_is_removed() -> None:
    attached = attach_vrnic(BUSY, "vr-1", SOCKET)
    assert vrnics_in(attached)[0].added == ("channel",)  # the memory was shared already
    restored, _ = detach_vrnic(attached, "vr-1")
    assert ET.fromstring(restored).find("memoryBacking") is not None
    assert "https://example.org/other" in restored


def test_refusals() -> None:
    attached = attach_vrnic(PLAIN, "vr-1", SOCKET)
    with pytest.raises(Conflict, match="already attached"):
        attach_vrnic(attached, "vr-1", SOCKET)
    with pytest.raises(Conflict, match="vRNIC vr-1 on port org.vrnic.0"):
        attach_vrnic(attached, "vr-2", SOCKET)
    with pytest.raises(InvalidArgument, match="not attached"):
        detach_vrnic(PLAIN, "vr-9")
    assert detach_vrnic(PLAIN) == (ET.tostring(ET.fromstring(PLAIN), encoding="unicode"), [])
    hugepages = PLAIN.replace("<vcpu>", "<memoryBacking><hugepages/></memoryBacking><vcpu>")
    with pytest.raises(InvalidArgument, match="hugepages"):
        attach_vrnic(hugepages, "vr-1", SOCKET)
    memfd = PLAIN.replace("<vcpu>", "<memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking>"
                                    "<vcpu>")
    with pytest.raises(InvalidArgument, match="memfd"):
        attach_vrnic(memfd, "vr-1", SOCKET)
    with pytest.raises(InvalidArgument, match="absolute"):
        attach_vrnic(PLAIN, "vr-1", Path("relative.sock"))
    with pytest.raises(InvalidArgument, match="not a domain XML"):
        attach_vrnic("<domain", "vr-1", SOCKET)
    assert domain_facts(PLAIN) == ("vm1", "757fef6f-c10c-4ed2-b625-46ea44233d94")


def test_sriov_hostdev_round_trip() -> None:
    alias = hostdev_alias("vr-5")
    interface = HostdevInterface(pci=PciAddress.parse("0000:01:10.0"), mac="52:54:00:12:34:56", alias=alias).to_xml()
    attached = attach_hostdev(PLAIN, "vr-5", interface)
    assert ET.fromstring(attached).find(f"devices/interface/alias[@name='{alias}']") is not None
    assert [(v.vrnic_id, v.mode) for v in vrnics_in(attached)] == [("vr-5", "sriov")]
    restored, removed = detach_vrnic(attached, "vr-5")
    assert removed == ["vr-5"] and canon(restored) == canon(PLAIN)
    with pytest.raises(InvalidArgument, match="alias"):
        attach_hostdev(PLAIN, "vr-6", "<interface type='hostdev'/>")


def test_controllers_libvirt_adds_for_the_channel_go_at_detach() -> None:
    attached = attach_vrnic(PLAIN, "vr-1", SOCKET)
    # what libvirtd's define adds for a virtio-serial channel
    defined = attached.replace("<emulator>", "<controller type='virtio-serial' index='0'/>"
                                             "<controller type='pci' index='1' model='pcie-root-port'/><emulator>")
    assert note_added_controllers(attached, attached, "vr-1") is None
    noted = note_added_controllers(attached, defined, "vr-1")
    assert noted is not None and "pci:1 virtio-serial:0" in noted
    restored, _ = detach_vrnic(noted)
    assert canon(restored) == canon(PLAIN)
    with pytest.raises(InvalidArgument):
        note_added_controllers(PLAIN, defined, "vr-9")
