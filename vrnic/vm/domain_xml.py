"""libvirt domain XML for a VM with a vRNIC, built from typed dataclasses (no I/O).

In the style of Nova's libvirt config classes: each dataclass knows how to
become an ElementTree element; `VmDomain.to_xml()` is the only serialization.

What a vRNIC VM needs from libvirt:
- guest RAM in a shared file (`<memoryBacking><source type='file'/><access mode='shared'/>`), so
  vrnicd can map the very pages the guest uses (qemu.conf `memory_backing_dir` picks the directory;
  libvirt names the file `<dir>/<domain short name>/<alias>`, e.g. `.../1-vm1/pc.ram`);
- a virtio-serial channel per vRNIC whose host end is a unix socket QEMU listens on (`mode='bind'`);
  the guest opens `/dev/virtio-ports/<name>`;
- a `<metadata>` element in vrnic's namespace naming the vRNICs, which the libvirt hook reads from
  the XML libvirtd passes it (the hook may not call back into libvirtd);
- `<features><acpi/>` so the guest can power off, and `on_poweroff`/`on_reboot`/`on_crash` destroy.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from vrnic.errors import InvalidArgument
from vrnic.sriov.libvirt_xml import HostdevInterface

VRNIC_NS = "https://vrnic.dev/xmlns/vrnic/1"
VRNIC_PREFIX = "vrnic"
DEFAULT_CHANNEL = "org.vrnic.0"

ET.register_namespace(VRNIC_PREFIX, VRNIC_NS)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
_CHANNEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_VRNIC_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


class DomainType(StrEnum):
    KVM = "kvm"  # hardware virtualization (nested KVM in the lab)
    QEMU = "qemu"  # TCG, the fallback when there is no /dev/kvm


def _abs(what: str, path: Path) -> str:
    if not path.is_absolute():
        raise InvalidArgument(f"{what} must be an absolute path, not {str(path)!r}")
    return str(path)


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrib: str) -> ET.Element:
    element = ET.SubElement(parent, tag, attrib)
    if text is not None:
        element.text = text
    return element


@dataclass(frozen=True)
class DirectKernelBoot:
    """Boot a kernel and initrd directly (no disk, no bootloader)."""

    kernel: Path
    initrd: Path | None = None
    cmdline: str = ""
    rom: Path | None = None  # `<loader type='rom'>` = QEMU -bios (e.g. qboot); None: QEMU's default firmware

    def fill(self, os_el: ET.Element) -> None:
        if self.rom is not None:
            _sub(os_el, "loader", _abs("rom", self.rom), type="rom", readonly="yes")
        _sub(os_el, "kernel", _abs("kernel", self.kernel))
        if self.initrd is not None:
            _sub(os_el, "initrd", _abs("initrd", self.initrd))
        if self.cmdline:
            _sub(os_el, "cmdline", self.cmdline)


@dataclass(frozen=True)
class VirtioSerialChannel:
    """A virtio-serial port; QEMU listens on `socket`, the guest opens /dev/virtio-ports/<name>."""

    socket: Path
    name: str = DEFAULT_CHANNEL

    def __post_init__(self) -> None:
        _abs("channel socket", self.socket)
        if not _CHANNEL.match(self.name):
            raise InvalidArgument(f"bad virtio-serial port name {self.name!r}")

    def to_element(self) -> ET.Element:
        channel = ET.Element("channel", type="unix")
        _sub(channel, "source", mode="bind", path=str(self.socket))
        _sub(channel, "target", type="virtio", name=self.name)
        return channel


@dataclass(frozen=True)
class HostDirShare:
    """A host directory over virtio-9p (`<filesystem type='mount'>`), read-only unless said otherwise.

    The lab shares its root this way, so a VM runs the host's python3 and vrnic without installing them.
    multidevs='remap' keeps inode numbers unique across the mounts under the shared directory.
    """

    source: Path
    tag: str
    readonly: bool = True

    def __post_init__(self) -> None:
        _abs("shared directory", self.source)
        if not _CHANNEL.match(self.tag):
            raise InvalidArgument(f"bad 9p mount tag {self.tag!r}")

    def to_element(self) -> ET.Element:
        share = ET.Element("filesystem", type="mount", accessmode="passthrough", multidevs="remap")
        _sub(share, "source", dir=str(self.source))
        _sub(share, "target", dir=self.tag)
        if self.readonly:
            _sub(share, "readonly")
        return share


@dataclass(frozen=True)
class SerialConsole:
    """The guest's ttyS0: appended to a file when `log` is set, else a pty."""

    log: Path | None = None

    def to_element(self) -> ET.Element:
        if self.log is None:
            serial = ET.Element("serial", type="pty")
        else:
            serial = ET.Element("serial", type="file")
            _sub(serial, "source", path=_abs("console log", self.log), append="on")
        _sub(serial, "target", port="0")
        return serial


