"""Edits of an existing domain's XML for `vrnic vm attach` and `vrnic vm detach`. Pure: text in, text out.

Attach adds what a paravirtual vRNIC needs and is missing — shared file memory,
the vRNIC's virtio-serial channel — and names the vRNIC in vrnic's `<metadata>`
element, noting there what it added. Detach removes exactly that, so attach then
detach gives back the domain as it was. An SR-IOV vRNIC adds its `<interface
type='hostdev'>` instead (its VF, whole). One paravirtual vRNIC per channel port.
"""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from vrnic.errors import Conflict, InvalidArgument
from vrnic.vm.domain_xml import DEFAULT_CHANNEL, VRNIC_NS, VirtioSerialChannel

_VRNICS = f"{{{VRNIC_NS}}}vrnics"
_VRNIC = f"{{{VRNIC_NS}}}vrnic"
MEMORY_BACKING = "memory-backing"
CHANNEL = "channel"
HOSTDEV = "hostdev"


@dataclass(frozen=True)
class AttachedVrnic:
    vrnic_id: str
    mode: str  # "paravirtual" or "sriov"
    channel: str | None
    added: tuple[str, ...]


def _parse(domain_xml: str) -> ET.Element:
    try:
        root = ET.fromstring(domain_xml)
        # keep other tools' metadata prefixes when we write the XML back (ElementTree would say ns0)
        for _, (prefix, uri) in ET.iterparse(io.StringIO(domain_xml), events=("start-ns",)):
            if prefix and not re.match(r"ns\d+$", prefix):
                ET.register_namespace(prefix, uri)
    except ET.ParseError as exc:
        raise InvalidArgument(f"not a domain XML: {exc}") from None
    if root.tag != "domain":
        raise InvalidArgument(f"expected <domain>, got <{root.tag}>")
    return root


def _text(root: ET.Element) -> str:
    return ET.tostring(root, encoding="unicode")


def _metadata_list(root: ET.Element, create: bool) -> ET.Element | None:
    metadata = root.find("metadata")
    if metadata is None:
        if not create:
            return None
        metadata = ET.Element("metadata")
        # libvirt orders <metadata> after name/uuid/title/description; it re-sorts on define anyway
        index = max((i + 1 for i, child in enumerate(root) if child.tag in ("name", "uuid", "title", "description")),
                    default=0)
        root.insert(index, metadata)
    vrnics = metadata.find(_VRNICS)
    if vrnics is None and create:
        vrnics = ET.SubElement(metadata, _VRNICS)
    return vrnics


def vrnics_in(domain_xml: str) -> list[AttachedVrnic]:
    """The vRNICs the domain's metadata names."""
    found = []
    vrnics = _metadata_list(_parse(domain_xml), create=False)
    for element in [] if vrnics is None else vrnics.findall(_VRNIC):
        added = tuple(a for a in (element.get("added") or "").split(",") if a)
        found.append(AttachedVrnic(element.get("id", ""), element.get("mode", "paravirtual"), element.get("channel"),
                                   added))
    return found


def _shared_file_memory(root: ET.Element) -> tuple[bool, ET.Element | None]:
    """(already shared file memory, the memoryBacking element if any)."""
    backing = root.find("memoryBacking")
    if backing is None:
        return False, None
    source, access = backing.find("source"), backing.find("access")
    if source is not None and source.get("type") not in (None, "file"):
        raise InvalidArgument(f"the domain's memory is backed by {source.get('type')!r}: vrnicd maps guest RAM "
                              "from a file (<source type='file'/>)")
    if backing.find("hugepages") is not None:
        raise InvalidArgument("the domain uses hugepages memory backing: vrnic needs file-backed shared memory "
                              "(point qemu.conf's memory_backing_dir at a hugetlbfs mount instead)")
    shared = source is not None and access is not None and access.get("mode") == "shared"
    return shared, backing


def _check_free(root: ET.Element, vrnic_id: str, port: str | None) -> ET.Element:
    vrnics = _metadata_list(root, create=True)
    assert vrnics is not None
    for element in vrnics.findall(_VRNIC):
        if element.get("id") == vrnic_id:
            raise Conflict(f"vRNIC {vrnic_id} is already attached to this domain", current_state="attached")
        if port is not None and element.get("channel") == port:
            raise Conflict(f"the domain already has vRNIC {element.get('id')} on port {port}",
                           current_state="attached")
    return vrnics


def attach_vrnic(domain_xml: str, vrnic_id: str, channel_socket: Path, port: str = DEFAULT_CHANNEL) -> str:
    """Add a paravirtual vRNIC: shared file memory (if missing), its channel, its metadata entry."""
    channel = VirtioSerialChannel(channel_socket, port)  # validates the path and the port name
    root = _parse(domain_xml)
    vrnics = _check_free(root, vrnic_id, port)
    devices = root.find("devices")
    if devices is None:
        devices = ET.SubElement(root, "devices")
    for existing in devices.findall("channel"):
        target = existing.find("target")
        if target is not None and target.get("name") == port:
            raise Conflict(f"the domain already has a channel named {port}", current_state="attached")
    added = []
    shared, backing = _shared_file_memory(root)
    if not shared:
        if backing is None:
            backing = ET.Element("memoryBacking")
            index = max((i + 1 for i, child in enumerate(root) if child.tag in ("memory", "currentMemory")),
                        default=len(root))
            root.insert(index, backing)
        elif len(backing):
            raise InvalidArgument("the domain has a memoryBacking that is not shared file memory; "
                                  "make it <source type='file'/><access mode='shared'/> first")
        ET.SubElement(backing, "source", type="file")
        ET.SubElement(backing, "access", mode="shared")
        added.append(MEMORY_BACKING)
    devices.append(channel.to_element())
    added.append(CHANNEL)
    ET.SubElement(vrnics, _VRNIC, {"id": vrnic_id, "channel": port, "added": ",".join(added)})
    return _text(root)


