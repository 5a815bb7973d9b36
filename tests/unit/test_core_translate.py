"""Checking and translating a guest's work request (vrnic.core.translate)."""

from __future__ import annotations

import pytest

from vrnic.core.rings import Access, Sge, WcStatus, WrOpcode
from vrnic.core.translate import (
    ATOMICS,
    REMOTE_ACCESS,
    MrWindow,
    WrRejected,
    local_sges,
    remote_target,
)
from vrnic.errors import InvalidArgument

ALL = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
BASE = 0x7F00_0000_0000


def window(vkey: int, offset: int, length: int, access: Access = ALL, base: int = BASE) -> MrWindow:
    return MrWindow(vkey=vkey, offset=offset, length=length, access=access, phys_lkey=1000 + vkey,
                    phys_rkey=2000 + vkey, base=base)


MINE = {1: window(1, 0, 4096), 2: window(2, 8192, 1024, Access(0)), 3: window(3, 4096, 4096, Access.LOCAL_WRITE)}


# ----- MrWindow.covers --------------------------------------------------------------------------

@pytest.mark.parametrize(("addr", "length", "inside"), [
    (100, 0, True), (100, 10, True), (100, 1, True), (1099, 1, True), (1100, 0, True),
    (99, 1, False), (99, 0, False), (1099, 2, False), (1100, 1, False), (100, 1001, False), (100, -1, False),
])
def test_covers_is_the_half_open_range(addr: int, length: int, inside: bool) -> None:
    assert window(1, 100, 1000).covers(addr, length) is inside


# ----- local SGEs -------------------------------------------------------------------------------

def test_local_sges_translate_to_mapped_address_and_physical_lkey() -> None:
    out = local_sges([Sge(0, 64, 1), Sge(4096, 4096, 3), Sge(8192 + 1000, 24, 2)], MINE, writable=False)
    assert out == [(BASE, 64, 1001), (BASE + 4096, 4096, 1003), (BASE + 9192, 24, 1002)]


def test_no_sges_is_nothing_to_translate() -> None:
    assert local_sges([], MINE, writable=True) == []


def test_unknown_lkey_is_a_local_protection_error() -> None:
    with pytest.raises(WrRejected, match="lkey 99 is not an MR of this vRNIC") as info:
        local_sges([Sge(0, 8, 1), Sge(0, 8, 99)], MINE, writable=False)
    assert info.value.status is WcStatus.LOC_PROT_ERR
    assert isinstance(info.value, InvalidArgument)
    assert info.value.to_dict()["code"] == "wr_rejected"


def test_a_foreign_vkey_is_unknown_here() -> None:
    theirs = {7: window(7, 0, 1 << 20)}
    with pytest.raises(WrRejected) as info:
        local_sges([Sge(0, 8, 7)], MINE, writable=False)
    assert info.value.status is WcStatus.LOC_PROT_ERR
    assert local_sges([Sge(0, 8, 7)], theirs, writable=False) == [(BASE, 8, 1007)]


@pytest.mark.parametrize(("addr", "length"), [(4095, 2), (0, 4097), (1 << 63, 1), (8191, 1), (4096, 1)])
def test_sge_outside_its_mr_is_refused(addr: int, length: int) -> None:
    with pytest.raises(WrRejected, match="outside MR") as info:
        local_sges([Sge(addr, length, 1)], MINE, writable=False)
    assert info.value.status is WcStatus.LOC_PROT_ERR


def test_sge_at_the_last_byte_is_fine() -> None:
    assert local_sges([Sge(4095, 1, 1)], MINE, writable=True) == [(BASE + 4095, 1, 1001)]


def test_writable_needs_local_write() -> None:
    with pytest.raises(WrRejected, match="MR 2 is not locally writable") as info:
        local_sges([Sge(8192, 8, 2)], MINE, writable=True)
    assert info.value.status is WcStatus.LOC_PROT_ERR
    assert local_sges([Sge(8192, 8, 2)], MINE, writable=False) == [(BASE + 8192, 8, 1002)]
    assert local_sges([Sge(4096, 8, 3)], MINE, writable=True) == [(BASE + 4096, 8, 1003)]


# ----- remote targets ---------------------------------------------------------------------------

PEER_BASE = 0x7E00_0000_0000
PEER = {
    10: window(10, 0, 4096, ALL, PEER_BASE),
    11: window(11, 4096, 4096, Access.REMOTE_WRITE, PEER_BASE),
    12: window(12, 8192, 4096, Access.REMOTE_READ, PEER_BASE),
    13: window(13, 12288, 4096, Access.REMOTE_ATOMIC, PEER_BASE),
    14: window(14, 16384, 4096, Access.LOCAL_WRITE, PEER_BASE),
}
ONLY = {Access.REMOTE_WRITE: 11, Access.REMOTE_READ: 12, Access.REMOTE_ATOMIC: 13}


