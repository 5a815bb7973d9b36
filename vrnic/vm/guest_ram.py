"""A VM's RAM file from the outside: where libvirt puts it, reading it by guest-physical address, HMP `xp`.

The layout (GPA -> file offset, the ROM window, the 4 GiB split) is vrnic.core.guest_phys; vrnicd's own
mapping of a VM's RAM is vrnic.backend.guest_memory.GuestMemory.from_vm_ram. This module serves tools and
tests that look at a running VM's memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from pathlib import Path

from vrnic.core.guest_phys import vm_layout
from vrnic.errors import InvalidArgument

SHORT_NAME_MAX = 20  # libvirt's VIR_DOMAIN_SHORT_NAME_MAX


def libvirt_ram_file(memory_backing_dir: Path, domain_id: int, name: str, alias: str = "pc.ram") -> Path:
    """Where libvirt 9.0 puts a running domain's file-backed RAM when qemu.conf sets memory_backing_dir:
    <dir>/libvirt/qemu/<id>-<name truncated to 20>/<alias> (pc.ram on q35 and pc)."""
    return memory_backing_dir / "libvirt" / "qemu" / f"{domain_id}-{name[:SHORT_NAME_MAX]}" / alias


_XP_LINE = re.compile(r"^\s*([0-9a-fA-F]+):((?:\s+0x[0-9a-fA-F]{2})+)\s*$")


def parse_hmp_xp(text: str) -> tuple[int, bytes]:
    """Parse HMP `xp /Nxb ADDR` output ('0000000000100000: 0x00 0x01 ...') -> (address, bytes)."""
    start: int | None = None
    data = bytearray()
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _XP_LINE.match(line)
        if match is None:
            raise InvalidArgument(f"not an `xp /Nxb` line: {line!r}")
        address = int(match.group(1), 16)
        if start is None:
            start = address
        elif address != start + len(data):
            raise InvalidArgument(f"xp output skips from {start + len(data):#x} to {address:#x}")
        data += bytes(int(b, 16) for b in match.group(2).split())
    if start is None:
        raise InvalidArgument("empty xp output")
    return start, bytes(data)


class GuestRamFile:
    """MAP_SHARED view of a running VM's RAM file (what vrnicd would register MRs on)."""

    def __init__(self, path: Path, machine: str = "q35", writable: bool = False) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self.layout = vm_layout(self.size, machine)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)

    def address(self, offset: int = 0) -> int:
        """The virtual address of file offset `offset` in this process (for MR registration; writable maps only)."""
        if not 0 <= offset < self.size:
            raise InvalidArgument(f"offset {offset:#x} is outside the RAM file ({self.size:#x} bytes)")
        anchor = ctypes.c_char.from_buffer(self.map)
        try:
            return ctypes.addressof(anchor) + offset
        finally:
            del anchor  # an exported buffer would keep the mapping from ever closing

    def read_gpa(self, gpa: int, length: int) -> bytes:
        offset = self.layout.locate(gpa, length, "guest range")
        return self.map[offset:offset + length]

    def find(self, needle: bytes, start: int = 0) -> int:
        """File offset of needle (first match at or after start), -1 if absent."""
        return self.map.find(needle, start)

    def close(self) -> None:
        self.map.close()
