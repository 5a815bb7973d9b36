"""A guest's memory as vrnicd maps it: today a container's sealed memfd arena.

vrnicd maps the same file the guest maps and registers MRs at its own mapping.
Guests name that memory by their own addresses; `layout` says where each lies
in the file (vrnic.core.guest_phys: arena offsets, or a VM's guest-physical
addresses). The file must be sealed against shrinking, or a guest could make
vrnicd fault (SIGBUS) by truncating it.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

from vrnic.core.arena import page_runs
from vrnic.core.guest_phys import MADV_POPULATE_WRITE, MemoryLayout, arena_layout, vm_layout
from vrnic.core.rings import index_words
from vrnic.errors import DeviceError, InvalidArgument, NotFound

REQUIRED_SEALS = fcntl.F_SEAL_SHRINK


class GuestMemory:
    """Owns the fd and the mapping; close() unmaps and closes both."""

    def __init__(self, fd: int, layout: MemoryLayout | None = None, *, sealed: bool = True) -> None:
        if sealed:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError as exc:
                raise InvalidArgument(f"the arena must be a memfd ({os.strerror(exc.errno or 0)})") from None
            if not seals & REQUIRED_SEALS:
                raise InvalidArgument("the arena memfd must be sealed against shrinking (F_SEAL_SHRINK)")
        # The whole file, its size read by mmap itself: an os.fstat of its own was 0.1 ms of every attach under
        # the lab's TCG (issue 14). The size is checked before anything reads the mapping.
        try:
            self._map = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except ValueError:  # "cannot mmap an empty file"
            raise InvalidArgument("the arena must be a positive number of pages, not 0 bytes") from None
        size = len(self._map)
        problem = None
        if size % mmap.PAGESIZE:
            problem = f"the arena must be a positive number of pages, not {size} bytes"
        elif layout is not None and layout.file_bytes > size:
            problem = f"the guest's memory layout needs {layout.file_bytes} bytes, the file has {size}"
        if problem is not None:
            self._map.close()
            raise InvalidArgument(problem)
        self.fd = fd
        self.size = size
        # A container's memfd: its pages are the guest's to allocate (see unallocated_page); a VM's RAM file is
        # QEMU's
        self.guest_allocates = sealed
        self.layout = layout or arena_layout(size)
        anchor = ctypes.c_char.from_buffer(self._map)
        self.base = ctypes.addressof(anchor)  # where guest offset 0 lives in vrnicd
        del anchor  # an exported buffer would keep the mapping from ever closing
        self.view = memoryview(self._map)
        self.words = index_words(self.view)  # 32-bit view for ring indices

    @classmethod
    def from_vm_ram(cls, path: Path, machine: str = "q35") -> GuestMemory:
        """A VM's RAM file (libvirt's shared file memoryBacking), addressed by guest-physical address.

        vrnicd opens it itself: virtio-serial carries no descriptors. QEMU created the file and nothing
        seals it, so here the trust is in QEMU (which never truncates guest RAM), not in the guest.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"no RAM file {path} (is the VM running with shared file memory?)") from None
        except OSError as exc:
            raise DeviceError(f"cannot open the VM's RAM file {path}: {exc.strerror}", exc.errno or 0) from None
        try:
            return cls(fd, vm_layout(os.fstat(fd).st_size, machine), sealed=False)
        except BaseException:
            os.close(fd)
            raise

    def data_extents(self, start: int, end: int) -> list[tuple[int, int]]:
        """The stretches of [start, end) of the file that may hold data, in order; the rest are holes, bytes no
        one ever wrote (nor allocated), which read as zeros. Found with lseek(SEEK_DATA/SEEK_HOLE), two calls
        per stretch; a file system that cannot tell has it all as data (never a hole)."""
        extents: list[tuple[int, int]] = []
        at = start
        try:
            while at < end:
                data = os.lseek(self.fd, at, os.SEEK_DATA)
                if data >= end:
                    break
                at = os.lseek(self.fd, data, os.SEEK_HOLE)
                extents.append((data, min(at, end)))
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no data from `at` on; anything else: cannot tell
                return [(start, end)]
        return extents

    def holds_data(self, spans: Sequence[tuple[int, int]]) -> list[bool]:
        """For each [start, end) of the file, whether any of it may hold data; False where it lies all in a hole
        (never written: zeros). One look at the file (`data_extents`) over the stretch that covers them all."""
        if not spans:
            return []
        data = self.data_extents(min(start for start, _ in spans), max(end for _, end in spans))
        starts = [start for start, _ in data]
        held = []
        for start, end in spans:
            i = bisect.bisect_right(starts, end - 1)  # the stretches of data that start before end
            held.append(i > 0 and data[i - 1][1] > start)  # the last of them reaches past start
        return held

    def unallocated_page(self, spans: Sequence[tuple[int, int]]) -> int | None:
        """The file offset of the first page under the [start, end) spans that no one has allocated, or None.

        A shmem page is charged to the memory cgroup of the task that allocates it (mm/shmem.c). A page the guest
        never wrote (nor populated) would be allocated by vrnicd's registration, through vrnicd's mapping, and
        charged to vrnicd: memory the guest's own limit never sees. lseek(SEEK_HOLE) tells: to shmem a page is data
        when it is in the page cache and up to date, or swapped out (it was charged when it was allocated), and a
        hole otherwise (mm/filemap.c, mapping_seek_hole_data). One call per run of pages the spans cover (a
        pool's buffers lie side by side: one). Not mincore() through ctypes and then lseek for the pages it
        missed: 0.7 ms of every pool refill in the lab under TCG, against tens of microseconds (issue 14)."""
        return self.first_unallocated(page_runs(spans))

    def first_unallocated(self, runs: Sequence[Sequence[int]]) -> int | None:
        """unallocated_page() of spans already merged into runs of whole pages (page_runs)."""
        page_size = mmap.PAGESIZE
        for first, last in runs:
            try:
                hole = os.lseek(self.fd, first, os.SEEK_HOLE)
            except OSError as exc:  # ENXIO: first is past the end of the file, where nothing is allocated
                if exc.errno == errno.ENXIO:
                    return first
                raise DeviceError(f"cannot look at the guest's memory: {exc.strerror}", exc.errno or 0) from None
            if hole < last:
                return hole // page_size * page_size
        return None

    def map_in(self, runs: Sequence[Sequence[int]]) -> None:
        """Map the [first, last) runs of pages (page_runs) into vrnicd's mapping, writable, ahead of their
        registration: one madvise(MADV_POPULATE_WRITE) per run, where the registration would fault each page in on
        its own (lab, 8 MRs of 4 KiB on pages another process allocated: 1.05 -> 0.94 ms, issue 14). Only for pages
        the guest allocated (first_unallocated): on a hole it would allocate a page charged to vrnicd. A failure is
        left to the registration, which faults the page in itself or says why it cannot."""
        for first, last in runs:
            with contextlib.suppress(OSError):
                self._map.madvise(MADV_POPULATE_WRITE, first, last - first)

    def close(self) -> None:
        if self._map.closed:
            return
        self.words.release()
        self.view.release()
        self._map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)