def test_remote_access_table_covers_every_one_sided_opcode() -> None:
    assert set(REMOTE_ACCESS) == set(WrOpcode) - {WrOpcode.SEND, WrOpcode.SEND_WITH_IMM}
    assert set(ATOMICS) == {WrOpcode.ATOMIC_CMP_AND_SWP, WrOpcode.ATOMIC_FETCH_AND_ADD}


@pytest.mark.parametrize("opcode", list(REMOTE_ACCESS))
def test_remote_target_translates_for_every_opcode(opcode: WrOpcode) -> None:
    length = 8 if opcode in ATOMICS else 512
    assert remote_target(opcode, 64, length, 10, PEER) == (PEER_BASE + 64, 2010)


@pytest.mark.parametrize("opcode", list(REMOTE_ACCESS))
def test_not_connected_is_a_remote_access_error(opcode: WrOpcode) -> None:
    with pytest.raises(WrRejected, match="not connected") as info:
        remote_target(opcode, 0, 8, 10, None)
    assert info.value.status is WcStatus.REM_ACCESS_ERR


def test_an_rkey_the_peer_does_not_have_is_refused() -> None:
    with pytest.raises(WrRejected, match="rkey 1 is not an MR of the connected peer") as info:
        remote_target(WrOpcode.RDMA_WRITE, 0, 8, 1, PEER)  # our own vkey, not the peer's
    assert info.value.status is WcStatus.REM_ACCESS_ERR
    with pytest.raises(WrRejected):
        remote_target(WrOpcode.RDMA_READ, 0, 8, 10, {})


@pytest.mark.parametrize(("addr", "length"), [(4090, 8), (0, 4097), (4096, 1), (1 << 40, 8)])
def test_remote_range_outside_the_mr_is_refused(addr: int, length: int) -> None:
    with pytest.raises(WrRejected, match="outside MR") as info:
        remote_target(WrOpcode.RDMA_WRITE, addr, length, 10, PEER)
    assert info.value.status is WcStatus.REM_ACCESS_ERR


@pytest.mark.parametrize("opcode", list(REMOTE_ACCESS))
@pytest.mark.parametrize("granted", list(ONLY))
def test_access_flags_per_opcode(opcode: WrOpcode, granted: Access) -> None:
    rkey = ONLY[granted]
    addr = PEER[rkey].offset
    length = 8 if opcode in ATOMICS else 64
    if REMOTE_ACCESS[opcode] is granted:
        assert remote_target(opcode, addr, length, rkey, PEER) == (PEER_BASE + addr, 2000 + rkey)
    else:
        with pytest.raises(WrRejected, match=f"does not allow {REMOTE_ACCESS[opcode].name}") as info:
            remote_target(opcode, addr, length, rkey, PEER)
        assert info.value.status is WcStatus.REM_ACCESS_ERR


@pytest.mark.parametrize("opcode", list(REMOTE_ACCESS))
def test_local_write_alone_grants_no_remote_access(opcode: WrOpcode) -> None:
    length = 8 if opcode in ATOMICS else 64
    with pytest.raises(WrRejected, match="does not allow"):
        remote_target(opcode, 16384, length, 14, PEER)


@pytest.mark.parametrize("opcode", list(ATOMICS))
@pytest.mark.parametrize(("addr", "length"), [(12289, 8), (12292, 8), (12288, 4), (12288, 16), (12288, 0)])
def test_atomics_need_8_aligned_bytes(opcode: WrOpcode, addr: int, length: int) -> None:
    with pytest.raises(WrRejected, match="8-byte aligned") as info:
        remote_target(opcode, addr, length, 13, PEER)
    assert info.value.status is WcStatus.REM_ACCESS_ERR


@pytest.mark.parametrize("opcode", list(ATOMICS))
def test_atomic_at_the_last_aligned_word(opcode: WrOpcode) -> None:
    assert remote_target(opcode, 12288 + 4088, 8, 13, PEER) == (PEER_BASE + 16376, 2013)
    with pytest.raises(WrRejected, match="outside MR"):
        remote_target(opcode, 12288 + 4096, 8, 13, PEER)


def test_unaligned_non_atomic_is_fine() -> None:
    assert remote_target(WrOpcode.RDMA_READ, 8193, 3, 12, PEER) == (PEER_BASE + 8193, 2012)
