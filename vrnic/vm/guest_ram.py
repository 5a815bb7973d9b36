"""A VM's RAM file as vrnicd would map it: guest-physical address -> file offset, and a shared mapping.

QEMU x86 (pc and q35) lays guest RAM out in one file: GPA == file offset below the 4 GiB split,
except 0xc0000-0xfffff, which the guest sees as ROM (the file still has bytes there, the guest
does not). RAM above the split starts at GPA 4 GiB and at file offset `below_4g`.
q35 keeps all RAM below 4 GiB when the VM has less than 2816 MiB (0xb0000000); pc (i440fx) below 3 GiB.

Unlike the container arena (a sealed memfd, backend/guest_memory.py), this file is a plain tmpfs
file that QEMU created: nothing seals it against truncation, so vrnicd must trust QEMU not to shrink it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

from vrnic.errors import InvalidArgument

ROM_HOLE = (0xC0000, 0x100000)  # [start, end): guest sees pc.rom/pc.bios, not pc.ram
GIB4 = 1 << 32
Q35_LOWMEM = 0xB0000000  # q35: RAM above this much goes above 4 GiB
PC_LOWMEM = 0xC0000000  # pc/i440fx
SHORT_NAME_MAX = 20  # libvirt's VIR_DOMAIN_SHORT_NAME_MAX


def libvirt_ram_file(memory_backing_dir: Path, domain_id: int, name: str, alias: str = "pc.ram") -> Path:
    """Where libvirt 9.0 puts a running domain's file-backed RAM when qemu.conf sets memory_backing_dir:
    <dir>/libvirt/qemu/<id>-<name truncated to 20>/<alias> (pc.ram on q35 and pc)."""
    return memory_backing_dir / "libvirt" / "qemu" / f"{domain_id}-{name[:SHORT_NAME_MAX]}" / alias


@dataclass(frozen=True)
class RamLayout:
    size: int  # bytes of guest RAM (= file size)
    lowmem_limit: int = Q35_LOWMEM

    @property
    def below_4g(self) -> int:
        return min(self.size, self.lowmem_limit)

    def file_offset(self, gpa: int, length: int = 1) -> int:
        """The file offset of [gpa, gpa+length); the range must be RAM the guest sees as RAM."""
        if length < 1 or gpa < 0:
            raise InvalidArgument(f"bad guest range {gpa:#x}+{length}")
        end = gpa + length
        if gpa < ROM_HOLE[1] and end > ROM_HOLE[0]:
            raise InvalidArgument(f"{gpa:#x}+{length} overlaps the ROM hole {ROM_HOLE[0]:#x}-{ROM_HOLE[1] - 1:#x}")
        if end <= self.below_4g:
            return gpa
        above = self.size - self.below_4g
        if gpa >= GIB4 and end <= GIB4 + above:
            return self.below_4g + (gpa - GIB4)
        raise InvalidArgument(f"{gpa:#x}+{length} is not guest RAM (size {self.size:#x})")


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

    def __init__(self, path: Path, lowmem_limit: int = Q35_LOWMEM, writable: bool = False) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            self.layout = RamLayout(os.fstat(fd).st_size, lowmem_limit)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.map = mmap.mmap(fd, self.layout.size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)

    def address(self, offset: int = 0) -> int:
        """The virtual address of file offset `offset` in this process (for MR registration; writable maps only)."""
        if not 0 <= offset < self.layout.size:
            raise InvalidArgument(f"offset {offset:#x} is outside the RAM file ({self.layout.size:#x} bytes)")
        anchor = ctypes.c_char.from_buffer(self.map)
        try:
            return ctypes.addressof(anchor) + offset
        finally:
            del anchor  # an exported buffer would keep the mapping from ever closing

    def read_gpa(self, gpa: int, length: int) -> bytes:
        offset = self.layout.file_offset(gpa, length)
        return self.map[offset:offset + length]

    def find(self, needle: bytes, start: int = 0) -> int:
        """File offset of needle (first match at or after start), -1 if absent."""
        return self.map.find(needle, start)

    def close(self) -> None:
        self.map.close()


class VmGuestMemory:
    """A VM's RAM file in the shape vrnicd's sessions use for a container arena (backend/guest_memory.py):
    fd, size, base, view, words, close().

    Guest addresses are guest-physical: `base + gpa` is where vrnicd sees them, which holds for the
    whole file only while all RAM sits below the 4 GiB split (q35 < 2816 MiB); above it the address
    space is not linear in the file, so such VMs are refused until sessions translate GPAs.
    `usable(gpa, length)` says whether the guest sees a range as RAM (not the ROM hole).
    Differences from the arena: vrnicd opens this file itself (path from the hook or the domain XML),
    nothing passes it over the channel (virtio-serial carries no fds), and it is not sealed.
    """

    def __init__(self, path: Path, lowmem_limit: int = Q35_LOWMEM) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size <= 0 or size % mmap.PAGESIZE:
                raise InvalidArgument(f"{path}: a RAM file must be a positive number of pages, not {size} bytes")
            self.layout = RamLayout(size, lowmem_limit)
            if size > self.layout.below_4g:
                raise InvalidArgument(f"{path}: {size >> 20} MiB of RAM reaches above the 4 GiB split; "
                                      f"guest-physical addresses are linear in the file only up to "
                                      f"{self.layout.below_4g >> 20} MiB")
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size = size
        anchor = ctypes.c_char.from_buffer(self._map)
        self.base = ctypes.addressof(anchor)  # where guest-physical address 0 lives in vrnicd
        del anchor  # an exported buffer would keep the mapping from ever closing
        self.view = memoryview(self._map)
        self.words = self.view.cast("B").cast("I")  # 32-bit view for ring indices (as core.rings.index_words)

    def usable(self, gpa: int, length: int) -> bool:
        try:
            self.layout.file_offset(gpa, length)
        except InvalidArgument:
            return False
        return True

    def close(self) -> None:
        if self._map.closed:
            return
        self.words.release()
        self.view.release()
        self._map.close()
        os.close(self.fd)
