"""First-fit allocator for the frontend's shared arena (offsets only, no memory of its own)."""

from __future__ import annotations

import threading

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
