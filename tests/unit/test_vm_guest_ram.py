"""vrnic.vm.guest_ram: guest-physical address -> RAM file offset, HMP xp parsing, the shared mapping."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import pytest

from vrnic.core.rings import Ring
from vrnic.errors import InvalidArgument
from vrnic.vm.guest_ram import (
    GIB4,
    PC_LOWMEM,
    Q35_LOWMEM,
    GuestRamFile,
    RamLayout,
    VmGuestMemory,
    parse_hmp_xp,
)

MIB = 1 << 20


def test_below_the_split_gpa_is_the_file_offset() -> None:
    layout = RamLayout(256 * MIB)
    assert layout.file_offset(0x200000, 64) == 0x200000
    assert layout.file_offset(0, 0xC0000) == 0
    assert layout.file_offset(0x100000) == 0x100000
    assert layout.file_offset(256 * MIB - 1) == 256 * MIB - 1


@pytest.mark.parametrize("gpa, length", [(0xC0000, 1), (0xFFFFF, 1), (0xBFFFF, 2), (0xF0000, 0x20000)])
def test_rom_hole_is_refused(gpa: int, length: int) -> None:
    with pytest.raises(InvalidArgument, match="ROM hole"):
        RamLayout(256 * MIB).file_offset(gpa, length)


def test_beyond_ram_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="not guest RAM"):
        RamLayout(256 * MIB).file_offset(256 * MIB - 1, 2)
    with pytest.raises(InvalidArgument, match="not guest RAM"):
        RamLayout(256 * MIB).file_offset(GIB4)


def test_above_the_split() -> None:
    size = 4096 * MIB
    q35 = RamLayout(size, Q35_LOWMEM)
    assert q35.below_4g == Q35_LOWMEM
    assert q35.file_offset(GIB4) == Q35_LOWMEM
    assert q35.file_offset(GIB4 + size - Q35_LOWMEM - 1) == size - 1
    with pytest.raises(InvalidArgument):
        q35.file_offset(Q35_LOWMEM)  # the PCI hole
    assert RamLayout(size, PC_LOWMEM).file_offset(GIB4 + 5) == PC_LOWMEM + 5


def test_parse_hmp_xp() -> None:
    text = ("0000000000100000: 0x52 0x41 0x4d 0x50 0x52 0x4f 0x4f 0x46\r\n"
            "0000000000100008: 0x3a 0x00 0x01 0xff\r\n\r\n")
    assert parse_hmp_xp(text) == (0x100000, b"RAMPROOF:\x00\x01\xff")


@pytest.mark.parametrize("text", ["", "garbage", "0000000000100000: 0x00\n0000000000100010: 0x00\n"])
def test_parse_hmp_xp_rejects(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_hmp_xp(text)


def test_guest_ram_file_maps_shared(tmp_path: Path) -> None:
    path = tmp_path / "pc.ram"
    path.write_bytes(bytes(2 * MIB))
    reader = GuestRamFile(path)
    writer = GuestRamFile(path, writable=True)
    try:
        writer.map[0x100000:0x100004] = b"ABCD"
        assert reader.read_gpa(0x100000, 4) == b"ABCD"
        assert reader.find(b"ABCD") == 0x100000
        assert path.read_bytes()[0x100000:0x100004] == b"ABCD"
        assert ctypes.string_at(writer.address(0x100000), 4) == b"ABCD"
        with pytest.raises(InvalidArgument):
            writer.address(2 * MIB)
    finally:
        reader.close()
        writer.close()


def test_vm_guest_memory_has_the_arena_shape(tmp_path: Path) -> None:
    path = tmp_path / "pc.ram"
    path.write_bytes(bytes(2 * MIB))
    memory = VmGuestMemory(path)
    try:
        assert memory.size == 2 * MIB
        ctypes.memmove(memory.base + 0x200000 - 8, b"12345678", 8)  # what an RDMA WRITE at gpa would do
        assert path.read_bytes()[0x200000 - 8:0x200000] == b"12345678"
        # a ring laid out by the guest at a guest-physical address, read by vrnicd's core.rings
        ring = Ring(memory.view, 0x10000, 8, struct.Struct("<Q"), memory.words)
        assert ring.count() == 0
        memory.words[0x10000 >> 2] = 3  # the guest's producer index (at the ring's byte 0)
        assert ring.count() == 3
        assert memory.usable(0x100000, 4096) and not memory.usable(0xC0000, 16)
    finally:
        memory.close()
    memory.close()  # idempotent


def test_vm_guest_memory_refuses_ram_above_the_split_and_odd_sizes(tmp_path: Path) -> None:
    odd = tmp_path / "odd.ram"
    odd.write_bytes(bytes(100))
    with pytest.raises(InvalidArgument, match="pages"):
        VmGuestMemory(odd)
    big = tmp_path / "big.ram"
    with big.open("wb") as f:
        f.truncate(4 * MIB)  # sparse
    with pytest.raises(InvalidArgument, match="above the 4 GiB split"):
        VmGuestMemory(big, lowmem_limit=2 * MIB)
