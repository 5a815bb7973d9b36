"""vrnicd registers no page of a container's arena that the guest has not allocated: a shmem page is charged to
the memory cgroup of whoever allocates it, so a registration over pages the guest never touched would charge
vrnicd for the guest's memory. The frontend faults a buffer's pages in before it registers it. (The charge
itself is proven in the lab: tests/kernel/test_guest_memory_charge.py.)"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from vrnic.backend.guest_memory import GuestMemory
from vrnic.core.arena import page_runs
from vrnic.core.guest_phys import MADV_POPULATE_WRITE
from vrnic.core.specs import AttachInfo
from vrnic.errors import InvalidArgument
from vrnic.frontend import MR, PD, Access, Context
from vrnic.frontend.guest_library import MR_POOL, MR_POOL_BYTES
from vrnic.frontend.memory import MemfdArena

pytestmark = pytest.mark.unit

PAGE = mmap.PAGESIZE
ARENA = 1 << 20


def _guest_mapping(memory: GuestMemory) -> mmap.mmap:
    """The guest's own mapping of the same file (vrnicd's is memory.view)."""
    return mmap.mmap(memory.fd, memory.size)


def test_pages_written_or_populated_by_the_guest_count_and_untouched_or_fallocated_ones_do_not(
        memory: GuestMemory) -> None:
    guest = _guest_mapping(memory)
    try:
        assert memory.unallocated_page([(0, 16 * PAGE)]) == 0
        guest[2 * PAGE + 7] = 1  # written
        guest.madvise(MADV_POPULATE_WRITE, 3 * PAGE, 2 * PAGE)  # faulted in, not written: the frontend's way
        os.posix_fallocate(memory.fd, 6 * PAGE, PAGE)  # allocated but not uptodate: mincore and SEEK_DATA miss it
        assert memory.unallocated_page([(2 * PAGE, 5 * PAGE)]) is None
        assert memory.unallocated_page([(2 * PAGE + 100, 2 * PAGE + 200), (4 * PAGE, 5 * PAGE - 1)]) is None
        assert memory.unallocated_page([(2 * PAGE, 6 * PAGE)]) == 5 * PAGE
        assert memory.unallocated_page([(6 * PAGE, 7 * PAGE)]) == 6 * PAGE
        # only the spans' pages are looked at, not the gap between them
        assert memory.unallocated_page([(2 * PAGE, 3 * PAGE), (4 * PAGE, 5 * PAGE)]) is None
        assert memory.unallocated_page([(2 * PAGE, 3 * PAGE), (9 * PAGE + 5, 9 * PAGE + 6)]) == 9 * PAGE
        assert memory.unallocated_page([]) is None
    finally:
        guest.close()


def _mapped_in(memory: GuestMemory, first: int, count: int) -> list[bool]:
    """For each of count pages from first: whether vrnicd's mapping has it mapped (/proc/self/pagemap's present
    bit), which is what a registration through that mapping would otherwise fault in page by page."""
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek((memory.base + first) // PAGE * 8)
        entries = struct.unpack(f"{count}Q", pagemap.read(8 * count))
    return [bool(entry >> 63) for entry in entries]


def test_pages_the_guest_allocated_are_mapped_into_vrnicd_in_one_call_per_run(
        memory: GuestMemory, monkeypatch: pytest.MonkeyPatch) -> None:
    guest = _guest_mapping(memory)
    try:
        guest.madvise(MADV_POPULATE_WRITE, 2 * PAGE, 4 * PAGE)
        guest.madvise(MADV_POPULATE_WRITE, 9 * PAGE, PAGE)
        assert _mapped_in(memory, 0, 12) == [False] * 12  # allocated by the guest, not yet mapped here
        calls: list[tuple[int, int]] = []
        real = memory._map.madvise

        def counting(option: int, start: int, length: int) -> None:
            calls.append((start, length))
            real(option, start, length)

        monkeypatch.setattr(memory, "_map", _Spy(memory._map, counting))
        memory.map_in(page_runs([(2 * PAGE + 8, 3 * PAGE), (3 * PAGE, 6 * PAGE), (9 * PAGE, 9 * PAGE + 1)]))
        assert calls == [(2 * PAGE, 4 * PAGE), (9 * PAGE, PAGE)]  # side by side: one run
        assert _mapped_in(memory, 0, 12) == [False] * 2 + [True] * 4 + [False] * 3 + [True] + [False] * 2
        assert memory.unallocated_page([(0, 2 * PAGE), (6 * PAGE, 9 * PAGE)]) == 0  # nothing else allocated
    finally:
        guest.close()


class _Spy:
    """A mapping whose madvise goes through a function of the test's."""

    def __init__(self, mapping: mmap.mmap, madvise: Callable[[int, int, int], None]) -> None:
        self._mapping, self.madvise = mapping, madvise

    def __getattr__(self, name: str) -> object:
        return getattr(self._mapping, name)