def attach_hostdev(domain_xml: str, vrnic_id: str, interface_xml: str) -> str:
    """Add an SR-IOV vRNIC: its `<interface type='hostdev'>` (from the API) and its metadata entry."""
    root = _parse(domain_xml)
    vrnics = _check_free(root, vrnic_id, None)
    try:
        interface = ET.fromstring(interface_xml)
    except ET.ParseError as exc:
        raise InvalidArgument(f"not an interface XML: {exc}") from None
    alias = interface.find("alias")
    if interface.tag != "interface" or alias is None or not alias.get("name"):
        raise InvalidArgument("the hostdev interface must be an <interface> with an <alias name='ua-...'/>")
    devices = root.find("devices")
    if devices is None:
        devices = ET.SubElement(root, "devices")
    devices.append(interface)
    ET.SubElement(vrnics, _VRNIC, {"id": vrnic_id, "mode": "sriov", "alias": alias.get("name", ""),
                                   "added": HOSTDEV})
    return _text(root)


def _controller_keys(root: ET.Element) -> set[str]:
    return {f"{c.get('type')}:{c.get('index')}" for c in root.findall("devices/controller")}


def note_added_controllers(before_xml: str, after_xml: str, vrnic_id: str) -> str | None:
    """libvirt adds controllers a new device needs (a virtio-serial controller, a PCIe root port for it) when
    it defines the domain. Note them on the vRNIC's entry, so detach removes them too; None if it added none."""
    added = sorted(_controller_keys(_parse(after_xml)) - _controller_keys(_parse(before_xml)))
    if not added:
        return None
    root = _parse(after_xml)
    vrnics = _metadata_list(root, create=False)
    entry = None if vrnics is None else next((e for e in vrnics.findall(_VRNIC) if e.get("id") == vrnic_id), None)
    if entry is None:
        raise InvalidArgument(f"vRNIC {vrnic_id} is not attached to this domain")
    entry.set("controllers", " ".join(added))
    return _text(root)


def hostdev_alias(vrnic_id: str) -> str:
    """The user alias an SR-IOV vRNIC's interface gets in a domain (libvirt wants ua-...)."""
    return "ua-vrnic-" + "".join(c if c.isalnum() or c in "-_" else "-" for c in vrnic_id)[:50]


def detach_vrnic(domain_xml: str, vrnic_id: str | None = None) -> tuple[str, list[str]]:
    """Remove one vRNIC (or all) and exactly what attaching it added; (the new XML, the ids removed)."""
    root = _parse(domain_xml)
    vrnics = _metadata_list(root, create=False)
    entries = [] if vrnics is None else [e for e in vrnics.findall(_VRNIC)
                                         if vrnic_id is None or e.get("id") == vrnic_id]
    if vrnic_id is not None and not entries:
        raise InvalidArgument(f"vRNIC {vrnic_id} is not attached to this domain")
    devices = root.find("devices")
    removed = []
    for entry in entries:
        added = set((entry.get("added") or "").split(","))
        if devices is not None:
            for device in list(devices):
                if CHANNEL in added and device.tag == "channel":
                    target = device.find("target")
                    if target is not None and target.get("name") == entry.get("channel"):
                        devices.remove(device)
                if HOSTDEV in added and device.tag == "interface":
                    alias = device.find("alias")
                    if alias is not None and alias.get("name") == entry.get("alias"):
                        devices.remove(device)
        controllers = set((entry.get("controllers") or "").split())
        if devices is not None and controllers:
            for device in list(devices.findall("controller")):
                if f"{device.get('type')}:{device.get('index')}" in controllers:
                    devices.remove(device)
        if MEMORY_BACKING in added:
            backing = root.find("memoryBacking")
            if backing is not None:
                root.remove(backing)
        assert vrnics is not None
        vrnics.remove(entry)
        removed.append(entry.get("id", ""))
    if vrnics is not None and not len(vrnics):
        metadata = root.find("metadata")
        assert metadata is not None
        metadata.remove(vrnics)
        if not len(metadata):
            root.remove(metadata)
    return _text(root), removed


def canonical(domain_xml: str) -> str:
    """Canonical XML with <devices> in a fixed order, to compare definitions: libvirt may re-list controllers in
    another order when it reads a definition back (their index, not their place, is what counts)."""
    root = _parse(domain_xml)
    devices = root.find("devices")
    if devices is not None:
        children = sorted(devices, key=lambda e: ET.canonicalize(ET.tostring(e, encoding="unicode"), strip_text=True))
        for child in list(devices):
            devices.remove(child)
        devices.extend(children)
    return ET.canonicalize(_text(root), strip_text=True)


def domain_facts(domain_xml: str) -> tuple[str, str | None]:
    """(name, uuid) of a domain XML."""
    root = _parse(domain_xml)
    return root.findtext("name") or "", root.findtext("uuid")
