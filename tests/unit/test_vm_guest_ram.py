"""vrnic.vm.guest_ram (HMP xp parsing, reading a RAM file by GPA) and GuestMemory over a VM's RAM file."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import pytest

from vrnic.backend.guest_memory import GuestMemory
from vrnic.core.rings import Ring
from vrnic.errors import InvalidArgument
from vrnic.vm.guest_ram import GuestRamFile, parse_hmp_xp

MIB = 1 << 20


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
    memory = GuestMemory.from_vm_ram(path)
    try:
        assert memory.size == 2 * MIB
        ctypes.memmove(memory.base + 0x200000 - 8, b"12345678", 8)  # what an RDMA WRITE at gpa would do
        assert path.read_bytes()[0x200000 - 8:0x200000] == b"12345678"
        # a ring laid out by the guest at a guest-physical address, read by vrnicd's core.rings
        ring = Ring(memory.view, 0x10000, 8, struct.Struct("<Q"), memory.words)
        assert ring.count() == 0
        memory.words[0x10000 >> 2] = 3  # the guest's producer index (at the ring's byte 0)
        assert ring.count() == 3
        assert memory.layout.locate(0x100000, 4096, "MR") == 0x100000
        with pytest.raises(InvalidArgument):
            memory.layout.locate(0xC0000, 16, "MR")  # the ROM window is not RAM
    finally:
        memory.close()
    memory.close()  # idempotent


def test_vm_guest_memory_refuses_odd_sizes_and_maps_ram_above_the_split(tmp_path: Path) -> None:
    odd = tmp_path / "odd.ram"
    odd.write_bytes(bytes(100))
    with pytest.raises(InvalidArgument, match="pages"):
        GuestMemory.from_vm_ram(odd)
    big = tmp_path / "big.ram"
    with big.open("wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB, so q35 puts 1 GiB above the 4 GiB split
    memory = GuestMemory.from_vm_ram(big)
    try:
        assert memory.layout.locate(4 << 30, 4096, "MR") == 2 << 30
        with pytest.raises(InvalidArgument):
            memory.layout.locate(3 << 30, 4096, "MR")  # the PCI hole
    finally:
        memory.close()