def test_one_look_at_the_file_per_run_of_pages(memory: GuestMemory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool's buffers lie side by side: one lseek for all of them; spans apart are looked at apart."""
    import vrnic.backend.guest_memory as guest_memory

    memory.view[2 * PAGE:8 * PAGE] = bytes(6 * PAGE)
    memory.view[10 * PAGE] = 1
    looks: list[int] = []
    real = guest_memory.os.lseek

    def counting(fd: int, offset: int, whence: int) -> int:
        looks.append(offset)
        return real(fd, offset, whence)

    monkeypatch.setattr(guest_memory.os, "lseek", counting)
    side_by_side = [(2 * PAGE + i * 512, 2 * PAGE + (i + 1) * 512) for i in range(24)]  # three pages
    assert memory.unallocated_page(side_by_side[::-1]) is None
    assert looks == [2 * PAGE]
    looks.clear()
    assert memory.unallocated_page([(10 * PAGE, 10 * PAGE + 8), (3 * PAGE, 8 * PAGE)]) is None
    assert looks == [3 * PAGE, 10 * PAGE]
    assert memory.unallocated_page([(7 * PAGE + 1, 11 * PAGE - 1)]) == 8 * PAGE


def test_vrnicd_refuses_an_mr_over_pages_the_guest_never_touched(make_vrnic: Callable[..., AttachInfo]) -> None:
    with Context.attach(make_vrnic(), ARENA) as ctx:
        pd = PD(ctx)
        buf = ctx.alloc(8 * PAGE, align=PAGE)
        with pytest.raises(InvalidArgument, match="never allocated"):
            ctx.call("reg_mr", pd=pd.handle, addr=buf.addr, length=buf.length, access=int(Access.LOCAL_WRITE))
        with pytest.raises(InvalidArgument, match="never allocated"):
            ctx.call("reg_mrs", pd=pd.handle, addrs=[buf.addr], length=PAGE, access=int(Access.LOCAL_WRITE))
        assert ctx.call("query_device")["quota_used"]["mr"] == 0  # refused before anything was charged
        ctx.arena.view[buf.offset:buf.offset + buf.length] = b"\1" * buf.length  # written by the guest: fine
        made = ctx.call("reg_mr", pd=pd.handle, addr=buf.addr, length=buf.length, access=int(Access.LOCAL_WRITE))
        ctx.call("dereg_mr", mr=made["mr"])
        # the frontend faults pages in itself: an MR of its own buffer, a pooled one, one of a caller's buffer
        big, small = MR(pd, 64 * PAGE), MR(pd, 512)
        given = ctx.alloc(4 * PAGE, align=PAGE)
        mine = MR(pd, given)
        assert {mr.buffer.length for mr in (big, small, mine)} == {64 * PAGE, 512, 4 * PAGE}
        for mr in (big, small, mine):
            mr.close()


def test_a_pool_refill_maps_its_pages_into_vrnicd_before_registering_them_and_a_lone_mr_does_not(
        make_vrnic: Callable[..., AttachInfo], monkeypatch: pytest.MonkeyPatch) -> None:
    """A refill's pages are new to vrnicd's mapping; a lone MR's (reg_mr) may have been mapped by its last
    registration, and mapping them again is a walk of every page for nothing."""
    mapped: list[list[list[int]]] = []
    real = GuestMemory.map_in

    def spying(self: GuestMemory, runs: list[list[int]]) -> None:
        mapped.append(runs)
        real(self, runs)

    monkeypatch.setattr(GuestMemory, "map_in", spying)
    with Context.attach(make_vrnic(), ARENA) as ctx:
        pd = PD(ctx)
        pooled = MR(pd, PAGE)
        [runs] = mapped
        assert sum(last - first for first, last in runs) == MR_POOL * PAGE  # the pool's pages, side by side
        assert any(first <= pooled.buffer.offset and pooled.buffer.offset + PAGE <= last for first, last in runs)
        alone = MR(pd, MR_POOL_BYTES + PAGE)  # too large to pool: one reg_mr
        assert len(mapped) == 1
        for mr in (pooled, alone):
            mr.close()


def test_the_frontend_populates_each_run_of_side_by_side_buffers_once(make_vrnic: Callable[..., AttachInfo],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with Context.attach(make_vrnic(), ARENA) as ctx:
        calls: list[tuple[int, int]] = []
        assert isinstance(ctx.arena, MemfdArena)
        monkeypatch.setattr(ctx.arena, "provision", lambda offset, length: calls.append((offset, length)))
        side_by_side = ctx.alloc_many([1000] * 4, align=64)
        apart = ctx.alloc(100, align=PAGE)
        ctx.alloc(8 * PAGE)  # a gap of pages between apart and far
        far = ctx.alloc(100, align=PAGE)
        ctx.provision([*side_by_side[::-1], apart, far])
        start = side_by_side[0].offset
        runs = sorted(calls)
        assert runs[0][0] == start and runs[0][1] >= side_by_side[-1].offset + 1000 - start
        assert runs[-1] == (far.offset, 100)
        assert len(runs) <= 3


def test_on_a_kernel_without_populate_the_frontend_reads_each_page_in() -> None:
    """MADV_POPULATE_WRITE came with Linux 5.14 (EINVAL before): a read fault allocates a shmem page too."""
    arena = MemfdArena(16 * PAGE)
    real = arena._map

    class OldKernel:
        def madvise(self, *_: int) -> None:
            raise OSError(22, "Invalid argument")

        def close(self) -> None:
            real.close()

    arena._map = OldKernel()  # type: ignore[assignment]
    memory = GuestMemory(os.dup(arena.fd))  # vrnicd's view (close() closes the fd)
    try:
        arena.provision(3 * PAGE + 10, 2 * PAGE)
        assert memory.unallocated_page([(3 * PAGE, 6 * PAGE)]) is None
        assert memory.unallocated_page([(0, 16 * PAGE)]) == 0
        assert memory.unallocated_page([(6 * PAGE, 7 * PAGE)]) == 6 * PAGE
    finally:
        memory.close()
        arena.close()


def test_the_frontend_populates_a_page_once() -> None:
    """Pages stay allocated once faulted in (punched only once the context detached): the populate walk is not
    made again."""
    arena = MemfdArena(16 * PAGE)
    real = arena._map
    calls: list[tuple[int, int]] = []

    class Counting:
        def madvise(self, option: int, start: int, length: int) -> None:
            calls.append((start, length))
            real.madvise(option, start, length)

        def close(self) -> None:
            real.close()

    arena._map = Counting()  # type: ignore[assignment]
    try:
        arena.provision(2 * PAGE + 5, PAGE)  # two pages
        arena.provision(2 * PAGE, 2 * PAGE)  # the same two: nothing to do
        arena.provision(3 * PAGE, 2 * PAGE)  # one of them and a new one: both, in one call
        assert calls == [(2 * PAGE, 2 * PAGE), (3 * PAGE, 2 * PAGE)]
    finally:
        arena.close()


@pytest.mark.parametrize(("size", "layout_bytes", "message"), [
    (0, None, "not 0 bytes"),
    (PAGE + 100, None, f"not {PAGE + 100} bytes"),
    (4 * PAGE, 8 * PAGE, f"needs {8 * PAGE} bytes, the file has {4 * PAGE}"),
])
def test_vrnicd_maps_no_file_of_a_size_it_cannot_serve(size: int, layout_bytes: int | None, message: str) -> None:
    """Empty, not whole pages, or smaller than the guest's memory layout: refused, and the mapping made to read
    the size is gone again (the caller still owns the fd)."""
    from vrnic.core.guest_phys import arena_layout

    fd = os.memfd_create("guest", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        maps_before = Path("/proc/self/maps").read_text().count("memfd:guest")
        with pytest.raises(InvalidArgument, match=message):
            GuestMemory(fd, None if layout_bytes is None else arena_layout(layout_bytes), sealed=False)
        assert Path("/proc/self/maps").read_text().count("memfd:guest") == maps_before
        os.fstat(fd)  # not closed
    finally:
        os.close(fd)
