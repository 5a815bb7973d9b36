"""vrnic.vm.domain_xml: typed VM description -> libvirt domain XML."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vrnic.errors import InvalidArgument
from vrnic.vm.domain_xml import (
    VRNIC_NS,
    DirectKernelBoot,
    DomainType,
    HostDirShare,
    SerialConsole,
    VirtioSerialChannel,
    VmDomain,
    VrnicAttachment,
)

BOOT = DirectKernelBoot(kernel=Path("/boot/vmlinuz"), initrd=Path("/tmp/initrd"), cmdline="console=ttyS0")


def canon(text: str) -> str:
    return ET.canonicalize(text, strip_text=True)


def test_full_vrnic_vm() -> None:
    domain = VmDomain(
        name="vm1",
        uuid="00000000-0000-4000-8000-000000000001",
        boot=BOOT,
        memory_mib=256,
        vrnics=(VrnicAttachment("v-1"),),
        channels=(VirtioSerialChannel(Path("/run/vm1/org.vrnic.0.sock")),),
        console=SerialConsole(Path("/var/log/vm1.console")),
    )
    expected = f"""
<domain type='kvm' xmlns:vrnic='{VRNIC_NS}'>
  <name>vm1</name>
  <uuid>00000000-0000-4000-8000-000000000001</uuid>
  <metadata><vrnic:vrnics><vrnic:vrnic id='v-1' channel='org.vrnic.0'/></vrnic:vrnics></metadata>
  <memory unit='MiB'>256</memory>
  <memoryBacking><source type='file'/><access mode='shared'/></memoryBacking>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>/boot/vmlinuz</kernel><initrd>/tmp/initrd</initrd><cmdline>console=ttyS0</cmdline>
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>
  <devices>
    <serial type='file'><source path='/var/log/vm1.console' append='on'/><target port='0'/></serial>
    <channel type='unix'>
      <source mode='bind' path='/run/vm1/org.vrnic.0.sock'/>
      <target type='virtio' name='org.vrnic.0'/>
    </channel>
    <controller type='usb' model='none'/>
    <memballoon model='none'/>
  </devices>
</domain>"""
    assert canon(domain.to_xml()) == canon(expected)


def test_minimal_tcg_vm_with_pty_console_and_rom() -> None:
    boot = DirectKernelBoot(kernel=Path("/k"), rom=Path("/usr/share/qemu/qboot.rom"))
    domain = VmDomain(name="t", boot=boot, domain_type=DomainType.QEMU, shared_file_memory=False, vcpus=2)
    root = ET.fromstring(domain.to_xml())
    assert root.get("type") == "qemu"
    assert root.find("metadata") is None
    assert root.find("memoryBacking") is None
    assert root.findtext("vcpu") == "2"
    loader = root.find("os/loader")
    assert loader is not None and loader.attrib == {"type": "rom", "readonly": "yes"}
    assert loader.text == "/usr/share/qemu/qboot.rom"
    assert [e.tag for e in root.find("os")] == ["type", "loader", "kernel"]  # type: ignore[union-attr]
    serial = root.find("devices/serial")
    assert serial is not None
    assert canon(ET.tostring(serial, encoding="unicode")) == canon("<serial type='pty'><target port='0'/></serial>")


def test_metadata_is_found_by_namespace_not_prefix() -> None:
    domain = VmDomain(name="vm2", boot=BOOT, vrnics=(VrnicAttachment("a"), VrnicAttachment("b", "org.vrnic.1")),
                      channels=(VirtioSerialChannel(Path("/s0")), VirtioSerialChannel(Path("/s1"), "org.vrnic.1")))
    root = ET.fromstring(domain.to_xml())
    found = root.findall(f"metadata/{{{VRNIC_NS}}}vrnics/{{{VRNIC_NS}}}vrnic")
    assert [(e.get("id"), e.get("channel")) for e in found] == [("a", "org.vrnic.0"), ("b", "org.vrnic.1")]


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "bad name"}, "domain name"),
    ({"name": "x", "memory_mib": 8}, "16 MiB"),
    ({"name": "x", "vrnics": (VrnicAttachment("v"),)}, "no virtio-serial channel"),
    ({"name": "x", "channels": (VirtioSerialChannel(Path("/a")), VirtioSerialChannel(Path("/b")))}, "unique"),
])
def test_invalid_domains(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        VmDomain(boot=BOOT, **kwargs)  # type: ignore[arg-type]


def test_invalid_parts() -> None:
    with pytest.raises(InvalidArgument, match="absolute"):
        VirtioSerialChannel(Path("relative.sock"))
    with pytest.raises(InvalidArgument, match="port name"):
        VirtioSerialChannel(Path("/s"), name="has space")
    with pytest.raises(InvalidArgument, match="vRNIC id"):
        VrnicAttachment("<evil>")
    with pytest.raises(InvalidArgument, match="absolute"):
        VmDomain(name="x", boot=DirectKernelBoot(kernel=Path("vmlinuz"))).to_xml()


def test_host_directory_share() -> None:
    domain = VmDomain(name="vm2", boot=BOOT, shares=(HostDirShare(Path("/"), "hostroot"),
                                                     HostDirShare(Path("/srv/x"), "x", readonly=False)))
    devices = ET.fromstring(domain.to_xml()).find("devices")
    assert devices is not None
    shares = [ET.tostring(e, encoding="unicode") for e in devices.findall("filesystem")]
    assert [canon(s) for s in shares] == [canon(
        "<filesystem type='mount' accessmode='passthrough' multidevs='remap'><source dir='/'/>"
        "<target dir='hostroot'/><readonly/></filesystem>"), canon(
        "<filesystem type='mount' accessmode='passthrough' multidevs='remap'><source dir='/srv/x'/>"
        "<target dir='x'/></filesystem>")]
    with pytest.raises(InvalidArgument, match="absolute"):
        HostDirShare(Path("rel"), "t")
    with pytest.raises(InvalidArgument, match="mount tag"):
        HostDirShare(Path("/"), "bad tag")
