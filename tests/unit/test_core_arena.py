"""First-fit allocator of the frontend's shared arena (vrnic.core.arena)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vrnic.core.arena import ArenaAllocator, SegmentedAllocator
from vrnic.errors import InvalidArgument, QuotaExceeded


def test_first_allocation_starts_at_zero_and_is_accounted() -> None:
    arena = ArenaAllocator(4096)
    assert arena.alloc(100) == 0
    assert arena.in_use() == 100


def test_default_alignment_is_64_bytes() -> None:
    arena = ArenaAllocator(4096)
    assert [arena.alloc(10) for _ in range(3)] == [0, 64, 128]
    assert arena.in_use() == 30


@pytest.mark.parametrize("align", [1, 2, 8, 256, 4096])
def test_alignment_is_honoured(align: int) -> None:
    arena = ArenaAllocator(1 << 16)
    arena.alloc(3, align=1)
    offset = arena.alloc(5, align=align)
    assert offset % align == 0
    assert offset >= 3


@pytest.mark.parametrize(("length", "align"), [(0, 64), (-1, 64), (8, 0), (8, -64), (8, 3), (8, 48)])
def test_bad_requests_are_refused(length: int, align: int) -> None:
    arena = ArenaAllocator(4096)
    with pytest.raises(InvalidArgument, match="bad allocation"):
        arena.alloc(length, align)
    assert arena.alloc(4096) == 0  # nothing was taken


@pytest.mark.parametrize("size", [0, -1])
def test_arena_size_must_be_positive(size: int) -> None:
    with pytest.raises(InvalidArgument):
        ArenaAllocator(size)


def test_exhaustion_is_a_quota_error_naming_arena_bytes() -> None:
    arena = ArenaAllocator(1024)
    arena.alloc(1000)
    with pytest.raises(QuotaExceeded) as info:
        arena.alloc(100)
    assert (info.value.limit, info.value.maximum, info.value.requested) == ("arena_bytes", 1024, 1100)
    assert arena.in_use() == 1000


def test_exact_fill_then_nothing_more() -> None:
    arena = ArenaAllocator(256)
    assert [arena.alloc(64) for _ in range(4)] == [0, 64, 128, 192]
    with pytest.raises(QuotaExceeded):
        arena.alloc(1, align=1)


def test_first_fit_reuses_the_lowest_hole_that_fits() -> None:
    arena = ArenaAllocator(4096)
    a, b, c, d = (arena.alloc(64) for _ in range(4))
    e = arena.alloc(256)
    arena.free(b)  # hole of 64 at 64
    arena.free(d)  # hole of 64 at 192
    assert arena.alloc(128) == e + 256  # neither hole fits 128
    assert arena.alloc(64) == b  # the lowest hole first
    assert arena.alloc(64) == d
    assert (a, c) == (0, 128)


def test_alignment_padding_stays_usable() -> None:
    arena = ArenaAllocator(4096)
    arena.alloc(8, align=1)  # [0, 8)
    assert arena.alloc(64, align=1024) == 1024
    assert arena.alloc(8, align=8) == 8  # the padding [8, 1024) is still free


def test_free_coalesces_neighbours_into_one_span() -> None:
    arena = ArenaAllocator(1024)
    offsets = [arena.alloc(256) for _ in range(4)]
    for offset in (offsets[0], offsets[2], offsets[1], offsets[3]):  # out of order
        arena.free(offset)
    assert arena.in_use() == 0
    assert arena.alloc(1024) == 0  # only possible if every hole merged back


def test_fragmentation_can_refuse_even_with_enough_bytes_free() -> None:
    arena = ArenaAllocator(256)
    offsets = [arena.alloc(64) for _ in range(4)]
    arena.free(offsets[0])
    arena.free(offsets[2])
    with pytest.raises(QuotaExceeded):
        arena.alloc(128)
    arena.free(offsets[1])
    assert arena.alloc(192) == 0


def test_double_free_and_unknown_offsets_are_refused() -> None:
    arena = ArenaAllocator(4096)
    offset = arena.alloc(128)
    arena.free(offset)
    with pytest.raises(InvalidArgument, match="was not allocated"):
        arena.free(offset)
    other = arena.alloc(128)
    with pytest.raises(InvalidArgument):
        arena.free(other + 64)  # inside an allocation, not its start
    with pytest.raises(InvalidArgument):
        arena.free(9999)
    assert arena.in_use() == 128


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.sampled_from([1, 8, 64, 512]), st.booleans()), max_size=40))
def test_allocations_never_overlap_and_stay_inside(requests: list[tuple[int, int, bool]]) -> None:
    size = 8192
    arena = ArenaAllocator(size)
    live: dict[int, int] = {}
    for length, align, free_one in requests:
        if free_one and live:
            victim = sorted(live)[len(live) // 2]
            arena.free(victim)
            del live[victim]
        try:
            offset = arena.alloc(length, align)
        except QuotaExceeded:
            continue
        assert offset % align == 0
        assert offset >= 0 and offset + length <= size
        for other, other_length in live.items():
            assert offset + length <= other or other + other_length <= offset
        live[offset] = length
        assert arena.in_use() == sum(live.values())
    for offset in list(live):
        arena.free(offset)
    assert arena.in_use() == 0
    assert arena.alloc(size, align=1) == 0  # everything coalesced back


def test_alloc_many_puts_pieces_side_by_side_each_freed_on_its_own() -> None:
    arena = ArenaAllocator(1 << 16)
    first = arena.alloc(100)
    pieces = arena.alloc_many([4160, 1000, 4160, 1000])
    assert pieces == [128, 128 + 4160, 128 + 4160 + 1024, 128 + 2 * 4160 + 1024]  # 100 -> 128, 1000 -> 1024
    assert arena.in_use() == 100 + 2 * 4160 + 2 * 1024  # each piece of the run holds its rounded length
    arena.free(pieces[1])
    assert arena.alloc(1000) == pieces[1]  # the hole one piece left
    for offset in [first, *pieces]:
        arena.free(offset)
    assert arena.in_use() == 0 and arena.alloc(1 << 16) == 0  # everything coalesced again


def test_alloc_many_is_all_or_nothing_and_checks_its_requests() -> None:
    arena = ArenaAllocator(8192)
    with pytest.raises(QuotaExceeded):
        arena.alloc_many([4096, 4096, 64])
    assert arena.in_use() == 0
    for lengths, align in (([], 64), ([64, 0], 64), ([64], 48)):
        with pytest.raises(InvalidArgument):
            arena.alloc_many(lengths, align)


def test_a_segmented_arena_keeps_a_run_in_one_segment_or_places_pieces_one_by_one() -> None:
    arena = SegmentedAllocator([(0, 4096), (1 << 20, 8192)])
    assert arena.alloc_many([2048, 2048, 2048]) == [1 << 20, (1 << 20) + 2048, (1 << 20) + 4096]
    # No segment has room for the whole run: each piece still lands in one piece of one segment.
    assert sorted(arena.alloc_many([2048, 2048, 2048])) == [0, 2048, (1 << 20) + 6144]
    with pytest.raises(QuotaExceeded):
        arena.alloc_many([64])
    assert arena.in_use() == 6 * 2048