@dataclass(frozen=True)
class VrnicAttachment:
    """One vRNIC attached to the VM, and the channel its guest library talks over."""

    vrnic_id: str
    channel: str = DEFAULT_CHANNEL

    def __post_init__(self) -> None:
        if not _VRNIC_ID.match(self.vrnic_id):
            raise InvalidArgument(f"bad vRNIC id {self.vrnic_id!r}")
        if not _CHANNEL.match(self.channel):
            raise InvalidArgument(f"bad virtio-serial port name {self.channel!r}")


def metadata_element(attachments: tuple[VrnicAttachment, ...]) -> ET.Element:
    """`<vrnic:vrnics xmlns:vrnic=NS><vrnic:vrnic id=.. channel=../></vrnic:vrnics>`.

    libvirt keeps one metadata child per namespace; this is ours.
    """
    root = ET.Element(f"{{{VRNIC_NS}}}vrnics")
    for attachment in attachments:
        ET.SubElement(root, f"{{{VRNIC_NS}}}vrnic", {"id": attachment.vrnic_id, "channel": attachment.channel})
    return root


@dataclass(frozen=True)
class VmDomain:
    name: str
    boot: DirectKernelBoot
    memory_mib: int = 256
    vcpus: int = 1
    domain_type: DomainType = DomainType.KVM
    machine: str = "q35"
    uuid: str | None = None
    vrnics: tuple[VrnicAttachment, ...] = ()
    channels: tuple[VirtioSerialChannel, ...] = ()
    console: SerialConsole = field(default_factory=SerialConsole)
    shared_file_memory: bool = True  # what vrnicd maps; False only to show what breaks without it
    hostdev_interfaces: tuple[HostdevInterface, ...] = ()  # SR-IOV mode: whole VFs
    shares: tuple[HostDirShare, ...] = ()

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise InvalidArgument(f"bad domain name {self.name!r}")
        if self.memory_mib < 16 or self.vcpus < 1:
            raise InvalidArgument(f"a VM needs at least 16 MiB and 1 vCPU (got {self.memory_mib}, {self.vcpus})")
        names = [c.name for c in self.channels]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"virtio-serial port names must be unique: {names}")
        missing = {a.channel for a in self.vrnics} - set(names)
        if missing:
            raise InvalidArgument(f"vRNIC channel(s) {sorted(missing)} have no virtio-serial channel")

    def to_element(self) -> ET.Element:
        domain = ET.Element("domain", type=str(self.domain_type))
        _sub(domain, "name", self.name)
        if self.uuid is not None:
            _sub(domain, "uuid", self.uuid)
        if self.vrnics:
            metadata = _sub(domain, "metadata")
            metadata.append(metadata_element(self.vrnics))
        _sub(domain, "memory", str(self.memory_mib), unit="MiB")
        if self.shared_file_memory:
            backing = _sub(domain, "memoryBacking")
            _sub(backing, "source", type="file")
            _sub(backing, "access", mode="shared")
        _sub(domain, "vcpu", str(self.vcpus))
        os_el = _sub(domain, "os")
        _sub(os_el, "type", "hvm", arch="x86_64", machine=self.machine)
        self.boot.fill(os_el)
        features = _sub(domain, "features")
        _sub(features, "acpi")
        for event in ("on_poweroff", "on_reboot", "on_crash"):
            _sub(domain, event, "destroy")
        devices = _sub(domain, "devices")
        devices.append(self.console.to_element())
        for channel in self.channels:
            devices.append(channel.to_element())
        for share in self.shares:
            devices.append(share.to_element())
        for interface in self.hostdev_interfaces:
            devices.append(interface.to_element())
        # Nothing the guest does not need: no USB controller, no balloon (it would move pages under vrnicd).
        _sub(devices, "controller", type="usb", model="none")
        _sub(devices, "memballoon", model="none")
        return domain

    def to_xml(self) -> str:
        element = self.to_element()
        ET.indent(element)
        return ET.tostring(element, encoding="unicode")
