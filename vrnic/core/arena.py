"""First-fit allocators for the frontend's shared arena (offsets only, no memory of their own)."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence

from vrnic.errors import InvalidArgument, QuotaExceeded


class ArenaAllocator:
    def __init__(self, size: int) -> None:
        if size <= 0:
            raise InvalidArgument("arena size must be positive")
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted (offset, length)
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    def alloc(self, length: int, align: int = 64) -> int:
        if length <= 0 or align <= 0 or align & (align - 1):
            raise InvalidArgument(f"bad allocation: {length} bytes aligned to {align}")
        with self._lock:
            for i, (start, span) in enumerate(self._free):
                offset = (start + align - 1) & ~(align - 1)
                pad = offset - start
                if pad + length <= span:
                    rest = [(start, pad)] if pad else []
                    if pad + length < span:
                        rest.append((offset + length, span - pad - length))
                    self._free[i:i + 1] = rest
                    self._used[offset] = length
                    return offset
        raise QuotaExceeded("arena_bytes", self.size, self.in_use() + length)

    def alloc_many(self, lengths: list[int], align: int = 64) -> list[int]:
        """Several allocations side by side, found in one search (a batch of QPs' rings); each is freed on its own.
        Each takes its length rounded up to align, so the next starts aligned."""
        if not lengths or align <= 0 or align & (align - 1) or min(lengths) <= 0:
            raise InvalidArgument(f"bad allocations: {len(lengths)} of {min(lengths, default=0)}+ bytes aligned to "
                                  f"{align}")
        sizes = [(length + align - 1) & ~(align - 1) for length in lengths]
        base = self.alloc(sum(sizes), align)
        offsets = []
        with self._lock:
            del self._used[base]
            offset = base
            for size in sizes:
                offsets.append(offset)
                self._used[offset] = size
                offset += size
        return offsets

    def free(self, offset: int) -> None:
        with self._lock:
            length = self._used.pop(offset, None)
            if length is None:
                raise InvalidArgument(f"offset {offset} was not allocated")
            self._free.append((offset, length))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, span in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + span)
                else:
                    merged.append((start, span))
            self._free = merged

    def in_use(self) -> int:
        return sum(self._used.values())


class SegmentedAllocator:
    """Allocations that never straddle a segment: a VM's arena is contiguous in guest-physical memory only
    piecewise (one run per set of adjacent pages), and vrnicd needs each buffer in one piece."""

    def __init__(self, segments: list[tuple[int, int]]) -> None:
        if not segments:
            raise InvalidArgument("an arena needs at least one segment")
        self.segments = sorted(segments)
        self._parts = [(start, ArenaAllocator(length)) for start, length in self.segments]
        self.size = sum(length for _, length in self.segments)

    def alloc(self, length: int, align: int = 64) -> int:
        for start, part in self._parts:
            if length <= part.size:
                try:
                    return start + part.alloc(length, align)
                except QuotaExceeded:
                    continue
        largest = max(length for _, length in self.segments)
        if length > largest:
            raise InvalidArgument(f"{length} bytes do not fit one physically contiguous piece of the arena "
                                  f"(the largest is {largest} bytes; use hugepages for larger buffers)")
        raise QuotaExceeded("arena_bytes", self.size, self.in_use() + length)

    def alloc_many(self, lengths: list[int], align: int = 64) -> list[int]:
        """Side by side in one segment if one has room, else one by one (each still in one piece)."""
        for start, part in self._parts:
            try:
                return [start + offset for offset in part.alloc_many(lengths, align)]
            except QuotaExceeded:
                continue
        offsets: list[int] = []
        try:
            for length in lengths:
                offsets.append(self.alloc(length, align))
        except BaseException:
            for offset in offsets:
                self.free(offset)
            raise
        return offsets

    def free(self, offset: int) -> None:
        for start, part in self._parts:
            if start <= offset < start + part.size:
                part.free(offset - start)
                return
        raise InvalidArgument(f"offset {offset} was not allocated")

    def in_use(self) -> int:
        return sum(part.in_use() for _, part in self._parts)


def contiguous_runs(frames: list[int], page_size: int) -> list[tuple[int, int, int]]:
    """(offset, length, physical address) runs of a mapping whose i-th page sits at frames[i] * page_size."""
    runs: list[tuple[int, int, int]] = []
    for index, frame in enumerate(frames):
        address = frame * page_size
        if runs and runs[-1][2] + runs[-1][1] == address:
            offset, length, start = runs[-1]
            runs[-1] = (offset, length + page_size, start)
        else:
            runs.append((index * page_size, page_size, address))
    return runs


def page_runs(spans: Sequence[tuple[int, int]], page_size: int = mmap.PAGESIZE) -> list[list[int]]:
    """The [first, last) runs of whole pages the [start, end) spans cover, pages that touch joined: one call per
    run where each span would make its own (a pool's buffers lie side by side: one run)."""
    runs: list[list[int]] = []
    for start, end in sorted(spans):
        first, last = start // page_size * page_size, -(-end // page_size) * page_size
        if runs and first <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], last)
        else:
            runs.append([first, last])
    return runs
