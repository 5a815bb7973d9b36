"""The guest's arena: memory it shares with vrnicd, and the address vrnicd knows each byte by.

A container guest shares a sealed memfd; vrnicd maps the same file, so an
address on the wire is the offset in the arena. A VM guest cannot hand over a
file: vrnicd maps the VM's whole RAM, so an address on the wire is a
guest-physical address. The VM's arena is therefore pinned memory whose
physical frames the frontend reads from /proc/self/pagemap (root only: the
kernel hides frame numbers from others), preferably 2 MiB hugepages, since a
buffer must be physically contiguous: without hugepages a buffer is at most one
4 KiB page, unless the kernel happened to hand out adjacent frames.

Standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import struct
import threading
from typing import ClassVar, Protocol

from vrnic.core.arena import ArenaAllocator, SegmentedAllocator, contiguous_runs
from vrnic.core.guest_phys import MADV_POPULATE_WRITE
from vrnic.core.rings import index_words
from vrnic.errors import DeviceError, InvalidArgument, NotSupported

PAGE = mmap.PAGESIZE
# Of the pages a detached context's arena had faulted in for MRs, what it keeps for the next context: zeroing a page
# in place costs a twentieth of faulting in a new one under the lab's TCG (issue 14).
KEPT_BYTES = 2 << 20
HUGEPAGE = 2 << 20
_PFN_MASK = (1 << 55) - 1
_PRESENT = 1 << 63


class Allocator(Protocol):
    def alloc(self, length: int, align: int = 64) -> int: ...

    def alloc_many(self, lengths: list[int], align: int = 64) -> list[int]: ...

    def free(self, offset: int) -> None: ...


class Arena:
    """Local memory (view, offsets) plus the translation to vrnicd's addresses."""

    size: int
    view: memoryview
    words: memoryview
    allocator: Allocator

    def wire(self, offset: int) -> int:
        raise NotImplementedError

    def provision(self, offset: int, length: int) -> None:
        """Have the pages under [offset, +length) allocated by this process (nothing to do if they always are)."""

    def retire(self) -> None:
        """Its context detached cleanly (vrnicd let go of it): close it, or keep it for this process's next one."""
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class MemfdArena(Arena):
    """A container's arena: a sealed memfd vrnicd maps too; wire address == offset."""

    # Arenas whose context detached, emptied, for the process's next attach of their size (at most one kept): a new
    # memfd, sized, sealed and mapped was a tenth of an attach under the lab's TCG (issue 14). close_kept() lets go.
    _kept: ClassVar[list[MemfdArena]] = []
    _kept_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, size: int) -> None:
        if size < PAGE or size % PAGE:
            raise InvalidArgument(f"the arena must be a positive number of pages, not {size} bytes")
        self.size = size
        self.fd = os.memfd_create("vrnic-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # Sealed so vrnicd can map it without fearing SIGBUS from a shrink.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self._provisioned = bytearray(size // PAGE)  # 1: this process faulted the page in (it stays allocated)
        self._start()

    @classmethod
    def new(cls, size: int) -> MemfdArena:
        """An empty arena of size: the one a context of this process left, if it has that size, else a new one."""
        with cls._kept_lock:
            kept = cls._kept.pop() if cls._kept and cls._kept[-1].size == size else None
        if kept is None:
            return cls(size)
        kept._start()
        return kept

    @classmethod
    def close_kept(cls) -> int:
        """Close the arena kept for the next attach, if any (its memfd and mapping hold two descriptors): for a
        process that wants nothing of a closed context left, and for tests that count descriptors."""
        with cls._kept_lock:
            kept, cls._kept[:] = list(cls._kept), []
        for arena in kept:
            arena._close_file()
        return len(kept)

    @classmethod
    def _forget_kept_after_fork(cls) -> None:
        """In a forked child: the kept arena's file is the parent's too, and two processes must never hand vrnicd
        the same arena. The child closes its copies and keeps nothing."""
        cls._kept_lock = threading.Lock()  # the parent's may have been held by another of its threads
        cls.close_kept()

    def _start(self) -> None:
        """Views and bookkeeping of an arena that reads as zeros: new, or emptied by retire (which may have left
        pages this process provisioned allocated, and marked so)."""
        self.view = memoryview(self._map)
        self.words = index_words(self.view)
        self.allocator = ArenaAllocator(self.size)

    def retire(self) -> None:
        """Kept for the next attach (one at most), emptied (_empty: it reads as zeros, and holds no memory but the
        pages this process faulted in for MRs). The views go, so a Buffer of the closed context cannot reach the
        next one's memory."""
        self.words.release()
        self.view.release()
        try:
            self._empty()
        except OSError:
            self._close_file()
            return
        with self._kept_lock:
            keep = not self._kept
            if keep:
                self._kept.append(self)
        if not keep:
            self._close_file()

    def _empty(self) -> None:
        """Make every page read as zeros again. The pages this process provisioned (up to KEPT_BYTES) are zeroed in
        place and stay allocated, so the next context does not fault them in again; every other page is punched
        out of the file."""
        kept = self._provisioned.count(1)
        if not kept or kept * PAGE > KEPT_BYTES:
            self._map.madvise(mmap.MADV_REMOVE)
            self._provisioned = bytearray(self.size // PAGE)
            return
        page, pages = 0, len(self._provisioned)
        while page < pages:
            used = self._provisioned.find(1, page)
            end = pages if used < 0 else used
            if end > page:
                self._map.madvise(mmap.MADV_REMOVE, page * PAGE, (end - page) * PAGE)
            if used < 0:
                break
            free = self._provisioned.find(0, used)
            page = pages if free < 0 else free
            self._map[used * PAGE:page * PAGE] = bytes((page - used) * PAGE)

    def wire(self, offset: int) -> int:
        return offset

    def provision(self, offset: int, length: int) -> None:
        """Fault the memfd's pages under [offset, +length) in here, writable, before vrnicd registers them. A shmem
        page is charged to the memory cgroup of whoever allocates it (mm/shmem.c): pages the guest never touched
        would be allocated by vrnicd's registration, through vrnicd's mapping, and charged to vrnicd instead of
        the guest, and vrnicd refuses to register them (GuestMemory.unallocated_page). Not fallocate: it leaves a
        shmem page !uptodate, which mincore and SEEK_DATA report as absent."""
        start = offset - offset % PAGE
        end = min(self.size, -(-(offset + length) // PAGE) * PAGE)
        first, last = start // PAGE, end // PAGE
        if self._provisioned.find(0, first, last) < 0:  # done before (each time: a 1 MiB MR loop ran 1.4x slower)
            return
        try:
            self._map.madvise(MADV_POPULATE_WRITE, start, end - start)
        except OSError as e:
            if e.errno != errno.EINVAL:  # ENOMEM: the guest's own memory cgroup is at its limit
                raise DeviceError(f"cannot allocate {end - start} bytes of the arena: {e.strerror}",
                                  e.errno or 0) from None
            for page in range(start, end, PAGE):  # a kernel before 5.14: a read fault allocates a shmem page too
                self.view[page]
        self._provisioned[first:last] = b"\1" * (last - first)

    def close(self) -> None:
        self.words.release()
        self.view.release()
        self._close_file()

    def _close_file(self) -> None:
        self._map.close()
        os.close(self.fd)


def _frame(entry: int) -> int | None:
    return entry & _PFN_MASK if entry & _PRESENT else None


def _mlock(address: int, length: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(length)) != 0:
        code = ctypes.get_errno()
        raise NotSupported(f"cannot pin the arena (mlock: {os.strerror(code)}); raise RLIMIT_MEMLOCK")


class VmArena(Arena):
    """A VM guest's arena: pinned pages, addressed on the wire by guest-physical address."""

    def __init__(self, size: int, hugepages: bool | None = None, pagemap: str = "/proc/self/pagemap") -> None:
        if size < PAGE or size % PAGE:
            raise InvalidArgument(f"the arena must be a positive number of pages, not {size} bytes")
        self.fd = -1
        huge = self._map_huge(size) if hugepages in (None, True) else None
        if huge is None:
            if hugepages:
                raise NotSupported(f"no {size} bytes of 2 MiB hugepages in this VM "
                                   "(echo N > /proc/sys/vm/nr_hugepages)")
            self._map = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        else:
            self._map = huge
            size = len(huge)
        self.hugepages = huge is not None
        self.size = size
        self.view = memoryview(self._map)
        anchor = ctypes.c_char.from_buffer(self._map)
        base = ctypes.addressof(anchor)
        del anchor
        try:
            for offset in range(0, size, PAGE):  # fault every page in before asking where it is
                self.view[offset] = 0
            if not self.hugepages:
                _mlock(base, size)  # hugetlb pages are never swapped or moved; 4 KiB ones must be pinned
            frames = self._frames(pagemap, base, size)
        except BaseException:
            self.view.release()
            self._map.close()
            self._close_fd()
            raise
        self.runs = contiguous_runs(frames, PAGE)
        self.words = index_words(self.view)
        self.allocator = SegmentedAllocator([(offset, length) for offset, length, _ in self.runs])

    def _map_huge(self, size: int) -> mmap.mmap | None:
        size = -(-size // HUGEPAGE) * HUGEPAGE
        try:
            self.fd = os.memfd_create("vrnic-arena", os.MFD_CLOEXEC | os.MFD_HUGETLB)
            os.ftruncate(self.fd, size)
            return mmap.mmap(self.fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError:  # no hugetlbfs, or no free hugepages
            self._close_fd()
            return None

    @staticmethod
    def _frames(pagemap: str, base: int, size: int) -> list[int]:
        with open(pagemap, "rb") as f:
            f.seek(base // PAGE * 8)
            raw = f.read(size // PAGE * 8)
        if len(raw) != size // PAGE * 8:
            raise NotSupported(f"{pagemap} does not describe the arena")
        frames = []
        for (entry,) in struct.iter_unpack("<Q", raw):
            frame = _frame(entry)
            if frame is None:
                raise NotSupported("an arena page is not present in memory after being touched")
            if not frame:  # present but 0: the kernel hides frames from processes without CAP_SYS_ADMIN
                raise NotSupported("cannot read guest-physical addresses from /proc/self/pagemap: "
                                   "the frontend in a VM runs as root")
            frames.append(frame)
        return frames

    def wire(self, offset: int) -> int:
        for start, length, physical in self.runs:
            if start <= offset < start + length:
                return physical + offset - start
        raise InvalidArgument(f"offset {offset} is outside the arena")

    def _close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.words.release()
        self.view.release()
        self._map.close()
        self._close_fd()


os.register_at_fork(after_in_child=MemfdArena._forget_kept_after_fork)
