"""Guest addresses to offsets in the memory file: arenas, and QEMU's x86 RAM layout (ROM hole, 4 GiB split)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vrnic.core.guest_phys import FOUR_GIB, GiB, arena_layout, vm_layout
from vrnic.errors import InvalidArgument

MiB = 1 << 20


def test_an_arena_is_addressed_by_offset() -> None:
    layout = arena_layout(4 * MiB)
    assert layout.locate(0, 4 * MiB, "MR") == 0
    assert layout.locate(12345, 10, "MR") == 12345
    for addr, length in ((4 * MiB, 1), (4 * MiB - 1, 2), (-1, 1), (0, 0)):
        with pytest.raises(InvalidArgument):
            layout.locate(addr, length, "MR")


def test_a_small_q35_vm_is_all_low_except_the_rom_window() -> None:
    layout = vm_layout(256 * MiB)
    assert [(r.gpa, r.end, r.file_offset) for r in layout.ranges] == [(0, 0xC0000, 0), (0x100000, 256 * MiB, 0x100000)]
    assert layout.locate(0x200000, 4096, "MR") == 0x200000  # GPA == file offset (FACTS: proven in the lab)
    with pytest.raises(InvalidArgument, match="outside the guest's memory"):
        layout.locate(0xC0000, 16, "MR")  # ROM, not RAM
    with pytest.raises(InvalidArgument):
        layout.locate(0xBF000, 8192, "MR")  # straddles into the ROM window
    with pytest.raises(InvalidArgument):
        layout.locate(256 * MiB - 8, 16, "MR")


def test_a_large_q35_vm_continues_above_4_gib() -> None:
    layout = vm_layout(4 * GiB)  # >= 2.75 GiB: 2 GiB low, the rest from 4 GiB on
    assert (layout.ranges[-1].gpa, layout.ranges[-1].length, layout.ranges[-1].file_offset) == (FOUR_GIB, 2 * GiB,
                                                                                                 2 * GiB)
    assert layout.locate(FOUR_GIB + 4096, 64, "ring") == 2 * GiB + 4096
    with pytest.raises(InvalidArgument):
        layout.locate(3 * GiB, 64, "ring")  # the PCI hole
    with pytest.raises(InvalidArgument):
        layout.locate(2 * GiB - 8, 16, "MR")  # across the split
    assert vm_layout(0xB0000000 - 4096).ranges[-1].end == 0xB0000000 - 4096  # just below the limit: all low
    assert vm_layout(0xB0000000).ranges[-1].gpa == FOUR_GIB


def test_i440fx_splits_at_3_gib() -> None:
    layout = vm_layout(4 * GiB, machine="pc-i440fx-7.2")
    assert layout.ranges[1].end == 3 * GiB
    assert layout.locate(FOUR_GIB, 8, "MR") == 3 * GiB
    with pytest.raises(InvalidArgument, match="no RAM layout"):
        vm_layout(GiB, machine="virt")


@given(ram=st.integers(2 * MiB, 8 * GiB).map(lambda n: n & ~0xFFF), addr=st.integers(0, 9 * GiB),
       length=st.integers(1, 1 << 21))
def test_located_ranges_are_inside_the_file_and_never_in_rom(ram: int, addr: int, length: int) -> None:
    layout = vm_layout(ram)
    try:
        offset = layout.locate(addr, length, "MR")
    except InvalidArgument:
        return
    assert offset >= 0 and offset + length <= ram
    assert addr + length <= 0xC0000 or addr >= 0x100000


@given(st.lists(st.integers(min_value=-8192, max_value=5 * GiB), min_size=1, max_size=8),
       st.sampled_from([1, 64, 4096, 1 << 20]), st.sampled_from(["arena", "q35", "i440fx"]))
def test_locating_many_ranges_of_one_length_is_locating_each(addresses: list[int], length: int, kind: str) -> None:
    """A pool's MRs are located at once (one check when they lie in one RAM range): the same offsets as one by
    one, or the same refusal."""
    layout = {"arena": arena_layout(4 * GiB), "q35": vm_layout(4 * GiB),
              "i440fx": vm_layout(4 * GiB, machine="pc-i440fx-7.2")}[kind]
    try:
        expected = [layout.locate(address, length, "MR") for address in addresses]
    except InvalidArgument:
        with pytest.raises(InvalidArgument, match="outside the guest's memory|not a valid range"):
            layout.locate_many(addresses, length, "MR")
    else:
        assert layout.locate_many(addresses, length, "MR") == expected


def test_locating_many_refuses_an_empty_length_and_takes_no_addresses() -> None:
    layout = arena_layout(4 * MiB)
    assert layout.locate_many([], 4096, "MR") == []
    with pytest.raises(InvalidArgument, match="not a valid range"):
        layout.locate_many([0, 4096], 0, "MR")
    assert layout.locate_many([8192, 0, 4096], 4096, "MR") == [8192, 0, 4096]  # in the order given
