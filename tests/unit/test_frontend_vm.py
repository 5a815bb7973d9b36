"""The frontend's VM side that runs anywhere: allocators over physically contiguous runs, the pinned
arena's pagemap translation, the port lookup, and the promise that a VM needs no third-party package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vrnic.core.arena import SegmentedAllocator, contiguous_runs
from vrnic.errors import InvalidArgument, NotFound, NotSupported, QuotaExceeded
from vrnic.frontend.channel import find_port
from vrnic.frontend.memory import PAGE, VmArena

pytestmark = pytest.mark.unit


def test_contiguous_runs_merge_adjacent_frames_only() -> None:
    assert contiguous_runs([10, 11, 12, 20, 21, 5], 4096) == [
        (0, 3 * 4096, 10 * 4096), (3 * 4096, 2 * 4096, 20 * 4096), (5 * 4096, 4096, 5 * 4096)]
    assert contiguous_runs([], 4096) == []


def test_segmented_allocator_never_straddles_a_segment() -> None:
    alloc = SegmentedAllocator([(0, 4096), (4096, 8192)])
    first = alloc.alloc(3000)
    second = alloc.alloc(3000)  # does not fit behind the first in segment 0: goes to segment 1
    assert first == 0 and second == 4096
    with pytest.raises(InvalidArgument, match="largest is 8192"):
        alloc.alloc(8193)
    alloc.alloc(4096, 4096)
    with pytest.raises(QuotaExceeded):
        alloc.alloc(4096)
    alloc.free(second)
    assert alloc.alloc(4096) == 4096
    with pytest.raises(InvalidArgument):
        alloc.free(99999)


def test_vm_arena_translates_by_pagemap(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("pagemap shows frame numbers to root only")
    arena = VmArena(16 * PAGE, hugepages=False)
    try:
        assert not arena.hugepages
        assert sum(length for _, length, _ in arena.runs) == 16 * PAGE
        for offset, length, physical in arena.runs:
            assert arena.wire(offset) == physical
            assert arena.wire(offset + length - 1) == physical + length - 1
        # every buffer lies in one run, so it is contiguous in physical memory
        for _ in range(8):
            offset = arena.allocator.alloc(1000)
            assert any(o <= offset and offset + 1000 <= o + n for o, n, _ in arena.runs)
        with pytest.raises(InvalidArgument):
            arena.wire(16 * PAGE)
    finally:
        arena.close()


def test_vm_arena_refuses_without_frame_numbers(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 64)
    with pytest.raises(NotSupported, match="does not describe the arena"):
        VmArena(4 * PAGE, hugepages=False, pagemap=str(short))
    sparse = tmp_path / "sparse"  # entries for the whole 47-bit address space, all 0: nothing present
    with sparse.open("wb") as f:
        f.truncate((1 << 47) // PAGE * 8)
    with pytest.raises(NotSupported, match="not present"):
        VmArena(4 * PAGE, hugepages=False, pagemap=str(sparse))

    # what a process without CAP_SYS_ADMIN reads: present, frame 0
    hidden = tmp_path / "hidden"
    hidden.write_bytes(b"\0" * 80 + (1 << 63).to_bytes(8, "little") * 2)
    with pytest.raises(NotSupported, match="runs as root"):
        VmArena._frames(str(hidden), base=10 * PAGE, size=2 * PAGE)
    present = tmp_path / "present"
    entries = [((1 << 63) | frame).to_bytes(8, "little") for frame in (0x1234, 0x99)]
    present.write_bytes(b"\0" * 80 + b"".join(entries))
    assert VmArena._frames(str(present), base=10 * PAGE, size=2 * PAGE) == [0x1234, 0x99]


def test_find_port_by_name(tmp_path: Path) -> None:
    for index, name in enumerate(("org.qemu.guest_agent.0", "org.vrnic.0")):
        (tmp_path / f"vport0p{index + 1}").mkdir()
        (tmp_path / f"vport0p{index + 1}" / "name").write_text(name + "\n")
    assert find_port("org.vrnic.0", sysfs=tmp_path, dev=Path("/dev")) == Path("/dev/vport0p2")
    with pytest.raises(NotFound, match="no virtio-serial port 'org.vrnic.1'"):
        find_port("org.vrnic.1", sysfs=tmp_path)


def test_the_frontend_imports_only_the_standard_library() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'pydantic', 'pydantic_core', 'fastapi', 'sqlalchemy', 'httpx',"
        " 'typer', 'rich', 'pyverbs', 'libvirt'}:\n"
        "            raise ImportError('a VM does not have ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import vrnic.frontend, vrnic.frontend.memory, vrnic.frontend.channel\n"
        "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
