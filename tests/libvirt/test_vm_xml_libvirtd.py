"""vrnic's own domain XML through a real libvirtd: what vrnic builds is what libvirt keeps and runs.

Host libvirtd offers only TCG here (no usable KVM), so the domains are type='qemu'.
"""

from __future__ import annotations

import os
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vrnic.lab.kernel import choose_kernel, installed_kernels, kernel_image
from vrnic.sriov.libvirt_xml import HostdevInterface, PciAddress
from vrnic.vm.domain_xml import (
    VRNIC_NS,
    DirectKernelBoot,
    DomainType,
    VirtioSerialChannel,
    VmDomain,
    VrnicAttachment,
)

PREFIX = "vrnic-libvirt-tier-"


@pytest.fixture
def channel_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=PREFIX) as tmp:
        os.chmod(tmp, 0o777)  # QEMU may run as libvirt-qemu and must create its socket here
        yield Path(tmp)


@pytest.fixture
def cleanup(libvirt_conn: Any) -> Iterator[list[str]]:
    """Names of domains a test made; destroyed and undefined afterwards, whatever happened."""
    import libvirt

    names: list[str] = []
    yield names
    for name in names:
        try:
            domain = libvirt_conn.lookupByName(name)
        except libvirt.libvirtError:
            continue
        if domain.isActive():
            domain.destroy()
        if domain.isPersistent():
            domain.undefine()


def vm(name: str, channel_dir: Path, **extra: Any) -> VmDomain:
    kernel = kernel_image(choose_kernel(installed_kernels()))
    return VmDomain(name=name, boot=DirectKernelBoot(kernel=kernel, cmdline="console=ttyS0 panic=-1"),
                    memory_mib=128, domain_type=DomainType.QEMU, machine="q35",
                    vrnics=(VrnicAttachment("vr-0123456789abcdef"),),
                    channels=(VirtioSerialChannel(channel_dir / "vrnic.sock"),), **extra)


def find(root: ET.Element, path: str) -> ET.Element:
    found = root.find(path, {"vrnic": VRNIC_NS})
    assert found is not None, f"{path} is missing from\n{ET.tostring(root, encoding='unicode')}"
    return found


def test_a_defined_domain_keeps_vrnics_metadata_channel_memory_and_vf(libvirt_conn: Any, channel_dir: Path,
                                                                        cleanup: list[str]) -> None:
    vf = HostdevInterface(pci=PciAddress.parse("0000:03:10.2"), mac="52:54:00:12:34:56", vlan=42,
                          alias="ua-vrnic-vf0")
    built = vm(f"{PREFIX}defined", channel_dir, hostdev_interfaces=(vf,))
    cleanup.append(built.name)
    libvirt_conn.defineXML(built.to_xml())  # libvirt validates it against its schema and its drivers
    kept = ET.fromstring(libvirt_conn.lookupByName(built.name).XMLDesc(0))

    attachment = find(kept, "metadata/vrnic:vrnics/vrnic:vrnic")
    assert attachment.attrib == {"id": "vr-0123456789abcdef", "channel": "org.vrnic.0"}
    assert find(kept, "memoryBacking/source").get("type") == "file"
    assert find(kept, "memoryBacking/access").get("mode") == "shared"
    channel = find(kept, "devices/channel[@type='unix']")
    assert find(channel, "source").get("path") == str(channel_dir / "vrnic.sock")
    assert find(channel, "target").attrib == {"type": "virtio", "name": "org.vrnic.0"}
    interface = find(kept, "devices/interface[@type='hostdev']")
    assert find(interface, "mac").get("address") == "52:54:00:12:34:56"
    address = find(interface, "source/address")
    assert {k: int(address.get(k, "-1"), 0) for k in ("domain", "bus", "slot", "function")} == \
        {"domain": 0, "bus": 3, "slot": 0x10, "function": 2}
    assert find(interface, "vlan/tag").get("id") == "42"
    assert find(interface, "alias").get("name") == "ua-vrnic-vf0"


def test_a_vrnic_vm_starts_with_shared_file_ram_and_its_channel(libvirt_conn: Any, channel_dir: Path,
                                                                 cleanup: list[str]) -> None:
    import libvirt

    built = vm(f"{PREFIX}running", channel_dir)
    cleanup.append(built.name)
    domain = libvirt_conn.createXML(built.to_xml(), 0)  # transient: gone once destroyed
    assert domain.state()[0] == libvirt.VIR_DOMAIN_RUNNING
    deadline = time.monotonic() + 10
    while not (channel_dir / "vrnic.sock").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (channel_dir / "vrnic.sock").is_socket(), "QEMU serves the vRNIC channel where vrnic said"
    live = ET.fromstring(domain.XMLDesc(0))
    assert find(live, "memoryBacking/access").get("mode") == "shared"
    pid = _qemu_pid(built.name)
    assert pid is not None
    ram = [p for p in Path("/proc", str(pid), "map_files").iterdir() if "pc.ram" in os.readlink(p)]
    assert ram, "guest RAM is a shared file QEMU mapped (what vrnicd maps too)"
    domain.destroy()
    assert built.name not in [d.name() for d in libvirt_conn.listAllDomains()]


def _qemu_pid(name: str) -> int | None:
    pid_file = Path("/run/libvirt/qemu") / f"{name}.pid"
    try:
        return int(pid_file.read_text())
    except (OSError, ValueError):
        return None
