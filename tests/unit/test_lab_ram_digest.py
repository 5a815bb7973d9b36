"""The RAM comparison of the cross-host migration test: the ROM window is left out, and two ends that differ
say where."""

from __future__ import annotations

from pathlib import Path

import pytest

from vrnic.lab.two_hosts.vm_target import DIGEST_CHUNK, ROM_WINDOW, differing_chunks, ram_chunk_digests, ram_digest

pytestmark = pytest.mark.unit

SIZE = 2 << 20


def _ram(tmp_path: Path, name: str, writes: dict[int, bytes]) -> Path:
    data = bytearray(SIZE)
    for at, payload in writes.items():
        data[at:at + len(payload)] = payload
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


def test_equal_files_have_equal_digests_and_no_differing_range(tmp_path: Path) -> None:
    a, b = _ram(tmp_path, "a", {0x1000: b"x"}), _ram(tmp_path, "b", {0x1000: b"x"})
    assert ram_digest(a) == ram_digest(b)
    assert differing_chunks(ram_chunk_digests(a), ram_chunk_digests(b)) == []
    assert len(ram_chunk_digests(a)) == SIZE // DIGEST_CHUNK


def test_one_byte_apart_is_found_in_its_64k_chunk(tmp_path: Path) -> None:
    a, b = _ram(tmp_path, "a", {0x15C66: b"\x4b"}), _ram(tmp_path, "b", {0x15C66: b"\x3d"})
    assert ram_digest(a) != ram_digest(b)
    assert differing_chunks(ram_chunk_digests(a), ram_chunk_digests(b)) == ["0x10000-0x20000"]


def test_the_rom_window_is_left_out_of_both_digests(tmp_path: Path) -> None:
    inside = ROM_WINDOW[0] + 0x100
    a, b = _ram(tmp_path, "a", {inside: b"rom"}), _ram(tmp_path, "b", {inside: b"bios"})
    assert ram_digest(a) == ram_digest(b)
    assert differing_chunks(ram_chunk_digests(a), ram_chunk_digests(b)) == []


def test_files_of_other_sizes_are_not_compared_silently(tmp_path: Path) -> None:
    a = _ram(tmp_path, "a", {})
    with pytest.raises(ValueError):
        differing_chunks(ram_chunk_digests(a), ram_chunk_digests(a)[:-1])
